"""Where a modality class's waiting messages are, and how many there are.

Shared by the API (to refuse work when a class is full) and the workers (the
``vlmq_queue_depth`` metric), so both count the same lists.
"""

from __future__ import annotations

from collections.abc import Iterable

from redis import Redis

from vlmq.config.keys import LANES, Keys
from vlmq.config.state.intake import PREPARED_CLASSES
from vlmq.config.wire import priority_lists

__all__ = ["prepare_backlog", "queue_depth", "queue_lists"]


def queue_lists(keys: Keys, modality: str, prepared: bool = True) -> list[str]:
    """The fixed Redis lists of a class's waiting messages: both lanes, at every
    priority step (each bulk job's own list is counted by the depth hash instead), and
    with ``prepared`` the lanes' prepared lists (tasks a prepare worker handed on)."""
    lists = [name for lane in LANES for name in priority_lists(keys.queue(modality, lane))]
    if prepared and modality in PREPARED_CLASSES:
        lists += [keys.prepared_queue(modality, lane) for lane in LANES]
    return lists


def queue_depth(
    redis: Redis, keys: Keys, modalities: Iterable[str], prepared: bool = True
) -> dict[str, int]:
    """Messages waiting per class: the fixed lists' lengths plus the job lists' counter,
    one pipelined round trip whatever the number of active jobs. Without ``prepared``:
    those not prepared yet (the prepare tier's backlog, ``vlmq_prepare_backlog``)."""
    names = {m: queue_lists(keys, m, prepared) for m in modalities}
    pipe = redis.pipeline(transaction=False)
    for modality, lists in names.items():
        for name in lists:
            pipe.llen(name)
        pipe.hget(keys.job_depth(), keys.active_tenants(modality))
    replies = iter(pipe.execute())
    depth = {}
    for modality, lists in names.items():
        fixed = sum(int(next(replies)) for _ in lists)
        depth[modality] = fixed + max(0, int(next(replies) or 0))
    return depth


def prepare_backlog(redis: Redis, keys: Keys, modalities: Iterable[str]) -> dict[str, int]:
    """Image and video tasks waiting that no prepare worker has prepared yet, per class
    (``vlmq_prepare_backlog``: what the prepare tier scales on)."""
    classes = [m for m in modalities if m in PREPARED_CLASSES]
    return queue_depth(redis, keys, classes, prepared=False) if classes else {}
