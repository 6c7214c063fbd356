"""What kills a worker takes only itself down: the rules both the GPU loop (``triage.py``,
``stages.py``) and the prepare tier (``prepare_tier.py``) apply to what they pulled.

Only deaths count. A delivery that was neither started (``attempts``, counted at the start)
nor returned (``returns``: a clean give-back, or a prepare worker's hand-on) ended with its
holder's death, perhaps because of it: a native decoder crash, an OOM kill, a stage stuck past
its time limit. A task whose holders died that way ``isolate_after_prestart_deaths`` times is
*suspect*: it is handled alone, after everything pulled with it is settled or handed on, least
often alone first, so it cannot take its batch-mates down again (one death is not enough:
after any worker death its whole pull comes back, and handling all of it one by one would cost
more than a second shared death). A task is given up, dead-lettered before its request is
read, once its holders died ``max_unstarted_deliveries`` times before starting it, or
``max_deliveries`` times while it was handled alone (``alone`` counts those: a delivery that
went alone and was returned is not counted, ``lua/intake.lua``).
"""

from __future__ import annotations

from collections.abc import Sequence

from vlmq.config.settings import FleetSettings
from vlmq.workers.fleet.work import Work

__all__ = ["given_up", "isolate"]


def given_up(work: Work, fleet: FleetSettings) -> str | None:
    """Why this delivery must not be handled at all (its task is dead-lettered before its
    request is read), or None."""
    deaths = work.prestart_deaths
    if deaths >= fleet.max_unstarted_deliveries:
        return (
            f"its holders died {deaths} times before starting it "
            f"(limit {fleet.max_unstarted_deliveries})"
        )
    if work.alone_before >= fleet.max_deliveries:
        return (
            f"its worker died each of the {work.alone_before} times it was prepared alone "
            f"(limit {fleet.max_deliveries})"
        )
    return None


def isolate(works: Sequence[Work], fleet: FleetSettings) -> tuple[list[Work], list[Work]]:
    """``works`` split into those handled together and the suspects, each to be handled
    alone after them, least often alone first."""
    limit = fleet.isolate_after_prestart_deaths
    together = [w for w in works if w.prestart_deaths < limit]
    alone = sorted((w for w in works if w.prestart_deaths >= limit), key=lambda w: w.alone_before)
    return together, alone
