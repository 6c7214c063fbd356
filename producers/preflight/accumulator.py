"""``Preflight``: what a JSONL file will cost, estimated line by line before anything runs.

Each valid line is estimated the way the worker will prepare it (``workers/engine/prepare``):
the same output-token default and cap, the same media limits, the same frames sampled from a
video and the same decode-time downscale, and the same token arithmetic
(``config/vision.py``) over sizes read from headers instead of decoded pixels
(``headers.py``). A line the worker would refuse (too many media, a file that cannot be read,
an image over the pixel limit, max_new_tokens over the cap, a prompt over the context) is
counted as a predicted failure with the worker's error code.

A size that is not read here is *unknown*, never zero and never a failure: an http(s) or
``s3://`` source (not fetched), a local path or ``file://`` URL named by a remote caller
(``local_files=False``: the HTTP API, ``Client(local_media=False)``, a remote input; the
file is never opened, so whether it exists or how big it is cannot change the answer), or
any media when Pillow/PyAV are missing. An unknown image counts as a 1280x720 picture and an
unknown video as a 60 s 1280x720 clip at 30 fps (``UNKNOWN_IMAGE_HW``, ``UNKNOWN_VIDEO``),
after the same decode-time downscale and frame sampling as a known one; a line with unknown
media is never predicted to overflow the context, and the report counts the unknowns and
says why.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmq.config.errors import (
    InvalidRequest,
    PromptTooLong,
    TooManyMedia,
    VlmqError,
)
from vlmq.config.jsonl import ParsedLine, parse_line
from vlmq.config.schemas import ImagePart, Request, VideoPart
from vlmq.config.settings import Settings
from vlmq.config.vision import (
    VisionProfile,
    downscaled_size,
    expanded_prompt_tokens,
    image_tokens,
    sampled_frame_count,
    video_tokens,
    worker_frame_counts,
)
from vlmq.producers.preflight.fleet import FleetRates, estimate_eta
from vlmq.producers.preflight.headers import (
    HeadersUnavailable,
    ImageTarget,
    LocalMediaNotRead,
    RemoteMedia,
    VideoHeader,
    image_size,
    open_media,
    video_header,
)
from vlmq.producers.preflight.model import ModelProfile

__all__ = ["LineEstimate", "Preflight"]

# Sizes assumed for media whose size is not read here (remote URLs are not fetched, a remote
# caller's local paths are not opened): see the module docstring.
UNKNOWN_IMAGE_HW = (720, 1280)  # a 720p picture
UNKNOWN_VIDEO = VideoHeader(width=1280, height=720, fps=30.0, duration_s=60.0, total_frames=1800)
MAX_LISTED = 10  # invalid lines and predicted failures listed in a report (all are counted)
HEADER_CACHE_ENTRIES = 4096  # local files whose header was read (a file asked about often)
_MODALITIES = ("text", "image", "video")


@dataclass
class LineEstimate:
    """One request's estimate; ``problem`` is (code, message) of the error the worker would
    fail it with, if any."""

    modality: str
    prompt_tokens: int
    text_tokens: int
    visual_tokens: int
    output_tokens: int
    frames: int = 0
    unknown_media: int = 0
    problem: tuple[str, str] | None = None


@dataclass
class _Media:
    """Per kind: sizes read, sizes unknown (and why), sources the worker would refuse."""

    read: int = 0
    unknown: int = 0
    failed: int = 0

    def add(self, other: _Media) -> None:
        self.read += other.read
        self.unknown += other.unknown
        self.failed += other.failed


@dataclass
class _Totals:
    lines: int = 0
    invalid: int = 0
    invalid_first: list[dict[str, Any]] = field(default_factory=list)
    modality: Counter[str] = field(default_factory=Counter)
    runnable: Counter[str] = field(default_factory=Counter)  # lines not predicted to fail
    prompt_tokens: Counter[str] = field(default_factory=Counter)
    output_tokens: Counter[str] = field(default_factory=Counter)
    text_tokens: int = 0
    visual_tokens: int = 0
    max_prompt_tokens: int = 0
    default_output: int = 0
    frames: int = 0
    images: _Media = field(default_factory=_Media)
    videos: _Media = field(default_factory=_Media)
    failing: int = 0
    failing_first: list[dict[str, Any]] = field(default_factory=list)
    unknown_reasons: set[str] = field(default_factory=set)

    def merge(self, other: _Totals) -> None:
        for name in (
            "lines",
            "invalid",
            "text_tokens",
            "visual_tokens",
            "default_output",
            "frames",
            "failing",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("modality", "runnable", "prompt_tokens", "output_tokens"):
            getattr(self, name).update(getattr(other, name))
        self.max_prompt_tokens = max(self.max_prompt_tokens, other.max_prompt_tokens)
        self.images.add(other.images)
        self.videos.add(other.videos)
        self.invalid_first = sorted(
            self.invalid_first + other.invalid_first, key=lambda e: e["line"]
        )[:MAX_LISTED]
        self.failing_first = sorted(
            self.failing_first + other.failing_first, key=lambda e: e["line"]
        )[:MAX_LISTED]
        self.unknown_reasons |= other.unknown_reasons


class _Unknown:
    """A media size that could not be read here, and why (stated in the report)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class Preflight:
    """Accumulates estimates over the lines of one job; nothing is enqueued or written.

    >>> preflight = Preflight(settings)                  # or Preflight(settings, profile)
    >>> for parsed in parsed_lines:                      # config.jsonl.parse_line results
    ...     preflight.add(parsed, base_dir=input_dir)
    >>> preflight.report(rates)                          # rates: read_fleet_rates(...) or None

    ``profile`` (``ModelProfile.load(settings.model)``) reads the model's files once; pass one
    to share it between many Preflights (an API validating several files). ``base_dir``
    resolves relative media paths, as ``vlmq submit`` does against the input file's folder;
    one that leads out of it (``..``, a symlink) is refused as staging refuses it, unless
    ``allow_outside_base``. ``local_files`` False: for a remote caller, whose local paths and
    ``file://`` URLs are never opened (their size is unknown). Two Preflights of parts of
    one file combine with ``merge``. Not thread-safe: one per thread, merged at the end.
    """

    def __init__(
        self,
        settings: Settings,
        profile: ModelProfile | None = None,
        *,
        local_files: bool = True,
        allow_outside_base: bool = False,
    ) -> None:
        self.settings = settings
        self.local_files = local_files
        self.allow_outside_base = allow_outside_base
        self.profile = profile if profile is not None else ModelProfile.load(settings.model)
        self._totals = _Totals()
        self._headers: OrderedDict[tuple[str, str], Any] = OrderedDict()
        max_pixels, cover = self.vision.decode_targets(video=False)
        video_pixels, video_cover = self.vision.decode_targets(video=True)
        downscale = settings.media.downscale_at_decode
        self._image_target = ImageTarget(max_pixels, cover) if downscale else None
        self._video_target = ImageTarget(video_pixels, video_cover) if downscale else None

    @property
    def vision(self) -> VisionProfile:
        return self.profile.vision

    # --- feeding ------------------------------------------------------------------------------

    def add(self, parsed: ParsedLine, base_dir: Path | None = None) -> LineEstimate | None:
        """Count one parsed line: an invalid one as invalid, a valid one estimated."""
        totals = self._totals
        totals.lines += 1
        if parsed.request is None:
            totals.invalid += 1
            error = parsed.error
            if error is not None and len(totals.invalid_first) < MAX_LISTED:
                totals.invalid_first.append(
                    {
                        "line": error.line,
                        "custom_id": error.custom_id,
                        "code": error.code,
                        "message": error.message,
                    }
                )
            return None
        estimate = self.estimate(parsed.request, base_dir)
        self._count(parsed, estimate)
        return estimate

    def add_lines(self, lines: Iterable[str], base_dir: Path | None = None) -> None:
        """Every non-blank line of a JSONL stream, numbered as ``vlmq submit`` numbers them."""
        for number, text in enumerate(lines, start=1):
            if text.strip():
                self.add(parse_line(text, number), base_dir)

    @property
    def estimated_tokens(self) -> int:
        """Prompt (visual included) plus output tokens of every valid line so far."""
        totals = self._totals
        return sum(totals.prompt_tokens.values()) + sum(totals.output_tokens.values())

    def merge(self, other: Preflight) -> Preflight:
        """Add ``other``'s counts to this one's (in place); returns self."""
        self._totals.merge(other._totals)
        return self

    def _count(self, parsed: ParsedLine, estimate: LineEstimate) -> None:
        totals, modality = self._totals, estimate.modality
        totals.modality[modality] += 1
        totals.prompt_tokens[modality] += estimate.prompt_tokens
        totals.output_tokens[modality] += estimate.output_tokens
        totals.text_tokens += estimate.text_tokens
        totals.visual_tokens += estimate.visual_tokens
        totals.max_prompt_tokens = max(totals.max_prompt_tokens, estimate.prompt_tokens)
        totals.frames += estimate.frames
        assert parsed.request is not None
        if parsed.request.generation.max_new_tokens is None:
            totals.default_output += 1
        if estimate.problem is None:
            totals.runnable[modality] += 1
            return
        totals.failing += 1
        if len(totals.failing_first) < MAX_LISTED:
            code, message = estimate.problem
            totals.failing_first.append(
                {
                    "line": parsed.line,
                    "custom_id": parsed.request.custom_id,
                    "code": code,
                    "message": message,
                }
            )

    # --- one request --------------------------------------------------------------------------

    def estimate(self, request: Request, base_dir: Path | None = None) -> LineEstimate:
        """One request's prompt and output tokens, as the worker will count them."""
        engine = self.settings.engine
        asked = request.generation.max_new_tokens or engine.max_new_tokens_default
        problem = self._request_problem(request, asked)
        visual, frames, unknown, media_problem = self._visual_tokens(request, base_dir)
        problem = problem or media_problem
        rendered = self.profile.text.count(_stub(request))
        prompt = expanded_prompt_tokens(rendered, visual)
        limit = self.vision.context_length
        if problem is None and not unknown and prompt + asked > limit:
            problem = (
                PromptTooLong.code,
                f"prompt of about {prompt} tokens plus max_new_tokens {asked} exceeds "
                f"the model context of {limit}",
            )
        return LineEstimate(
            modality=request.modality.value,
            prompt_tokens=prompt,
            # The rendered text holds one placeholder per item; each becomes its item's tokens.
            text_tokens=rendered - len(visual),
            visual_tokens=sum(visual),
            # Each of the n completions may run to the limit (the prompt is shared).
            output_tokens=min(asked, engine.max_new_tokens_cap) * request.generation.completions,
            frames=frames,
            unknown_media=unknown,
            problem=problem,
        )

    def _request_problem(self, request: Request, asked: int) -> tuple[str, str] | None:
        """What the worker refuses before fetching anything, in the order it checks."""
        media = self.settings.media
        images, videos = len(request.parts("image")), len(request.parts("video"))
        if images > media.max_images_per_request:
            return TooManyMedia.code, (
                f"{images} images; at most {media.max_images_per_request} per request"
            )
        if videos > media.max_videos_per_request:
            return TooManyMedia.code, (
                f"{videos} videos; at most {media.max_videos_per_request} per request"
            )
        cap = self.settings.engine.max_new_tokens_cap
        if asked > cap:
            return InvalidRequest.code, f"max_new_tokens: must be at most {cap}"
        return None

    def _visual_tokens(
        self, request: Request, base_dir: Path | None
    ) -> tuple[list[int], int, int, tuple[str, str] | None]:
        """(tokens per video then per image, frames sampled, media of unknown size, the first
        problem, in the worker's order: videos are loaded before images)."""
        problems: list[tuple[str, str]] = []
        headers, unknown = [], 0
        for video in request.parts("video"):
            header, failure = self._video(video, base_dir)
            if failure is not None:  # refused media adds no tokens: its line fails anyway
                problems.append(failure)
                continue
            unknown += header is None
            headers.append((video, header or UNKNOWN_VIDEO))
        counts = worker_frame_counts(
            self.vision.family, [self._frames(part, header) for part, header in headers]
        )
        tokens = []
        for (_, header), frames in zip(headers, counts, strict=True):
            width, height = self._frame_size(header)
            tokens.append(self._counted(video_tokens, (frames, height, width), problems))
        for part in request.parts("image"):
            hw, failure = self._image_hw(part, base_dir)
            if failure is not None:
                problems.append(failure)
                continue
            unknown += hw is None
            tokens.append(self._counted(image_tokens, hw or self._unknown_image_hw(), problems))
        return tokens, sum(counts), unknown, problems[0] if problems else None

    def _counted(self, count: Any, shape: tuple[int, ...], problems: list[tuple[str, str]]) -> int:
        try:
            return int(count(self.vision, *shape))
        except ValueError:
            # The processor refuses the shape (past its aspect limit, when the worker's own
            # limit allows more): the worker fails the request while preparing it.
            problems.append((VlmqError.code, "could not prepare this request"))
            return 0

    def _unknown_image_hw(self) -> tuple[int, int]:
        height, width = UNKNOWN_IMAGE_HW
        target = self._image_target
        if target is None:
            return height, width
        width, height = downscaled_size((width, height), target.max_pixels, target.cover)
        return height, width

    def _frames(self, part: VideoPart, header: VideoHeader) -> int:
        media = self.settings.media
        target_fps = part.fps if part.fps is not None else media.video_fps
        cap = min(part.max_frames or media.video_max_frames, media.video_max_frames)
        return sampled_frame_count(header.duration_s, header.total_frames, target_fps, cap)

    def _frame_size(self, header: VideoHeader) -> tuple[int, int]:
        size = (header.width, header.height)
        target = self._video_target
        return size if target is None else downscaled_size(size, target.max_pixels, target.cover)

    # --- media headers, cached by file ----------------------------------------------------------

    def _image_hw(
        self, part: ImagePart, base_dir: Path | None
    ) -> tuple[tuple[int, int] | None, tuple[str, str] | None]:
        media = self.settings.media
        result = self._read(
            "image",
            part.source,
            base_dir,
            lambda file: image_size(file, media, self._image_target),
            media.max_image_bytes,
        )
        return self._outcome(result, self._totals.images)

    def _video(
        self, part: VideoPart, base_dir: Path | None
    ) -> tuple[VideoHeader | None, tuple[str, str] | None]:
        media = self.settings.media
        result = self._read(
            "video",
            part.source,
            base_dir,
            lambda file: video_header(file, media),
            media.max_video_bytes,
        )
        return self._outcome(result, self._totals.videos)

    def _outcome(self, result: Any, counts: _Media) -> tuple[Any, tuple[str, str] | None]:
        if isinstance(result, _Unknown):
            counts.unknown += 1
            self._totals.unknown_reasons.add(result.reason)
            return None, None
        if isinstance(result, VlmqError):
            counts.failed += 1
            return None, (result.code, result.message)
        counts.read += 1
        return result, None

    def _read(self, kind: str, source: str, base_dir: Path | None, read: Any, cap: int) -> Any:
        """The header's result (a size, a ``VlmqError`` the worker would raise, or
        ``_Unknown``); local files are read once per Preflight."""
        inline = source.startswith("data:")
        key = (kind, source if inline else str(base_dir / source if base_dir else source))
        if not inline and key in self._headers:
            self._headers.move_to_end(key)
            return self._headers[key]
        result = _read_header(
            source,
            base_dir,
            read,
            cap,
            local_files=self.local_files,
            confine=not self.allow_outside_base,
        )
        if not inline:
            self._headers[key] = result
            if len(self._headers) > HEADER_CACHE_ENTRIES:
                self._headers.popitem(last=False)
        return result

    # --- the report ---------------------------------------------------------------------------

    def report(self, rates: FleetRates | None = None) -> dict[str, Any]:
        """The estimate as plain JSON types (``format_summary`` prints it for people)."""
        totals, engine = self._totals, self.settings.engine
        return {
            "lines": totals.lines,
            "valid_lines": totals.lines - totals.invalid,
            "invalid_lines": {"count": totals.invalid, "first": list(totals.invalid_first)},
            "modality": {m: totals.modality[m] for m in _MODALITIES},
            "prompt_tokens": {
                "total": sum(totals.prompt_tokens.values()),
                "text": totals.text_tokens,
                "visual": totals.visual_tokens,
                "max_line": totals.max_prompt_tokens,
                "by_modality": {m: totals.prompt_tokens[m] for m in _MODALITIES},
                "text_method": self.profile.text.method,
            },
            "output_tokens": {
                "total": sum(totals.output_tokens.values()),
                "by_modality": {m: totals.output_tokens[m] for m in _MODALITIES},
                "default_used": totals.default_output,
                "default": engine.max_new_tokens_default,
                "cap": engine.max_new_tokens_cap,
            },
            "media": {
                "images": vars(totals.images).copy(),
                "videos": vars(totals.videos).copy(),
                "frames_sampled": totals.frames,
            },
            "predicted_failures": {"count": totals.failing, "first": list(totals.failing_first)},
            "model": {"name": self.profile.name, "family": self.vision.family},
            "assumptions": self._assumptions(),
            "fleet": rates.as_dict() if rates is not None else None,
            "eta": estimate_eta(dict(totals.runnable), rates),
        }

    def _assumptions(self) -> list[str]:
        notes = list(self.profile.assumptions)
        totals = self._totals
        assumed = []
        if totals.images.unknown:
            height, width = UNKNOWN_IMAGE_HW
            assumed.append(f"{totals.images.unknown:,} image(s) as {width}x{height}")
        if totals.videos.unknown:
            video = UNKNOWN_VIDEO
            assumed.append(
                f"{totals.videos.unknown:,} video(s) as {video.width}x{video.height}, "
                f"{video.duration_s:g} s at {video.fps:g} fps"
            )
        if assumed:
            why = "; ".join(sorted(totals.unknown_reasons))
            notes.append(f"size unknown ({why}): counted {' and '.join(assumed)}")
        notes.append(
            "frames sampled and sizes come from headers; a stream shorter than its metadata "
            "gives the worker fewer frames"
        )
        return notes


def _read_header(
    source: str, base_dir: Path | None, read: Any, cap: int, *, local_files: bool, confine: bool
) -> Any:
    try:
        with open_media(source, base_dir, cap, local_files=local_files, confine=confine) as file:
            return read(file)
    except RemoteMedia as exc:
        return _Unknown(f"{exc} URLs are not fetched")
    except LocalMediaNotRead:
        return _Unknown("local paths are not read for a remote caller")
    except HeadersUnavailable as exc:
        return _Unknown(str(exc))
    except VlmqError as exc:
        return exc


def _stub(request: Request) -> list[dict[str, Any]]:
    """The placeholder conversation the worker renders (``config.vision.template_stub`` of
    its decoded conversation)."""
    return [
        {
            "role": message.role,
            "content": [
                {"type": "text", "text": part.text} if part.type == "text" else {"type": part.type}
                for part in message.content
            ],
        }
        for message in request.messages
    ]
