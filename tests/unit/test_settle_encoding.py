"""How moves and usage are laid out for the scripts: what a call's moves share goes once."""

from __future__ import annotations

from vlmq.broker.state.tasks import Move, encode_moves
from vlmq.config.status import TaskState
from vlmq.config.usage import TaskUsage, usage_argv


def test_a_batchs_shared_fields_go_once_and_its_own_per_move():
    moves = [
        Move("a", TaskState.SUCCEEDED, {"worker": "w", "url": "u-a", "err": None}, 3, "done"),
        Move("b", TaskState.SUCCEEDED, {"worker": "w", "url": "u-b"}, 4, "done"),
        Move("c", TaskState.FAILED, {"worker": "w", "err": "boom"}, 5, "done"),
    ]
    header, per_move = encode_moves(moves)
    assert header[0] == 2  # two kinds: succeeded and failed
    succeeded = header[1:8]
    assert succeeded[0] == "succeeded" and succeeded[2:5] == ["done", "0", 1]
    assert succeeded[5:] == ["worker", "w"]
    failed = header[8:]
    assert failed[0] == "failed" and failed[4:] == [2, "err", "boom", "worker", "w"]
    assert per_move == [[1, "3", 1, "url", "u-a"], [1, "4", 1, "url", "u-b"], [2, "5", 0]]


def test_an_unfenced_move_has_an_empty_token():
    header, per_move = encode_moves([Move("a", TaskState.CANCELLED, {})], [TaskState.QUEUED])
    assert header == [1, "cancelled", "queued", "", "0", 0]
    assert per_move == [[1, "", 0]]


def test_usage_is_grouped_by_model_modality_and_job():
    usage = [
        TaskUsage("m", "text", 1, 2, 0.5, 3, 4, job_id="j1"),
        None,
        TaskUsage("m", "text", 10, 20, 1.5, 30, 40, job_id="j1"),
        TaskUsage("m", "text", 5, 5, 0.0, 0, 0, job_id="j2"),
    ]
    header, per_task = usage_argv(usage)
    assert header == [2, "m|text", 2, 11, 22, 2, 2_000_000, 33, 44, "m|text", 1, 5, 5, 1, 0, 0, 0]
    assert per_task == [
        ["1", "1 2 1 500000 3 4"],
        ["0", ""],
        ["1", "10 20 1 1500000 30 40"],
        ["2", "5 5 1 0 0 0"],
    ]
