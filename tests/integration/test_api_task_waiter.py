"""The API's task waiter (producers/api/waiter.py) on a real Redis: a task's end wakes its
watch through the one subscription, and no wake-up is lost to a subscription not yet made or
to a connection cut while the task ended (the status is read again on every subscribe)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.support.proxy import Proxy
from vlmq.config.settings import Settings
from vlmq.producers.api.waiter import TaskWaiter
from vlmq.producers.client import Client

TEXT = [{"role": "user", "content": "hi"}]


@pytest.fixture
def settings(redis_server: Any) -> Settings:
    return Settings(redis_url=redis_server.url, results_url="file:///nonexistent")


async def _until(check: Any, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_a_task_that_ends_wakes_its_watch_and_only_its_own(settings: Settings) -> None:
    client = Client(settings)

    async def run() -> None:
        waiter = TaskWaiter(settings)
        a, b = (client.submit(TEXT, notify=waiter.channel) for _ in range(2))
        watch_a, watch_b = waiter.watch(a), waiter.watch(b)
        await _until(lambda: waiter.subscriptions == 1)
        assert not await watch_a.wait(0.05)  # nothing ended yet
        client.cancel(a)
        assert await watch_a.wait(5)
        assert not await watch_b.wait(0.1)
        watch_a.close()
        watch_a.close()  # twice is fine
        assert waiter.waiting == 1
        del watch_b  # a watch its holder dropped without closing it ends with it
        assert waiter.waiting == 0
        await waiter.close()

    asyncio.run(run())


def test_a_task_that_ended_before_the_subscription_is_found_by_the_recheck(
    settings: Settings,
) -> None:
    client = Client(settings)

    async def run() -> None:
        waiter = TaskWaiter(settings)
        task_id = client.submit(TEXT, notify=waiter.channel)
        watch = waiter.watch(task_id)  # starts the listener; it has not subscribed yet
        client.cancel(task_id)  # published to no one
        assert waiter.subscriptions == 0
        assert await watch.wait(5)
        await waiter.close()

    asyncio.run(run())


def test_a_task_that_ends_while_the_connection_is_down_is_found_on_reconnect(
    settings: Settings, redis_server: Any
) -> None:
    proxy = Proxy(redis_server.port).up()
    db = settings.redis_url.rsplit("/", 1)[1]
    through_proxy = settings.model_copy(
        update={"redis_url": f"redis://127.0.0.1:{proxy.port}/{db}"}
    )
    client = Client(settings)

    def subscribers(channel: str) -> int:
        return int(dict(client.redis.pubsub_numsub(channel))[channel])

    async def run() -> None:
        waiter = TaskWaiter(through_proxy)
        task_id = client.submit(TEXT, notify=waiter.channel)
        watch = waiter.watch(task_id)
        await _until(lambda: subscribers(waiter.channel) == 1)
        proxy.down()
        await _until(lambda: subscribers(waiter.channel) == 0)
        client.cancel(task_id)  # its message is lost: no one listens
        assert not await watch.wait(0.2)
        proxy.up()
        assert await watch.wait(10)  # the re-check after subscribing again
        assert waiter.subscriptions == 2
        await waiter.close()

    try:
        asyncio.run(run())
    finally:
        proxy.down()


def test_a_loop_that_cancels_its_tasks_at_exit_never_waits_on_the_listener(
    settings: Settings,
) -> None:
    """A loop that ends cancels what is left (asyncio.run, a test client's portal per call).
    A cancel that lands while the listener connects or subscribes was swallowed by redis-py
    and its next read then waited for ever: 10 of 300 such loops hung before the fix. Each
    delay below lands the cancel in a different phase of the listener's first session."""
    waiter = TaskWaiter(settings)
    delays = [0.0, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.02] * 15

    async def watch_then_leave(delay: float) -> None:
        waiter.watch("a-task")
        await asyncio.sleep(delay)

    hung = []
    for delay in delays:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(watch_then_leave(delay))
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            ended = asyncio.gather(*left, return_exceptions=True)
            _, pending = loop.run_until_complete(asyncio.wait({ended}, timeout=3))
            if pending:
                hung.append(delay)
                ended.cancel()  # what is still stuck is dropped with the loop
        finally:
            loop.close()
    assert hung == []
