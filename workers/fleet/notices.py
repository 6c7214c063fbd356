"""Preemption notices: the signs that this machine is about to be taken away.

SIGTERM is one (Kubernetes, docker stop, systemd, a spot node's shutdown); the others are
watched here, on a thread, every ``VLMQ_DRAIN__NOTICE_POLL_S``: a file that appears
(``notice_file``: written by a node agent or a sidecar, e.g. from Kubernetes' node
termination handler) and an HTTP endpoint polled (``notice_url``: the clouds' spot notices;
AWS's ``spot/instance-action`` answers 404 until a notice and 200 then; GCE's
``instance/preempted`` answers ``TRUE`` once preempted, with ``Metadata-Flavor: Google``).
A notice drains the worker as SIGTERM does (``drain.py``): the watcher raises SIGTERM in its
own process, so a plain worker and one hosted by Celery take the same path.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from vlmq.config.settings import DrainSettings

__all__ = ["NoticeWatcher", "file_notice", "sigterm_self", "url_notice"]

log = logging.getLogger(__name__)

# An endpoint that does not answer within this is asked again at the next poll.
URL_TIMEOUT_S = 1.0


def file_notice(path: str) -> str | None:
    """What the file says, when it exists (a notice), else None."""
    target = Path(path)
    if not target.exists():
        return None
    try:
        text = target.read_text(errors="replace")[:200].strip()
    except OSError:
        text = ""
    return f"notice file {path} appeared" + (f": {text}" if text else "")


def url_notice(url: str, headers: dict[str, str], body: str = "") -> str | None:
    """A 200 answer of ``url`` (containing ``body``, when set) is a notice; anything else,
    an error or no answer included, is none (the next poll asks again)."""
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=URL_TIMEOUT_S) as answer:
            if answer.status != 200:
                return None
            text = answer.read(4096).decode("utf-8", errors="replace")
    except (urllib.error.URLError, OSError, ValueError):
        return None
    if body and body not in text:
        return None
    return f"{url} answered 200: {text.strip()[:200]}"


def sigterm_self() -> None:
    """Drain this process as SIGTERM does (its handler: the plain worker's, or Celery's
    warm shutdown)."""
    os.kill(os.getpid(), signal.SIGTERM)


class NoticeWatcher:
    """Checks the configured notices every ``notice_poll_s``; the first one calls
    ``on_notice`` once (by default, SIGTERM to this process) and the watch ends."""

    def __init__(
        self, settings: DrainSettings, on_notice: Callable[[], None] = sigterm_self
    ) -> None:
        self.settings = settings
        self.on_notice = on_notice
        self.noticed: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def configured(self) -> bool:
        return bool(self.settings.notice_file or self.settings.notice_url)

    def check(self) -> str | None:
        """The notice, if one is there now."""
        drain = self.settings
        if drain.notice_file and (found := file_notice(drain.notice_file)):
            return found
        if drain.notice_url:
            return url_notice(drain.notice_url, drain.notice_headers, drain.notice_body)
        return None

    def start(self) -> NoticeWatcher:
        if self.configured:
            self._thread = threading.Thread(target=self._watch, name="notices", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                found = self.check()
            except Exception:  # a watch that fails is logged, never a reason to stop
                log.exception("checking for a preemption notice failed")
                found = None
            if found:
                self.noticed = found
                log.warning("preemption notice: %s; draining", found)
                self.on_notice()
                return
            self._stop.wait(self.settings.notice_poll_s)
