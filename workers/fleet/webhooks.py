"""Job-finished webhooks: signed with HMAC-SHA256, retried with backoff.

The status script queues a job id on ``vlmq:events`` exactly once, when a
sealed job's last task turns terminal. Any worker takes events with LMOVE
into a processing list (so a crash mid-delivery leaves them visible), posts
``{"event": "job.finished", ...}`` to the job's ``webhook_url`` with header
``X-Vlmq-Signature: sha256=<hex hmac of the body>``, retries on failure with
exponential backoff, and removes the event when done or given up.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import ipaddress
import json
import logging
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from vlmq.config.errors import VlmqError
from vlmq.config.keys import Keys
from vlmq.config.settings import WebhookSettings
from vlmq.config.status import COUNTED, TERMINAL
from vlmq.config.statusdb import StatusDB
from vlmq.workers.media.netpolicy import check_addresses, parse_http_url

__all__ = ["WebhookSender", "sign"]

log = logging.getLogger(__name__)


_TERMINAL_ORDER = [s for s in COUNTED if s in TERMINAL]


def sign(secret: str, body: bytes) -> str:
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


class WebhookSender:
    def __init__(self, status: StatusDB, settings: WebhookSettings) -> None:
        self.status = status
        self.redis = status.redis
        self.keys: Keys = status.keys
        self.settings = settings
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="webhook")

    def poll(self, limit: int = 16) -> int:
        """Take up to ``limit`` finished-job events and deliver them in the background."""
        taken = 0
        while taken < limit:
            job_id = self.redis.lmove(
                self.keys.events(), self.keys.events_processing(), "RIGHT", "LEFT"
            )
            if job_id is None:
                break
            taken += 1
            self._pool.submit(self._deliver, str(job_id))
        return taken

    def _payload(self, job_id: str) -> tuple[str | None, bytes]:
        job = self.status.job(job_id)
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
            if url:
                self._post_with_retry(url, body, job_id)
        except Exception:
            log.exception("webhook for job %s failed", job_id)
        finally:
            self.redis.lrem(self.keys.events_processing(), 1, job_id)

    def _post_with_retry(self, url: str, body: bytes, job_id: str) -> None:
        delay = 0.5
        for attempt in range(1, self.settings.max_attempts + 1):
            try:
                status = self._post(url, body)
                if status < 300:
                    self.redis.hset(self.keys.job(job_id), "webhook_status", str(status))
                    return
                if 400 <= status < 500 and status not in (408, 429):
                    break  # the receiver refused it: retrying will not help
            except (OSError, VlmqError, http.client.HTTPException):
                log.warning("webhook attempt %d for job %s failed", attempt, job_id)
            time.sleep(delay)
            delay = min(delay * 2, 60.0)
        self.redis.hset(self.keys.job(job_id), "webhook_status", "failed")

    def _post(self, url: str, body: bytes) -> int:
        target = parse_http_url(url)
        infos = socket.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
        addresses = [ipaddress.ip_address(info[4][0]) for info in infos]
        address = check_addresses(addresses, self.settings.allow_private_addresses)[0]
        connection: http.client.HTTPConnection
        if target.is_tls:
            connection = http.client.HTTPSConnection(
                target.host, target.port, timeout=self.settings.timeout_s
            )
        else:  # connect to the address that was checked
            connection = http.client.HTTPConnection(
                str(address), target.port, timeout=self.settings.timeout_s
            )
        headers = {
            "Host": target.host,
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
        self._pool.shutdown(wait=False, cancel_futures=True)
