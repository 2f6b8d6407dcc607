"""nanoddp on torch's in-process threaded backend: a group with collectives and no send/recv.

torch's own DDP and FSDP2 test suites run ranks as threads on that backend. nanoddp's
collectives need point-to-point, so on such a group each one is torch.distributed's own
(`nanoddp.comm.collectives_only`). The reference here is a one-process run on the whole batch:
our DDP on 2 thread-ranks must end with its gradients. (The backend lives in torch's test
package; it is the thing under test, not our test infrastructure.)
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.testing._internal.distributed.multi_threaded_pg import _install_threaded_pg, _uninstall_threaded_pg

import nanoddp
import nanoddp.comm as comm

WORLD = 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(2 * WORLD, 4, generator=g), torch.randn(2 * WORLD, 2, generator=g)


def _rank_main(rank: int, store: dist.Store, out: dict) -> None:
    dist.init_process_group("threaded", rank=rank, world_size=WORLD, store=store)
    try:
        t = torch.full((3,), float(rank + 1))
        comm.all_reduce(t)
        gathered = [torch.empty(1) for _ in range(WORLD)]
        comm.all_gather(gathered, torch.tensor([float(rank)]))
        ddp = nanoddp.DistributedDataParallel(_model())
        x, y = _batch()
        rows = slice(2 * rank, 2 * rank + 2)
        nn.functional.mse_loss(ddp(x[rows]), y[rows]).backward()
        out[rank] = (t, torch.cat(gathered), [p.grad.clone() for p in ddp.parameters()])
    except BaseException as exc:  # noqa: BLE001  (reported to the test thread)
        out[rank] = exc
    finally:
        dist.destroy_process_group()


def test_collectives_and_ddp_run_on_torchs_threaded_backend():
    torch._C._distributed_c10d._set_thread_isolation_mode(True)  # a group registry per thread
    _install_threaded_pg()
    store = dist.HashStore()
    out: dict[int, object] = {}
    try:
        threads = [threading.Thread(target=_rank_main, args=(r, store, out), daemon=True) for r in range(WORLD)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)
        assert not any(th.is_alive() for th in threads), "a thread-rank hung"
    finally:
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    reference = _model()
    x, y = _batch()
    nn.functional.mse_loss(reference(x), y).backward()
    for rank in range(WORLD):
        result = out[rank]
        if isinstance(result, BaseException):
            raise result
        summed, gathered, grads = result
        torch.testing.assert_close(summed, torch.full((3,), 3.0), rtol=0, atol=0)
        torch.testing.assert_close(gathered, torch.tensor([0.0, 1.0]), rtol=0, atol=0)
        # the mean of two half-batch gradients vs one whole-batch gradient: another summation order
        for got, want in zip(grads, [p.grad for p in reference.parameters()], strict=True):
            torch.testing.assert_close(got, want)
