"""Typed settings for every vlmq process.

Read once at an entry point (``Settings()`` reads ``VLMQ_*`` environment
variables and an optional ``.env``), then passed in. Nothing reads settings at
import time. Nested fields use ``__``: ``VLMQ_MEDIA__VIDEO_FPS=1``.
"""

from __future__ import annotations

from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = [
    "ApiSettings",
    "BatchPolicy",
    "EngineSettings",
    "FaultInjection",
    "FleetSettings",
    "MediaSettings",
    "MetricsSettings",
    "Settings",
    "TenantQuota",
    "TenantSettings",
    "VllmSettings",
    "WebhookSettings",
    "WorkerSettings",
]

MiB = 1024 * 1024


class MediaSettings(BaseModel):
    """Where media may come from and how much of it a request may carry."""

    # Remote http(s) fetching is off unless hosts are listed (exact match).
    allowed_hosts: list[str] = Field(default_factory=list)
    # Local paths / file:// only under these roots (after resolving symlinks).
    local_roots: list[str] = Field(default_factory=list)
    # s3:// only for these buckets.
    allowed_buckets: list[str] = Field(default_factory=list)
    # s3:// also for objects under these s3://bucket/prefix locations (narrower than a whole
    # bucket); workers add the staging location below themselves.
    allowed_s3_prefixes: list[str] = Field(default_factory=list)
    # Producers upload local media files and data: URIs here (content-addressed, once) and
    # send the staged URL instead: s3://bucket/prefix or file:///dir; empty:
    # {results_url}/media. Workers may always read it (docs/design.md, media staging).
    staging_url: str = ""
    # Off: media goes as it is given; a local file outside local_roots is then refused at
    # submit (no worker could read it) and data: URIs travel inside the queued message.
    staging: bool = True
    # Parallel uploads while staging (S3 stores only; a local disk gains nothing).
    staging_threads: int = Field(8, ge=1, le=64)
    max_redirects: int = Field(0, ge=0, le=3)
    max_image_bytes: int = 20 * MiB
    max_video_bytes: int = 256 * MiB
    image_fetch_timeout_s: float = 10.0
    video_fetch_timeout_s: float = 30.0
    max_image_pixels: int = 40_000_000
    image_formats: list[str] = Field(default_factory=lambda: ["JPEG", "PNG", "WEBP", "GIF"])
    video_formats: list[str] = Field(
        default_factory=lambda: ["mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm", "avi", "gif"]
    )
    video_fps: float = Field(2.0, gt=0)
    video_max_frames: int = Field(16, ge=2)
    video_max_duration_s: float = 3600.0
    video_max_pixels_per_frame: int = 8_294_400  # 3840 x 2160
    # Longest side over shortest side, images and video frames: Qwen's
    # processors raise on more than 200:1 (a 1x100000 image), so refuse it here.
    max_aspect_ratio: float = Field(200.0, ge=1)
    # Transient fetch failures (5xx, 429, timeouts, DNS) are retried with
    # exponential backoff before the request fails with the reason.
    fetch_retries: int = Field(2, ge=0, le=10)
    fetch_retry_backoff_s: float = Field(0.5, ge=0)
    max_images_per_request: int = 16
    max_videos_per_request: int = 2
    # Most frames one video may cost to decode (each seek decodes from the
    # previous keyframe; unindexed files are decoded in order), so a long GOP or
    # an unindexed file cannot burn unbounded CPU. 4096 covers 16 samples of
    # x264's default 250-frame GOP; raise it with video_max_frames.
    video_max_decoded_frames: int = Field(4096, ge=2)
    # Seek to each sampled frame from the keyframe before it (off: decode in order up to
    # the last sample; for comparison).
    video_seek: bool = True
    # A seek restarts the decoder, costing about what decoding 20-60 frames of 720p H.264
    # does (measured): it is taken only when it skips more frames than this.
    video_seek_min_skip_frames: int = Field(30, ge=0)
    # Between samples, frames no other frame refers to are not decoded (exact: the sampled
    # frames are those of a full decode; measured 1.4x faster on 720p H.264).
    video_skip_unreferenced: bool = True
    # FFmpeg decoder threading: SLICE (measured fastest with clips decoding in parallel),
    # FRAME, AUTO (both) or NONE.
    video_thread_type: str = Field("SLICE", pattern="^(SLICE|FRAME|AUTO|NONE)$")
    # Decode images and video frames no larger than the model's processor will use (its
    # max pixels): a JPEG is decoded at reduced scale, frames are downscaled as they are
    # converted. Off: decode at full size and let the processor resize.
    downscale_at_decode: bool = True
    # Decoded media and per-media processor outputs kept per worker (content-addressed, LRU),
    # so a job asking several questions about one image or clip processes it once. 0: off.
    cache_bytes: int = Field(1024 * MiB, ge=0)
    # Testing only: let http(s) fetches reach loopback/private/link-local
    # addresses (a local test server). Never enable in production: it turns the
    # host allowlist into the only SSRF guard.
    allow_private_addresses: bool = False


# Exit status of a worker killed on purpose by FaultInjection.crash_marker.
EXIT_INJECTED_CRASH = 86


class FaultInjection(BaseModel):
    """Testing only: deterministic faults, so the GPU and fleet failure paths run on CPU."""

    # Raise an out-of-memory error for any micro-batch larger than this.
    oom_above_batch: int | None = None
    # Raise inside generate for any micro-batch holding a request whose text
    # contains this marker (a "poison" request for bisection tests).
    poison_marker: str | None = None
    # Exit the worker process abruptly (as a segfault or an OOM kill would)
    # when a batch holds a request whose text contains this marker.
    crash_marker: str | None = None
    # The same while the request is prepared (before it starts: a native decoder crash or an
    # OOM kill while decoding).
    prepare_crash_marker: str | None = None
    # The first N settles of a worker raise an unexpected error (a bug in settling).
    settle_errors: int = Field(0, ge=0)
    # The worker's Nth heartbeat raises an unexpected error (a bug in the renewal thread).
    heartbeat_error_at: int | None = Field(None, ge=1)


class VllmSettings(BaseModel):
    """The vLLM engine's own settings (``VLMQ_ENGINE__BACKEND=vllm``; docs/engines.md)."""

    # Prompt plus output tokens per sequence (vLLM sizes its KV cache and encoder budget by it).
    max_model_len: int = Field(8192, ge=64)
    # Share of the GPU's memory vLLM may take (weights, activations, KV cache).
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    tensor_parallel_size: int = Field(1, ge=1)
    # Sequences decoded together at most (vLLM's max_num_seqs): the engine's own batch.
    max_num_seqs: int = Field(64, ge=1)
    # Reuse the KV cache of a shared prompt prefix, images included (vLLM hashes them).
    enable_prefix_caching: bool = True
    # vLLM's cache of processed images and videos, per engine process (GiB; 0 turns it off).
    mm_processor_cache_gb: float = Field(4.0, ge=0)
    # CUDA graphs off: slower decoding, faster start (always on for the CPU build).
    enforce_eager: bool = False
    # vLLM compiles the model with torch.compile at start (its default); off runs it as plain
    # PyTorch: the same numbers, a start ~15 s shorter on CPU, slower steps on a GPU.
    torch_compile: bool = True
    # CPU build only: GiB of KV cache (vLLM's VLLM_CPU_KVCACHE_SPACE).
    cpu_kv_cache_gib: int = Field(1, ge=1)


class EngineSettings(BaseModel):
    """How the model is loaded and how batches are cut."""

    # hf: transformers' padded generate (the default and the reference); vllm: vLLM's engine
    # with continuous batching (the extra vlmq[vllm]; docs/engines.md).
    backend: str = Field("hf", pattern="^(hf|vllm)$")
    vllm: VllmSettings = Field(default_factory=VllmSettings)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16 | float16
    attn_implementation: str = "auto"  # auto (flash_attention_2 if importable, else sdpa)
    max_new_tokens_default: int = Field(128, ge=1)
    max_new_tokens_cap: int = Field(2048, ge=1)
    max_batch_size: int = Field(32, ge=1)
    # Padded tokens (prompt incl. visual tokens, plus new tokens) per micro-batch:
    # the device's limit. A class's batch policy may only lower it.
    token_budget: int = Field(65536, ge=1)
    # Sort each pulled batch by length before cutting micro-batches, so rows of
    # similar length are padded together (off: first-come order, for comparison).
    length_bucketing: bool = True
    # Distinct constraints (schemas, regexes, choices, grammars) kept compiled per worker.
    grammar_cache_size: int = Field(512, ge=1)
    torch_threads: int | None = None
    # The image processor's backend: torchvision (the fast one, transformers' default) or pil
    # (the slow reference). Their pixel values differ slightly (docs/design.md).
    image_processor_backend: str = Field("torchvision", pattern="^(torchvision|pil)$")
    # auto: with a CUDA model and the torchvision backend, the image and video processors
    # resize and normalise on the model's GPU; cpu: always on the CPU.
    processor_device: str = Field("auto", pattern="^(auto|cpu)$")
    # Benchmarks only: force fixed output lengths (min_new_tokens = max_new_tokens)
    # so random-weight checkpoints that emit EOS early still do comparable work.
    fixed_output_length: bool = False
    faults: FaultInjection = Field(default_factory=FaultInjection)


class BatchPolicy(BaseModel):
    """How a worker pulls one modality class from the queue."""

    max_batch_size: int = Field(ge=1)
    max_wait_s: float = Field(ge=0)
    token_budget: int = Field(ge=1)


class WorkerSettings(BaseModel):
    """How a worker process feeds its model: the pipeline of stages (docs/design.md)."""

    # on: pulling, preparing (fetch, decode, estimate) and collating run ahead in their own
    # threads while the model thread generates; off: the serial loop, for comparison.
    pipeline: bool = True
    # Threads that prepare and collate (their heavy parts release the GIL: measured);
    # default: cores minus one, at least one.
    preprocess_workers: int | None = Field(None, ge=1)
    # Pulled batches held ahead of the model, at most, and their decoded media, at most.
    prefetch_batches: int = Field(2, ge=1)
    prefetch_bytes: int = Field(2048 * MiB, ge=1)
    # A preparing or collating stage busy on one item longer than this is stuck: the worker
    # exits and its messages are redelivered (the engine call has batch_time_limit_s).
    stage_time_limit_s: float = Field(600.0, gt=0)
    # How long a Python thread may hold the GIL before it is asked to hand it over (CPython's
    # default is 5 ms). The model thread gives the GIL up in every torch op and must win it
    # back; at 5 ms a Python-heavy preprocessing thread slowed generate 52x, at 0.1 ms 1.8x
    # (measured, docs/design.md). Applied to the process when the pipeline starts.
    gil_switch_interval_s: float = Field(0.0001, gt=0, le=0.1)


class FleetSettings(BaseModel):
    """Queue semantics of the fleet (see docs/design.md for how they relate)."""

    key_prefix: str = "vlmq"
    # A worker holds each pulled message under a lease it renews every lease_s/3;
    # a dead worker's messages are put back by any worker's reaper within about
    # lease_s + reap_interval_s.
    lease_s: float = Field(30.0, gt=1)
    reap_interval_s: float = Field(5.0, gt=0)
    # Handed to an engine this many times without finishing: dead-lettered, not run again.
    max_deliveries: int = Field(3, ge=1)
    # Delivered this many times without ever starting (each holder died before it ran, or
    # handling the message itself killed it): dead-lettered before it is even decoded.
    max_unstarted_deliveries: int = Field(10, ge=2)
    # A request whose holders died this many times before starting it is prepared alone,
    # after its batch-mates are settled (and dead-lettered after max_deliveries such deaths
    # alone): a request that kills its worker while being prepared takes only itself down.
    isolate_after_prestart_deaths: int = Field(2, ge=1)
    # A message larger than this fails as invalid_request without being parsed.
    max_message_bytes: int = Field(64 * MiB, ge=1024)
    # One engine call running longer than this is stuck: the worker exits and its messages
    # are redelivered. (Per call: a batch's suspect re-runs each get their own.)
    batch_time_limit_s: float = Field(900.0, gt=0)
    # Before a request that ran before runs alone, the results of its batch-mates are
    # settled; past this the suspect runs anyway (a stuck store must not stall the worker).
    suspect_drain_timeout_s: float = Field(60.0, gt=0)
    upload_threads: int = Field(8, ge=1)
    # Longest pause between retries of a result upload while the store is down.
    store_retry_max_s: float = Field(10.0, gt=0)
    # Results waiting to be stored past which the worker stops pulling (a slow or down store).
    max_settle_backlog: int = Field(256, ge=1)
    # An idle worker polls its queues from every idle_poll_min_s, backing off to idle_poll_max_s.
    idle_poll_min_s: float = Field(0.002, gt=0)
    idle_poll_max_s: float = Field(0.02, gt=0)
    redis_socket_timeout_s: float = 10.0
    task_ttl_s: int = 7 * 86400
    # A job is not finished while a submitter is adding to it; one that stops renewing this
    # lease (it crashed; every chunk it submits renews it) no longer holds the job open.
    submitter_lease_s: float = Field(300.0, gt=0)
    # Invalid lines of a bulk job stored as error records, at most (all are counted).
    max_line_errors: int = Field(1000, ge=0)
    # Dead-lettered messages kept (newest), each with at most the first 4 KiB of its message.
    max_dead_letters: int = Field(10_000, ge=0)
    # A bulk file with more than this share of invalid lines fails validation as a whole:
    # nothing of it runs (its error records say why), like OpenAI's validating -> failed.
    max_invalid_share: float = Field(0.5, ge=0, le=1)
    # Tasks of one bulk job held in Redis at most (queued or running); the rest of its input
    # waits in the store and is fed as they finish (config/feeding.py).
    feed_window: int = Field(50_000, ge=1)
    # ... and about this many bytes of their messages (lines with inline media fill a window
    # by bytes long before by count); a single larger line still runs, alone.
    feed_window_bytes: int = Field(256 * MiB, ge=1)
    # Feeders add nothing while Redis uses more than this share of its maxmemory (none set:
    # no limit), so queued work never crowds out the fleet's own bookkeeping.
    feed_max_memory_share: float = Field(0.8, gt=0, le=1)
    # A feeder (the submitter, then any worker) holds a feed under this lease; one that died
    # is replaced when it lapses, and resumes from the feed's cursor.
    feed_lease_s: float = Field(60.0, gt=0)
    # How often each worker's feeder looks for feeds to top up.
    feed_interval_s: float = Field(0.5, gt=0)
    # Publish Celery task events (received/started/succeeded/failed) so Flower
    # shows the inference tasks; three extra publishes per task.
    task_events: bool = False
    # After each settle, WAIT on the same connection until this many replicas have it (0: off),
    # at most settle_wait_timeout_ms: with Sentinel, an acknowledged result then survives a
    # failover. Fewer replicas in time is logged and counted (vlmq_settle_wait_short_total),
    # not failed: the write is done on the master.
    settle_wait_replicas: int = Field(0, ge=0)
    settle_wait_timeout_ms: int = Field(1000, ge=1)
    # How long the reply of a call that is not safe to repeat is kept for a retry of that
    # call (config/scripts.py): longer than redis-py's resends take.
    replay_ttl_s: int = Field(60, ge=5)


class ApiSettings(BaseModel):
    """The HTTP API (``vlmq serve``)."""

    host: str = "127.0.0.1"
    port: int = 8000
    # Bearer tokens accepted by the API, each acting as the default tenant. With no key at all
    # (none here, in tenant_keys or admin_keys) there is no authentication: the server then
    # binds to loopback only and answers only loopback Host names (no DNS rebinding).
    api_keys: list[str] = Field(default_factory=list)
    # Key -> tenant: each key acts as its tenant and sees that tenant's work only
    # (VLMQ_API__TENANT_KEYS='{"<key>": "team-a"}'). Docs: README "Multi-tenant".
    tenant_keys: dict[str, str] = Field(default_factory=dict)
    # Keys with the admin role: they see and cancel every tenant's work (their own
    # submissions go to the default tenant).
    admin_keys: list[str] = Field(default_factory=list)
    # Shorter keys are refused at start (a key is the only secret between a caller and a fleet).
    min_key_length: int = Field(16, ge=1)
    # Callers without a valid key, per client address: a guessing caller is slowed down
    # before it gets far (a keyless server's callers share the default tenant's rate).
    unauthenticated_rate_limit_per_s: float = Field(5.0, ge=0)
    unauthenticated_rate_limit_burst: int = Field(20, ge=1)
    max_body_bytes: int = 32 * MiB
    max_batch_items: int = 1000  # POST /v1/tasks:batch
    # Requests per tenant, shared by every API process (the bucket is in Redis); a tenant's
    # quota may set its own (VLMQ_TENANTS__QUOTAS).
    rate_limit_per_s: float = 50.0
    rate_limit_burst: int = 100
    # Refuse new work with 429 once this many tasks wait in a class's queues.
    max_queue_depth: int = 1_000_000
    # Refuse new work with 429 once Redis uses this share of its maxmemory (when one is set):
    # a full Redis refuses writes, and the fleet must keep the room it needs to drain.
    max_memory_share: float = Field(0.9, gt=0, le=1)
    max_file_bytes: int = 512 * MiB  # POST /v1/files
    # Estimate each batch's tokens (visual ones from image headers and video metadata) while
    # it is validated, shown on the batch object; costs the validation pass ~0.3 ms a line.
    preflight: bool = True
    # POST /v1/chat/completions waits this long for its task, then answers 504 with the task's
    # status URL (the task keeps its place and runs; its result stays readable there).
    sync_timeout_s: float = Field(300.0, gt=0)


class WebhookSettings(BaseModel):
    # HMAC-SHA256 key for the X-Vlmq-Signature header. Required to send webhooks: without it
    # a job's webhook is not sent (webhook_status says why), since an unsigned webhook
    # cannot be told from a forged one.
    secret: str = ""
    max_attempts: int = Field(6, ge=1)
    timeout_s: float = 10.0
    # A sender holds an event under this lease, renewed before each attempt; if the sender
    # dies, another worker delivers the event once the lease runs out.
    lease_s: float = Field(120.0, gt=0)
    # Webhooks go to arbitrary URLs: loopback/private targets only when allowed.
    allow_private_addresses: bool = False


class MetricsSettings(BaseModel):
    # Port of a worker's Prometheus /metrics endpoint; None: not served.
    port: int | None = None
    # Loopback unless configured: the metrics name tenants and jobs (0.0.0.0 for a scraper
    # on another host, behind the network's own access control).
    host: str = "127.0.0.1"


class TenantQuota(BaseModel):
    """One tenant's limits (None: unlimited / the API's default rate)."""

    # Tasks queued (fed or not yet fed) at most; more is refused with 429 quota_exceeded.
    max_queued_tasks: int | None = Field(None, ge=0)
    # Estimated tokens (prompt incl. visual tokens, plus max_new_tokens) of its queued tasks.
    max_queued_tokens: int | None = Field(None, ge=0)
    # API requests per second, shared by every API process (429 rate_limited).
    rate_limit_per_s: float | None = Field(None, ge=0)
    rate_limit_burst: int | None = Field(None, ge=1)


class TenantSettings(BaseModel):
    """Quotas per tenant (docs/scaling.md, Multi-tenant)."""

    # tenant -> its quota (VLMQ_TENANTS__QUOTAS='{"team-a": {"max_queued_tasks": 100000}}').
    quotas: dict[str, TenantQuota] = Field(default_factory=dict)
    # The quota of every tenant not listed.
    default_quota: TenantQuota = Field(default_factory=TenantQuota)

    def quota(self, tenant: str) -> TenantQuota:
        return self.quotas.get(tenant, self.default_quota)


def _default_policies() -> dict[str, BatchPolicy]:
    return {
        # A pull larger than the engine's micro-batch is the bucketing window:
        # the engine sorts it by length and cuts similar-length micro-batches.
        "text": BatchPolicy(max_batch_size=128, max_wait_s=0.05, token_budget=32768),
        "image": BatchPolicy(max_batch_size=64, max_wait_s=0.1, token_budget=49152),
        "video": BatchPolicy(max_batch_size=8, max_wait_s=0.2, token_budget=65536),
    }


class Settings(BaseSettings):
    """Everything a vlmq process needs; construct at an entry point, pass in."""

    model_config = SettingsConfigDict(
        env_prefix="VLMQ_", env_nested_delimiter="__", env_file=".env", extra="ignore"
    )

    redis_url: str = "redis://127.0.0.1:6379/0"
    # With a Sentinel URL (redis+sentinel://[[user]:password@]host1:26379,host2:26379/service[/db],
    # config/connection.py): the sentinels' own password (their requirepass; the URL's password
    # is the master's), empty for none, and the socket timeout of each sentinel query (a
    # sentinel that does not answer is skipped after it).
    redis_sentinel_password: str = ""
    redis_sentinel_timeout_s: float = Field(1.0, gt=0)
    # The tenant this process's own submissions belong to (the Python client, the CLI); the
    # API acts as the tenant of each caller's key instead.
    tenant: str = Field("default", pattern=r"^[A-Za-z0-9_-]{1,64}$")
    results_url: str = "file://./.vlmq/results"
    s3_endpoint_url: str | None = None
    s3_region: str = "us-east-1"
    model: str = ".vlmq/models/tiny-qwen2_5_vl"
    media: MediaSettings = Field(default_factory=MediaSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    batch: dict[str, BatchPolicy] = Field(default_factory=_default_policies)
    fleet: FleetSettings = Field(default_factory=FleetSettings)
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    api: ApiSettings = Field(default_factory=ApiSettings)
    tenants: TenantSettings = Field(default_factory=TenantSettings)
    webhooks: WebhookSettings = Field(default_factory=WebhookSettings)
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)
