"""save_state only writes what load_state can read back: `torch.load(weights_only=True)` refuses
numpy scalars and arrays, datetimes and dataclasses, so a file holding one was "saved atomically,
checksummed" and yet could never be loaded. numpy values are converted (scalars to Python numbers,
arrays to tensors), anything else unreadable is refused before a byte is written, naming where it
sits; and load_state(directory) skips a file that fails to load for any reason."""

from __future__ import annotations

import dataclasses
import datetime
import logging

import numpy as np
import pytest
import torch

import nanoddp
from nanoddp.train.checkpoint import snapshot, user_state


class Ema:
    """A user's stateful helper whose state_dict holds numpy values (np.mean of losses)."""

    def __init__(self) -> None:
        self.value = np.float64(0.0)
        self.history = np.zeros(3, dtype=np.float32)

    def state_dict(self):
        return {"value": self.value, "history": self.history}

    def load_state_dict(self, state):
        self.value, self.history = state["value"], state["history"]


@dataclasses.dataclass
class Meta:
    epoch: int


def test_numpy_values_load_back_as_python_numbers_and_tensors(tmp_path):
    losses = [1.0, 2.0, 4.5]
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    ema = Ema()
    ema.value, ema.history = np.mean(losses), np.array([0.5, 0.25, 0.125], dtype=np.float32)
    nested = {"hist": [np.float32(0.5), np.int32(2)], "flag": np.bool_(True), "name": np.str_("x"), 7: (np.int64(1),)}
    path = nanoddp.save_state(
        tmp_path / "s.pt", step=np.int64(3), loss=np.mean(losses), array=array, nested=nested, ema=ema
    )
    fresh = Ema()
    state = nanoddp.load_state(path, ema=fresh)
    assert state["step"] == 3 and type(state["step"]) is int
    assert state["loss"] == np.mean(losses) and type(state["loss"]) is float
    assert isinstance(state["array"], torch.Tensor) and torch.equal(state["array"], torch.from_numpy(array))
    assert state["nested"] == {"hist": [0.5, 2], "flag": True, "name": "x", 7: (1,)}
    assert [type(v) for v in state["nested"]["hist"]] == [float, int] and type(state["nested"]["name"]) is str
    assert fresh.value == np.mean(losses) and torch.equal(fresh.history, torch.tensor([0.5, 0.25, 0.125]))
    assert type(array[0, 0]) is np.float32 and type(ema.value) is np.float64  # the caller's objects untouched


def test_model_state_keeps_its_metadata(tmp_path):
    model = torch.nn.BatchNorm1d(3)
    path = nanoddp.save_state(tmp_path / "m.pt", model=model, extra=np.float64(1.0))
    saved = snapshot.load(path)["objects"]["model"]["state"]
    assert getattr(saved, "_metadata", None) == model.state_dict()._metadata


@pytest.mark.parametrize(
    ("value", "where", "kind"),
    [
        ({"when": datetime.datetime(2024, 1, 2)}, r"meta\['when'\]", "datetime.datetime"),
        ({"runs": [1, Meta(epoch=2)]}, r"meta\['runs'\]\[1\]", "Meta"),
        ({"arr": np.array([object()])}, r"meta\['arr'\]", "numpy array of dtype object"),
        ({"day": np.datetime64("2024-01-02")}, r"meta\['day'\]", "numpy.datetime64"),
        ({frozenset({1}): 1}, r"meta \(a key\)", "frozenset"),
    ],
)
def test_a_value_that_would_not_load_is_refused_before_writing(tmp_path, value, where, kind):
    target = tmp_path / "s.pt"
    with pytest.raises(TypeError, match=rf"save_state: {where} is a .*{kind}.*weights_only=True") as info:
        nanoddp.save_state(target, step=1, meta=value)
    assert "\n" not in str(info.value)
    assert not target.exists() and list(tmp_path.iterdir()) == []


def test_a_stateful_objects_state_is_checked_too(tmp_path):
    ema = Ema()
    ema.value = datetime.date(2024, 1, 1)
    with pytest.raises(TypeError, match=r"save_state: ema \(its state_dict\)\['value'\] is a datetime.date"):
        nanoddp.save_state(tmp_path / "s.pt", ema=ema)
    assert not (tmp_path / "s.pt").exists()


def test_directory_skips_a_file_that_fails_to_load_and_says_why(tmp_path, caplog):
    nanoddp.save_state(tmp_path, step=1, note="good")
    # Verifies (checksum fine) but cannot be unpickled with weights_only: what older versions wrote.
    bad = snapshot.save(
        snapshot.snapshot_path(tmp_path, 3),
        {"format": user_state.FORMAT, "objects": {"note": {"kind": "value", "state": np.float64(1.0)}}, "rng": []},
    )
    truncated = snapshot.snapshot_path(tmp_path, 2)
    nanoddp.save_state(tmp_path, step=2, note="cut")
    truncated.write_bytes(truncated.read_bytes()[:-5])
    with caplog.at_level(logging.WARNING, logger=user_state.__name__):
        state = nanoddp.load_state(tmp_path)
    assert state["note"] == "good" and state["step"] == 1
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 2 and all("\n" not in line for line in lines), lines
    assert str(bad) in lines[0] and "numpy" in lines[0], lines
    assert str(truncated) in lines[1] and "truncated" in lines[1], lines


def test_an_unloadable_file_named_directly_is_one_clear_line(tmp_path):
    bad = snapshot.save(tmp_path / "old.pt", {"format": user_state.FORMAT, "x": np.float64(1.0)})
    with pytest.raises(snapshot.SnapshotError, match=r"old.pt cannot be loaded with weights_only=True") as info:
        nanoddp.load_state(bad)
    assert "\n" not in str(info.value)


def _refused_on_every_rank(env, directory):
    torch.set_num_threads(1)
    value = datetime.datetime(2024, 1, 2) if env.rank == 0 else 1.0  # only rank 0's values are saved
    try:
        nanoddp.save_state(directory, step=1, meta={"when": value})
    except TypeError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(120)
def test_refusal_is_the_same_error_on_every_rank(on_ranks, tmp_path):
    errors = on_ranks(_refused_on_every_rank, 2, str(tmp_path), timeout=100)
    assert errors[0] is not None and errors == [errors[0]] * 2, errors
    assert "meta['when'] is a datetime.datetime" in errors[0]
    assert not list(tmp_path.glob("step-*"))


def test_a_numpy_step_names_the_file_in_a_directory(tmp_path):
    """`step=np.int64(k)` (a step counted with numpy) names step-<k>.pt like an int does."""
    written = nanoddp.save_state(tmp_path, step=np.int64(7), note="numpy step")
    assert written == tmp_path / "step-00000007.pt"
    assert nanoddp.load_state(tmp_path)["step"] == 7
