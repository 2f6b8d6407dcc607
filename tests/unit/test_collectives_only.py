"""nanoddp on torch's in-process threaded backend: a group with collectives and no send/recv.

torch's own DDP and FSDP2 test suites run ranks as threads on that backend. nanoddp's
collectives need point-to-point, so on such a group each one is torch.distributed's own
(`nanoddp.comm.transport.collectives_only`). The reference here is a one-process run on the whole batch:
our DDP on 2 thread-ranks must end with its gradients. (The backend lives in torch's test
package; it is the thing under test, not our test infrastructure.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.testing._internal.distributed.multi_threaded_pg import _install_threaded_pg, _uninstall_threaded_pg

import nanoddp
import nanoddp.comm as comm
from nanoddp.fsdp import fully_shard

WORLD = 2


_GLOBAL_RNG = threading.Lock()  # thread-ranks share torch's default generator: seed and draw as one


def _model() -> nn.Module:
    with _GLOBAL_RNG:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def _batch(rows: int = 2 * WORLD) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, 4, generator=g), torch.randn(rows, 2, generator=g)


def _ddp_rank(rank: int, out: dict) -> None:
    t = torch.full((3,), float(rank + 1))
    comm.all_reduce(t)
    gathered = [torch.empty(1) for _ in range(WORLD)]
    comm.all_gather(gathered, torch.tensor([float(rank)]))
    ddp = nanoddp.DistributedDataParallel(_model())
    x, y = _batch()
    rows = slice(2 * rank, 2 * rank + 2)
    nn.functional.mse_loss(ddp(x[rows]), y[rows]).backward()
    out[rank] = (t, torch.cat(gathered), [p.grad.clone() for p in ddp.parameters()])


def _on_thread_ranks(world: int, rank_fn: Callable[[int, dict], None]) -> dict[int, object]:
    """`rank_fn(rank, out)` on `world` threads of one process, each a rank of torch's threaded backend."""
    torch._C._distributed_c10d._set_thread_isolation_mode(True)  # a group registry per thread
    _install_threaded_pg()
    store = dist.HashStore()
    out: dict[int, object] = {}

    def rank_main(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
        try:
            rank_fn(rank, out)
        except BaseException as exc:  # noqa: BLE001  (re-raised by the test thread)
            out[rank] = exc
        finally:
            dist.destroy_process_group()

    try:
        threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)
        assert not any(th.is_alive() for th in threads), "a thread-rank hung"
    finally:
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    for result in out.values():
        if isinstance(result, BaseException):
            raise result
    return out


def test_collectives_and_ddp_run_on_torchs_threaded_backend():
    out = _on_thread_ranks(WORLD, _ddp_rank)
    reference = _model()
    x, y = _batch()
    nn.functional.mse_loss(reference(x), y).backward()
    for rank in range(WORLD):
        summed, gathered, grads = out[rank]  # type: ignore[misc]
        torch.testing.assert_close(summed, torch.full((3,), 3.0), rtol=0, atol=0)
        torch.testing.assert_close(gathered, torch.tensor([0.0, 1.0]), rtol=0, atol=0)
        # the mean of two half-batch gradients vs one whole-batch gradient: another summation order
        for got, want in zip(grads, [p.grad for p in reference.parameters()], strict=True):
            torch.testing.assert_close(got, want)


def _fsdp_rank(rank: int, out: dict) -> None:
    # reshard_after_forward=2 at 4 ranks builds row groups of 2: per world, never another
    # thread-world's (they were once cached by rank lists, process-wide)
    model = _model()
    for layer in (model[0], model[2]):
        fully_shard(layer, reshard_after_forward=2)
    fully_shard(model)
    x, y = _batch(rows=4)
    rows = slice(rank, rank + 1)
    nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
    out[rank] = [p.grad.full_tensor() for p in model.parameters()]


def test_fsdp_row_groups_on_torchs_threaded_backend():
    out = _on_thread_ranks(4, _fsdp_rank)
    reference = _model()
    x, y = _batch(rows=4)
    nn.functional.mse_loss(reference(x), y).backward()
    for rank in range(4):
        # four one-row gradients averaged vs one four-row gradient: another summation order
        for got, want in zip(out[rank], [p.grad for p in reference.parameters()], strict=True):  # type: ignore[call-overload]
            torch.testing.assert_close(got, want)
