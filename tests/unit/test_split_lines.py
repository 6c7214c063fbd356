"""``split_lines``: the lines of a chunked stream with resumable offsets, whatever the
chunk boundaries, in time linear in the line length."""

from __future__ import annotations

import time
from itertools import pairwise

from hypothesis import given
from hypothesis import strategies as st

from vlmq.stores.base import split_lines


def _chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    bounds = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    return [data[a:b] for a, b in pairwise(bounds)]


def _expected(data: bytes) -> list[bytes]:
    lines = data.split(b"\n")
    return lines[:-1] if lines[-1] == b"" else lines


@given(
    data=st.binary(max_size=300).map(lambda b: b.replace(b"\x00", b"\n")),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=20),
)
def test_lines_and_offsets_whatever_the_chunks(data, cuts):
    found = list(split_lines(iter(_chunked(data, cuts))))
    assert [line for _, line in found] == _expected(data)
    for offset, line in found:
        # The offset is just past the line and its newline (the last line may have none).
        begin = offset - len(line) - 1
        with_newline = begin >= 0 and data[begin:offset] == line + b"\n"
        last_without = offset == len(data) and data.endswith(line) and not data.endswith(b"\n")
        assert with_newline or last_without
        # Resuming there gives exactly the lines after it.
        later = [x for _, x in split_lines(iter([data[offset:]]), offset)]
        assert later == _expected(data[offset:])
    assert not found or found[-1][0] == len(data)


def test_a_long_line_across_many_chunks_costs_linear_time():
    chunk = b"x" * 64 * 1024
    chunks = [chunk] * 2048 + [b"\nend"]  # one 128 MiB line, then a short one
    started = time.monotonic()
    found = list(split_lines(iter(chunks)))
    elapsed = time.monotonic() - started
    assert [len(line) for _, line in found] == [len(chunk) * 2048, 3]
    assert found[0][0] == len(chunk) * 2048 + 1
    # Linear: well under a second; copying the pending line per chunk takes minutes.
    assert elapsed < 10, f"{elapsed:.1f} s"
