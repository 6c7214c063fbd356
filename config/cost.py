"""What a result's GPU time costs: a worker's price per GPU-hour, in integer micro-cents.

Money is kept in micro-cents (``ucents``: 1e-6 of a cent, 1e-8 of a currency unit) and GPU
time in microseconds, both integers: a result's cost is one integer, the settle script adds
those integers to the usage counters, so the sum of a job's results equals its usage exactly
(no float drift, whatever the order). Amounts are formatted to the cent only at the edges
(``vlmq usage``, ``vlmq status``, the API).

A result's cost is ``price x GPU-seconds``, rounded half up to the micro-cent once per
result; at 2.50 per hour one micro-cent is 14.4 ns of GPU time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vlmq.config.settings import CostSettings

__all__ = [
    "UCENTS_PER_CENT",
    "UCENTS_PER_UNIT",
    "US_PER_HOUR",
    "Pricing",
    "apportion",
    "cents",
    "per_thousand",
]

UCENTS_PER_CENT = 1_000_000
UCENTS_PER_UNIT = 100 * UCENTS_PER_CENT
US_PER_HOUR = 3_600 * 1_000_000


@dataclass(frozen=True)
class Pricing:
    """One worker's price: micro-cents per GPU-hour, its currency and its GPU's name."""

    ucents_per_hour: int = 0
    currency: str = "USD"
    gpu: str = "cpu"

    @classmethod
    def of(cls, settings: CostSettings, gpu: str) -> Pricing:
        """From the settings; ``gpu``: the name detected (settings.gpu_name wins)."""
        return cls(
            ucents_per_hour=round(settings.gpu_hour_price * UCENTS_PER_UNIT),
            currency=settings.currency,
            gpu=settings.gpu_name or gpu,
        )

    @property
    def gpu_hour_price(self) -> float:
        return self.ucents_per_hour / UCENTS_PER_UNIT

    def ucents(self, gpu_us: int) -> int:
        """The cost of ``gpu_us`` microseconds of GPU time, rounded half up."""
        return (self.ucents_per_hour * max(0, gpu_us) + US_PER_HOUR // 2) // US_PER_HOUR

    def charge(self, gpu_us: int, basis: str) -> dict[str, Any]:
        """A result's ``cost`` field. ``basis``: 'device' (the engine measured the GPU's own
        time) or 'model' (model seconds: the engine's wall time in the model)."""
        return {
            "gpu_s": gpu_us / 1e6,
            "gpu_us": gpu_us,
            "ucents": self.ucents(gpu_us),
            "currency": self.currency,
            "gpu_hour_price": self.gpu_hour_price,
            "gpu": self.gpu,
            "basis": basis,
        }

    def record(self) -> dict[str, Any]:
        """What the worker record says of it."""
        return {"gpu": self.gpu, "gpu_hour_price": self.gpu_hour_price, "currency": self.currency}


def apportion(total: int, weights: Sequence[int]) -> list[int]:
    """Split the integer ``total`` in proportion to ``weights``, summing to ``total`` exactly
    (largest remainder; ties to the earlier share). All weights zero: equal shares."""
    if not weights:
        return []
    weights = [max(0, int(w)) for w in weights]
    whole = sum(weights)
    if whole == 0:
        weights, whole = [1] * len(weights), len(weights)
    shares = [total * w // whole for w in weights]
    left = total - sum(shares)
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(total * weights[i] % whole), i))
    for i in by_remainder[:left]:
        shares[i] += 1
    return shares


def cents(ucents: int) -> str:
    """Micro-cents as currency units to the cent ('12.34'), rounded half up."""
    whole = (int(ucents) + UCENTS_PER_CENT // 2) // UCENTS_PER_CENT
    sign = "-" if whole < 0 else ""
    whole = abs(whole)
    return f"{sign}{whole // 100}.{whole % 100:02d}"


def per_thousand(ucents: int, requests: int) -> int:
    """Micro-cents per 1,000 requests (0 with no request)."""
    if requests <= 0:
        return 0
    return (int(ucents) * 1000 + requests // 2) // requests
