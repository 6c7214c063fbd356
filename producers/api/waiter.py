"""Waiting for tasks to end with no thread and no poll per call: one pub/sub subscription per
API process.

A call that waits (``POST /v1/chat/completions``) takes a :class:`Watch` on its task here
*before* it enqueues the task with ``notify`` set to this process's channel
(``Keys.finished_channel``); the script that ends a task publishes its id there
(``lua/tasks.lua``), and the one listener (an asyncio task) wakes that task's watches. A wake
is a hint: the woken call reads the task's status, which is the truth.

No wake-up is lost. The watch exists before the task does, so a task that ends after the
subscription is up is heard; and each time the subscription is (re)established (the first
time, after a dropped connection, after Redis went silent) the listener reads the state of
every watched task in one round trip and wakes those that ended meanwhile. A silent
connection is found by a PING every few seconds: no reply in ``_SILENT_S`` drops it.

Waiting costs an ``asyncio.Event`` per call, no thread: thousands of waiting calls cost
memory only. A watch is held weakly, so it also ends with whatever held it (a stream's
generator dropped unstarted when its client left) even if no one closed it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import weakref
from typing import Any

from vlmq.broker.connection import create_async_redis
from vlmq.config.keys import Keys
from vlmq.config.settings import Settings
from vlmq.config.status import TERMINAL

__all__ = ["TaskWaiter", "Watch"]

log = logging.getLogger(__name__)

_TERMINAL = frozenset(s.value for s in TERMINAL)
# The listener's read slice, how often it pings an idle subscription, and how long a
# connection may stay silent (no message, no pong) before it is dropped and made again.
_READ_S = 1.0
_PING_S = 5.0
_SILENT_S = 15.0
# Backoff between attempts to subscribe while Redis is unreachable.
_FIRST_BACKOFF_S = 0.05
_MAX_BACKOFF_S = 2.0


class Watch:
    """One call's wait for one task's end."""

    def __init__(self, waiter: TaskWaiter, task_id: str) -> None:
        self.task_id = task_id
        self._waiter = waiter
        self._event = asyncio.Event()

    def wake(self) -> None:
        self._event.set()

    async def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a wake-up; False if none came. Taking a wake-up
        clears it, so read the status *after* this returns: a wake that comes while it is read
        is kept for the next wait."""
        if not self._event.is_set():
            if timeout <= 0:
                return False
            try:
                await asyncio.wait_for(self._event.wait(), timeout)
            except asyncio.TimeoutError:
                return False
        self._event.clear()
        return True

    def close(self) -> None:
        """Stop watching (safe to call twice)."""
        self._waiter.forget(self)


class TaskWaiter:
    """This process's subscription to its finished channel, and the watches it wakes."""

    def __init__(self, settings: Settings, listener: str | None = None) -> None:
        self.settings = settings
        self.keys = Keys(settings.fleet.key_prefix)
        # One channel per process: a task names the process that waits for it.
        self.listener = listener or f"api-{secrets.token_hex(8)}"
        self.channel = self.keys.finished_channel(self.listener)
        self.subscriptions = 0  # times the subscription was made (logs, tests)
        # One watch per task (a call's own new task), held weakly: see the module's note.
        self._watches: weakref.WeakValueDictionary[str, Watch] = weakref.WeakValueDictionary()
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def waiting(self) -> int:
        """Watches open now."""
        return len(self._watches)

    def watch(self, task_id: str) -> Watch:
        """The watch on ``task_id``, to take before the task is enqueued (in the event loop);
        it replaces an earlier one of the same task."""
        self._ensure_listening()
        watch = Watch(self, task_id)
        self._watches[task_id] = watch
        return watch

    def forget(self, watch: Watch) -> None:
        if self._watches.get(watch.task_id) is watch:
            del self._watches[watch.task_id]

    async def close(self) -> None:
        """Stop listening (the app's shutdown)."""
        task, self._task = self._task, None
        if task is None or task.get_loop() is not asyncio.get_running_loop():
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    def _ensure_listening(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is not None and not self._task.done() and self._loop is loop:
            return
        if self._loop is not loop:
            # A new event loop (a test client's portal): the old loop's watches are gone.
            self._watches.clear()
        self._loop = loop
        self._task = loop.create_task(self._listen(), name="vlmq-task-waiter")

    async def _listen(self) -> None:
        backoff = _FIRST_BACKOFF_S
        while True:
            before = self.subscriptions
            try:
                await self._session()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis down or silent: subscribe again
                _raise_if_cancelled()
                log.warning("task waiter: Redis %s; subscribing again", type(exc).__name__)
            if self.subscriptions > before:  # it was up: the next try starts quickly
                backoff = _FIRST_BACKOFF_S
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _MAX_BACKOFF_S)

    async def _session(self) -> None:
        """One connection's life: subscribe, re-check, then wake watches until it fails."""
        redis = create_async_redis(self.settings)
        pubsub = redis.pubsub()
        loop = asyncio.get_running_loop()
        try:
            await pubsub.subscribe(self.channel)
            heard = pinged = loop.time()
            while True:
                _raise_if_cancelled()
                message = await pubsub.get_message(timeout=_READ_S)
                now = loop.time()
                if message is not None:
                    heard = now
                    await self._on_message(redis, message)
                elif now - heard > _SILENT_S:
                    raise ConnectionError("the subscription went silent")
                if now - pinged > _PING_S:
                    await pubsub.ping()
                    pinged = now
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()
            with contextlib.suppress(Exception):
                await redis.aclose()

    async def _on_message(self, redis: Any, message: dict[str, Any]) -> None:
        kind = message.get("type")
        if kind == "message":
            self._wake(str(message.get("data")))
        elif kind == "subscribe":
            self.subscriptions += 1
            if self.subscriptions > 1:
                log.info("task waiter: subscribed again; re-checking %d tasks", len(self._watches))
            await self._recheck(redis)

    async def _recheck(self, redis: Any) -> None:
        """Wake the watches of tasks that ended (or are gone) while no one listened."""
        task_ids = list(self._watches)
        if not task_ids:
            return
        pipe = redis.pipeline(transaction=False)
        for task_id in task_ids:
            pipe.hget(self.keys.task(task_id), "state")
        states = await pipe.execute()
        for task_id, state in zip(task_ids, states, strict=True):
            if state is None or state in _TERMINAL:
                self._wake(task_id)

    def _wake(self, task_id: str) -> None:
        watch = self._watches.get(task_id)
        if watch is not None:
            watch.wake()


def _raise_if_cancelled() -> None:
    """redis-py (8.2) can swallow a cancellation that lands while it connects or subscribes:
    the task stays marked as cancelling but goes on, and its next read waits for ever, so a
    loop that cancels its tasks at exit (``asyncio.run``, a test client's portal) hangs.
    Honour the mark at each turn instead of relying on the CancelledError."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
