"""Redis with Sentinel on loopback, for failover tests and ``bench/ha.py``.

:class:`SentinelCluster` starts a master, replicas (``--replicaof``) and sentinels (``redis-server
--sentinel``) on free loopback ports; its :attr:`~SentinelCluster.url` is the
``redis+sentinel://`` URL every vlmq process takes (vlmq/broker/connection.py). Each replica can
reach the master through a :class:`LaggyLink`, a TCP forwarder that delays what it carries and
can be paused and cut: data still in it is dropped, as when the master's host dies with
replication in flight. With a link delay of d seconds a kill loses about the master's last d
seconds of writes (the asynchronous replication lag a loaded or distant replica has); with
the links paused first, it loses exactly what the master wrote since the pause.
"""

from __future__ import annotations

import collections
import contextlib
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import redis

from tests.support.proxy import close_all, listen_on
from vlmq.config.errors import ConfigError
from vlmq.producers.localredis import LocalRedis, free_port

__all__ = ["DataNode", "LaggyLink", "SentinelCluster", "SentinelNode"]


class LaggyLink:
    """A TCP forwarder to ``target_port`` that delivers each chunk ``delay_s`` after it was
    read, in order, both ways. :meth:`pause` holds everything it carries from then on;
    :meth:`cut` closes every connection and drops what is still in transit or held (nothing
    queued is delivered after it)."""

    def __init__(self, target_port: int, delay_s: float = 0.0) -> None:
        self.target_port = target_port
        self.delay_s = delay_s
        self.port = free_port()
        self._listener: socket.socket | None = None
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._cut = threading.Event()
        self._flowing = threading.Event()
        self._flowing.set()

    def up(self) -> LaggyLink:
        listener = listen_on(self.port, backlog=16)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def pause(self) -> None:
        self._flowing.clear()

    def resume(self) -> None:
        """Delivers what a pause held, in order, and carries on."""
        self._flowing.set()

    def cut(self) -> None:
        self._cut.set()
        self._flowing.set()  # wake the writers: they see the cut and drop what they hold
        listener, self._listener = self._listener, None
        close_all(listener, self._sockets, self._lock)

    def _accept(self, listener: socket.socket) -> None:
        while not self._cut.is_set():
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._sockets.update({client, upstream})
            for a, b in ((client, upstream), (upstream, client)):
                self._carry(a, b)

    def _carry(self, source: socket.socket, sink: socket.socket) -> None:
        queue: collections.deque[tuple[float, bytes]] = collections.deque()
        ready = threading.Condition()

        def read() -> None:
            while not self._cut.is_set():
                try:
                    data = source.recv(65536)
                except OSError:
                    data = b""
                with ready:
                    queue.append((time.monotonic() + self.delay_s, data))
                    ready.notify()
                if not data:
                    return

        def write() -> None:
            while True:
                with ready:
                    while not queue:
                        ready.wait()
                    due, data = queue.popleft()
                pause = due - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
                self._flowing.wait()
                if self._cut.is_set():
                    return  # what is still in transit is lost
                if not data:
                    with contextlib.suppress(OSError):
                        sink.shutdown(socket.SHUT_WR)
                    return
                try:
                    sink.sendall(data)
                except OSError:
                    return

        threading.Thread(target=read, daemon=True).start()
        threading.Thread(target=write, daemon=True).start()


class DataNode(LocalRedis):
    """A master or replica: redis-server with a config file of its own (Sentinel rewrites it
    when it reconfigures the node), replicating from ``replicaof`` when given."""

    def __init__(self, workdir: Path, replicaof: int | None = None) -> None:
        super().__init__(workdir, appendonly=True)
        self.replicaof = replicaof

    def command(self) -> list[str]:
        conf = self.workdir / "redis.conf"
        if not conf.exists():
            conf.write_text("# written by tests.support.sentinel\n", encoding="utf-8")
        command = [self.binary, str(conf), *self.command_args()]
        # Start a replica's first sync at once (Redis 7 waits 5 s for more replicas).
        command += ["--repl-diskless-sync-delay", "0"]
        if self.replicaof is not None:
            command += ["--replicaof", "127.0.0.1", str(self.replicaof)]
        return command

    def command_args(self) -> list[str]:
        return super().command()[1:]

    def connect(self) -> redis.Redis:
        return redis.Redis(port=self.port, decode_responses=True, socket_timeout=5)

    def kill(self) -> float:
        """SIGKILL; returns when it was sent (``time.time()``)."""
        at = time.time()
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)
        return at


class SentinelNode(LocalRedis):
    """``redis-server --sentinel`` monitoring ``service`` at ``master_port``."""

    def __init__(
        self,
        workdir: Path,
        service: str,
        master_port: int,
        quorum: int,
        down_after_ms: int,
        failover_timeout_ms: int,
    ) -> None:
        super().__init__(workdir, appendonly=False)
        self.service = service
        self.master_port = master_port
        self.quorum = quorum
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms

    def command(self) -> list[str]:
        conf = self.workdir / "sentinel.conf"
        name = self.service
        conf.write_text(
            "\n".join(
                [
                    f"port {self.port}",
                    "bind 127.0.0.1",
                    f"dir {self.workdir}",
                    f"logfile {self.workdir / 'sentinel.log'}",
                    f"sentinel monitor {name} 127.0.0.1 {self.master_port} {self.quorum}",
                    f"sentinel down-after-milliseconds {name} {self.down_after_ms}",
                    f"sentinel failover-timeout {name} {self.failover_timeout_ms}",
                    f"sentinel parallel-syncs {name} 1",
                    "",
                ]
            ),
            encoding="utf-8",
        )
        return [self.binary, str(conf), "--sentinel"]

    def connect(self) -> redis.Redis:
        return redis.Redis(port=self.port, decode_responses=True, socket_timeout=2)

    def kill(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)


class SentinelCluster:
    """A master, ``replicas`` replicas (each through a :class:`LaggyLink` of ``link_delay_s``,
    or directly with ``links=False``) and ``sentinels`` sentinels with quorum 2, on loopback."""

    def __init__(
        self,
        workdir: Path,
        service: str = "vlmq",
        replicas: int = 2,
        sentinels: int = 3,
        links: bool = True,
        link_delay_s: float = 0.0,
        down_after_ms: int = 1000,
        # Also how long a sentinel waits before it "fixes" a replica that replicates from
        # another address than the master's (+fix-slave-config): the replicas here replicate
        # through links, so this must outlast a drill, or the sentinels rewire them around
        # the links (measured: they did, with 3000).
        failover_timeout_ms: int = 60_000,
    ) -> None:
        self.workdir = workdir
        self.service = service
        self.link_delay_s = link_delay_s
        self.master = DataNode(workdir / "node-0")
        self.links = (
            [LaggyLink(self.master.port, link_delay_s) for _ in range(replicas)] if links else []
        )
        self.replicas = [
            DataNode(
                workdir / f"node-{i + 1}",
                replicaof=self.links[i].port if links else self.master.port,
            )
            for i in range(replicas)
        ]
        self.sentinels = [
            SentinelNode(
                workdir / f"sentinel-{i}",
                service,
                self.master.port,
                quorum=min(2, sentinels),
                down_after_ms=down_after_ms,
                failover_timeout_ms=failover_timeout_ms,
            )
            for i in range(sentinels)
        ]

    # addresses -------------------------------------------------------------------
    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.service}/0"

    @property
    def nodes(self) -> list[DataNode]:
        return [self.master, *self.replicas]

    def node(self, port: int) -> DataNode:
        return next(n for n in self.nodes if n.port == port)

    def master_port(self) -> int | None:
        """The master's port as the sentinels say (the majority of those that answer)."""
        votes: collections.Counter[int] = collections.Counter()
        for sentinel in self.sentinels:
            if sentinel.process is None or sentinel.process.poll() is not None:
                continue
            try:
                with contextlib.closing(sentinel.connect()) as conn:
                    address = conn.execute_command(
                        "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service
                    )
            except redis.RedisError:
                continue
            if address:
                votes[int(address[1])] += 1
        return votes.most_common(1)[0][0] if votes else None

    # lifecycle -----------------------------------------------------------------------
    def start(self, timeout_s: float = 60.0) -> SentinelCluster:
        deadline = time.monotonic() + timeout_s
        self.master.start()
        for link in self.links:
            link.up()
        for replica in self.replicas:
            replica.start()
        self._wait(deadline, self._replicas_online, "the replicas to sync")
        for sentinel in self.sentinels:
            sentinel.start()
        self._wait(deadline, self._sentinels_ready, "the sentinels to see each other")
        return self

    def _replicas_online(self) -> bool:
        with contextlib.closing(self.master.connect()) as conn:
            info = conn.info("replication")
        online = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
        return len(online) == len(self.replicas) and all(r.get("state") == "online" for r in online)

    def _sentinels_ready(self) -> bool:
        """Each sentinel knows the master, every replica and every other sentinel."""
        for sentinel in self.sentinels:
            try:
                with contextlib.closing(sentinel.connect()) as conn:
                    replicas = conn.execute_command("SENTINEL", "REPLICAS", self.service)
                    others = conn.execute_command("SENTINEL", "SENTINELS", self.service)
            except redis.RedisError:
                return False
            if len(replicas) != len(self.replicas) or len(others) != len(self.sentinels) - 1:
                return False
            if any("s_down" in _fields(r).get("flags", "") for r in replicas):
                return False
        return True

    @staticmethod
    def _wait(deadline: float, predicate: Any, what: str) -> None:
        while True:
            try:
                if predicate():
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise ConfigError(f"timed out waiting for {what}")
            time.sleep(0.05)

    def pause_replication(self) -> None:
        """The links from the master hold what they carry: what the master writes from now on
        reaches no replica (until :meth:`fail_master` drops it)."""
        for link in self.links:
            link.pause()

    def resume_replication(self) -> None:
        """The links deliver what they held since :meth:`pause_replication`."""
        for link in self.links:
            link.resume()

    def fail_master(self, port: int | None = None) -> float:
        """The master's host dies: its replication links are cut (what they carry is lost)
        and the master (``port``, or the one the sentinels name) is SIGKILLed. Returns the
        time of the kill (``time.time()``)."""
        port = port or self.master_port() or self.master.port
        for link in self.links:
            if link.target_port == port:
                link.cut()
        return self.node(port).kill()

    def wait_failover(self, old_port: int, timeout_s: float = 30.0) -> int:
        """Until the sentinels name a new master that answers as one; returns its port."""
        deadline = time.monotonic() + timeout_s
        while True:
            port = self.master_port()
            if port is not None and port != old_port and self._is_master(port):
                return port
            if time.monotonic() > deadline:
                raise TimeoutError(f"no failover within {timeout_s}s")
            time.sleep(0.02)

    def _is_master(self, port: int) -> bool:
        try:
            with contextlib.closing(self.node(port).connect()) as conn:
                return conn.info("replication").get("role") == "master"
        except (redis.RedisError, StopIteration):
            return False

    def kill(self) -> None:
        for sentinel in self.sentinels:
            sentinel.kill()
        for link in self.links:
            link.cut()
        for node in self.nodes:
            node.kill()

    def __enter__(self) -> SentinelCluster:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.kill()


def _fields(reply: Any) -> dict[str, str]:
    """A SENTINEL REPLICAS entry as a dict (redis-py may give a flat list or a dict)."""
    if isinstance(reply, dict):
        return {str(k): str(v) for k, v in reply.items()}
    return {str(reply[i]): str(reply[i + 1]) for i in range(0, len(reply) - 1, 2)}
