"""A webhook receiver on loopback that records what it gets and can stall on purpose."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["HookReceiver"]


class HookReceiver:
    """Records (signature, body) of every POST; the first ``stall`` requests wait
    ``stall_s`` before answering (a slow receiver a sender can die in front of)."""

    def __init__(self, stall: int = 0, stall_s: float = 0.0) -> None:
        self.received: list[tuple[str, bytes]] = []
        self.stall, self.stall_s = stall, stall_s
        self._seen = 0
        self._lock = threading.Lock()
        self._release = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with receiver._lock:
                    receiver._seen += 1
                    stalled = receiver._seen <= receiver.stall
                if stalled:
                    receiver._release.wait(receiver.stall_s)
                    return  # no answer: the sender's attempt fails
                with receiver._lock:
                    receiver.received.append((self.headers["X-Vlmq-Signature"], body))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}/hook"

    @property
    def requests_seen(self) -> int:
        with self._lock:
            return self._seen

    def close(self) -> None:
        self._release.set()
        self.server.shutdown()
        self.server.server_close()
