"""A TCP forwarder on loopback that a test can take down and bring back.

Stands in for an endpoint outage (toxiproxy's "down" toxic): while down it
refuses new connections and cuts open ones; the server behind keeps its state.
"""

from __future__ import annotations

import contextlib
import socket
import threading

from tests.support.services import free_port

__all__ = ["Proxy", "close_all", "listen_on"]


def listen_on(port: int, backlog: int = 64) -> socket.socket:
    """A listening socket on loopback ``port`` (reusable at once after a close)."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(backlog)
    return listener


def close_all(
    listener: socket.socket | None, sockets: set[socket.socket], lock: threading.Lock
) -> None:
    """Stop accepting and cut every open connection (``sockets`` is emptied)."""
    if listener is not None:
        # close() alone does not wake a thread blocked in accept(): it would take one more
        # connection after the forwarder is down.
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()
    with lock:
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        sockets.clear()


class Proxy:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._listener: socket.socket | None = None
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.connections = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def up(self) -> Proxy:
        listener = listen_on(self.port)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def down(self) -> None:
        listener, self._listener = self._listener, None
        close_all(listener, self._open, self._lock)

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            if self._listener is not listener:  # taken down meanwhile
                client.close()
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            self.connections += 1
            with self._lock:
                self._open.update({client, upstream})
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
