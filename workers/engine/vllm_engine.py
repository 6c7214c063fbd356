"""The vLLM engine: continuous batching behind the same generation interface.

vlmq keeps what is its own: it fetches, guards and decodes media (the HF engine's
``Preparer``: the same limits, the same frame choice), estimates lengths and plans batches,
and builds one result per request with the same fields and error codes. vLLM gets the
rendered prompt and the decoded images and frames (with their metadata, so it never samples
frames itself), and one ``SamplingParams`` per request mapped from the request's generation
fields, structured outputs included. ``submit`` adds requests to vLLM's ``LLMEngine`` while
others decode; ``poll`` steps it and returns the requests that finished. A request vLLM
refuses fails alone (``invalid_request``); an engine that died raises ``EngineDied`` so the
worker exits and its leases are redelivered.

Needs the ``vllm`` package (``vlmq[vllm]`` on a GPU; on CPU the environment of
``make setup-vllm``). Importing this module imports neither.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vlmq.config.constraints import Constraint
from vlmq.config.errors import ConfigError, InvalidRequest, VlmqError
from vlmq.config.schemas import MAX_TOP_LOGPROBS, FinishReason, Request, Result, Usage
from vlmq.config.settings import EngineSettings, MediaSettings
from vlmq.workers.engine.batching import plan_micro_batches
from vlmq.workers.engine.completions import (
    Generated,
    completion_seed,
    logprob_entry,
    result_choices,
)
from vlmq.workers.engine.interface import CONTINUOUS, Collated, EngineDied
from vlmq.workers.engine.model import LoadedModel, detect_family, eos_token_ids, load_processor
from vlmq.workers.engine.placeholders import unwrapped
from vlmq.workers.engine.prepare import Prepared, Preparer
from vlmq.workers.engine.processors import ProcessorSet
from vlmq.workers.media import MediaLoader, Pixels
from vlmq.workers.media.devpixels import DeviceFrames

if TYPE_CHECKING:
    from vlmq.workers.engine.engine import EngineStats

__all__ = ["CPU_BUILD_ENV", "VllmEngine", "sampling_fields"]

# What vLLM's CPU build wants in its environment on one machine (docs/engines.md): its
# message queue on loopback (otherwise it picked another interface's address), and both
# cores for the one engine (by default it keeps one for itself).
CPU_BUILD_ENV = {
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
}

log = logging.getLogger(__name__)


class _CheckedForVllm:
    """vLLM compiles constraints itself (its llguidance backend), but a grammar the tokenizer
    cannot serve comes out of it as an empty, successful completion. So prepare compiles each
    distinct constraint once against the model's tokenizer, as the HF engine does, and fails
    the request naming the field; vLLM gets the constraint as it is."""

    def __init__(self, book: Any) -> None:
        self.book = book

    def compile(self, constraint: Constraint) -> Constraint:
        self.book.compile(constraint)
        return constraint


def _structured(constraint: Constraint | None, request: Request) -> dict[str, Any] | None:
    """vLLM's StructuredOutputsParams fields for a request's constraint."""
    if constraint is None:
        return None
    params = request.generation
    if params.response_format is not None:
        if params.response_format["type"] == "json_object":
            return {"json_object": True}
        schema = params.response_format["json_schema"]["schema"]
        # Compact JSON, as the HF engine generates it.
        return {"json": json.dumps(schema), "disable_any_whitespace": True}
    if params.regex is not None:
        return {"regex": params.regex}
    if params.choice is not None:
        return {"choice": list(params.choice)}
    return {"grammar": params.grammar}


def sampling_fields(
    request: Request, max_new_tokens: int, fixed_length: bool = False
) -> dict[str, Any]:
    """A request's generation fields as vLLM ``SamplingParams`` keyword arguments (plain
    data, so it is testable without vLLM). ``fixed_length``: benchmarks, every request
    generates exactly ``max_new_tokens`` (as the HF engine's ``fixed_output_length``)."""
    params = request.generation
    sampled = params.sampling
    fields: dict[str, Any] = {
        "max_tokens": max_new_tokens,
        "n": params.completions if sampled else 1,
        # vLLM is greedy at temperature 0, like vlmq without sampling.
        "temperature": (1.0 if params.temperature is None else params.temperature)
        if sampled
        else 0.0,
        "top_p": params.top_p or 1.0,
        "stop": list(params.stop) or None,
        "min_tokens": max_new_tokens if fixed_length else (params.min_tokens or 0),
        "repetition_penalty": params.repetition_penalty or 1.0,
        "presence_penalty": params.presence_penalty or 0.0,
        "frequency_penalty": params.frequency_penalty or 0.0,
        "skip_special_tokens": True,
    }
    if sampled and params.seed is not None:
        fields["seed"] = params.seed
    if params.logprobs:
        # vLLM always returns the chosen token's logprob beside the top k.
        fields["logprobs"] = params.top_logprobs or 0
    structured = _structured(params.constraint, request)
    if structured is not None:
        fields["structured_outputs"] = structured
    return fields


@dataclass
class _Inflight:
    """One request inside vLLM: its completions are vLLM requests of their own (ids
    ``<key>.<i>``), so each gets its own seed."""

    item: Prepared
    submitted_at: float
    batch_id: str
    batch_size: int
    collate_s: float
    expected: int = 1
    outputs: dict[int, Any] = field(default_factory=dict)  # completion index -> its output
    prompt_tokens: int = 0


class VllmEngine:
    """Owns one vLLM ``LLMEngine``; ``setup()`` starts it (~25 s on CPU), ``run()`` serves
    whole batches, ``submit``/``poll`` feed it continuously."""

    capabilities = CONTINUOUS
    stats: EngineStats | None = None  # vLLM keeps its own counters

    def __init__(
        self,
        model: str,
        engine: EngineSettings | None = None,
        media: MediaSettings | None = None,
        loader: MediaLoader | None = None,
    ) -> None:
        self.model_name = model
        self.settings = engine or EngineSettings(backend="vllm")
        self.media_settings = media or MediaSettings()
        self.loader = loader or MediaLoader(self.media_settings)
        self._pool = ThreadPoolExecutor(max_workers=min(8, (os.cpu_count() or 2) * 2))
        self._inflight: dict[str, _Inflight] = {}
        self._refused: list[Result] = []
        self._llm: Any = None
        self._dead = False
        self.loaded: LoadedModel | None = None

    # lifecycle -------------------------------------------------------------
    def setup(self) -> VllmEngine:
        if self._llm is not None:
            return self
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(self.model_name)
        processor = load_processor(self.model_name, self.settings)
        vllm_settings = self.settings.vllm
        self.loaded = LoadedModel(
            name=self.model_name,
            model=None,
            processor=processor,
            family=detect_family(config.model_type),
            device="vllm",
            dtype=self._dtype(),
            attn_implementation="vllm",
            context_length=vllm_settings.max_model_len,
        )
        self.processors = ProcessorSet(
            processor, lambda: load_processor(self.model_name, self.settings), self.loader.cache
        )
        self._book = self._grammars(config, processor)
        self._preparer = Preparer(
            self.loaded,
            self.settings,
            self.media_settings,
            self.loader,
            self._pool,
            self.processors,
            _CheckedForVllm(self._book),  # type: ignore[arg-type]
        )
        self._llm = self._start()
        threading.Thread(target=self._watch, name="vllm-watch", daemon=True).start()
        return self

    def _watch(self) -> None:
        """Notice vLLM's engine process dying. vLLM's own monitor marks its client dead and
        shuts it down, but a ``step`` already waiting for output then waits forever; this
        hands that wait an error, so ``poll`` raises ``EngineDied`` and the worker exits."""
        while self._llm is not None:
            resources = getattr(getattr(self._llm, "engine_core", None), "resources", None)
            if getattr(resources, "engine_dead", False):
                self._dead = True
                outputs = getattr(self._llm.engine_core, "outputs_queue", None)
                if outputs is not None:
                    outputs.put_nowait(EngineDied("the vLLM engine process died"))
                return
            time.sleep(0.5)

    def _grammars(self, config: Any, processor: Any) -> Any:
        from transformers import GenerationConfig

        from vlmq.workers.engine.constraints import GrammarBook

        tokenizer = unwrapped(processor.tokenizer)
        text_config = getattr(config, "text_config", config)
        vocab = int(getattr(text_config, "vocab_size", len(tokenizer)))
        try:
            eos = GenerationConfig.from_pretrained(self.model_name).eos_token_id
        except OSError:
            eos = None
        eos_ids = eos_token_ids(eos, tokenizer)
        return GrammarBook(tokenizer, vocab, eos_ids, self.settings.grammar_cache_size)

    def _dtype(self) -> str:
        if self.settings.dtype != "auto":
            return self.settings.dtype
        import torch

        return "bfloat16" if torch.cuda.is_available() else "float32"

    def _start(self) -> Any:
        try:
            from vllm import EngineArgs, LLMEngine
            from vllm.config import CompilationConfig, CompilationMode, StructuredOutputsConfig
        except ImportError as exc:
            raise ConfigError(
                "--engine vllm needs the vllm package: pip install 'vlmq[vllm]' on a GPU, "
                "or `make setup-vllm` for the CPU build (docs/engines.md)"
            ) from exc

        settings = self.settings.vllm
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(settings.cpu_kv_cache_gib))
        args = EngineArgs(
            model=self.model_name,
            dtype=self._dtype(),
            max_model_len=settings.max_model_len,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            tensor_parallel_size=settings.tensor_parallel_size,
            max_num_seqs=settings.max_num_seqs,
            enable_prefix_caching=settings.enable_prefix_caching,
            mm_processor_cache_gb=settings.mm_processor_cache_gb,
            enforce_eager=settings.enforce_eager,
            limit_mm_per_prompt={
                "image": self.media_settings.max_images_per_request,
                "video": self.media_settings.max_videos_per_request,
            },
            seed=0,
            # llguidance, as the HF engine and the producers' checks: one grammar dialect
            # (Lark, JSON Schema as llguidance reads it) whichever engine runs a request.
            structured_outputs_config=StructuredOutputsConfig(
                backend="guidance", disable_any_whitespace=True
            ),
            max_logprobs=MAX_TOP_LOGPROBS,
            **_compilation(settings.torch_compile, CompilationConfig, CompilationMode),
        )
        started = time.perf_counter()
        llm = LLMEngine.from_engine_args(args)
        log.info(
            "vLLM engine for %s started in %.1fs", self.model_name, time.perf_counter() - started
        )
        return llm

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        llm, self._llm = self._llm, None
        if llm is not None:
            shutdown = getattr(getattr(llm, "engine_core", None), "shutdown", None)
            if callable(shutdown):
                shutdown()

    def _ready(self) -> Any:
        if self._llm is None:
            raise RuntimeError("VllmEngine.setup() must run before the engine is used")
        return self._llm

    # the steps -------------------------------------------------------------
    def prepare(
        self, request: Request, tenant: str | None = None, prepared_media: bool = False
    ) -> Prepared:
        self._ready()
        return self._preparer.prepare(request, tenant, prepared_media)

    def plan(
        self, prepared: Sequence[Prepared], token_budget: int | None = None
    ) -> list[list[Prepared]]:
        """vLLM schedules by itself: a micro-batch is what the worker hands over at once."""
        budget = min(token_budget or self.settings.token_budget, self.settings.token_budget)
        return plan_micro_batches(
            list(prepared), self.settings.vllm.max_num_seqs, budget, bucketing=False
        )

    def collate(self, items: Sequence[Prepared]) -> Collated:
        """Each request as vLLM's prompt: the rendered chat template and its decoded media."""
        started = time.perf_counter()
        processor = self.processors.for_thread()
        inputs = [_prompt(item, processor) for item in items]
        return Collated(list(items), inputs, time.perf_counter() - started)

    def capacity(self) -> int:
        """Sequences the engine can take before it is full."""
        return max(0, self.settings.vllm.max_num_seqs - len(self._inflight))

    def submit(self, collated: Collated) -> None:
        llm = self._ready()
        batch_id = uuid.uuid4().hex[:12]
        prompts = collated.inputs or [None] * collated.rows
        for item, prompt in zip(collated.items, prompts, strict=True):
            key = f"{item.request.id}-{uuid.uuid4().hex[:8]}"
            try:
                if prompt is None:
                    prompt = _prompt(item, self.processors.primary)
                count = self._add(llm, key, item, prompt)
            except Exception as exc:
                if self._dead or _engine_dead(exc):
                    # No fault of this request's (vLLM's engine process is gone): the worker
                    # exits and the fleet redelivers it, as it does what was inside.
                    raise EngineDied(f"the vLLM engine died: {exc}") from exc
                self._refused.append(self._refusal(item, exc))  # refused: it fails alone
                continue
            self._inflight[key] = _Inflight(
                item, time.perf_counter(), batch_id, collated.rows, collated.collate_s, count
            )
            item.conversation = []  # vLLM has its own copy of the media now

    def _add(self, llm: Any, key: str, item: Prepared, prompt: dict[str, Any]) -> int:
        """Add a request's completions to vLLM, each its own request with its own seed
        (vLLM's own ``n`` gives every child the parent's seed: identical samples); all or
        none. The number added."""
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        fields = sampling_fields(
            item.request, item.max_new_tokens, self.settings.fixed_output_length
        )
        count = fields.pop("n")
        # The HF engine's end of a row: any of the model's EOS ids (the generation config's
        # and the tokenizer's), so both engines stop, and hold back min_tokens, alike.
        fields["stop_token_ids"] = list(self._book.eos_ids)
        structured = fields.pop("structured_outputs", None)
        if structured is not None:
            fields["structured_outputs"] = StructuredOutputsParams(**structured)
        seed = fields.pop("seed", None)
        if item.request.generation.sampling and seed is None:
            seed = int.from_bytes(uuid.uuid4().bytes[:7], "big")
        added: list[str] = []
        try:
            for index in range(count):
                params = dict(fields)
                if seed is not None:
                    params["seed"] = completion_seed(seed, index)
                llm.add_request(f"{key}.{index}", prompt, SamplingParams(**params))
                added.append(f"{key}.{index}")
        except Exception:
            if added:
                llm.abort_request(added)
            raise
        return count

    def poll(self, worker: str) -> list[Result]:
        """Step the engine once; the results of the requests that finished."""
        results, self._refused = self._refused, []
        if not self._inflight:
            return results
        llm = self._ready()
        if self._dead:
            raise EngineDied("the vLLM engine process died")
        try:
            outputs = llm.step()
        except Exception as exc:
            if self._dead or _engine_dead(exc):
                raise EngineDied(f"the vLLM engine died: {exc}") from exc
            raise
        for output in outputs:
            if not output.finished:
                continue
            key, _, index = output.request_id.rpartition(".")
            inflight = self._inflight.get(key)
            if inflight is None:
                continue
            inflight.outputs[int(index)] = output.outputs[0]
            inflight.prompt_tokens = len(output.prompt_token_ids or [])
            if len(inflight.outputs) == inflight.expected:
                del self._inflight[key]
                results.append(self._result(inflight, worker))
        return results

    @property
    def pending(self) -> int:
        """Requests submitted whose results ``poll`` has not returned yet."""
        return len(self._inflight) + len(self._refused)

    def reject(self, prepared: Prepared, worker: str) -> Result:
        error = prepared.error or VlmqError("could not prepare this request")
        return _failed(prepared.request, self.model_name, error, worker, prepared.timings)

    # all in order ----------------------------------------------------------
    def run(
        self,
        requests: Sequence[Request],
        worker: str | None = None,
        token_budget: int | None = None,
    ) -> list[Result]:
        """One result per request, in order (``vlmq run``): every request is added at once
        and the engine runs until all have finished."""
        name = worker or "vlmq-run"
        self._ready()
        prepared = self._preparer.prepare_all(list(requests))
        results: dict[str, Result] = {}
        ready = [p for p in prepared if p.error is None]
        for item in prepared:
            if item.error is not None:
                results[item.request.id] = self.reject(item, name)
        for batch in self.plan(ready, token_budget):
            self.submit(self.collate(batch))
        while self.pending:
            for result in self.poll(name):
                results[result.id] = result
        return [results[r.id] for r in requests]

    # encode ----------------------------------------------------------------
    def _refusal(self, item: Prepared, exc: Exception) -> Result:
        log.warning("vLLM refused request %s: %s", item.request.id, exc)
        error = InvalidRequest(f"refused by vLLM: {str(exc)[:300]}")
        return _failed(item.request, self.model_name, error, None, item.timings)

    def _result(self, inflight: _Inflight, worker: str) -> Result:
        request = inflight.item.request
        completions = [inflight.outputs[i] for i in sorted(inflight.outputs)]
        params = request.generation
        if len(completions) < params.completions:  # greedy n: one sequence, copied
            completions += [completions[0]] * (params.completions - len(completions))
        first = completions[0]
        timings = dict(inflight.item.timings)
        timings["generate_s"] = round(time.perf_counter() - inflight.submitted_at, 4)
        timings["collate_s"] = round(inflight.collate_s, 4)
        usage = Usage(
            prompt_tokens=inflight.prompt_tokens,
            completion_tokens=sum(len(c.token_ids) for c in completions),
        )
        record: dict[str, Any] = {
            "id": request.id,
            "custom_id": request.custom_id,
            "job_id": request.job_id,
            "model": self.model_name,
            "modality": request.modality,
            "worker": worker,
            "status": "succeeded",
            "output": first.text,
            "finish_reason": _finish(first),
            "usage": usage,
            "batch_id": inflight.batch_id,
            "batch_size": inflight.batch_size,
            "timings": timings,
        }
        top = params.top_logprobs or 0
        generated = [
            Generated(
                list(c.token_ids),
                c.text,
                _finish(c),
                _logprobs(c, top, self._token_bytes) if params.logprobs else None,
            )
            for c in completions
        ]
        record.update(result_choices(request, generated))
        return Result.model_validate(record)

    def _token_bytes(self, token_id: int) -> bytes:
        return bytes(self._book.token_bytes(token_id))


def _compilation(torch_compile: bool, config: Any, modes: Any) -> dict[str, Any]:
    """vLLM's own compilation unless ``torch_compile`` is off: then none (plain PyTorch)."""
    return {} if torch_compile else {"compilation_config": config(mode=modes.NONE)}


def _finish(completion: Any) -> FinishReason:
    return FinishReason.LENGTH if completion.finish_reason == "length" else FinishReason.STOP


def _logprobs(
    completion: Any, top: int, token_bytes: Callable[[int], bytes]
) -> dict[str, Any] | None:
    """vLLM's per-step logprob dicts (the chosen token, plus the top ``top`` by rank) in
    OpenAI's chat shape; token text and bytes as the HF engine gives them (from the token ids,
    not vLLM's incremental detokenizer, which leaves a partial UTF-8 character empty)."""
    if completion.logprobs is None:
        return None
    content = []
    for token_id, step in zip(completion.token_ids, completion.logprobs, strict=False):
        ranked = sorted(
            ((tid, lp) for tid, lp in step.items() if lp.rank is not None and 1 <= lp.rank <= top),
            key=lambda pair: pair[1].rank,
        )
        entry = logprob_entry(token_bytes, token_id, float(step[token_id].logprob))
        entry["top_logprobs"] = [
            logprob_entry(token_bytes, tid, float(lp.logprob)) for tid, lp in ranked
        ]
        content.append(entry)
    return {"content": content}


def _failed(
    request: Request, model: str, error: VlmqError, worker: str | None, timings: dict[str, float]
) -> Result:
    return Result.model_validate(
        {
            "id": request.id,
            "custom_id": request.custom_id,
            "job_id": request.job_id,
            "model": model,
            "modality": request.modality,
            "worker": worker,
            "status": "failed",
            "error": error.to_dict(),
            "timings": dict(timings),
        }
    )


def _engine_dead(exc: BaseException) -> bool:
    return type(exc).__name__ in ("EngineDeadError", "EngineGenerateError") or (
        "engine core" in str(exc).lower() and "dead" in str(exc).lower()
    )


def _channels_last(frames: Any) -> Any:
    """A video's frames as vLLM takes them: ``(frames, height, width, 3)`` uint8 on the host
    (its preparer has no device decoder: ``prepare._video_decoder``; frames on a device would
    be brought back here)."""
    import numpy as np

    if isinstance(frames, Pixels | DeviceFrames):
        return frames.channels_last()
    return np.stack([np.asarray(frame.convert("RGB")) for frame in frames])


def _prompt(item: Prepared, processor: Any) -> dict[str, Any]:
    """vLLM's prompt for one prepared request: the chat template rendered as text, the
    decoded images, and each video as its frames with vlmq's metadata (so vLLM keeps vlmq's
    frame choice and places the frames in time)."""
    text = processor.apply_chat_template(
        item.conversation, tokenize=False, add_generation_prompt=True
    )
    images = []
    videos = []
    for message in item.conversation:
        for part in message["content"]:
            if part["type"] == "image":
                image = part["image"]
                images.append(image.image() if isinstance(image, Pixels) else image)
            elif part["type"] == "video":
                frames = _channels_last(part["video"])
                meta = dict(part["metadata"])
                fps = float(meta.get("fps") or 1.0)
                meta.setdefault("duration", meta.get("total_num_frames", len(frames)) / fps)
                meta["do_sample_frames"] = False
                meta.setdefault("video_backend", "vlmq")
                videos.append((frames, meta))
    prompt: dict[str, Any] = {"prompt": text}
    media: dict[str, Any] = {}
    if images:
        media["image"] = images
    if videos:
        media["video"] = videos
    if media:
        prompt["multi_modal_data"] = media
    return prompt
