"""Triton kernel of ``kvpool.kernels.write_req_to_token`` (imported on the first launch only):
req_to_token[rows[i], starts[i] : starts[i] + counts[i]] =
slots[offsets[i] : offsets[i] + counts[i]] for every request i, in one launch.

`slots` holds the new slots of all requests back to back, in request order (what
SlotAllocator.extend returns). offsets is the exclusive prefix sum of counts;
pass it if you have it (e.g. computed on the host with the counts), otherwise
each program sums the counts before its own on device — O(B) per program, which
for decode/prefill batch sizes is far cheaper than a separate scan launch, and
needs no host sync. Requests with a negative row or a count <= 0 are skipped
(their count, if positive, still occupies its span of `slots`).
"""

# No `from __future__ import annotations` here: Triton 3.0's interpreter (TRITON_INTERPRET=1)
# treats a parameter as constexpr only if its annotation is the tl.constexpr class, not a string
# (tests/test_review_dependency_floors.py).

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from kvpool.kernels.launch import CompiledLaunch, Plan, launch_planned


@triton.jit
def _write_req_to_token_kernel(
    table_ptr, rows_ptr, starts_ptr, counts_ptr, offsets_ptr, slots_ptr,
    B, stride_row, rows_st, starts_st, counts_st, offsets_st, slots_st,
    HAS_OFFSETS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK: tl.constexpr,
):
    # The index tensors may be any 1-D views (columns of a batch tensor): element i
    # of each is at i * its stride.
    i = tl.program_id(0).to(tl.int64)
    if HAS_OFFSETS:
        offset = tl.load(offsets_ptr + i * offsets_st).to(tl.int64)
    else:
        acc = tl.zeros([BLOCK_B], dtype=tl.int64)
        for j in range(0, B, BLOCK_B):
            idx = j + tl.arange(0, BLOCK_B)
            cnt = tl.load(counts_ptr + idx.to(tl.int64) * counts_st, mask=idx < i, other=0).to(tl.int64)
            acc += tl.maximum(cnt, 0)
        offset = tl.sum(acc, axis=0)
    row = tl.load(rows_ptr + i * rows_st).to(tl.int64)
    start = tl.load(starts_ptr + i * starts_st).to(tl.int64)
    # int32 loop bound: counts fit, and it keeps the loop induction variable 32-bit.
    count = tl.load(counts_ptr + i * counts_st).to(tl.int32)
    count = tl.where(row >= 0, count, 0)
    dst = table_ptr + row * stride_row + start
    src = slots_ptr + offset * slots_st
    for k in range(0, count, BLOCK):
        idx = k + tl.arange(0, BLOCK)
        m = idx < count
        s = tl.load(src + idx.to(tl.int64) * slots_st, mask=m)
        tl.store(dst + idx, s.to(table_ptr.dtype.element_ty), mask=m)


_LAUNCH = CompiledLaunch(_write_req_to_token_kernel)
_PLANS: dict[tuple, Plan] = {}  # plan key -> plan (kvpool.kernels.launch)


def launch_write_req_to_token(
    req_to_token: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor,
    slots: torch.Tensor, offsets: torch.Tensor | None,
) -> None:
    """One launch of the table kernel; arguments validated by
    ``kvpool.kernels.write_req_to_token``.

    A device pool's ``extend`` makes this launch at every step. Its plan key holds what
    Triton specialises on (``kvpool.kernels.launch``): dtypes, exact strides, the batch
    size's value class and BLOCK_B, each pointer's 16-byte alignment and the device, so
    after a key's first launch its compiled kernel is launched directly."""
    b = rows.shape[0]
    offs = offsets if offsets is not None else counts  # (read only with HAS_OFFSETS)
    # BLOCK_B only sizes the on-device prefix sum; with host offsets it is unused,
    # so keep it fixed rather than compiling a new variant per power-of-two batch size.
    block_b = min(max(triton.next_power_of_2(b), 16), 1024) if offsets is None else 16
    head = (req_to_token, rows, starts, counts, offs, slots)
    key = _table_key(req_to_token, tuple((t.dtype, t.stride(0), t.data_ptr() % 16 == 0) for t in head[1:]),
                     offsets is not None, block_b, b)
    launch_planned(_LAUNCH, _write_req_to_token_kernel, _PLANS, key,
                   lambda: _plan(req_to_token, rows, starts, counts, offs, slots, offsets is not None, block_b),
                   head, b, req_to_token.is_cuda)


def _table_key(req_to_token: torch.Tensor, parts: tuple, has_offsets: bool, block_b: int, b: int) -> tuple:
    """A table launch's plan key, the one definition of it (``launch_write_req_to_token`` and
    ``launch_packed_kept``): ``parts`` is (dtype, stride, 16-byte aligned) of rows, starts,
    counts, offsets and slots; the device index last (``launch_planned`` launches on ``key[-1]``)."""
    return (req_to_token.dtype, req_to_token.stride(0), req_to_token.data_ptr() % 16 == 0, parts,
            has_offsets, block_b, b == 1, b % 16 == 0, b >= 1 << 31, req_to_token.get_device())


def _plan(req_to_token: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor,
          offs: torch.Tensor, slots: torch.Tensor, has_offsets: bool, block_b: int) -> Plan:
    tail = (req_to_token.stride(0), rows.stride(0), starts.stride(0), counts.stride(0), offs.stride(0),
            slots.stride(0), has_offsets, block_b, 1024)  # ..., HAS_OFFSETS, BLOCK_B, BLOCK
    return tail, 1, 1, 4  # one program per request, 4 warps


# The parts of a packed array as the views' key names them (int64, unit stride, as aligned as
# the array), by the array's alignment.
_PACKED_PARTS = {aligned: ((torch.int64, 1, aligned),) * 5 for aligned in (False, True)}


def launch_packed_kept(req_to_token: torch.Tensor, packed: torch.Tensor, b: int, seg: int) -> bool:
    """The table write of a pool's own ``extend_packed`` array on the device (``packed``: int64,
    contiguous, parts ``[rows | starts | counts | offsets]`` of ``b`` entries each ``seg`` apart,
    then the slots), through the kernel kept for it, with the parts' addresses: no view of
    ``packed`` is made. False, with nothing launched, where the caller must take
    ``launch_write_req_to_token`` with the parts as tensors (the first launch of a key, the
    codegen tests' recorder, anything ``CompiledLaunch.launch_kept`` declines).

    Five views of a device tensor cost a CUDA pool's ``extend`` ~9 µs of host time a step on a
    2-core Xeon VM, more than the rest of the launch. The key is the one
    ``launch_write_req_to_token`` builds for those views (int64, unit stride, offsets given,
    BLOCK_B 16; every part as aligned as ``packed``, since ``seg`` is even), so the kernel kept
    under it is the one that call compiled for them."""
    if _write_req_to_token_kernel is not _LAUNCH.fn or packed.dtype != torch.int64 or packed.stride(0) != 1:
        return False
    base = packed.data_ptr()
    key = _table_key(req_to_token, _PACKED_PARTS[base % 16 == 0], True, 16, b)
    plan = _PLANS.get(key)
    if plan is None:
        return False
    tail, rows, grid_y, _ = plan
    step = 8 * seg
    args = (req_to_token, base, base + step, base + 2 * step, base + 3 * step, base + 4 * step, b) + tail
    return _LAUNCH.launch_kept(key, (-(-b // rows), grid_y), args, key[-1])
