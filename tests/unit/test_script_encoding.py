"""How tasks, moves and usage are laid out for the scripts: what a call's tasks share goes
once."""

from __future__ import annotations

from vlmq.broker.state.jobs import QUEUED_FIELDS, Queued, status_layout
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


def _queued(n: int, modality: str, est: int | None) -> Queued:
    fields: dict[str, object] = {"job_id": "j", "custom_id": f"c{n}", "modality": modality}
    fields |= {"claim": f"k{n}", "est": est, "expires_at": "1.5"}
    return Queued(f"t{n}", f"c{n}", modality, fields, f'{{"delivery_tag":"tag{n}"}}')


def test_a_chunks_shared_status_fields_go_once_and_est_always_per_task():
    lines = [_queued(0, "text", 5), _queued(1, "image", 5)]
    header, values = status_layout(lines)
    names = header[1 : 1 + header[0]]
    assert names == ["custom_id", "modality", "claim", "est", "tag"]
    shared = header[2 + header[0] :]
    assert header[1 + header[0]] == 2 and shared == ["job_id", "j", "expires_at", "1.5"]
    assert values[0][:4] == ["c0", "text", "k0", "5"] and values[1][:4] == [
        "c1",
        "image",
        "k1",
        "5",
    ]
    assert values[0][4] != values[1][4]  # each message's tag
    # Every field a line has is in its names or the shared pairs, with its value.
    for line, own in zip(lines, values, strict=True):
        given = dict(zip(QUEUED_FIELDS, line.values(), strict=True))
        laid = dict(zip(names, own, strict=True)) | dict(
            zip(shared[::2], shared[1::2], strict=True)
        )
        assert {k: v for k, v in given.items() if v} == {k: v for k, v in laid.items() if v}
