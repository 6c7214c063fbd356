"""Prometheus metrics of a worker (served on VLMQ_METRICS__PORT when set).

Every figure an operator needs to size and debug the fleet: queue depth per
class and lane, batch size and fill, padding efficiency, token rates (as counters; use
``rate()``), per-stage latency, failures by error code, OOM splits,
redeliveries and dead letters. Fed by the batch loop's observer hooks.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from vlmq.config.cost import UCENTS_PER_UNIT
from vlmq.config.usage import TaskUsage
from vlmq.workers.fleet.observer import LoopObserver

if TYPE_CHECKING:
    from vlmq.workers.engine.engine import EngineStats

__all__ = ["WorkerMetrics"]

_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
_FRACTIONS = (0.1, 0.25, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900)


# A result's load counts (workers/engine/prepare.py timings) -> vlmq_media_loads sources.
_LOAD_TIMINGS = (
    ("decoded", "media_decodes"),
    ("frame_store", "frame_store_hits"),
    ("cache", "media_cache_hits"),
)


class WorkerMetrics(LoopObserver):
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        def histogram(name: str, doc: str, labels: list[str], buckets: Any) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=registry)

        def counter(name: str, doc: str, labels: list[str]) -> Counter:
            return Counter(name, doc, labels, registry=registry)

        self.queue_depth = Gauge(
            "vlmq_queue_depth",
            "Messages waiting per modality class",
            ["modality"],
            registry=registry,
        )
        self.lane_depth = Gauge(
            "vlmq_queue_lane_depth",
            "Messages waiting per modality class and lane (interactive, bulk)",
            ["modality", "lane"],
            registry=registry,
        )
        self.batch_size = histogram(
            "vlmq_batch_size", "Requests per engine batch", ["modality"], _SIZES
        )
        self.batch_fill = histogram(
            "vlmq_batch_fill", "Batch size / maximum batch size", ["modality"], _FRACTIONS
        )
        self.padding = histogram(
            "vlmq_padding_ratio", "Real / padded prompt tokens", ["modality"], _FRACTIONS
        )
        # Usage per tenant (also in Redis for GET /v1/usage: config/usage.py).
        usage_labels = ["modality", "tenant"]
        self.prompt_tokens = counter(
            "vlmq_prompt_tokens", "Prompt tokens processed (visual included)", usage_labels
        )
        self.generated_tokens = counter("vlmq_generated_tokens", "Tokens generated", usage_labels)
        self.model_seconds = counter(
            "vlmq_model_seconds", "Engine seconds, each task's share of its batch", usage_labels
        )
        # Cost per result (config/cost.py): GPU-seconds, and their cost in currency units.
        self.gpu_seconds = counter(
            "vlmq_gpu_seconds",
            "GPU seconds charged to results (measured, else model seconds; split by tokens)",
            ["model", *usage_labels],
        )
        self.cost = counter(
            "vlmq_cost",
            "Cost of results' GPU time, in currency units (VLMQ_COST__GPU_HOUR_PRICE)",
            ["model", *usage_labels, "currency"],
        )
        self.stage = histogram(
            "vlmq_stage_seconds", "Latency per pipeline stage", ["stage", "modality"], _SECONDS
        )
        self.tasks = counter("vlmq_tasks", "Tasks finished", ["modality", "status", "tenant"])
        self.failures = counter("vlmq_failures", "Failed tasks by error code", ["code"])
        self.oom_splits = counter("vlmq_oom_splits", "Micro-batches halved after OOM", [])
        self.redeliveries = counter("vlmq_redeliveries", "Messages delivered more than once", [])
        self.dead_letters = counter("vlmq_dead_letters", "Requests dead-lettered", [])
        self.superseded_results = counter(
            "vlmq_superseded_results", "Results discarded: their delivery was superseded", []
        )
        self.dropped_copies = counter(
            "vlmq_dropped_copies", "Copies of finished or live-held tasks dropped at pull", []
        )
        self.stage_busy = counter(
            "vlmq_stage_busy_seconds", "Seconds each pipeline stage was busy", ["stage"]
        )
        self.pipeline_depth = Gauge(
            "vlmq_pipeline_depth",
            "Items between pipeline stages (prefetch_bytes: decoded bytes held ahead)",
            ["handoff"],
            registry=registry,
        )
        self.model_busy = Gauge(
            "vlmq_model_busy_ratio",
            "Share of wall time the model spent generating, since the last heartbeat",
            [],
            registry=registry,
        )
        self.cache_lookups = counter(
            "vlmq_media_cache_lookups",
            "Media cache lookups (decoded media, processor outputs)",
            ["outcome"],
        )
        self.cache_evictions = counter("vlmq_media_cache_evictions", "Media cache evictions", [])
        self.cache_bytes = Gauge(
            "vlmq_media_cache_bytes", "Bytes held by the media cache", [], registry=registry
        )
        self.prepare_backlog_depth = Gauge(
            "vlmq_prepare_backlog",
            "Image and video tasks waiting, not prepared yet (the prepare tier scales on it)",
            ["modality"],
            registry=registry,
        )
        self.media_load_count = counter(
            "vlmq_media_loads",
            "Media loaded for tasks, by where they came from (decoded here, frame store, cache)",
            ["modality", "source"],
        )
        self.device_seconds = counter(
            "vlmq_device_seconds",
            "The device's own time (CUDA events; the host's on CPU) by work: prefill, decode "
            "(replayed graphs: kernel time), decode_eager (eager steps: an upper bound)",
            ["work"],
        )
        self.gpu_busy = Gauge(
            "vlmq_gpu_busy_ratio",
            "The device's own time over wall time since the last heartbeat (prefill and decode)",
            [],
            registry=registry,
        )
        self.decode_steps = counter(
            "vlmq_decode_steps", "Decode loop steps, replayed as CUDA graphs or eager", ["path"]
        )
        self.decode_slot_steps = counter(
            "vlmq_decode_slot_steps",
            "Slots x steps the decode loop computed (first tokens included)",
            [],
        )
        self.decode_useful = counter(
            "vlmq_decode_useful_tokens",
            "Tokens that reached an output (over vlmq_decode_slot_steps: the loop's useful share)",
            [],
        )
        self.decode_generate = counter(
            "vlmq_decode_generate_batches",
            "Micro-batches the decode loop could not hold (longer than its slots), run by "
            "transformers' generate",
            [],
        )
        self.renewals_stalled_now = Gauge(
            "vlmq_renewals_stalled",
            "1 while this worker's lease renewals are stalled (it pulls nothing meanwhile)",
            [],
            registry=registry,
        )
        self.renewal_stalls = counter(
            "vlmq_renewal_stalls", "Times this worker's lease renewals stalled", []
        )
        self._cache_seen = (0, 0, 0)
        self._busy_seen: dict[str, float] = {}
        self._wall_seen = 0.0
        self._oom_seen = 0
        self._engine_seen: dict[str, float] = {}
        self._engine_wall: float | None = None

    def batch(self, modality: str, size: int, max_size: int, redelivered: int) -> None:
        self.batch_size.labels(modality).observe(size)
        self.batch_fill.labels(modality).observe(size / max(1, max_size))
        if redelivered:
            self.redeliveries.inc(redelivered)

    def dead_lettered(self, task_id: str) -> None:
        self.dead_letters.inc()

    def result(self, record: Mapping[str, Any]) -> None:
        modality = str(record.get("modality") or "unknown")
        status = str(record.get("status"))
        tenant = str(record.get("tenant") or "default")
        self.tasks.labels(modality, status, tenant).inc()
        used = TaskUsage.of(record)
        self.prompt_tokens.labels(modality, tenant).inc(used.prompt_tokens)
        self.generated_tokens.labels(modality, tenant).inc(used.completion_tokens)
        self.model_seconds.labels(modality, tenant).inc(used.model_s)
        cost = record.get("cost")
        if cost:
            model = str(record.get("model") or "unknown")
            self.gpu_seconds.labels(model, modality, tenant).inc(used.gpu_us / 1e6)
            currency = str(cost.get("currency") or "")
            self.cost.labels(model, modality, tenant, currency).inc(
                used.cost_ucents / UCENTS_PER_UNIT
            )
        if record.get("padding_ratio") is not None:
            self.padding.labels(modality).observe(record["padding_ratio"])
        timings = record.get("timings") or {}
        queued, started = timings.get("queued_at"), timings.get("started_at")
        if queued and started:
            self.stage.labels("queue_wait", modality).observe(max(0.0, started - queued))
        for stage, key in (
            ("media_fetch", "prepare_s"),
            ("preprocess", "collate_s"),
            ("generate", "generate_s"),
        ):
            if timings.get(key) is not None:
                self.stage.labels(stage, modality).observe(timings[key])
        if status != "succeeded":
            self.failures.labels(str((record.get("error") or {}).get("code"))).inc()
        for source, key in _LOAD_TIMINGS:
            if timings.get(key):
                self.media_loads(modality, source, int(timings[key]))

    def uploaded(self, seconds: float, modality: str) -> None:
        self.stage.labels("upload", modality).observe(seconds)

    def prepare_backlog(self, depths: Mapping[str, int]) -> None:
        for modality, depth in depths.items():
            self.prepare_backlog_depth.labels(modality).set(depth)

    def media_loads(self, modality: str, source: str, count: int) -> None:
        self.media_load_count.labels(modality, source).inc(count)

    def renewals_stalled(self, stalled: bool) -> None:
        self.renewals_stalled_now.set(1 if stalled else 0)
        if stalled:
            self.renewal_stalls.inc()

    def superseded(self, task_ids: Sequence[str]) -> None:
        self.superseded_results.inc(len(task_ids))

    def dropped(self, count: int) -> None:
        self.dropped_copies.inc(count)

    def heartbeat(self, queue_depths: Mapping[str, Mapping[str, int]], engine_stats: Any) -> None:
        for modality, lanes in queue_depths.items():
            self.queue_depth.labels(modality).set(sum(lanes.values()))
            for lane, depth in lanes.items():
                self.lane_depth.labels(modality, lane).set(depth)
        if engine_stats is not None:
            self._engine(engine_stats)

    def pipeline(
        self, depths: Mapping[str, int], wall_s: float, busy_s: Mapping[str, float]
    ) -> None:
        for handoff, depth in depths.items():
            self.pipeline_depth.labels(handoff).set(depth)
        for stage, seconds in busy_s.items():
            self.stage_busy.labels(stage).inc(max(0.0, seconds - self._busy_seen.get(stage, 0.0)))
        window = wall_s - self._wall_seen
        if window > 0:
            generated = busy_s.get("generate", 0.0) - self._busy_seen.get("generate", 0.0)
            self.model_busy.set(min(1.0, generated / window))
        self._busy_seen, self._wall_seen = dict(busy_s), wall_s

    def _engine(self, stats: EngineStats) -> None:
        """Engine counters are cumulative; export the increase."""
        total = stats.oom_splits
        if total > self._oom_seen:
            self.oom_splits.inc(total - self._oom_seen)
            self._oom_seen = total
        cache = stats.cache
        hits, misses, evictions = self._cache_seen
        self.cache_lookups.labels("hit").inc(max(0, cache.hits - hits))
        self.cache_lookups.labels("miss").inc(max(0, cache.misses - misses))
        self.cache_evictions.inc(max(0, cache.evictions - evictions))
        self.cache_bytes.set(cache.bytes)
        self._cache_seen = (cache.hits, cache.misses, cache.evictions)
        self._decode(stats)

    def _decode(self, stats: EngineStats) -> None:
        """The decode loop's counters and the device's own time, as increases."""
        now = time.monotonic()
        device = dict(stats.device_s)
        totals: dict[str, float] = {f"device:{k}": v for k, v in device.items()}
        totals["generate_fallbacks"] = stats.generate_fallbacks
        decode = stats.decode
        if decode is not None:
            totals |= {
                "slot_steps": decode.row_steps,
                "useful": decode.useful_steps,
                "graph_steps": decode.graph_steps,
                "eager_steps": decode.steps - decode.graph_steps,
            }
        grown = {k: v - self._engine_seen.get(k, 0.0) for k, v in totals.items()}
        for work in device:
            self.device_seconds.labels(work).inc(max(0.0, grown[f"device:{work}"]))
        self.decode_generate.inc(max(0.0, grown["generate_fallbacks"]))
        if decode is not None:
            self.decode_slot_steps.inc(max(0.0, grown["slot_steps"]))
            self.decode_useful.inc(max(0.0, grown["useful"]))
            self.decode_steps.labels("graph").inc(max(0.0, grown["graph_steps"]))
            self.decode_steps.labels("eager").inc(max(0.0, grown["eager_steps"]))
        if self._engine_wall is not None and now > self._engine_wall:
            busy = sum(max(0.0, grown[f"device:{w}"]) for w in device)
            self.gpu_busy.set(min(1.0, busy / (now - self._engine_wall)))
        self._engine_seen, self._engine_wall = totals, now
