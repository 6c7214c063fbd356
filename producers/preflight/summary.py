"""A pre-flight report (``Preflight.report()``) as lines for a person."""

from __future__ import annotations

from typing import Any

__all__ = ["format_summary"]


def _duration(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _eta(eta: dict[str, Any]) -> str:
    if eta["seconds"] is None:
        return f"unknown: {eta['reason']}"
    per_class = eta.get("per_class_s") or {}
    classes = ", ".join(f"{m} {_duration(s)}" for m, s in per_class.items())
    return f"~{_duration(eta['seconds'])} {eta['reason']}" + (f" ({classes})" if classes else "")


def _listed(title: str, section: dict[str, Any]) -> list[str]:
    if not section["count"]:
        return []
    lines = [f"{title} ({section['count']:,}; first {len(section['first'])}):"]
    for entry in section["first"]:
        who = f" ({entry['custom_id']})" if entry.get("custom_id") else ""
        lines.append(f"  line {entry['line']}{who}: {entry['code']}: {entry['message']}")
    return lines


def format_summary(report: dict[str, Any]) -> str:
    prompt, output, media = report["prompt_tokens"], report["output_tokens"], report["media"]
    mix = "  ".join(f"{m} {n:,}" for m, n in report["modality"].items())
    images, videos = media["images"], media["videos"]
    fleet = report.get("fleet") or {}
    rates = "  ".join(f"{m} {r:,.2f}/s" for m, r in (fleet.get("tasks_per_s") or {}).items())
    lines = [
        "dry run: nothing was enqueued",
        f"lines           {report['lines']:,} ({report['invalid_lines']['count']:,} invalid)",
        f"modality        {mix}",
        f"prompt tokens   ~{prompt['total']:,} (text {prompt['text']:,}, visual "
        f"{prompt['visual']:,}; longest line {prompt['max_line']:,})",
        f"  text tokens   {prompt['text_method']}",
        f"output tokens   up to {output['total']:,} ({output['default_used']:,} line(s) use the "
        f"default {output['default']:,}; cap {output['cap']:,})",
        f"images          {images['read']:,} sized from headers, {images['unknown']:,} unknown, "
        f"{images['failed']:,} unreadable or refused",
        f"videos          {videos['read']:,} sized from headers, {videos['unknown']:,} unknown, "
        f"{videos['failed']:,} unreadable or refused; {media['frames_sampled']:,} frames sampled",
        f"would fail      {report['predicted_failures']['count']:,}",
        f"model           {report['model']['name']} ({report['model']['family']})",
    ]
    if rates:
        lines.append(f"fleet rate      {rates} ({fleet['measured']} measured workers)")
    lines.append(f"ETA             {_eta(report['eta'])}")
    lines += [f"note            {note}" for note in report["assumptions"]]
    lines += _listed("invalid lines", report["invalid_lines"])
    lines += _listed("predicted failures", report["predicted_failures"])
    return "\n".join(lines)
