"""Pre-flight estimates of a bulk job: ``vlmq submit --dry-run``, and batch metadata.

Torch-free (Pillow and PyAV, when installed, read media headers; never pixels)::

    from vlmq.producers.preflight import Preflight, read_fleet_rates

    preflight = Preflight(settings)            # reads settings.model's files once
    for parsed in parsed_lines:                # vlmq.config.jsonl.parse_line(...) results
        preflight.add(parsed, base_dir=folder) # folder: where relative media paths resolve
    report = preflight.report(read_fleet_rates(redis, settings))   # plain JSON types

``report()`` answers: lines, invalid lines (count, the first few), the modality mix, prompt
tokens including visual tokens (counted as the worker counts them, ``config/vision.py``),
requested output tokens (default and cap applied), lines the worker would refuse, the
assumptions made, the fleet's measured rate and the ETA at it (None, with the reason, when no
worker has a measured rate). ``merge`` adds another Preflight's counts; ``add_lines`` feeds a
raw JSONL stream; ``format_summary`` prints a report for people.
"""

from vlmq.producers.preflight.accumulator import LineEstimate, Preflight
from vlmq.producers.preflight.fleet import FleetRates, WorkerRate, estimate_eta, read_fleet_rates
from vlmq.producers.preflight.model import ModelProfile
from vlmq.producers.preflight.summary import format_summary

__all__ = [
    "FleetRates",
    "LineEstimate",
    "ModelProfile",
    "Preflight",
    "WorkerRate",
    "estimate_eta",
    "format_summary",
    "read_fleet_rates",
]
