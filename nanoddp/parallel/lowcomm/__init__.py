"""Training over slow links: sync every H steps instead of every step (LocalSGD, DiLoCo)."""

from nanoddp.parallel.lowcomm.diloco import DiLoCo
from nanoddp.parallel.lowcomm.localsgd import LocalSGD

__all__ = ["DiLoCo", "LocalSGD"]
