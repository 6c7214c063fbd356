"""Typed settings for every vlmq process.

Read once at an entry point (``Settings()`` reads ``VLMQ_*`` environment
variables and an optional ``.env``), then passed in. Nothing reads settings at
import time. Nested fields use ``__``: ``VLMQ_MEDIA__VIDEO_FPS=1``.

Every field's meaning is its ``description``: ``vlmq settings`` prints them, and
``.env.example`` and ``docs/settings.md`` are generated from them
(config/settings_reference.py; ``make settings-docs``).
"""

from __future__ import annotations

from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = [
    "ApiSettings",
    "BatchPolicy",
    "CelerySettings",
    "CostSettings",
    "DrainSettings",
    "EngineSettings",
    "FleetSettings",
    "FrameStoreSettings",
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
GiB = 1024 * MiB


class FrameStoreSettings(BaseModel):
    """The fleet-wide store of prepared media (decoded, sampled, resized to the processor's
    target), content-addressed in the object store: a clip or photo prepared once is read
    back by every worker instead of fetched and decoded again (docs/prepare-tier.md)."""

    enabled: bool = Field(
        True,
        description="Look prepared media up before fetching and decoding, and store what was "
        "decoded. The prepare tier needs it.",
    )
    url: str = Field(
        "",
        description="Where prepared media is stored: s3://bucket/prefix or file:///dir; "
        "empty: a folder named frames beside the results store, never inside it "
        "(file://./.vlmq/frames beside file://./.vlmq/results, s3://bucket/frames beside "
        "s3://bucket/results; a results store that is a whole bucket needs this set).",
    )
    max_bytes: int = Field(
        16 * GiB,
        ge=1,
        description="The store's budget: past it, the least recently used objects are deleted "
        "(a read marks an object used; any object may go, a missing one is prepared again). "
        "Counted by each worker from a listing of the store every minute plus its own "
        "writes.",
    )
    min_free_bytes: int = Field(
        GiB,
        ge=0,
        description="file:// stores: free space the store leaves on its volume. A write that "
        "would pass it is not made and the least recently used objects are deleted, so the "
        "frame store never fills a volume it shares (with the results store, say).",
    )
    kinds: list[str] = Field(
        default_factory=lambda: ["video"],
        description="Which media a GPU worker preparing for itself stores (tasks the prepare "
        "tier handed on use it for every kind). Video only by default: a clip costs ~1.2 s "
        "to decode against milliseconds to read back; a downscaled photo about one store "
        "round trip.",
    )
    codec: str = Field(
        "auto",
        pattern="^(auto|raw|zstd|zlib|png|webp)$",
        description="How frames are written, all lossless: auto (raw with the xxhash package, "
        "else zstd with zstandard, else zlib), raw (uint8 frames checked by XXH3: a GPU worker "
        "reads a 1080p photo back in ~0.5 ms of CPU, measured, for ~15% more bytes than zstd), "
        "zstd (raw uint8 + zstd; zstd_level), zlib, png or webp.",
    )
    zstd_level: int = Field(
        -1,
        ge=-7,
        le=19,
        description="The zstd codec's level. -1 (measured): literals stay uncompressed, so a "
        "GPU worker reads a photo back in ~1 ms instead of ~4 ms (level 3) and a clip sample "
        "in 7 ms instead of 13 ms, for ~20% more bytes on a photo; raise it where store "
        "bytes cost more than CPU.",
    )
    share_across_tenants: bool = Field(
        False,
        description="Keys are per tenant; on: one tenant's prepared media serve another's "
        "request for the same bytes (saves the decode, and tells a tenant whether another "
        "holds that media).",
    )
    max_object_bytes: int = Field(
        256 * MiB,
        ge=1024,
        description="A stored object larger than this is neither written nor read.",
    )
    read_buffer_bytes: int = Field(
        1024 * MiB,
        ge=0,
        description="Freed memory a worker keeps to decompress objects' frames into: fresh "
        "memory costs page faults, ~7 ms of CPU per 1080p photo measured against ~1 ms into "
        "memory used before. 0: always fresh memory.",
    )


class MediaSettings(BaseModel):
    """Where media may come from and how much of it a request may carry."""

    allowed_hosts: list[str] = Field(
        default_factory=list,
        description="http(s) hosts media may be fetched from (exact match); remote fetching "
        "is off while none is listed. A JSON list.",
    )
    local_roots: list[str] = Field(
        default_factory=list,
        description="Local folders that media paths and file:// URLs may point into "
        "(checked after resolving symlinks). A JSON list.",
    )
    allowed_buckets: list[str] = Field(
        default_factory=list, description="Buckets s3:// media may come from. A JSON list."
    )
    allowed_s3_prefixes: list[str] = Field(
        default_factory=list,
        description="s3://bucket/prefix locations whose objects may be read as media "
        "(narrower than a whole bucket); workers add the staging location themselves. "
        "A JSON list.",
    )
    staging_url: str = Field(
        "",
        description="Where producers upload local media files and data: URIs before "
        "enqueueing (content-addressed, once: {url}/sha256/<hex>.<ext>) and send the staged "
        "URL instead: s3://bucket/prefix or file:///dir. Empty: {VLMQ_RESULTS_URL}/media. "
        "Workers may always read it.",
    )
    staging: bool = Field(
        True,
        description="Stage media before enqueueing. false: media goes as it is given; a "
        "local file outside local_roots is then refused at submit (no worker could read "
        "it) and data: URIs travel inside the queued message.",
    )
    staging_threads: int = Field(
        8,
        ge=1,
        le=64,
        description="Parallel uploads while staging (S3 stores only; a local disk gains nothing).",
    )
    max_redirects: int = Field(0, ge=0, le=3, description="HTTP redirects followed per fetch.")
    max_image_bytes: int = Field(20 * MiB, description="Byte cap of one image (20 MiB).")
    max_video_bytes: int = Field(256 * MiB, description="Byte cap of one video (256 MiB).")
    image_fetch_timeout_s: float = Field(
        10.0, description="Total deadline of one image fetch, in seconds."
    )
    video_fetch_timeout_s: float = Field(
        30.0, description="Total deadline of one video fetch, in seconds."
    )
    max_image_pixels: int = Field(
        40_000_000, description="Decompression-bomb limit: most pixels in one image."
    )
    image_formats: list[str] = Field(
        default_factory=lambda: ["JPEG", "PNG", "WEBP", "GIF"],
        description="Accepted image formats (Pillow format names). A JSON list.",
    )
    video_formats: list[str] = Field(
        default_factory=lambda: ["mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm", "avi", "gif"],
        description="Accepted video containers (PyAV format names). A JSON list.",
    )
    video_fps: float = Field(
        2.0,
        gt=0,
        description="Frames sampled per second of video (a request may ask for its own fps).",
    )
    video_max_frames: int = Field(16, ge=2, description="Most frames sampled from one video.")
    video_max_duration_s: float = Field(3600.0, description="Longest accepted video, in seconds.")
    video_max_pixels_per_frame: int = Field(
        8_294_400, description="Most pixels in one video frame (3840 x 2160)."
    )
    max_aspect_ratio: float = Field(
        200.0,
        ge=1,
        description="Longest side over shortest side of an image or video frame, at most: "
        "Qwen's processors raise on more than 200:1 (a 1x100000 image), so it is refused "
        "before.",
    )
    fetch_retries: int = Field(
        2,
        ge=0,
        le=10,
        description="Retries of a transient fetch failure (5xx, 429, timeouts, DNS), with "
        "exponential backoff, before the request fails with the reason.",
    )
    fetch_retry_backoff_s: float = Field(
        0.5, ge=0, description="First pause between fetch retries, in seconds; it doubles."
    )
    max_images_per_request: int = Field(16, description="Most images in one request.")
    max_videos_per_request: int = Field(2, description="Most videos in one request.")
    video_max_decoded_frames: int = Field(
        4096,
        ge=2,
        description="Most frames one video may cost to decode (each seek decodes from the "
        "previous keyframe; unindexed files are decoded in order), so a long GOP or an "
        "unindexed file cannot burn unbounded CPU. 4096 covers 16 samples of x264's default "
        "250-frame GOP; raise it with video_max_frames.",
    )
    video_seek: bool = Field(
        True,
        description="Seek to each sampled frame from the keyframe before it. false: decode "
        "in order up to the last sample (for comparison).",
    )
    video_seek_min_skip_frames: int = Field(
        30,
        ge=0,
        description="A seek is taken only when it skips more frames than this: it restarts "
        "the decoder, costing about what decoding 20-60 frames of 720p H.264 does "
        "(measured).",
    )
    video_skip_unreferenced: bool = Field(
        True,
        description="Between samples, frames no other frame refers to are not decoded "
        "(exact: the sampled frames are those of a full decode; measured 1.4x faster on "
        "720p H.264).",
    )
    video_thread_type: str = Field(
        "SLICE",
        pattern="^(SLICE|FRAME|AUTO|NONE)$",
        description="FFmpeg decoder threading: SLICE (measured fastest with clips decoding "
        "in parallel), FRAME, AUTO (both) or NONE.",
    )
    downscale_at_decode: bool = Field(
        True,
        description="Decode images and video frames no larger than the model's processor "
        "will use (its max pixels): a JPEG is decoded at reduced scale, frames are "
        "downscaled as they are converted. false: decode at full size and let the "
        "processor resize.",
    )
    cache_bytes: int = Field(
        1024 * MiB,
        ge=0,
        description="Bytes of decoded media and per-media processor outputs kept per worker "
        "(content-addressed, LRU), so a job asking several questions about one image or "
        "clip processes it once. 0: off.",
    )
    video_sampling: str = Field(
        "exact",
        pattern="^(exact|keyframes)$",
        description="How video frames are sampled unless a request says (its video_sampling): "
        "exact (the frame on screen at each sample time) or keyframes (the keyframe nearest "
        "each sample time: one frame decoded per sample; timestamps off by up to half a GOP).",
    )
    device_decode: str = Field(
        "cpu",
        pattern="^(auto|cpu|cuda)$",
        description="Decode on the model's GPU: cuda (JPEG images through nvJPEG whenever CUDA "
        "is there; videos of media.device_video_codecs through NVDEC), auto (per item by rule: "
        "workers/media/devpixels.py, nvdec.py) or cpu (the reference; CPU machines unchanged). "
        "Device decode is not bit-exact and falls back to the CPU per item, so it is opt-in.",
    )
    device_video_min_height: int = Field(
        720,
        ge=1,
        description="auto's video rule: CUDA decoding only for frames at least this tall "
        "(below, CPU decoding measured faster).",
    )
    device_video_min_samples_per_s: float = Field(
        1.0,
        ge=0,
        description="auto's video rule: CUDA decoding only for samples at least this dense "
        "per second of video (sparse seeks are faster on the CPU).",
    )
    device_video_codecs: list[str] = Field(
        default_factory=lambda: ["h264", "hevc"],
        description="auto's video rule: codecs (FFmpeg names) sent to the GPU's hardware "
        "decoder (NVDEC: workers/media/nvdec.py); any other stays on the CPU (AV1 falls back "
        "to software on Hopper). A JSON list.",
    )
    device_jpeg_batch: int = Field(
        32,
        ge=1,
        description="Most photos decoded together in one nvJPEG batch on the device: those "
        "of requests prepared at the same time share it (workers/media/photobatch.py).",
    )
    device_jpeg_window_ms: float = Field(
        2.0,
        ge=0,
        description="How long a photo waits for others to share its nvJPEG batch, unless "
        "device_jpeg_batch are waiting first (ms).",
    )
    frame_store: FrameStoreSettings = Field(
        default_factory=FrameStoreSettings,
        description="The fleet-wide frame store of prepared media.",
    )
    allow_private_addresses: bool = Field(
        False,
        description="Testing only: let http(s) fetches reach loopback, private and "
        "link-local addresses (a local test server). Never in production: it leaves the "
        "host allowlist the only SSRF guard.",
    )


class VllmSettings(BaseModel):
    """The vLLM engine's own settings (``VLMQ_ENGINE__BACKEND=vllm``; docs/engines.md)."""

    max_model_len: int = Field(
        8192,
        ge=64,
        description="Prompt plus output tokens per sequence (vLLM sizes its KV cache and "
        "encoder budget by it).",
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0,
        le=1,
        description="Share of the GPU's memory vLLM may take (weights, activations, KV cache).",
    )
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs one model is split over.")
    max_num_seqs: int = Field(
        64,
        ge=1,
        description="Sequences decoded together at most (vLLM's max_num_seqs): the engine's "
        "own batch.",
    )
    enable_prefix_caching: bool = Field(
        True,
        description="Reuse the KV cache of a shared prompt prefix, images included (vLLM "
        "hashes them).",
    )
    mm_processor_cache_gb: float = Field(
        4.0,
        ge=0,
        description="vLLM's cache of processed images and videos per engine process, in GiB "
        "(0: off).",
    )
    enforce_eager: bool = Field(
        False,
        description="No CUDA graphs: slower decoding, a faster start (always on for the CPU "
        "build).",
    )
    torch_compile: bool = Field(
        True,
        description="vLLM compiles the model with torch.compile at start (its default). "
        "false: plain PyTorch, the same numbers, a start ~15 s shorter on CPU, slower steps "
        "on a GPU.",
    )
    cpu_kv_cache_gib: int = Field(
        1,
        ge=1,
        description="CPU build only: GiB of KV cache (vLLM's VLLM_CPU_KVCACHE_SPACE).",
    )


class DecodeSettings(BaseModel):
    """How the HF engine decodes (``VLMQ_ENGINE__DECODE__*``; docs/engines.md, "The decode
    loop")."""

    mode: str = Field(
        "loop",
        pattern="^(loop|generate)$",
        description="loop: vlmq's decode loop (a slot KV cache, every per-row control as tensor "
        "work on the device with no host sync per step, CUDA graphs on a GPU, rows of many "
        "micro-batches decoding together); generate: transformers' generate with per-row "
        "logits processors (the reference the loop is tested against).",
    )
    cuda_graphs: str = Field(
        "auto",
        pattern="^(auto|on|off)$",
        description="Replay decode steps as CUDA graphs, captured per rows and cache-length "
        "bucket on first use (auto: on with CUDA). A capture that fails turns them off for "
        "the worker's life with one log line; steps then run eagerly (counted in metrics).",
    )
    inflight: bool = Field(
        True,
        description="A slot freed by a finished row takes a row of the next micro-batch while "
        "the others decode (the worker keeps the loop full, as it keeps vLLM full). false: "
        "each micro-batch decodes alone to its end.",
    )
    slots: int | None = Field(
        None,
        ge=1,
        description="Rows decoding at once (the KV cache's rows). Unset: the engine's "
        "max_batch_size.",
    )
    admit_rows: int | None = Field(
        None,
        ge=1,
        description="In flight: rows a micro-batch has at most (one prefill), so a slot freed "
        "by a finished row is refilled once this many are free. Unset: an eighth of the "
        "slots, at least 1.",
    )
    max_length: int | None = Field(
        None,
        ge=64,
        description="Positions per slot at most (prompt, images and videos included, plus new "
        "tokens); the cache grows to it by doubling as longer rows arrive, so its memory is "
        "slots x length x the model's KV bytes per token. A micro-batch that needs more runs "
        "through generate. Unset: the model's context, at most 8192.",
    )
    sync_every: int = Field(
        8,
        ge=1,
        description="Steps between the host's looks at the device (finished rows, stop "
        "strings); a row that reaches its max_new_tokens is seen at that step. A row that "
        "ended by EOS or a stop string keeps its slot up to this many steps.",
    )
    poll_steps: int = Field(
        64,
        ge=1,
        description="Steps the loop runs per poll at most before the worker may add rows.",
    )
    compile: bool = Field(
        False,
        description="torch.compile the decode step (dynamic shapes, inductor) before its CUDA "
        "graphs are captured. The first start compiles for minutes on a large model; "
        "compile_cache_dir keeps the result for restarts.",
    )
    compile_cache_dir: str | None = Field(
        None,
        description="Where inductor keeps compiled kernels and graphs across restarts "
        "(TORCHINDUCTOR_CACHE_DIR). Unset: ~/.cache/vlmq/inductor.",
    )


class EngineSettings(BaseModel):
    """How the model is loaded and how batches are cut."""

    backend: str = Field(
        "hf",
        pattern="^(hf|vllm)$",
        description="hf: transformers' padded generate (the default and the reference); "
        "vllm: vLLM's engine with continuous batching (the extra vlmq[vllm]; on CPU the "
        "environment of `make setup-vllm`; docs/engines.md).",
    )
    vllm: VllmSettings = Field(
        default_factory=VllmSettings,
        description="The vLLM engine's own settings (VLMQ_ENGINE__BACKEND=vllm only).",
    )
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N.")
    dtype: str = Field(
        "auto",
        description="auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16 | float16.",
    )
    attn_implementation: str = Field(
        "auto",
        description="auto (flash_attention_2 if flash-attn imports, else sdpa) | sdpa | eager "
        "| flash_attention_2.",
    )
    max_new_tokens_default: int = Field(
        128, ge=1, description="max_new_tokens of a request that gives none."
    )
    max_new_tokens_cap: int = Field(
        2048, ge=1, description="Hard cap on a request's max_new_tokens."
    )
    max_batch_size: int = Field(32, ge=1, description="Rows per micro-batch.")
    token_budget: int = Field(
        65536,
        ge=1,
        description="Padded tokens (prompt incl. visual tokens, plus new tokens) per "
        "micro-batch: the device's limit. A class's batch policy may only lower it.",
    )
    length_bucketing: bool = Field(
        True,
        description="Sort each pulled batch by length before cutting micro-batches, so rows "
        "of similar length are padded together. false: arrival order, for comparison.",
    )
    grammar_cache_size: int = Field(
        512,
        ge=1,
        description="Distinct constraints (JSON schemas, regexes, choices, grammars) kept "
        "compiled per worker (LRU).",
    )
    torch_threads: int | None = Field(
        None, description="torch intra-op threads; unset: torch's default."
    )
    image_processor_backend: str = Field(
        "torchvision",
        pattern="^(torchvision|pil)$",
        description="The image processor's backend: torchvision (the fast one, transformers' "
        "default) or pil (the slow reference); their pixel values differ slightly.",
    )
    processor_device: str = Field(
        "auto",
        pattern="^(auto|cpu)$",
        description="auto: with a CUDA model and the torchvision backend, the image and video "
        "processors resize and normalise on the model's GPU; cpu: always on the CPU.",
    )
    fixed_output_length: bool = Field(
        False,
        description="Benchmarks only: every row generates exactly max_new_tokens "
        "(min_new_tokens = max_new_tokens), so random-weight checkpoints that emit EOS "
        "early still do comparable work.",
    )
    decode: DecodeSettings = Field(
        default_factory=DecodeSettings,
        description="How the HF engine decodes: its decode loop or transformers' generate.",
    )


class BatchPolicy(BaseModel):
    """How a worker pulls one modality class from the queue."""

    max_batch_size: int = Field(
        ge=1,
        description="Requests pulled per batch at most (a pull larger than the engine's "
        "micro-batch is the window the engine sorts by length).",
    )
    max_wait_s: float = Field(
        ge=0, description="Seconds a pull waits for more messages after the first one."
    )
    token_budget: int = Field(
        ge=1,
        description="Padded tokens per micro-batch of this class (at most the engine's "
        "token_budget).",
    )


class WorkerSettings(BaseModel):
    """How a worker process feeds its model: the pipeline of stages (docs/design.md)."""

    pipeline: bool = Field(
        True,
        description="Pulling, preparing (fetch, decode, estimate) and collating run ahead in "
        "their own threads while the model thread generates. false: the serial loop (the "
        "same stages in turn), for comparison and debugging.",
    )
    preprocess_workers: int | None = Field(
        None,
        ge=1,
        description="Threads that collate (the prepare pool is twice that; their heavy "
        "parts release the GIL: measured). Unset: cores minus one, at least one.",
    )
    prefetch_batches: int = Field(
        2,
        ge=1,
        description="Pulled batches held ahead of the model at most (the one generating included).",
    )
    prefetch_bytes: int = Field(
        2048 * MiB, ge=1, description="Decoded media bytes held ahead of the model at most."
    )
    stage_time_limit_s: float = Field(
        600.0,
        gt=0,
        description="A preparing or collating stage busy on one item longer than this (s) is "
        "stuck: the worker exits and its messages are redelivered (the engine call has "
        "VLMQ_FLEET__BATCH_TIME_LIMIT_S).",
    )
    gil_switch_interval_s: float = Field(
        0.0001,
        gt=0,
        le=0.1,
        description="How long a Python thread may hold the GIL before it is asked to hand it "
        "over, applied when the pipeline starts. The model thread gives the GIL up in every "
        "torch op and must win it back: at CPython's default 5 ms a Python-heavy "
        "preprocessing thread slowed generate 52x, at 0.1 ms 1.8x (measured).",
    )


class FleetSettings(BaseModel):
    """Queue semantics of the fleet (see docs/design.md for how they relate)."""

    key_prefix: str = Field(
        "vlmq",
        description="Prefix of every Redis key and queue name (vlmq.text, vlmq:task:{id}, ...).",
    )
    lease_s: float = Field(
        30.0,
        gt=1,
        description="Lease on each pulled message (s), renewed every lease_s/3 while its "
        "worker lives: with reap_interval_s it bounds redelivery after a crash (about "
        "lease_s + reap_interval_s), not the length of a batch.",
    )
    reap_interval_s: float = Field(
        5.0,
        gt=0,
        description="How often every worker puts the messages of expired leases back (s).",
    )
    max_deliveries: int = Field(
        3,
        ge=1,
        description="Times a request is handed to an engine without finishing before it is "
        "dead-lettered (vlmq:dead) and not run again.",
    )
    max_unstarted_deliveries: int = Field(
        10,
        ge=2,
        description="Times a task's holders may die before starting it (a clean give-back "
        "or a prepare worker's hand-on is not a death) before it is dead-lettered without its "
        "message being decoded.",
    )
    isolate_after_prestart_deaths: int = Field(
        2,
        ge=1,
        description="A request whose holders died this many times before starting it is "
        "prepared alone, after its batch-mates are settled or handed on (and dead-lettered "
        "after max_deliveries such deaths alone), by GPU and prepare workers alike: a request "
        "that kills its worker while being prepared takes only itself down.",
    )
    max_message_bytes: int = Field(
        64 * MiB,
        ge=1024,
        description="A message larger than this (bytes) fails as invalid_request without "
        "being parsed. Producers refuse a request whose message would be larger before "
        "enqueueing it (the API: 413, and no task or chat body over it is read).",
    )
    batch_time_limit_s: float = Field(
        900.0,
        gt=0,
        description="One engine call running longer than this (s) is stuck: the worker exits "
        "and its messages are redelivered (per call: a batch's suspect re-runs each get "
        "their own). Keep docker's stop_grace_period above it.",
    )
    suspect_drain_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Before a request that ran before runs alone, its batch-mates' results "
        "are settled; past this (s) the suspect runs anyway (a stuck store must not stall "
        "the worker).",
    )
    upload_threads: int = Field(8, ge=1, description="Threads uploading result objects.")
    store_retry_max_s: float = Field(
        10.0,
        gt=0,
        description="Longest pause between retries of a result upload while the store is down (s).",
    )
    store_retry_deadline_s: float = Field(
        300.0,
        gt=0,
        description="How long a batch's result uploads are retried while the store refuses "
        "them (down, full) before each task still unstored fails with store_unavailable "
        "(retryable: submit it again), so no task is left running with its lease held on a "
        "store that never takes it (s).",
    )
    max_settle_backlog: int = Field(
        256,
        ge=1,
        description="Results waiting to be stored past which the worker stops pulling (a slow "
        "or down store).",
    )
    idle_poll_min_s: float = Field(
        0.002,
        gt=0,
        description="An idle worker polls its queues every idle_poll_min_s (s), backing off "
        "to idle_poll_max_s.",
    )
    idle_poll_max_s: float = Field(
        0.02, gt=0, description="Longest pause between polls of an idle worker (s)."
    )
    redis_socket_timeout_s: float = Field(10.0, description="Redis socket and connect timeout (s).")
    task_ttl_s: int = Field(
        7 * 86400,
        description="Lifetime of task and job status hashes in Redis (s; 7 days).",
    )
    submitter_lease_s: float = Field(
        300.0,
        gt=0,
        description="A job is not finished while a submitter is adding to it; one that stops "
        "renewing this lease (s; it crashed; every chunk it submits renews it) no longer "
        "holds the job open.",
    )
    max_line_errors: int = Field(
        1000,
        ge=0,
        description="Invalid lines of a bulk job stored as error records, at most (all are "
        "counted).",
    )
    max_dead_letters: int = Field(
        10_000,
        ge=0,
        description="Dead-lettered messages kept (the newest), each with at most the first "
        "4 KiB of its message.",
    )
    max_invalid_share: float = Field(
        0.5,
        ge=0,
        le=1,
        description="A bulk file with more than this share of invalid lines fails validation "
        "as a whole: nothing of it runs (its error records say why), like OpenAI's "
        "validating -> failed.",
    )
    feed_window: int = Field(
        50_000,
        ge=1,
        description="Tasks of one bulk job held in Redis at most (queued or running); the "
        "rest of its input waits in the store and is fed as they finish.",
    )
    feed_window_bytes: int = Field(
        256 * MiB,
        ge=1,
        description="... and about this many bytes of their messages (lines with inline "
        "media fill a window by bytes long before by count); a single larger line still "
        "runs, alone.",
    )
    feed_max_memory_share: float = Field(
        0.8,
        gt=0,
        le=1,
        description="Feeders add nothing while Redis uses more than this share of its "
        "maxmemory (none set: no limit), so queued work never crowds out the fleet's own "
        "bookkeeping.",
    )
    feed_lease_s: float = Field(
        60.0,
        gt=0,
        description="A feeder (the submitter, then any worker) holds a feed under this lease "
        "(s); one that died is replaced when it lapses, and resumes from the feed's cursor.",
    )
    feed_interval_s: float = Field(
        0.5, gt=0, description="How often each worker's feeder tops jobs up to their window (s)."
    )
    task_events: bool = Field(
        False,
        description="Publish Celery task events (received/started/succeeded/failed) for the "
        "inference tasks so Flower shows them; three extra publishes per task (compose: "
        "true).",
    )
    settle_wait_replicas: int = Field(
        0,
        ge=0,
        description="After each settle, WAIT on the same connection until this many "
        "replicas have it (0: off), at most settle_wait_timeout_ms: with Sentinel, an "
        "acknowledged result then survives a failover. Fewer replicas in time is logged and "
        "counted (vlmq_settle_wait_short_total), not failed.",
    )
    settle_wait_timeout_ms: int = Field(
        1000, ge=1, description="Longest WAIT after a settle (ms; settle_wait_replicas)."
    )
    replay_ttl_s: int = Field(
        60,
        ge=5,
        description="How long the reply of a call that is not safe to repeat is kept for a "
        "retry of that call (s): longer than redis-py's resends take, so no write is "
        "applied twice.",
    )


class ApiSettings(BaseModel):
    """The HTTP API (``vlmq serve``)."""

    host: str = Field(
        "127.0.0.1",
        description="Bind address of `vlmq serve` (compose runs `serve --host 0.0.0.0`).",
    )
    port: int = Field(8000, description="Port of `vlmq serve`.")
    api_keys: list[str] = Field(
        default_factory=list,
        examples=[["replace-with-a-long-random-key"]],
        description="Bearer tokens accepted by the API, each acting as the default tenant; a "
        "JSON list. With no key at all (none here, in tenant_keys or admin_keys) there is no "
        "authentication: the server then binds to loopback only and answers only loopback "
        "Host names. Compose's API needs one.",
    )
    tenant_keys: dict[str, str] = Field(
        default_factory=dict,
        examples=[{"replace-with-a-long-random-key-b": "team-b"}],
        description="Key -> tenant, a JSON object: each key acts as its tenant and sees that "
        "tenant's work only.",
    )
    admin_keys: list[str] = Field(
        default_factory=list,
        examples=[["replace-with-a-long-random-admin-key"]],
        description="Keys with the admin role, a JSON list: they see and cancel every "
        "tenant's work (their own submissions go to the default tenant).",
    )
    min_key_length: int = Field(
        16,
        ge=1,
        description="Shorter keys are refused at start (a key is the only secret between a "
        "caller and a fleet).",
    )
    unauthenticated_rate_limit_per_s: float = Field(
        5.0,
        ge=0,
        description="Requests per second of callers without a valid key, per client address "
        "(429 before 401 once spent): a guessing caller is slowed down before it gets far. "
        "A keyless server's callers share the default tenant's rate instead.",
    )
    unauthenticated_rate_limit_burst: int = Field(
        20, ge=1, description="Burst of unauthenticated_rate_limit_per_s."
    )
    max_body_bytes: int = Field(
        32 * MiB,
        description="Largest request body (32 MiB). A task's or a chat completion's is also "
        "at most fleet.max_message_bytes (what a worker takes); an upload's is "
        "max_file_bytes.",
    )
    max_body_objects: int = Field(
        262_144,
        ge=1,
        description="Most JSON objects and arrays in one request body (413 past it, counted "
        "while parsing, before the rest is built): each costs ~70 bytes of memory once "
        "parsed against two or three bytes of JSON.",
    )
    max_batch_items: int = Field(1000, description="Most requests in one POST /v1/tasks:batch.")
    rate_limit_per_s: float = Field(
        50.0,
        description="Requests per second per tenant, shared by every API process (the bucket "
        "is in Redis); a tenant's quota may set its own.",
    )
    rate_limit_burst: int = Field(100, description="Burst of rate_limit_per_s.")
    max_queue_depth: int = Field(
        1_000_000,
        description="New work is refused with 429 once this many tasks wait in a class's queues.",
    )
    max_memory_share: float = Field(
        0.9,
        gt=0,
        le=1,
        description="New work is refused (429 broker_full) once Redis uses this share of its "
        "maxmemory (when one is set): a full Redis refuses writes, and the fleet must keep "
        "the room it needs to drain.",
    )
    max_file_bytes: int = Field(
        512 * MiB, description="Largest upload to POST /v1/files (512 MiB)."
    )
    preflight: bool = Field(
        True,
        description="Estimate each batch's tokens (visual ones from image headers and video "
        "metadata) while it is validated, shown as the batch object's preflight; costs the "
        "validation pass ~0.3 ms a line.",
    )
    sync_timeout_s: float = Field(
        300.0,
        gt=0,
        description="POST /v1/chat/completions waits this long for its task, then answers 504 "
        "with the task's status URL (the task keeps its place and runs; its result stays "
        "readable there).",
    )


class WebhookSettings(BaseModel):
    """Job-finished notifications."""

    secret: str = Field(
        "",
        description="HMAC-SHA256 key of the X-Vlmq-Signature header: set a long random one. "
        "Required to send webhooks: while empty no webhook is sent (the job's webhook_status "
        "says why), since an unsigned webhook cannot be told from a forged one.",
    )
    max_attempts: int = Field(6, ge=1, description="Delivery attempts per event.")
    timeout_s: float = Field(10.0, description="Timeout of one delivery (s).")
    lease_s: float = Field(
        120.0,
        gt=0,
        description="A sender holds an event under this lease (s), renewed before each "
        "attempt; if the sender dies, another worker delivers the event once it runs out.",
    )
    allow_private_addresses: bool = Field(
        False,
        description="Testing only: allow webhook URLs on loopback and private addresses "
        "(webhooks go to arbitrary URLs).",
    )


class CelerySettings(BaseModel):
    """Tasks that arrive through Celery (``send_task``, ``delay``, canvas): their results in a
    Celery result backend, revoke and canvas callbacks (docs/celery.md)."""

    enabled: bool = Field(
        True,
        description="Record the results of Celery messages that ask for one (Celery's "
        "ignore_result header false; vlmq's own producers ask for none unless told).",
    )
    result_backend: str = Field(
        "",
        description="Any Celery result backend URL (Celery messages carry none); empty: the "
        "fleet's Redis.",
    )
    result_expires_s: int = Field(
        86400, ge=1, description="How long a recorded result is kept (Celery's result_expires)."
    )
    track_started: bool = Field(
        True, description="Record STARTED when the engine takes the task (task_track_started)."
    )
    default_queue: str = Field(
        "celery",
        description="Where link, link_error and chord callbacks go when their signature names "
        "no queue.",
    )


class MetricsSettings(BaseModel):
    """A worker's Prometheus /metrics endpoint."""

    port: int | None = Field(
        None,
        examples=[9100],
        description="Port of a worker's Prometheus /metrics endpoint; unset: not served. "
        "Compose sets 9100, the port docker/prometheus.yml scrapes.",
    )
    host: str = Field(
        "127.0.0.1",
        description="Address the endpoint binds: loopback unless set, since the metrics name "
        "tenants and jobs (0.0.0.0 for a scraper on another host, behind the network's own "
        "access control; compose sets it for its Prometheus).",
    )


class CostSettings(BaseModel):
    """What a worker's GPU time costs, recorded with every result (docs/operations.md, Cost)."""

    gpu_hour_price: float = Field(
        0.0,
        ge=0,
        examples=[2.5],
        description="Price of one GPU-hour of this worker, in currency units (2.5: 2.50 per "
        "hour). 0: results record their GPU-seconds at no cost.",
    )
    currency: str = Field(
        "USD",
        pattern=r"^[A-Z]{3}$",
        description="ISO 4217 code of gpu_hour_price; usage sums cost across workers that "
        "share one currency.",
    )
    gpu_name: str | None = Field(
        None,
        examples=["NVIDIA H100 80GB HBM3"],
        description="The GPU's name in the worker record and each result's cost. Unset: "
        "the CUDA device's name when there is one, else 'cpu'.",
    )


class DrainSettings(BaseModel):
    """How a worker leaves when its machine is taken away (spot preemption, a rolling
    deploy): docs/fleet.md, Drain."""

    window_s: float = Field(
        25.0,
        ge=0,
        description="On SIGTERM or a notice, a worker stops pulling at once, finishes only "
        "the micro-batches whose expected remaining engine time fits in this many seconds, "
        "and hands everything else it holds (prefetched and running) back to the queues in "
        "one call, for other workers to take at once. Keep it under the notice the platform "
        "gives (spot: 30-120 s; Kubernetes: terminationGracePeriodSeconds).",
    )
    notice_file: str = Field(
        "",
        description="A path whose appearance is a preemption notice (a node agent or a "
        "sidecar writes it); empty: none.",
    )
    notice_url: str = Field(
        "",
        examples=[
            "http://169.254.169.254/latest/meta-data/spot/instance-action",
            "http://metadata.google.internal/computeMetadata/v1/instance/preempted",
        ],
        description="An HTTP endpoint polled for a preemption notice: a 200 answer (whose "
        "body contains notice_body, when set) is one; empty: none.",
    )
    notice_headers: dict[str, str] = Field(
        default_factory=dict,
        examples=[{"Metadata-Flavor": "Google"}],
        description="Headers sent with each poll of notice_url, a JSON object.",
    )
    notice_body: str = Field(
        "",
        examples=["TRUE"],
        description="Text a 200 answer of notice_url must contain to be a notice (GCE's "
        "preempted endpoint answers 200 FALSE until it is TRUE); empty: any 200 is one.",
    )
    notice_poll_s: float = Field(
        2.0,
        gt=0,
        description="How often notice_file and notice_url are checked (s).",
    )


class TenantQuota(BaseModel):
    """One tenant's limits (None: unlimited / the API's default rate)."""

    max_queued_tasks: int | None = Field(
        None,
        ge=0,
        examples=[1_000_000],
        description="Tasks queued (fed or not yet fed) at most; more is refused with 429 "
        "quota_exceeded. Unset: unlimited.",
    )
    max_queued_tokens: int | None = Field(
        None,
        ge=0,
        examples=[500_000_000],
        description="Estimated tokens (prompt incl. visual tokens, plus max_new_tokens) of "
        "its queued tasks at most. Unset: unlimited.",
    )
    rate_limit_per_s: float | None = Field(
        None,
        ge=0,
        description="API requests per second, shared by every API process (429 "
        "rate_limited). Unset: VLMQ_API__RATE_LIMIT_PER_S.",
    )
    rate_limit_burst: int | None = Field(
        None, ge=1, description="Burst of rate_limit_per_s. Unset: VLMQ_API__RATE_LIMIT_BURST."
    )


class TenantSettings(BaseModel):
    """Quotas per tenant (docs/tenants-ha.md)."""

    quotas: dict[str, TenantQuota] = Field(
        default_factory=dict,
        examples=[{"team-b": {"max_queued_tasks": 100000, "max_queued_tokens": 50000000}}],
        description="Tenant -> its quota, a JSON object.",
    )
    default_quota: TenantQuota = Field(
        default_factory=TenantQuota,
        description="The quota of every tenant not listed in quotas (unlimited unless set).",
    )

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

    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Broker and status store (compose sets redis://redis:6379/0). With "
        "Sentinel: redis+sentinel://[[user]:password@]host1:26379,host2:26379/service[/db] "
        "(the password is the master's; docs/tenants-ha.md).",
    )
    redis_sentinel_password: str = Field(
        "",
        description="Sentinel URLs only: the sentinels' own password (their requirepass; the "
        "URL's password is the master's); empty: none.",
    )
    redis_sentinel_timeout_s: float = Field(
        1.0,
        gt=0,
        description="Sentinel URLs only: socket timeout of each sentinel query (s); a "
        "sentinel that does not answer is skipped after it.",
    )
    tenant: str = Field(
        "default",
        pattern=r"^[A-Za-z0-9_-]{1,64}$",
        description="The tenant this process's own submissions belong to (the Python client, "
        "the CLI); the API acts as the tenant of each caller's key instead.",
    )
    results_url: str = Field(
        "file://./.vlmq/results",
        description="Where result objects go: s3://bucket/prefix or file:///dir (compose sets "
        "s3://$RESULTS_BUCKET/results).",
    )
    s3_endpoint_url: str | None = Field(
        None,
        description="S3-compatible endpoint (MinIO, ...); unset: AWS. Compose sets "
        "http://minio:9000.",
    )
    s3_region: str = Field("us-east-1", description="Region given to boto3.")
    model: str = Field(
        ".vlmq/models/tiny-qwen2_5_vl",
        description="The model: a Hugging Face hub id (looked up in HF_HOME) or a local "
        "directory. Compose's default: Qwen/Qwen2.5-VL-3B-Instruct.",
    )
    media: MediaSettings = Field(
        default_factory=MediaSettings,
        description="Where media may come from, and how much of it a request may carry.",
    )
    engine: EngineSettings = Field(
        default_factory=EngineSettings,
        description="How the model is loaded and how micro-batches are cut.",
    )
    batch: dict[str, BatchPolicy] = Field(
        default_factory=_default_policies,
        description="Per-class pull policy, a JSON object: class -> policy. Replaces the "
        "whole default: list every class a worker serves.",
    )
    fleet: FleetSettings = Field(
        default_factory=FleetSettings,
        description="Queue semantics: leases, redelivery, dead letters, bulk-job feeding.",
    )
    worker: WorkerSettings = Field(
        default_factory=WorkerSettings,
        description="How a worker process feeds its model: the pipeline of stages.",
    )
    api: ApiSettings = Field(
        default_factory=ApiSettings, description="The HTTP API (`vlmq serve`)."
    )
    tenants: TenantSettings = Field(
        default_factory=TenantSettings,
        description="Quotas per tenant (docs/tenants-ha.md).",
    )
    webhooks: WebhookSettings = Field(
        default_factory=WebhookSettings, description="Job-finished notifications."
    )
    metrics: MetricsSettings = Field(
        default_factory=MetricsSettings,
        description="A worker's Prometheus /metrics endpoint.",
    )
    cost: CostSettings = Field(
        default_factory=CostSettings,
        description="What a worker's GPU time costs (per result, in vlmq usage).",
    )
    drain: DrainSettings = Field(
        default_factory=DrainSettings,
        description="How a worker leaves on SIGTERM or a preemption notice.",
    )
    celery: CelerySettings = Field(
        default_factory=CelerySettings,
        description="Tasks that arrive through Celery: results, revoke, canvas callbacks.",
    )
