"""Where a modality class's waiting messages are, and how many there are.

Shared by the API (to refuse work when a class is full) and the workers (the
``vlmq_queue_depth`` and ``vlmq_queue_lane_depth`` metrics), so both count the same lists.
"""

from __future__ import annotations

from collections.abc import Iterable

from redis import Redis

from vlmq.broker.state.intake import PREPARED_CLASSES
from vlmq.config.keys import LANES, Keys
from vlmq.config.wire import priority_lists

__all__ = ["lane_depths", "prepare_backlog", "queue_depth", "queue_lists", "waiting"]


def _lane_lists(keys: Keys, modality: str, lane: str, prepared: bool) -> list[str]:
    """One lane's fixed lists: every priority step, and with ``prepared`` the lane's
    prepared list (tasks a prepare worker handed on)."""
    lists = priority_lists(keys.queue(modality, lane))
    if prepared and modality in PREPARED_CLASSES:
        lists = [*lists, keys.prepared_queue(modality, lane)]
    return lists


def queue_lists(keys: Keys, modality: str, prepared: bool = True) -> list[str]:
    """The fixed Redis lists of a class's waiting messages: both lanes, at every
    priority step (each bulk job's own list is counted by the depth hash instead), and
    with ``prepared`` the lanes' prepared lists."""
    return [name for lane in LANES for name in _lane_lists(keys, modality, lane, prepared)]


def queue_depth(
    redis: Redis, keys: Keys, modalities: Iterable[str], prepared: bool = True
) -> dict[str, int]:
    """Messages waiting per class, both lanes together (without ``prepared``: those not
    prepared yet)."""
    depths = lane_depths(redis, keys, modalities, prepared)
    return {m: sum(lanes.values()) for m, lanes in depths.items()}


def lane_depths(
    redis: Redis, keys: Keys, modalities: Iterable[str], prepared: bool = True
) -> dict[str, dict[str, int]]:
    """Messages waiting per class and lane: each lane's fixed lists, and on the bulk lane
    the job lists' counter too (without ``prepared``: the prepared lists left out)."""
    counts = _counts(redis, keys, modalities)
    return {
        m: {lane: raw + (ready if prepared else 0) for lane, (raw, ready) in lanes.items()}
        for m, lanes in counts.items()
    }


def prepare_backlog(redis: Redis, keys: Keys, modalities: Iterable[str]) -> dict[str, int]:
    """Image and video tasks waiting that no prepare worker has prepared yet, per class
    (``vlmq_prepare_backlog``: what the prepare tier scales on)."""
    classes = [m for m in modalities if m in PREPARED_CLASSES]
    return queue_depth(redis, keys, classes, prepared=False) if classes else {}


def waiting(
    redis: Redis, keys: Keys, modalities: Iterable[str]
) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
    """``lane_depths`` and ``prepare_backlog`` from one read (a worker's heartbeat)."""
    counts = _counts(redis, keys, modalities)
    depths = {
        m: {lane: raw + ready for lane, (raw, ready) in lanes.items()}
        for m, lanes in counts.items()
    }
    backlog = {
        m: sum(raw for raw, _ in lanes.values())
        for m, lanes in counts.items()
        if m in PREPARED_CLASSES
    }
    return depths, backlog


def _counts(
    redis: Redis, keys: Keys, modalities: Iterable[str]
) -> dict[str, dict[str, tuple[int, int]]]:
    """Per class and lane: (messages not prepared, prepared ones), the job lists' counter
    on the bulk lane's first; one pipelined round trip whatever the number of active
    jobs."""
    names = {
        m: {
            lane: (
                _lane_lists(keys, m, lane, prepared=False),
                [keys.prepared_queue(m, lane)] if m in PREPARED_CLASSES else [],
            )
            for lane in LANES
        }
        for m in modalities
    }
    pipe = redis.pipeline(transaction=False)
    for modality, lanes in names.items():
        for raw, ready in lanes.values():
            for name in [*raw, *ready]:
                pipe.llen(name)
        pipe.hget(keys.job_depth(), keys.active_tenants(modality))
    replies = iter(pipe.execute())
    counts: dict[str, dict[str, tuple[int, int]]] = {}
    for modality, lanes in names.items():
        lane_counts = {
            lane: (
                sum(int(next(replies)) for _ in raw),
                sum(int(next(replies)) for _ in ready),
            )
            for lane, (raw, ready) in lanes.items()
        }
        raw_bulk, ready_bulk = lane_counts["bulk"]
        jobs = max(0, int(next(replies) or 0))  # each bulk job's own list
        lane_counts["bulk"] = (raw_bulk + jobs, ready_bulk)
        counts[modality] = lane_counts
    return counts
