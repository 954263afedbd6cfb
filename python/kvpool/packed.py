"""Packed int64 arrays: several int64 parts in one array, each part starting on a
16-byte boundary, so one host -> device copy carries them all.

The alignment matters on the device: Triton specializes a kernel on whether each
pointer argument is 16-byte aligned, so a part that started at an odd int64
offset whenever a batch size changed parity would compile a new kernel variant
while serving.

``SlotAllocator.extend_packed`` / ``admit_packed`` return one such array laid out
as ``[rows | starts | counts | offsets | slots]``: the first four parts are
``num_requests`` long, each padded to ``segment_len(num_requests)``; ``slots``
fills the rest. ``PackedExtend.parse`` names those parts; ``pack`` / ``unpack``
build and split arrays of any parts the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = ["PackedExtend", "pack", "segment_len", "slots_start", "unpack"]


def segment_len(n: int) -> int:
    """Room a part of ``n`` int64s takes: ``n`` rounded up to even (16 bytes)."""
    return n + (n & 1)


def slots_start(num_requests: int) -> int:
    """Where ``slots`` begins in an ``extend_packed`` array of ``num_requests`` requests."""
    return 4 * segment_len(num_requests)


class PackedExtend(NamedTuple):
    """The parts of an ``extend_packed`` / ``admit_packed`` array, as views of it.

    ``rows[i]`` is request ``i``'s row of ``req_to_token``, ``starts[i]`` its
    length before the call, ``counts[i]`` the tokens it grew by, ``offsets[i]``
    where its new slots begin in ``slots`` (the prefix sum of ``counts``).
    """

    rows: Any
    starts: Any
    counts: Any
    offsets: Any
    slots: Any

    @classmethod
    def parse(cls, packed: Any, num_requests: int) -> PackedExtend:
        """Views of ``packed`` (a numpy array or a tensor, host or device) for a
        batch of ``num_requests`` requests; nothing is copied."""
        n, s = num_requests, segment_len(num_requests)
        # Five slices: on a device tensor, every view is a torch op on the step's
        # path, and a [4, s] view unpacked row by row would take seven.
        return cls(packed[:n], packed[s : s + n], packed[2 * s : 2 * s + n], packed[3 * s : 3 * s + n],
                   packed[4 * s :])


def pack(parts: Sequence[np.ndarray]) -> tuple[np.ndarray, list[int]]:
    """``parts`` (int64) in one zero-padded array, each starting on a 16-byte
    boundary; returns the array and each part's start."""
    starts = np.cumsum([0] + [segment_len(len(p)) for p in parts]).tolist()
    out = np.zeros(starts[-1], dtype=np.int64)
    for p, lo in zip(parts, starts):
        out[lo : lo + len(p)] = p
    return out, starts[:-1]


def unpack(packed: Any, starts: Sequence[int], lengths: Sequence[int]) -> list[Any]:
    """The parts ``pack`` placed at ``starts``, as views of ``packed`` (or of its device copy)."""
    return [packed[lo : lo + n] for lo, n in zip(starts, lengths)]
