"""A reply-dropping proxy between a process and Redis: the command runs, its reply is lost.

A TCP forwarder on loopback (``listen_on`` / ``close_all`` of tests.support.proxy) that
reads RESP both ways: the commands a client sends (pipelines and MULTI/EXEC included: one
command at a time, in order) and the replies Redis sends back, matched first in, first out to
the commands of that connection (a reply is the answer to the oldest command not answered yet;
inside MULTI each queued command's ``+QUEUED`` is its reply, EXEC's is the transaction's).

When a reply answers a command a :class:`Rule` matches, the rule decides (the Nth match, or
each match with a probability drawn from a seeded RNG) whether to lose it: the command has
reached Redis and run, and instead of forwarding its reply the proxy closes the client's
connection (and its own to Redis). The client sees a ``ConnectionError`` while reading the
reply; redis-py's ``Retry`` (vlmq's ``create_redis``: two retries on ConnectionError) then
sends the same command again on a new connection, so it runs twice. A rule may instead *hold*
the reply (``hold=True``): it is not forwarded until :meth:`Rule.release` (the client waits,
as it would behind a stalled network, and can be interrupted meanwhile).

Only replies count: an error reply (``-NOSCRIPT`` before redis-py loads a script, ``-ERR``)
neither counts as a match nor is dropped unless ``count_errors`` (the command did not apply).
A connection that subscribes (SUBSCRIBE, PSUBSCRIBE, SSUBSCRIBE) or runs MONITOR stops being
matched: replies are no longer one per command, so from there on it is forwarded untouched.
RESP3 push frames (``>``) are forwarded and never matched.

>>> proxy = ReplyDropProxy(redis_port).up()
>>> settle = proxy.add(Rule.script("settle"))  # FCALL (or EVAL) whose ARGV[1] is 'settle'
>>> env = {"VLMQ_REDIS_URL": proxy.url_for(redis_url)}
>>> ...; settle.dropped  # 1 once the first settle's reply was lost
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from tests.support.proxy import close_all, listen_on
from tests.support.services import free_port, wait_until

__all__ = [
    "FrameScanner",
    "ProtocolError",
    "ReplyDropProxy",
    "Rule",
    "parse_command",
    "script_name",
]

Args = Sequence[bytes]

_SCRIPT_COMMANDS = frozenset(
    {b"EVAL", b"EVALSHA", b"EVAL_RO", b"EVALSHA_RO", b"FCALL", b"FCALL_RO"}
)
# After these a connection's replies are no longer one per command.
_PASSTHROUGH_AFTER = frozenset({b"SUBSCRIBE", b"PSUBSCRIBE", b"SSUBSCRIBE", b"MONITOR"})


class ProtocolError(ValueError):
    """Bytes that are not RESP."""


# ---------------------------------------------------------------------------------------------
# RESP framing
# ---------------------------------------------------------------------------------------------

_SIMPLE = frozenset(b"+-:_,#(")  # one line each
_BULK = frozenset(b"$!=")  # a length line, then that many bytes and CRLF
_AGGREGATE = frozenset(b"*~>")  # n elements
_PAIRS = frozenset(b"%")  # n key/value pairs
_ATTRIBUTE = ord("|")  # n pairs, then the element they describe


class FrameScanner:
    """Finds where the first complete RESP frame of a growing buffer ends, resuming where it
    stopped when more bytes arrive (a 100 MB bulk string or a 1,000,000-element array is
    scanned once, not once per read). RESP2 and RESP3; ``inline`` also takes a client's inline
    command (a line not starting with ``*``)."""

    def __init__(self, inline: bool = False) -> None:
        self.inline = inline
        self.reset()

    def reset(self) -> None:
        """Forget the frame in progress (after the caller cut a whole frame off its buffer)."""
        self._pos = 0
        self._stack: list[int] = []  # elements still to come, per open aggregate
        self._skip_to: int | None = None  # the end of a bulk string's payload being read

    def frame_end(self, buf: bytes | bytearray) -> int | None:
        """The end offset of the first complete frame of ``buf``, or None for not yet."""
        while True:
            if self._skip_to is not None:
                if len(buf) < self._skip_to:
                    return None
                self._pos, self._skip_to = self._skip_to, None
                if self._element_done():
                    return self._pos
                continue
            if self._pos >= len(buf):
                return None
            if self.inline and not self._stack and buf[self._pos] not in _AGGREGATE:
                end = buf.find(b"\n", self._pos)
                return None if end < 0 else end + 1
            line_end = buf.find(b"\r\n", self._pos)
            if line_end < 0:
                return None
            kind, header = buf[self._pos], bytes(buf[self._pos + 1 : line_end])
            if self._header(kind, header, line_end + 2):
                return self._pos

    def _header(self, kind: int, header: bytes, after: int) -> bool:
        """One element's header line (type byte ``kind``), read up to ``after``; True when
        that completes the frame."""
        self._pos = after
        if kind in _SIMPLE:
            return self._element_done()
        if kind in _BULK:
            size = _length(header)
            if size < 0:
                return self._element_done()
            self._skip_to = after + size + 2
            return False
        if kind in _AGGREGATE or kind in _PAIRS or kind == _ATTRIBUTE:
            count = _length(header)
            if kind in _PAIRS:
                count *= 2
            elif kind == _ATTRIBUTE:
                count = 2 * count + 1  # its pairs, then the element it is about
            if count <= 0:
                return self._element_done()
            self._stack.append(count)
            return False
        raise ProtocolError(f"unknown RESP type byte {bytes([kind])!r}")

    def _element_done(self) -> bool:
        """One element ended at ``_pos``; True when that completes the frame."""
        while self._stack:
            self._stack[-1] -= 1
            if self._stack[-1] > 0:
                return False
            self._stack.pop()  # that aggregate is complete: one element of its parent
        return True


def _length(header: bytes) -> int:
    if header == b"?":
        raise ProtocolError("streamed RESP3 aggregates are not supported")
    try:
        return int(header)
    except ValueError:
        raise ProtocolError(f"bad RESP length {header[:32]!r}") from None


def parse_command(frame: bytes) -> list[bytes]:
    """A command's arguments from one complete client frame (an array of bulk strings, or an
    inline command)."""
    if not frame.startswith(b"*"):
        return frame.strip().split()
    line_end = frame.index(b"\r\n")
    count = int(frame[1:line_end])
    args: list[bytes] = []
    pos = line_end + 2
    for _ in range(max(count, 0)):
        if frame[pos : pos + 1] != b"$":
            raise ProtocolError("a command is an array of bulk strings")
        line_end = frame.index(b"\r\n", pos)
        size = int(frame[pos + 1 : line_end])
        start = line_end + 2
        args.append(frame[start : start + size])
        pos = start + size + 2
    return args


def script_name(args: Args) -> str | None:
    """ARGV[1] of an FCALL or EVAL/EVALSHA (vlmq's functions name their command there; all
    three put the key count second), or None."""
    if not args or args[0].upper() not in _SCRIPT_COMMANDS or len(args) < 3:
        return None
    try:
        keys = int(args[2])
    except ValueError:
        return None
    at = 3 + keys
    return args[at].decode(errors="replace") if len(args) > at else None


# ---------------------------------------------------------------------------------------------
# rules
# ---------------------------------------------------------------------------------------------


@dataclass(eq=False)
class Rule:
    """Which replies to lose. ``matches`` sees each command's arguments (bytes; the name as
    the client wrote it). Of the replies to matching commands (error replies only with
    ``count_errors``), the ``nth`` (1-based) is dropped, or, with ``nth=None``, each with
    ``probability`` (a ``random.Random(seed)``; at most ``limit`` drops). ``hold``: instead of
    closing the connection, keep the reply until :meth:`release`."""

    name: str
    matches: Callable[[Args], bool]
    nth: int | None = 1
    probability: float = 0.0
    seed: int = 0
    limit: int | None = None
    hold: bool = False
    count_errors: bool = False
    in_block: Callable[[Args], bool] | None = None  # see Rule.transaction
    matched: int = 0  # replies to matching commands seen
    dropped: int = 0  # of those, dropped (or held)
    _rng: random.Random = field(init=False, repr=False)
    _lock: threading.Lock = field(init=False, repr=False, default_factory=threading.Lock)
    _released: threading.Event = field(init=False, repr=False, default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    @classmethod
    def command(cls, name: str, **options: Any) -> Rule:
        """Replies to the command ``name`` (any case): ``Rule.command("EXEC", nth=2)``."""
        wanted = name.upper().encode()
        return cls(name.upper(), lambda args: bool(args) and args[0].upper() == wanted, **options)

    @classmethod
    def transaction(cls, name: str, holding: Callable[[Args], bool], **options: Any) -> Rule:
        """Replies to EXEC whose MULTI block held a command ``holding`` matches (the EXEC that
        enqueues: ``Rule.transaction("enqueue", lambda a: a[0].upper() == b"LPUSH")``)."""
        return cls(name, lambda args: False, in_block=holding, **options)

    @classmethod
    def script(cls, command: str, **options: Any) -> Rule:
        """Replies to FCALL (or EVAL/EVALSHA) calls whose ARGV[1] is ``command`` (how vlmq's
        Scripts name the command its library runs: 'settle', 'pull', 'transition', ...)."""
        return cls(f"script:{command}", lambda args: script_name(args) == command, **options)

    def applies(self, args: Args, block: Sequence[Args] | None) -> bool:
        """Whether this rule looks at the reply to ``args`` (``block``: the commands of the
        MULTI block an EXEC ends)."""
        if self.in_block is not None:
            is_exec = bool(args) and args[0].upper() == b"EXEC"
            return is_exec and block is not None and any(map(self.in_block, block))
        return self.matches(args)

    def decide(self, error_reply: bool) -> bool:
        """One reply to a matching command: True when it is to be dropped (or held)."""
        if error_reply and not self.count_errors:
            return False
        with self._lock:
            self.matched += 1
            if self.nth is not None:
                fire = self.matched == self.nth
            else:
                fire = self._rng.random() < self.probability
                if self.limit is not None and self.dropped >= self.limit:
                    fire = False
            if fire:
                self.dropped += 1
            return fire

    def release(self) -> None:
        """Forward the held replies (and every later one this rule would hold)."""
        self._released.set()

    @property
    def released(self) -> bool:
        return self._released.is_set()

    def wait_dropped(self, count: int = 1, timeout: float = 30.0) -> None:
        """Until this rule dropped (or holds) ``count`` replies."""
        wait_until(lambda: self.dropped >= count, timeout=timeout, what=f"{self.name} dropped")


# ---------------------------------------------------------------------------------------------
# the proxy
# ---------------------------------------------------------------------------------------------


@dataclass
class _Pending:
    """A command sent to Redis whose reply has not come back yet."""

    name: bytes
    rules: list[Rule]
    passthrough_after: bool = False


class _Link:
    """One client connection and its own connection to Redis."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client = client
        self.upstream = upstream
        self.pending: deque[_Pending] = deque()
        self.passthrough = False
        self.multi: list[list[bytes]] | None = None  # the commands of an open MULTI block
        self.closed = threading.Event()
        self._running = 2  # its two forwarding threads
        self._lock = threading.Lock()

    def close(self) -> None:
        self.closed.set()
        for sock in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def thread_done(self) -> bool:
        """One forwarding thread ended; True for the last one (its sockets can go)."""
        self.close()
        with self._lock:
            self._running -= 1
            return self._running == 0


class ReplyDropProxy:
    """A loopback forwarder to ``target_port`` that loses the replies its rules pick (see the
    module's docstring). Counters: ``commands_seen``, ``command_counts`` (per command name),
    ``script_counts`` (per script command), ``connections``, and each rule's ``matched`` and
    ``dropped``."""

    def __init__(
        self, target_port: int, rules: Iterable[Rule] = (), target_host: str = "127.0.0.1"
    ) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.port = free_port()
        self.rules: list[Rule] = list(rules)
        self.commands_seen = 0
        self.command_counts: Counter[str] = Counter()
        self.script_counts: Counter[str] = Counter()
        self.connections = 0
        self._listener: socket.socket | None = None
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()

    # addresses ---------------------------------------------------------------------------
    def url_for(self, redis_url: str) -> str:
        """``redis_url`` (a ``redis://`` URL of the target) through this proxy: same database,
        same credentials."""
        parts = urlsplit(redis_url)
        auth, at, _ = parts.netloc.rpartition("@")
        return urlunsplit(parts._replace(netloc=f"{auth}{at}127.0.0.1:{self.port}"))

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    # rules and counters ------------------------------------------------------------------
    def add(self, rule: Rule) -> Rule:
        with self._lock:
            self.rules.append(rule)
        return rule

    def remove(self, rule: Rule) -> None:
        with self._lock:
            self.rules.remove(rule)
        rule.release()

    def dropped(self) -> dict[str, int]:
        """Replies dropped (or held) per rule name."""
        with self._lock:
            rules = list(self.rules)
        out: Counter[str] = Counter()
        for rule in rules:
            out[rule.name] += rule.dropped
        return dict(out)

    # lifecycle ---------------------------------------------------------------------------
    def up(self) -> ReplyDropProxy:
        listener = listen_on(self.port)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def down(self) -> None:
        with self._lock:
            rules = list(self.rules)
        for rule in rules:
            rule.release()
        listener, self._listener = self._listener, None
        close_all(listener, self._open, self._lock)

    def __enter__(self) -> ReplyDropProxy:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            if self._listener is not listener:
                client.close()
                return
            try:
                upstream = socket.create_connection((self.target_host, self.target_port), 5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            link = _Link(client, upstream)
            with self._lock:
                self.connections += 1
                self._open.update({client, upstream})
            threading.Thread(target=self._commands, args=(link,), daemon=True).start()
            threading.Thread(target=self._replies, args=(link,), daemon=True).start()

    # client -> Redis -----------------------------------------------------------------------
    def _commands(self, link: _Link) -> None:
        try:
            for frame in self._frames(link, link.client, link.upstream, FrameScanner(inline=True)):
                # Queued before it is sent: its reply can only come after.
                link.pending.append(self._command(link, parse_command(frame)))
                link.upstream.sendall(frame)
        except (OSError, ProtocolError):
            pass
        finally:
            self._finished(link)

    @staticmethod
    def _frames(
        link: _Link, source: socket.socket, sink: socket.socket, scanner: FrameScanner
    ) -> Iterator[bytes]:
        """Each whole RESP frame ``source`` sends; once the link passes everything through,
        the rest goes straight to ``sink``."""
        buf = bytearray()
        while data := source.recv(65536):
            buf += data
            while buf:
                if link.passthrough:
                    sink.sendall(buf)
                    buf.clear()
                    break
                end = scanner.frame_end(buf)
                if end is None:
                    break
                frame = bytes(buf[:end])
                del buf[:end]
                scanner.reset()
                yield frame

    def _finished(self, link: _Link) -> None:
        if link.thread_done():
            with self._lock:
                self._open.difference_update({link.client, link.upstream})
            link.client.close()
            link.upstream.close()

    def _command(self, link: _Link, args: list[bytes]) -> _Pending:
        name = args[0].upper() if args else b""
        script = script_name(args)
        block = None
        if name == b"MULTI":
            link.multi = []
        elif name in (b"EXEC", b"DISCARD"):
            block, link.multi = link.multi, None
        elif link.multi is not None:
            link.multi.append(args)
        with self._lock:
            self.commands_seen += 1
            self.command_counts[name.decode(errors="replace")] += 1
            if script is not None:
                self.script_counts[script] += 1
            rules = [rule for rule in self.rules if rule.applies(args, block)]
        return _Pending(name, rules, name in _PASSTHROUGH_AFTER)

    # Redis -> client -----------------------------------------------------------------------
    def _replies(self, link: _Link) -> None:
        try:
            for frame in self._frames(link, link.upstream, link.client, FrameScanner()):
                if not self._forward(link, frame):
                    return
        except (OSError, ProtocolError):
            pass
        finally:
            self._finished(link)

    def _forward(self, link: _Link, frame: bytes) -> bool:
        """Forward one reply, or lose it (False: the link is closed) or hold it."""
        if frame.startswith(b">"):  # RESP3 push: no command's reply
            link.client.sendall(frame)
            return True
        pending = link.pending.popleft() if link.pending else None
        if pending is not None and pending.passthrough_after:
            link.passthrough = True
        error = frame[:1] in (b"-", b"!")
        rule = next((r for r in (pending.rules if pending else []) if r.decide(error)), None)
        if rule is not None and not rule.hold:
            link.close()  # the command ran; its reply never reaches the client
            return False
        if rule is not None:
            while not rule.released and not link.closed.is_set():
                time.sleep(0.02)
            if link.closed.is_set():
                return False
        link.client.sendall(frame)
        return True
