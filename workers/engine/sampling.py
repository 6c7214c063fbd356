"""Token choice for a whole batch in tensor ops: greedy rows take the argmax, sampled rows draw
with their own temperature, top-p and seed, and nothing goes to the host.

A sampled row's draw is a function of its seed, its step and its logits only: one uniform number
per row and step comes from a counter-based hash of (seed, step), and the token is where that
number falls in the row's sorted, top-p filtered distribution (inverse CDF). A seeded request
therefore samples the same tokens whatever its batch-mates, whichever decode path runs it
(transformers' generate with ``RowSampler``, or the decode loop, eager or replayed as a CUDA
graph), and on whichever slot of the batch it sits.

The hash keeps every product below 2**63 (a 32-bit value times a constant below 2**31), so it is
the same in int64 on every device. Importing this module imports torch.
"""

from __future__ import annotations

import torch

__all__ = ["MIN_TEMPERATURE", "choose_tokens", "seed_words", "uniform"]

# Below this a temperature is greedy in effect; it keeps the division finite.
MIN_TEMPERATURE = 1e-5

_M32 = 0xFFFFFFFF
# Odd multipliers below 2**31 (a 32-bit value times one stays below 2**63 in int64).
_C1 = 0x7FEB352D
_C2 = 0x2C1B3C6D
_C3 = 0x297A2D39
_STREAM = 0x5BD1E995 & 0x7FFFFFFF


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche (lowbias32's shape), on int64 values in [0, 2**32)."""
    x = ((x ^ (x >> 16)) * _C1) & _M32
    x = ((x ^ (x >> 15)) * _C2) & _M32
    return x ^ (x >> 16)


def seed_words(seeds: torch.Tensor) -> torch.Tensor:
    """A row's 63-bit seed folded to one 32-bit key (int64 tensor in, int64 out)."""
    low = seeds & _M32
    high = (seeds >> 32) & _M32
    return _mix(_mix(low) ^ high)


def uniform(keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One float64 in [0, 1) per row, from its seed key and its step: 53 bits from two
    32-bit draws of the same counter."""
    counter = _mix(keys ^ ((steps * _C3) & _M32))
    high = _mix(counter ^ _STREAM) >> 11  # 21 bits
    low = _mix(counter)  # 32 bits
    return (high.double() * 4294967296.0 + low.double()) / 9007199254740992.0


def choose_tokens(
    logits: torch.Tensor,
    sampled: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    keys: torch.Tensor,
    steps: torch.Tensor,
) -> torch.Tensor:
    """One token per row: argmax where ``sampled`` is False, else a seeded draw.

    ``logits`` rows x vocab (after penalties and masks; -inf is never drawn); ``temperature``,
    ``top_p`` float per row; ``keys`` per-row seed keys (``seed_words``); ``steps`` the row's
    count of generated tokens. A sampled row with temperature 0 is greedy.
    """
    greedy = logits.argmax(dim=-1)
    scaled = logits.float() / temperature.clamp(min=MIN_TEMPERATURE).unsqueeze(1)
    probs = torch.softmax(scaled - scaled.max(dim=-1, keepdim=True).values, dim=-1)
    ordered, order = torch.sort(probs, dim=-1, descending=True)
    cumulative = torch.cumsum(ordered, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (always the top token).
    kept = ordered.masked_fill(cumulative - ordered > top_p.unsqueeze(1), 0.0)
    cumulative = torch.cumsum(kept, dim=-1)
    target = uniform(keys, steps).to(cumulative.dtype) * cumulative[:, -1]
    position = torch.searchsorted(cumulative, target.unsqueeze(1), right=True)
    position = position.clamp(max=logits.shape[-1] - 1)
    drawn = order.gather(1, position).squeeze(1)
    draw = sampled & (temperature > 0)
    return torch.where(draw, drawn, greedy)
