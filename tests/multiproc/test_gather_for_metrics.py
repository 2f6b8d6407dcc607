"""gather_for_metrics: accuracy over a distributed eval set equals the single-process figure
exactly, with a dataset length that does not divide by the world size (so the sampler pads)."""

from __future__ import annotations

import pytest
import torch
from helpers import run_on_ranks
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import nanoddp
from nanoddp.train.data.sampler import ResumableDistributedSampler

DATASET_LEN = 23  # neither 2 nor 3 divides it: 1 (ws 2) or 1 (ws 3) padded duplicate


def _eval_set() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(DATASET_LEN, 5, generator=generator)  # (N, 5)
    y = torch.randint(0, 3, (DATASET_LEN,), generator=generator)  # (N,)
    return TensorDataset(torch.arange(DATASET_LEN), x, y)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(5, 3)


def _single_process_figures() -> tuple[float, torch.Tensor]:
    _, x, y = _eval_set().tensors
    with torch.no_grad():
        preds = _model()(x).argmax(1)  # (N,)
    return (preds == y).float().mean().item(), preds


def _sampler_orders(world_size: int) -> dict[str, list[list[int]]]:
    """One process: every rank's sampler order, as each rank of the launch builds it."""
    dataset = _eval_set()
    return {
        "torch": [list(DistributedSampler(dataset, world_size, r, shuffle=True, seed=3)) for r in range(world_size)],
        "nanoddp": [
            list(ResumableDistributedSampler(dataset, world_size, r, shuffle=True, seed=3)) for r in range(world_size)
        ],
    }


def _eval_worker(env) -> dict:
    dataset = _eval_set()
    model = _model()
    results = {}
    samplers = {
        "torch": DistributedSampler(dataset, shuffle=True, seed=3),
        "nanoddp": ResumableDistributedSampler(dataset, shuffle=True, seed=3),
    }
    for name, sampler in samplers.items():
        loader = DataLoader(dataset, batch_size=4, sampler=sampler)
        local_idx, local_preds, local_labels, per_batch = [], [], [], []
        with torch.no_grad():
            for idx, x, y in loader:
                preds = model(x).argmax(1)  # (B,)
                local_idx.append(idx)
                local_preds.append(preds)
                local_labels.append(y)
                per_batch.append(nanoddp.gather_for_metrics(preds))  # one block of the global order per call
        idx, preds, labels = nanoddp.gather_for_metrics(
            (torch.cat(local_idx), torch.cat(local_preds), torch.cat(local_labels)), dataset_len=len(dataset)
        )
        names = nanoddp.gather_for_metrics([f"sample-{i}" for i in torch.cat(local_idx).tolist()], len(dataset))
        plain = [torch.empty_like(torch.cat(local_idx)) for _ in range(env.world_size)]
        torch.distributed.all_gather(plain, torch.cat(local_idx))  # what a plain all_gather + cat gives
        results[name] = {
            "idx": idx,
            "preds": preds,
            "accuracy": (preds == labels).float().mean().item(),
            "per_batch": torch.cat(per_batch)[: len(dataset)],
            "names": names,
            "plain": torch.cat(plain),
            "naive": torch.cat(plain).numel(),
        }
    # An unpadded shard (nanoddp.train.data.sampler.shard(drop_last=False)): rank r holds dataset[r::W], so the
    # first len % W ranks hold one more sample; the gathered order must still be the dataset's.
    unpadded = torch.arange(DATASET_LEN)[env.rank :: env.world_size]
    results["unpadded"] = nanoddp.gather_for_metrics(unpadded.float().unsqueeze(1))  # (n_r, 1) -> (N, 1)
    # dataset_len equal to the number gathered (nothing padded to drop) is valid: all N rows
    results["unpadded_len"] = nanoddp.gather_for_metrics(unpadded, dataset_len=DATASET_LEN)
    try:  # ranks disagree on the trailing shape: the same clear error everywhere, no hang
        nanoddp.gather_for_metrics(torch.zeros(2, 1 + env.rank))
    except ValueError as exc:
        results["error"] = str(exc)
    return results


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size", [2, 3])
def test_accuracy_equals_single_process(world_size):
    accuracy, preds = _single_process_figures()
    per_rank = run_on_ranks(_eval_worker, world_size, timeout=180)
    orders = _sampler_orders(world_size)
    for rank_results in per_rank:
        assert "same trailing shape and dtype on every rank" in rank_results["error"]
        assert torch.equal(rank_results["unpadded"], torch.arange(DATASET_LEN).float().unsqueeze(1))
        assert torch.equal(rank_results["unpadded_len"], torch.arange(DATASET_LEN))
        for name in ("torch", "nanoddp"):
            got = rank_results[name]
            # the reference, computed in one process: the ranks' sampler orders, concatenated (a plain
            # gather) and interleaved position by position then cut to the dataset (gather_for_metrics)
            concatenated = [i for order in orders[name] for i in order]
            interleaved = [order[j] for j in range(len(orders[name][0])) for order in orders[name]][:DATASET_LEN]
            assert got["plain"].tolist() == concatenated, name
            assert len(set(concatenated)) == DATASET_LEN < len(concatenated), name  # duplicates in a plain gather
            assert got["idx"].tolist() == interleaved, name
            assert got["naive"] > DATASET_LEN  # the sampler did pad: a plain gather would count duplicates
            assert sorted(got["idx"].tolist()) == list(range(DATASET_LEN)), name  # each sample exactly once
            assert torch.equal(got["preds"], preds[got["idx"]]), name
            assert got["accuracy"] == accuracy, name
            assert torch.equal(got["per_batch"], got["preds"]), name
            assert got["names"] == [f"sample-{i}" for i in got["idx"].tolist()], name


def test_single_process_only_trims():
    preds = torch.arange(10)
    assert torch.equal(nanoddp.gather_for_metrics(preds, dataset_len=7), torch.arange(7))
    assert torch.equal(nanoddp.gather_for_metrics(preds, dataset_len=10), preds)  # every row: valid
    assert nanoddp.gather_for_metrics(["a", "b", "c"], 3) == ["a", "b", "c"]
    assert nanoddp.gather_for_metrics(["a", "b", "c"], 2) == ["a", "b"]
    with pytest.raises(ValueError, match=r"dataset_len must be an int in \[0, 10\]"):
        nanoddp.gather_for_metrics(preds, dataset_len=11)
    with pytest.raises(TypeError, match="takes a tensor, a list of per-sample objects"):
        nanoddp.gather_for_metrics(3.5)
