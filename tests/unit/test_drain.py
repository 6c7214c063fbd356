"""The drain's plan (which micro-batches finish inside the window, ``drain.py``), the engine
watch it reads, and the preemption notices (``notices.py``)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from vlmq.config.settings import DrainSettings, Settings
from vlmq.workers.fleet.drain import EngineWatch, InEngine, fits, plan
from vlmq.workers.fleet.notices import NoticeWatcher, file_notice, url_notice


def _batch(began: float, expected: float | None, *ids: str) -> InEngine:
    return InEngine(set(ids), began, expected, len(ids))


# the plan ----------------------------------------------------------------------------------


def test_a_batch_fits_when_its_expected_remaining_time_is_inside_the_window():
    now = 100.0
    assert fits(_batch(90.0, 30.0, "a"), 25.0, now)  # 20 s left
    assert not fits(_batch(95.0, 60.0, "a"), 25.0, now)  # 55 s left
    assert fits(_batch(50.0, 30.0, "a"), 25.0, now)  # overdue: expected any moment
    assert fits(_batch(100.0, 25.0, "a"), 25.0, now)  # exactly the window


def test_a_batch_whose_time_is_unknown_is_handed_back():
    assert not fits(_batch(99.0, None, "a"), 1000.0, 100.0)


def test_a_zero_window_hands_back_everything_still_running():
    assert not fits(_batch(99.0, 5.0, "a"), 0.0, 100.0)


def test_plan_splits_running_micro_batches_into_finish_and_hand_back():
    short, long, unknown = _batch(90, 12, "s"), _batch(90, 600, "l"), _batch(99, None, "u")
    finish, back = plan([short, long, unknown], 25.0, 100.0)
    assert finish == [short]
    assert back == [long, unknown]


# the engine watch ---------------------------------------------------------------------------


def test_the_watch_learns_engine_time_from_micro_batches_that_went_through():
    watch = EngineWatch(weight=0.5)
    watch.began(1, ["a", "b"], now=0.0)
    assert watch.running()[0].expected_s is None  # nothing known yet
    watch.settled(1, ["a"], now=5.0)
    assert watch.expected_s is None  # one request still inside
    assert watch.running()[0].task_ids == {"b"}
    watch.settled(1, ["b"], now=10.0)
    assert watch.expected_s == 10.0 and watch.running() == []
    watch.began(2, ["c"], now=20.0)
    assert watch.running()[0].expected_s == 10.0
    watch.settled(2, ["c"], now=40.0)
    assert watch.expected_s == pytest.approx(15.0)  # 0.5 x 20 + 0.5 x 10


def test_requests_given_back_on_a_failure_path_leave_the_watch_uncounted():
    watch = EngineWatch()
    watch.began(1, ["a", "b"], now=0.0)
    watch.forget(["a", "b"])
    assert watch.running() == [] and watch.expected_s is None
    watch.settled(1, ["a"], now=1.0)  # a late settle of a forgotten batch: nothing
    assert watch.expected_s is None


# notices ------------------------------------------------------------------------------------


def test_a_file_that_appears_is_a_notice(tmp_path: Path) -> None:
    path = tmp_path / "preempted"
    assert file_notice(str(path)) is None
    path.write_text("spot reclaim in 30s\n")
    notice = file_notice(str(path))
    assert notice is not None and "spot reclaim in 30s" in notice


class _Answers(http.server.BaseHTTPRequestHandler):
    status = 404
    body = b""
    seen_headers: ClassVar[dict[str, str]] = {}

    def do_GET(self) -> None:
        type(self).seen_headers = dict(self.headers)
        self.send_response(self.status)
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def endpoint() -> Iterator[tuple[str, type[_Answers]]]:
    handler = type("Handler", (_Answers,), {})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/spot", handler
    server.shutdown()
    server.server_close()


def test_a_polled_url_answering_200_is_a_notice(endpoint):
    url, handler = endpoint
    assert url_notice(url, {}) is None  # AWS: 404 until a notice
    handler.status, handler.body = 200, b'{"action": "terminate"}'
    notice = url_notice(url, {"X-Test": "1"})
    assert notice is not None and "terminate" in notice
    assert handler.seen_headers.get("X-Test") == "1"


def test_a_notice_body_must_be_in_the_answer_when_one_is_set(endpoint):
    url, handler = endpoint
    handler.status, handler.body = 200, b"FALSE"  # GCE: 200 FALSE until preempted
    assert url_notice(url, {"Metadata-Flavor": "Google"}, "TRUE") is None
    handler.body = b"TRUE"
    assert url_notice(url, {"Metadata-Flavor": "Google"}, "TRUE") is not None


def test_an_endpoint_that_does_not_answer_is_no_notice():
    assert url_notice("http://127.0.0.1:9/", {}) is None


def test_the_watcher_calls_once_on_the_first_notice(tmp_path: Path) -> None:
    path = tmp_path / "notice"
    called = threading.Event()
    calls: list[int] = []

    def on_notice() -> None:
        calls.append(1)
        called.set()

    settings = DrainSettings(notice_file=str(path), notice_poll_s=0.05)
    watcher = NoticeWatcher(settings, on_notice).start()
    assert not called.wait(0.2)
    path.touch()
    assert called.wait(5)
    watcher.stop()
    assert calls == [1] and watcher.noticed is not None


def test_no_notice_configured_starts_no_watch():
    assert not NoticeWatcher(DrainSettings()).start().configured


def test_drain_settings_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("VLMQ_DRAIN__WINDOW_S", "12")
    monkeypatch.setenv("VLMQ_DRAIN__NOTICE_URL", "http://169.254.169.254/x")
    monkeypatch.setenv("VLMQ_DRAIN__NOTICE_HEADERS", '{"Metadata-Flavor": "Google"}')
    drain = Settings().drain
    assert drain.window_s == 12.0 and drain.notice_url.endswith("/x")
    assert drain.notice_headers == {"Metadata-Flavor": "Google"}
