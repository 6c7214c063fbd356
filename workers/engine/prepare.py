"""Decode step: per request, check limits, fetch and decode media, estimate length.

Each request is prepared on its own, on any thread; a failure here (bad media, too many
items, over-long prompt) fails only that request, with a stable error code. Media is decoded
no larger than the model's processor will use (``visual_downscale``) and cached by content.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from vlmq.config.errors import (
    InvalidRequest,
    PromptTooLong,
    RetryableError,
    TooManyMedia,
    VlmqError,
)
from vlmq.config.schemas import ImagePart, Request, TextPart, VideoPart
from vlmq.config.settings import EngineSettings, MediaSettings
from vlmq.workers.engine.estimate import estimate_prompt_tokens
from vlmq.workers.engine.hostcopy import pin_buffers
from vlmq.workers.engine.model import LoadedModel, processor_device
from vlmq.workers.engine.processors import ProcessorSet
from vlmq.workers.media import (
    DecodedVideo,
    Downscale,
    ImageDecoder,
    MediaLoader,
    Pixels,
    VideoDecoder,
    frames_bytes,
    image_bytes,
)
from vlmq.workers.media.device import device_image_decoder
from vlmq.workers.media.devpixels import DeviceFrames, DevicePhotoDecoder, photo_device
from vlmq.workers.media.nvdec import device_video_decoder

if TYPE_CHECKING:
    from vlmq.workers.engine.constraints import GrammarBook

__all__ = ["Prepared", "Preparer", "visual_downscale"]

T = TypeVar("T")

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    """A request ready to collate, or the error that stopped it."""

    request: Request
    max_new_tokens: int
    conversation: list[dict[str, Any]] = field(default_factory=list)
    prompt_tokens: int = 0
    error: VlmqError | None = None
    timings: dict[str, float] = field(default_factory=dict)
    media_bytes: int = 0  # decoded pixels it holds (the pipeline's prefetch budget)
    constraint: Any = None  # its compiled constraint (a template matcher), if it has one

    @property
    def rows(self) -> int:
        """Rows it takes in a padded batch: one per sampled completion (a greedy request's
        completions are all the same: one row, copied)."""
        generation = self.request.generation
        return generation.completions if generation.sampling else 1


def video_content(video: DecodedVideo) -> dict[str, Any]:
    """A decoded video as a chat-template content part.

    The processor ignores extra keys in a part; ``metadata`` (source frame
    count, fps and the indices we sampled) is collected from here at collation
    and passed as ``video_metadata``, which places the frames in time (Qwen's
    temporal M-RoPE, Qwen3-VL's timestamps).
    """
    metadata = {
        "total_num_frames": video.total_frames,
        "fps": video.fps,
        "frames_indices": list(video.frame_indices),
    }
    frames = video.frames
    # Pixels and device frames stay whole: the HF runner hands them to the processor as one
    # tensor.
    return {
        "type": "video",
        "video": frames if isinstance(frames, Pixels | DeviceFrames) else list(frames),
        "metadata": metadata,
    }


def _subsample(video: DecodedVideo, count: int) -> DecodedVideo:
    """Keep ``count`` evenly spaced frames (InternVL needs equal frame counts)."""
    if len(video.frames) <= count:
        return video
    step = len(video.frames) / count
    return _taken(video, [int(i * step) for i in range(count)])


def _taken(video: DecodedVideo, keep: list[int]) -> DecodedVideo:
    """The video with only the frames at ``keep`` (repeats allowed)."""
    frames = video.frames
    return replace(
        video,
        frames=(
            frames.take(keep)
            if isinstance(frames, Pixels | DeviceFrames)
            else [frames[i] for i in keep]
        ),
        frame_indices=[video.frame_indices[i] for i in keep],
    )


def video_frame_counts(conversation: list[dict[str, Any]]) -> tuple[int, ...]:
    return tuple(
        len(part["video"]) for m in conversation for part in m["content"] if part["type"] == "video"
    )


def _size_attr(size: Any, name: str) -> int | None:
    value = getattr(size, name, None)
    if value is None and isinstance(size, dict):
        value = size.get(name)
    return int(value) if value else None


def _target(processor: Any, tiles: int) -> Downscale | None:
    """What one image or frame can be at most for ``processor`` (None: unknown)."""
    size = getattr(processor, "size", None)
    if size is None:
        return None
    longest = _size_attr(size, "longest_edge")
    if longest:  # Qwen: a pixel budget, aspect kept
        return Downscale(max_pixels=longest)
    height, width = _size_attr(size, "height"), _size_attr(size, "width")
    if height and width:  # InternVL: fixed tiles
        if tiles > 1:
            return Downscale(max_pixels=height * width * tiles)
        return Downscale(cover=(width, height))
    return None


def visual_downscale(processor: Any) -> tuple[Downscale | None, Downscale | None]:
    """Decode-time downscale targets for images and for video frames, from the processor's
    own limits (Qwen's pixel budgets; InternVL's tiles)."""
    image = getattr(processor, "image_processor", None)
    video = getattr(processor, "video_processor", None)
    tiles = (
        int(getattr(image, "max_patches", 1) or 1)
        if getattr(image, "crop_to_patches", False)
        else 1
    )
    return (
        _target(image, tiles) if image is not None else None,
        _target(video, 1) if video is not None else None,
    )


def _image_decoder(
    engine: EngineSettings, media: MediaSettings, model_device: str
) -> ImageDecoder | None:
    """Photos decoded and left on the processor's GPU when the processor runs there and device
    decoding is on (``devpixels``); else nvJPEG brought back to the host where allowed
    (``device.py``); None: the CPU reference."""
    on = photo_device(media, processor_device(engine, model_device))
    if on is not None:
        return DevicePhotoDecoder(on, media.device_jpeg_batch, media.device_jpeg_window_ms / 1e3)
    return device_image_decoder(media, model_device)


def _video_decoder(
    engine: EngineSettings, media: MediaSettings, model_device: str
) -> VideoDecoder | None:
    """Clips' sampled frames decoded by NVDEC and left on the processor's GPU when the
    processor runs there, device decoding is on and a hardware decoder imports (``nvdec``);
    None: the CPU reference. vLLM's ``model_device`` ("vllm") never gets one: it takes frames
    on the host."""
    return device_video_decoder(media, processor_device(engine, model_device))


class Preparer:
    """Turns requests into collatable conversations, fetching media concurrently."""

    def __init__(
        self,
        loaded: LoadedModel,
        engine: EngineSettings,
        media: MediaSettings,
        loader: MediaLoader,
        pool: Executor,
        processors: ProcessorSet,
        grammars: GrammarBook | None = None,
    ) -> None:
        self.loaded = loaded
        self.grammars = grammars
        self.engine = engine
        self.media = media
        self.loader = loader
        self.pool = pool
        self.processors = processors
        targets = visual_downscale(loaded.processor)
        self.image_target, self.video_target = (
            targets if media.downscale_at_decode else (None, None)
        )
        # nvJPEG on the model's GPU when media.device_decode allows it; None: the CPU path.
        self.image_decoder: ImageDecoder | None = _image_decoder(engine, media, loaded.device)
        # NVDEC on the processor's GPU under the same conditions (and a decoder installed).
        self.video_decoder: VideoDecoder | None = _video_decoder(engine, media, loaded.device)
        if loader.frames is not None and loaded.device.startswith("cuda"):
            # Frame-store reads into pinned memory: the copy to the device does not block.
            pin_buffers(loader.frames.buffers)

    def prepare_all(self, requests: list[Request]) -> list[Prepared]:
        futures = [self.pool.submit(self.prepare, request) for request in requests]
        return [f.result() for f in futures]

    def prepare(
        self, request: Request, tenant: str | None = None, prepared_media: bool = False
    ) -> Prepared:
        """``tenant`` keys the frame store (without one it is used only when tenants share);
        ``prepared_media``: a prepare worker put this task's media in the frame store (read
        it back; CPU-decoded pixels, whatever ``device_decode`` says)."""
        prepared = Prepared(request, self._max_new_tokens(request))
        started = time.perf_counter()
        before = self.loader.thread_counts()
        try:
            self._check_media_counts(request)
            self._check_max_new_tokens(prepared.max_new_tokens)
            self._check_min_tokens(request, prepared.max_new_tokens)
            self._check_text(request)
            prepared.constraint = self._compile(request)
            prepared.conversation, sizes = self._decode(request, tenant, prepared_media)
            prepared.media_bytes = _media_bytes(prepared.conversation)
            prepared.prompt_tokens = self._estimate(prepared.conversation, *sizes)
            self._check_context(prepared)
        except VlmqError as exc:
            prepared.error = exc
        except Exception:
            # A bug (or a processor surprise) fails this request alone, never
            # the batch; the client sees a code, not the exception text.
            log.exception("preparing request %s failed", request.id)
            prepared.error = VlmqError("could not prepare this request")
        prepared.timings["prepare_s"] = round(time.perf_counter() - started, 4)
        if request.parts("image") or request.parts("video"):
            after = self.loader.thread_counts()
            prepared.timings["media_cache_hits"] = after.cache_hits - before.cache_hits
            prepared.timings["media_decodes"] = after.decodes - before.decodes
            if self.loader.frames is not None:
                prepared.timings["frame_store_hits"] = after.store_hits - before.store_hits
        return prepared

    def _max_new_tokens(self, request: Request) -> int:
        return request.generation.max_new_tokens or self.engine.max_new_tokens_default

    def _compile(self, request: Request) -> Any:
        """The request's constraint against this model's tokenizer (cached per grammar); a
        refusal is this request's ``invalid_request``, naming the field."""
        constraint = request.generation.constraint
        if constraint is None:
            return None
        if self.grammars is None:
            raise InvalidRequest("this engine does not constrain decoding", field=constraint.field)
        return self.grammars.compile(constraint)

    def _check_min_tokens(self, request: Request, max_new_tokens: int) -> None:
        if (request.generation.min_tokens or 0) > max_new_tokens:
            raise InvalidRequest(
                f"must be at most max_new_tokens ({max_new_tokens})", field="min_tokens"
            )

    def _check_max_new_tokens(self, value: int) -> None:
        if value > self.engine.max_new_tokens_cap:
            raise InvalidRequest(
                f"must be at most {self.engine.max_new_tokens_cap}", field="max_new_tokens"
            )

    def _check_media_counts(self, request: Request) -> None:
        images, videos = len(request.parts("image")), len(request.parts("video"))
        if images > self.media.max_images_per_request:
            raise TooManyMedia(
                f"{images} images; at most {self.media.max_images_per_request} per request"
            )
        if videos > self.media.max_videos_per_request:
            raise TooManyMedia(
                f"{videos} videos; at most {self.media.max_videos_per_request} per request"
            )

    def _check_text(self, request: Request) -> None:
        """Text the tokenizer cannot encode, or that carries the processor's own
        media placeholders (which it would try to match to images), fails here."""
        placeholders = self._media_placeholders()
        for part in request.parts("text"):
            try:
                part.text.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidRequest(
                    "must be valid Unicode (no lone surrogates)", field="text"
                ) from None
            for token in placeholders:
                if token in part.text:
                    raise InvalidRequest(
                        f"must not contain the model's media placeholder {token!r}", field="text"
                    )

    def _media_placeholders(self) -> list[str]:
        processor = self.loaded.processor
        tokens = (getattr(processor, name, None) for name in ("image_token", "video_token"))
        return [t for t in tokens if isinstance(t, str) and t]

    def _check_context(self, prepared: Prepared) -> None:
        limit = self.loaded.context_length
        if prepared.prompt_tokens + prepared.max_new_tokens > limit:
            raise PromptTooLong(
                f"prompt of about {prepared.prompt_tokens} tokens plus max_new_tokens "
                f"{prepared.max_new_tokens} exceeds the model context of {limit}"
            )

    def _decode(
        self, request: Request, tenant: str | None = None, prepared_media: bool = False
    ) -> tuple[list[dict[str, Any]], tuple[list[tuple[int, int]], list[tuple[int, int, int]]]]:
        image_sizes: list[tuple[int, int]] = []
        video_sizes: list[tuple[int, int, int]] = []
        conversation = []
        videos = self._load_videos(request, tenant, prepared_media)
        # The prepare tier decodes on CPUs: its objects are the CPU decoder's.
        decoder = None if prepared_media else self.image_decoder
        for message in request.messages:
            content: list[dict[str, Any]] = []
            for part in message.content:
                if isinstance(part, TextPart):
                    content.append({"type": "text", "text": part.text})
                elif isinstance(part, ImagePart):
                    load = partial(
                        self.loader.load_image,
                        part.source,
                        self.image_target,
                        tenant,
                        decoder,
                        prepared_media,
                    )
                    image = self._with_retry(load)
                    image_sizes.append((image.height, image.width))
                    content.append({"type": "image", "image": image})
                elif isinstance(part, VideoPart):
                    video = videos.pop(0)
                    video_sizes.append((len(video.frames), video.height, video.width))
                    content.append(video_content(video))
            conversation.append({"role": message.role, "content": content})
        return conversation, (image_sizes, video_sizes)

    def _with_retry(self, load: Callable[[], T]) -> T:
        """Retry transient fetch failures with exponential backoff, then give up
        with the last (retryable, clearly coded) error."""
        delay = self.media.fetch_retry_backoff_s
        for _ in range(self.media.fetch_retries):
            try:
                return load()
            except RetryableError:
                time.sleep(delay)
                delay *= 2
        return load()

    def _load_videos(
        self, request: Request, tenant: str | None = None, prepared_media: bool = False
    ) -> list[DecodedVideo]:
        # As for photos: prepared media are read back as the CPU decoder's frames.
        decoder = None if prepared_media else self.video_decoder
        videos = [
            self._with_retry(
                partial(
                    self.loader.load_video,
                    part.source,
                    part.fps,
                    part.max_frames,
                    self.video_target,
                    part.video_sampling,
                    tenant,
                    prepared_media,
                    decoder,
                )
            )
            for part in request.parts("video")
        ]
        # Qwen's temporal patch covers two frames: a one-frame clip repeats its frame.
        videos = [_taken(v, [0, 0]) if len(v.frames) == 1 else v for v in videos]
        if self.loaded.family == "internvl" and videos:
            # InternVL stacks every video of one processor call: equal frame counts.
            common = min(len(v.frames) for v in videos)
            videos = [_subsample(v, common) for v in videos]
        return videos

    def _estimate(
        self,
        conversation: list[dict[str, Any]],
        image_sizes: list[tuple[int, int]],
        video_sizes: list[tuple[int, int, int]],
    ) -> int:
        family = self.loaded.family
        return self.processors.estimate(
            lambda processor: estimate_prompt_tokens(
                processor, family, conversation, image_sizes, video_sizes
            )
        )


def _media_bytes(conversation: list[dict[str, Any]]) -> int:
    total = 0
    for message in conversation:
        for part in message["content"]:
            if part["type"] == "image":
                total += image_bytes(part["image"])
            elif part["type"] == "video":
                total += frames_bytes(part["video"])
    return total
