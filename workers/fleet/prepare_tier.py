"""The prepare tier: workers without a model that feed the GPU workers.

A prepare worker (``vlmq worker --role prepare``) pulls raw image and video tasks exactly as a
GPU worker does (same leases, fencing, fair share, reaping), fetches and guards their media,
decodes, samples frames and resizes them to the target the model's processor will use (read
from the model's config files, torch-free: ``config/vision.py``), writes the prepared media to
the frame store (``workers/media/prepared/framestore.py``) and hands each task on, unchanged
and under the same id, to its lane's prepared list (``lua/intake.lua`` ``hand_on``). GPU workers
pull prepared lists first and read the media back instead of decoding them. With no prepare worker
running, GPU workers pull raw tasks and prepare them themselves, as they always did.

Nothing fails here: a request the worker cannot read, media it cannot fetch or decode, a task
that expired are handed on as they are, and the GPU worker meets the same error and fails
that task alone (one place decides how a task fails). A task cancelled or expired by a sweep
while it was being prepared is forgotten at hand-on; a prepare worker that dies is reaped like
any worker and its tasks go back to the raw lists.

What kills a prepare worker (a decoder crash, an OOM kill, preparing stuck past its time limit)
takes only itself down, by the GPU loop's rules (``suspects.py``): a task whose holders died
before starting it twice is prepared alone, after the rest of its pull is handed on, and one
given up (its holders died too often) is handed on unprepared, for the GPU worker to
dead-letter. Redis outages are ridden out (``polling.py``), as the GPU loop does.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from vlmq.broker.queues import prepare_backlog
from vlmq.broker.state import State
from vlmq.broker.state.intake import Delivery, Intake, Pull
from vlmq.config.errors import ConfigError, InvalidRequest, VlmqError
from vlmq.config.model_files import find_model_dir, vision_profile_of
from vlmq.config.schemas import Request
from vlmq.config.settings import FleetSettings
from vlmq.config.vision import VisionProfile
from vlmq.config.wire import priority_lists
from vlmq.workers.fleet.clock import StageClock
from vlmq.workers.fleet.held import Held
from vlmq.workers.fleet.housekeeping import Housekeeper
from vlmq.workers.fleet.observer import LoopObserver
from vlmq.workers.fleet.polling import poll_until_stopped, when_answered
from vlmq.workers.fleet.suspects import given_up, isolate
from vlmq.workers.fleet.triage import expired, parse_delivery
from vlmq.workers.fleet.work import Work
from vlmq.workers.media import Downscale, MediaLoader

__all__ = ["PrepareLoop", "PrepareParts", "Targets", "model_targets"]

log = logging.getLogger(__name__)

# How long an idle prepare worker waits before it looks at the queues again.
_IDLE_S = 0.05


@dataclass(frozen=True)
class Targets:
    """What images and video frames are decoded down to: the model processor's limits
    (``workers/engine/prepare.visual_downscale`` derives the same from the processor)."""

    image: Downscale | None
    video: Downscale | None

    @classmethod
    def of_profile(cls, profile: VisionProfile) -> Targets:
        image_pixels, image_cover = profile.decode_targets(video=False)
        video_pixels, video_cover = profile.decode_targets(video=True)
        return cls(Downscale(image_pixels, image_cover), Downscale(video_pixels, video_cover))


def model_targets(model: str, downscale_at_decode: bool = True) -> Targets:
    """The targets of ``model`` (a local directory or a hub id in the Hugging Face cache),
    from its config files alone. A prepare worker refuses to start without them: guessed
    targets would key the frame store apart from the GPU workers' (they would decode again)."""
    if not downscale_at_decode:
        return Targets(None, None)
    directory = find_model_dir(model)
    profile = vision_profile_of(directory) if directory is not None else None
    if profile is None:
        raise ConfigError(
            f"the prepare tier needs the config files of model {model!r} (a local directory, "
            "or the hub id downloaded into the Hugging Face cache: config.json and the "
            "processor configs are enough, no weights)"
        )
    return Targets.of_profile(profile)


@dataclass
class PrepareParts:
    """A prepare loop's collaborators (built by ``service.compose_prepare_loop``)."""

    state: State
    intakes: dict[str, Intake]
    held: Held
    loader: MediaLoader
    targets: Targets
    pool: ThreadPoolExecutor
    observer: LoopObserver
    clock: StageClock
    # The chores any worker does for the fleet (reaping dead holders, prepare workers' too).
    housekeeper: Housekeeper


class PrepareLoop:
    """Pull raw tasks, prepare their media into the frame store, hand them on."""

    def __init__(
        self,
        fleet: FleetSettings,
        stage_time_limit_s: float,
        worker: str,
        parts: PrepareParts,
        batch_size: int,
    ) -> None:
        self.fleet = fleet
        self.stage_time_limit_s = stage_time_limit_s
        self.worker = worker
        self.parts = parts
        self.batch_size = batch_size
        self.modalities = list(parts.intakes)
        self.batches_done = 0
        self.pipeline = None  # the heartbeat record's field: a prepare loop has no pipeline
        self._turn = 0
        self._stop = threading.Event()
        self._idle = threading.Event()

    # heartbeat ---------------------------------------------------------------
    def stuck(self) -> str | None:
        longest = self.parts.clock.longest_running()
        if longest and longest[1] > self.stage_time_limit_s:
            return f"preparing one task exceeded {self.stage_time_limit_s}s"
        return None

    def heartbeat(self) -> bool:
        """Renew leases unless a task's preparing is stuck; False means give up."""
        if self.stuck() is not None:
            return False
        parts = self.parts
        lost = parts.held.renew(parts.state.leases, self.fleet.lease_s)
        if lost:
            log.warning("lost the leases of %d tasks being prepared", lost)
        try:
            backlog = prepare_backlog(parts.state.redis, parts.state.keys, self.modalities)
        except Exception:  # a metric: never a reason to stop renewing
            log.warning("the prepare backlog could not be read", exc_info=True)
        else:
            parts.observer.prepare_backlog(backlog)
        return True

    # the loop ----------------------------------------------------------------
    def run_forever(self) -> None:
        try:
            idle = (_IDLE_S, _IDLE_S)
            poll_until_stopped(self.run_once, self.parts.housekeeper, self._stop, idle)
        finally:
            self._idle.set()

    def run_once(self) -> bool:
        """Prepare and hand on one pull of the next class that has work; False when every
        class was empty."""
        order = self.modalities[self._turn :] + self.modalities[: self._turn]
        self._turn = (self._turn + 1) % len(self.modalities)
        for modality in order:
            pull = self.parts.intakes[modality].pull(self.batch_size, self.fleet.lease_s)
            if not pull.deliveries:
                continue
            self.parts.held.add(pull.deliveries)
            try:
                self._handle(modality, pull)
            finally:
                # What an error stopped on its way goes back (a clean return, not a death).
                self.parts.held.give_back(self.parts.state.leases, self._ids(pull.deliveries))
            self.batches_done += 1
            return True
        return False

    def _handle(self, modality: str, pull: Pull) -> None:
        """Prepare and hand on one pull, by the GPU loop's rules (``suspects.py``): everything
        but its suspects together, then each suspect alone, with nothing else in hand (if it
        kills this worker, it alone comes back), least often alone first. A task given up is
        handed on as it is, with the others: the GPU worker dead-letters it (one place decides
        how a task fails)."""
        works = [Work(d, status=dict(d.status)) for d in pull.deliveries]
        kept = [w for w in works if given_up(w, self.fleet) is None]
        together, alone = isolate(kept, self.fleet)
        self._prepare_all(modality, together, pull.now)
        suspects = {id(w) for w in alone}
        self._hand_on(modality, [w for w in works if id(w) not in suspects])
        for work in alone:
            when_answered(self.parts.state.tasks.mark_alone, self._stop, work.task_id, work.token)
            self._prepare_all(modality, [work], pull.now)
            self._hand_on(modality, [work])

    @staticmethod
    def _ids(deliveries: Sequence[Delivery]) -> list[str]:
        return [d.task_id for d in deliveries]

    def _prepare_all(self, modality: str, works: Sequence[Work], now: float) -> None:
        pool = self.parts.pool
        futures = [pool.submit(self._prepare, modality, w.delivery, now) for w in works]
        for future in futures:
            future.result()

    def _prepare(self, modality: str, delivery: Delivery, now: float) -> None:
        """Load one task's media through the frame store; never raises (what cannot be
        prepared is handed on as it is: the GPU worker fails it with the same error, and
        settles an expired one expired)."""
        try:
            message, request = parse_delivery(delivery, self.fleet.max_message_bytes)
        except InvalidRequest:
            return
        if expired(message, delivery.status, now):
            return
        tenant = delivery.status.get("tenant")
        before = self.parts.loader.thread_counts()
        try:
            with self.parts.clock.timing("prepare"):
                self._load(request, tenant)
        except VlmqError as exc:
            log.info("task %s: %s; handed on unprepared", delivery.task_id, exc)
        except Exception:
            log.exception("preparing task %s failed; handed on unprepared", delivery.task_id)
        after = self.parts.loader.thread_counts()
        for source, count in (
            ("decoded", after.decodes - before.decodes),
            ("frame_store", after.store_hits - before.store_hits),
            ("cache", after.cache_hits - before.cache_hits),
        ):
            if count:
                self.parts.observer.media_loads(modality, source, count)

    def _load(self, request: Request, tenant: str | None) -> None:
        loader, targets = self.parts.loader, self.parts.targets
        for image in request.parts("image"):
            loader.load_image(image.source, targets.image, tenant, prepared=True)
        for video in request.parts("video"):
            loader.load_video(
                video.source,
                video.fps,
                video.max_frames,
                targets.video,
                video.video_sampling,
                tenant,
                prepared=True,
            )

    def _hand_on(self, modality: str, works: Sequence[Work]) -> None:
        """Each task to its lane's prepared list (those this worker still holds)."""
        keys = self.parts.state.keys
        interactive = set(priority_lists(keys.queue(modality, "interactive")))
        by_list: dict[str, dict[str, int]] = defaultdict(dict)
        held = self.parts.held.tokens([w.task_id for w in works])
        for w in works:
            if w.task_id in held:
                lane = "interactive" if w.delivery.origin in interactive else "bulk"
                by_list[keys.prepared_queue(modality, lane)][w.task_id] = w.token
        outcomes: dict[str, str] = {}
        for prepared_list, tokens in by_list.items():
            # Retried while Redis does not answer (hand_on is safe to repeat): the tasks stay
            # held and leased meanwhile, so what was prepared is not prepared again.
            hand_on = self.parts.state.leases.hand_on
            outcomes.update(when_answered(hand_on, self._stop, prepared_list, tokens))
        self.parts.held.release(held)
        ended = [t for t, word in outcomes.items() if word == "ended"]
        if ended:
            log.info("%d tasks ended while they were prepared (cancelled or expired)", len(ended))

    def stop(self) -> None:
        self._stop.set()

    def drain(self, settle_s: float = 2.0) -> int:
        """Stop pulling now and hand back everything held in one call (``lua/intake.lua``
        ``hand_back``): preparing is redone in a moment by whoever takes the task (or the
        GPU worker prepares it itself), while waiting for it may cost the machine. The
        round under way finds its hand-on refused. Then, after the round ended (``settle_s``
        at most), what a pull under way brought in. Returns how many went back."""
        self.stop()
        back = self._hand_back()
        self._idle.wait(settle_s)
        back += self._hand_back()
        self.parts.pool.shutdown(wait=False, cancel_futures=True)
        self.parts.housekeeper.close()
        self.parts.observer.close()
        return back

    def _hand_back(self) -> int:
        held = self.parts.held.tokens()
        if not held:
            return 0
        try:
            back = self.parts.state.leases.hand_back(held)
        except Exception:
            log.warning("could not hand %d tasks back; their leases will lapse", len(held))
            back = 0
        self.parts.held.release(held)
        log.warning("draining: %d tasks handed back", back)
        return back

    def shutdown(self, drain_timeout_s: float = 60.0) -> None:
        """Let the current round finish (it hands its tasks on), then give back anything
        still held."""
        self.stop()
        self._idle.wait(drain_timeout_s)
        self.parts.held.give_back(self.parts.state.leases)
        self.parts.pool.shutdown(wait=False, cancel_futures=True)
        self.parts.housekeeper.close()
        self.parts.observer.close()
