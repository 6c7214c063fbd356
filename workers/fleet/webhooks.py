"""Job-finished webhooks: signed with HMAC-SHA256, retried with backoff, delivered at least once.

The status script queues a job id on ``Keys.events()`` exactly once, when a sealed job's last
task turns terminal. Any worker takes events under a lease (``Keys.events_leased()``, renewed
before each attempt), posts ``{"event": "job.finished", ...}`` to the job's ``webhook_url``
with header ``X-Vlmq-Signature: sha256=<hex hmac of the body>``, retries on failure with
exponential backoff, and removes the event when done or given up. A sender that stops gives
back what it had not started; one that dies leaves leases that lapse, and any worker's
housekeeping puts those events back. The connection goes to the address that was checked
(TLS included: SNI and certificate for the host), never to a second lookup. Without a signing
secret nothing is sent, and the job says why (``webhook_status``).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import http.client
import ipaddress
import json
import logging
import socket
import ssl
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor

from redis import RedisError

from vlmq.broker.connection import TRANSIENT_REDIS_ERRORS
from vlmq.broker.state import State
from vlmq.config.errors import VlmqError
from vlmq.config.keys import Keys
from vlmq.config.settings import WebhookSettings
from vlmq.config.status import COUNTED, TERMINAL
from vlmq.workers.media.netpolicy import check_addresses, parse_http_url
from vlmq.workers.media.pinned import pinned_connection

__all__ = ["WebhookSender", "sign"]

log = logging.getLogger(__name__)


_TERMINAL_ORDER = [s for s in COUNTED if s in TERMINAL]


def sign(secret: str, body: bytes) -> str:
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


class WebhookSender:
    def __init__(
        self,
        state: State,
        settings: WebhookSettings,
        workers: int = 2,
        tls_context: ssl.SSLContext | None = None,
    ) -> None:
        self.state = state
        self.redis = state.redis
        self.keys: Keys = state.keys
        self.settings = settings
        self._workers = workers
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="webhook")
        self._tls = tls_context or ssl.create_default_context()
        self._pending: dict[Future[None], str] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    def poll(self) -> int:
        """Take as many finished-job events as there are free senders; deliver them in the
        background. Also puts back events whose sender died (their lease ran out)."""
        self.state.events.reap()
        with self._lock:
            free = self._workers - len(self._pending)
        if free <= 0:
            return 0
        taken = self.state.events.take(free, self._lease_s())
        for job_id in taken:
            future = self._pool.submit(self._deliver, str(job_id))
            with self._lock:
                self._pending[future] = str(job_id)
            future.add_done_callback(self._forget)
        return len(taken)

    def _forget(self, future: Future[None]) -> None:
        with self._lock:
            self._pending.pop(future, None)

    def _lease_s(self) -> float:
        return self.settings.lease_s

    def _payload(self, job_id: str) -> tuple[str | None, bytes]:
        job = self.state.jobs.get(job_id)
        body = {
            "event": "job.finished",
            "event_id": uuid.uuid4().hex,
            "job_id": job_id,
            "state": job.state.value,
            "total": job.total,
            "counts": {s.value: job.counts.get(s.value, 0) for s in _TERMINAL_ORDER},
            "finished_at": job.finished_at or time.time(),
        }
        return job.webhook_url, json.dumps(body, separators=(",", ":")).encode()

    def _deliver(self, job_id: str) -> None:
        try:
            url, body = self._payload(job_id)
            if url and not self.settings.secret:
                log.error(
                    "job %s: webhook not sent: VLMQ_WEBHOOKS__SECRET is empty, and an unsigned "
                    "webhook cannot be told from a forged one",
                    job_id,
                )
                self._record(job_id, "refused: no signing secret")
            elif url and not self._post_with_retry(url, body, job_id):
                # Stopping between attempts: another worker takes it from here.
                self.state.events.give_back([job_id])
                return
            self.state.events.done(job_id)
        except TRANSIENT_REDIS_ERRORS as exc:
            # Redis blinked: the event stays leased, its lease lapses, and any worker's
            # housekeeping puts it back (sent again at worst: webhooks are at least once).
            log.warning("webhook for job %s: Redis %s; it is sent again", job_id, _name(exc))
        except Exception:
            log.exception("webhook for job %s failed", job_id)
            with contextlib.suppress(RedisError):
                self.state.events.done(job_id)

    def _record(self, job_id: str, outcome: str) -> None:
        self.redis.hset(self.keys.job(job_id), "webhook_status", outcome)

    def _post_with_retry(self, url: str, body: bytes, job_id: str) -> bool:
        """Deliver, or give up and say so; False when stopping cut the attempts short."""
        delay = 0.5
        for attempt in range(1, self.settings.max_attempts + 1):
            if self._stopping.is_set():
                return False
            self.state.events.renew(job_id, self._lease_s())
            try:
                status = self._post(url, body)
                if status < 300:
                    self._record(job_id, str(status))
                    return True
                if 400 <= status < 500 and status not in (408, 429):
                    break  # the receiver refused it: retrying will not help
            except (OSError, VlmqError, http.client.HTTPException):
                log.warning("webhook attempt %d for job %s failed", attempt, job_id)
            self._stopping.wait(delay)
            delay = min(delay * 2, 60.0)
        self._record(job_id, "failed")
        return True

    def _post(self, url: str, body: bytes) -> int:
        target = parse_http_url(url)
        infos = socket.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
        addresses = [ipaddress.ip_address(info[4][0]) for info in infos]
        address = check_addresses(addresses, self.settings.allow_private_addresses)[0]
        connection = pinned_connection(target, address, self.settings.timeout_s, self._tls)
        # http.client writes the Host header from the URL's host and port (not the address).
        headers = {
            "Content-Type": "application/json",
            "User-Agent": "vlmq-webhook/1",
            "X-Vlmq-Signature": sign(self.settings.secret, body),
        }
        try:
            connection.request("POST", target.request_target, body=body, headers=headers)
            return connection.getresponse().status
        finally:
            connection.close()

    def close(self) -> None:
        """Stop: deliveries not started go back to the queue at once; one in progress gives
        its event back after the attempt under way (or, if this process ends first, keeps a
        lease that lapses: another worker sends it)."""
        self._stopping.set()
        with self._lock:
            unstarted = [job for future, job in self._pending.items() if future.cancel()]
        self._pool.shutdown(wait=False, cancel_futures=True)
        if unstarted:
            with contextlib.suppress(RedisError):
                self.state.events.give_back(unstarted)


def _name(exc: BaseException) -> str:
    return type(exc).__name__
