"""The request-to-token table writes: ``write_req_to_token`` for callers (checked), and
``write_packed_table`` for a pool's own ``extend`` / ``admit`` (the core's values, trusted).

Split from ``ops`` (which re-exports ``write_req_to_token``): the same validate-then-one-backend
shape, for the table rather than K/V.
"""

from __future__ import annotations

import torch

from kvpool.kernels import _common as c
from kvpool.kernels import _ref
from kvpool.kernels._guard import on_device

__all__ = ["write_packed_kept", "write_packed_table", "write_req_to_token"]


def _check_table_spans(table: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor,
                       counts: torch.Tensor, slots: torch.Tensor, offsets: torch.Tensor | None = None) -> None:
    """Host (CPU) values of write_req_to_token: every written span inside the table,
    enough slots for the counts, and offsets (if given) their exclusive prefix sum. Torch would raise IndexError, wrap a start of -1 to the
    last column, or broadcast too few slots; the interpreter would write past the table."""
    r, cols = table.shape
    bad = rows >= r
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise c.KernelArgumentError(f"rows[{i}] = {int(rows[i])} is not a row of req_to_token: valid rows "
                                    f"are [0, {r}) (negative rows are skipped)")
    cnt = counts.long()
    live = (rows >= 0) & (cnt > 0)
    st = starts.long()
    # cnt > cols - st, not st + cnt > cols: int64 starts and counts near 2**62 would wrap the sum
    # negative and pass (the torch path then raised untyped, the interpreter wrote past the table).
    for mask, what in ((live & (st < 0), "starts[{i}] = {s}"),
                       (live & (st >= 0) & (cnt > cols - st), "starts[{i}] + counts[{i}] = {e}")):
        if bool(mask.any()):
            i = int(mask.nonzero()[0, 0])
            at = what.format(i=i, s=int(st[i]), e=int(st[i]) + int(cnt[i]))
            raise c.KernelArgumentError(f"{at} is outside the row: req_to_token has {cols} columns, so "
                                        f"a span [start, start + count) must lie in [0, {cols}]")
    cnt = cnt.clamp(min=0)
    # (a skipped request's count is not bounded by the row: past len(slots) alone, or summed, it
    # could wrap the int64 sum below to a small need)
    most = int(cnt.max()) if cnt.numel() else 0
    need = most if most > slots.shape[0] else int(cnt.sum())
    if need > slots.shape[0]:
        raise c.TensorShapeError(f"slots has {slots.shape[0]} entries, the counts need {need} (the spans of "
                                 "all requests back to back, skipped ones included)")
    if table.dtype == torch.int32 and slots.dtype == torch.int64 and need:
        wide = (slots[:need] > 2**31 - 1) | (slots[:need] < -(2**31))
        if bool(wide.any()):
            bad = int(wide.nonzero()[0, 0])
            raise c.KernelArgumentError(f"slots[{bad}] = {int(slots[bad])} does not fit the int32 req_to_token "
                                        "(it would wrap to another slot): use an int64 table, or slots below 2**31")
    if offsets is not None:
        # The kernel reads slots at offsets[i] as given; the torch path sums the counts
        # itself. Only the prefix sum makes both read the same slots, inside `slots`.
        want = torch.cumsum(cnt, 0) - cnt
        bad = offsets.long() != want
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise c.KernelArgumentError(f"offsets[{i}] = {int(offsets[i])}, but offsets must be the exclusive "
                                        f"prefix sum of counts (negative counts as 0): {int(want[i])} there")


def write_packed_table(req_to_token: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor,
                       counts: torch.Tensor, slots: torch.Tensor, offsets: torch.Tensor) -> None:
    """``write_req_to_token`` of a pool's own ``extend`` / ``admit``: the index tensors are the
    parts of the packed array its core made for this very table (``tables.update_req_to_token``),
    one device copy of values the allocator checked, so only the launch is left. A device
    pool makes it at every step, where the five index checks cost about 5 µs of host time."""
    if rows.shape[0] == 0 or slots.shape[0] == 0:
        return
    _table_write(req_to_token, rows, starts, counts, slots, offsets)


def write_packed_kept(req_to_token: torch.Tensor, packed: torch.Tensor, b: int, seg: int) -> bool:
    """``write_packed_table`` of a whole ``extend_packed`` array on a CUDA device, without
    views of it, through the kernel kept for its shape (``req_table.launch_packed_kept``);
    False, with nothing launched, where the caller must pass the parts as views."""
    if not req_to_token.is_cuda or b == 0 or packed.shape[0] == 4 * seg:
        return False
    from kvpool.kernels.req_table import launch_packed_kept

    with on_device(req_to_token.device):
        return launch_packed_kept(req_to_token, packed, b, seg)


def _table_write(req_to_token: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor,
                 slots: torch.Tensor, offsets: torch.Tensor | None) -> None:
    """The table write itself, its arguments checked (``write_req_to_token``) or the core's own."""
    if not c.use_triton(req_to_token):
        _ref.write_req_to_token_ref(req_to_token, rows, starts, counts, slots)
        return
    from kvpool.kernels.req_table import launch_write_req_to_token

    with on_device(req_to_token.device):
        launch_write_req_to_token(req_to_token, rows, starts, counts, slots, offsets)


def write_req_to_token(
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    starts: torch.Tensor,
    counts: torch.Tensor,
    slots: torch.Tensor,
    offsets: torch.Tensor | None = None,
) -> None:
    """Scatter each request's new slots into its row of the request-to-token table:
    ``req_to_token[rows[i], starts[i] : starts[i] + counts[i]] =
    slots[offsets[i] : offsets[i] + counts[i]]``, one launch for the batch.

    Args:
        req_to_token: int32/int64 [R, max_context_len] with unit column stride.
        rows, starts, counts: int32/int64 [B]. Requests with a negative row or a
            count <= 0 are skipped (a positive count still occupies its span of
            ``slots``).
        slots: int32/int64, the new slots of all requests back to back in request
            order (what ``SlotAllocator.extend`` returns), sum(counts) entries (not
            checked: that would read counts on the host).
        offsets: the exclusive prefix sum of counts (negative ones as 0), if the
            caller has it (saves the kernel summing counts on device); on the CPU
            anything else is a KernelArgumentError.
        Device values are trusted (start + count <= max_context_len): the pool
        validates them on the host with the allocator before calling. CPU values
        are checked (spans inside the table, enough slots).

    Raises:
        TensorShapeError, TensorDtypeError, TensorDeviceError, KernelArgumentError:
            a bad argument, or (CPU) a span past the table (nothing written).
        TritonUnavailableError: CUDA tensors and no usable Triton.
    """
    if (
        not isinstance(req_to_token, torch.Tensor)
        or req_to_token.layout is not torch.strided
        or req_to_token.dim() != 2
        or req_to_token.dtype not in c.INDEX_DTYPES
        or req_to_token.stride(1) != 1
    ):
        raise c.KernelArgumentError(
            "req_to_token must be a dense 2-D int32/int64 tensor with contiguous rows"
        )
    c.check_writable(req_to_token, "req_to_token")
    dev = req_to_token.device
    c.check_index(rows, "rows", dev)
    b = rows.shape[0]
    c.check_index(starts, "starts", dev, b)
    c.check_index(counts, "counts", dev, b)
    c.check_index(slots, "slots", dev)
    if offsets is not None:
        c.check_index(offsets, "offsets", dev, b)
    if b == 0:
        return
    if dev.type == "cpu":  # (before the empty-slots return: positive counts need slots)
        _check_table_spans(req_to_token, rows, starts, counts, slots, offsets)
    if slots.shape[0] == 0:
        return
    _table_write(req_to_token, rows, starts, counts, slots, offsets)
