"""`nanoddp.base.records`: the one writer and reader of `metrics.jsonl`.

The file's format is what users' tools read (docs/trainer.md, docs/ft.md): one `json.dumps` object
per line, in the writer's key order. The writer is checked byte for byte against that, the reader
against the records written, and `truncate_after` against the records a resumed run keeps.
"""

from __future__ import annotations

import json

import pytest

from nanoddp.base import records

STEP = {**dict.fromkeys(records.STEP_FIELDS), "step": 1, "loss": 2.5, "world_size": 2, "time": 12.0}
LOST = {"event": "rank_lost", "step": 2, "world_size": 1, "replicas": [1]}


def _step(step: int) -> dict:
    return {**STEP, "step": step}


def test_the_file_holds_one_json_dumps_line_per_record_in_order(tmp_path):
    written = [_step(1), LOST, _step(2), {"event": "eval", "step": 2, "val_loss": 1.5, "world_size": 1,
                                          "eval_time_s": 0.1}]  # fmt: skip
    writer = records.RecordWriter(tmp_path / "run")
    for record in written:
        writer.write(record)
    path = tmp_path / "run" / "metrics.jsonl"
    assert path.read_bytes() == "".join(json.dumps(r) + "\n" for r in written).encode()
    assert records.read_records(tmp_path / "run") == written == records.read_records(path)
    assert records.step_records(written) == [_step(1), _step(2)]
    assert records.events(written) == [written[1], written[3]] and records.events(written, "rank_lost") == [LOST]
    assert records.last_step(tmp_path / "run") == 2


def test_truncate_after_keeps_what_a_resumed_run_keeps(tmp_path):
    writer = records.RecordWriter(tmp_path)
    for record in (_step(1), _step(2), LOST, _step(3)):
        writer.write(record)
    writer.truncate_after(1)
    assert records.read_records(tmp_path) == [_step(1)]  # events past the step go too: they are redone
    writer.truncate_after(5)
    assert records.read_records(tmp_path) == [_step(1)]
    records.truncate_after(tmp_path / "absent", 3)  # no file: none is made
    assert not (tmp_path / "absent").exists()


def test_no_file_is_an_error_unless_missing_is_expected(tmp_path):
    with pytest.raises(FileNotFoundError):
        records.read_records(tmp_path)
    assert records.read_records(tmp_path, missing_ok=True) == [] and records.last_step(tmp_path) == 0
    records.RecordWriter(None).write(_step(1))  # no run directory: nothing written, still checked


@pytest.mark.parametrize(
    "record, match",
    [
        ({"step": 1, "loss": 2.0}, r"a step record needs .*missing \['lr'"),
        ({**STEP, "grad_norm": 1.0}, r"unknown \['grad_norm'\]"),
        ({"event": "rank_gone", "step": 1}, r"unknown event 'rank_gone'"),
        ({"event": "rank_lost", "step": 1, "world_size": 1}, r"'rank_lost' event has the fields"),
    ],
)
def test_a_record_off_the_format_is_refused_before_it_is_written(tmp_path, record, match):
    with pytest.raises(ValueError, match=match):
        records.RecordWriter(tmp_path).write(record)
    assert not (tmp_path / "metrics.jsonl").exists() or (tmp_path / "metrics.jsonl").read_text() == ""
