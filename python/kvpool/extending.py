"""``KVPool.extend``: the per-step call that grows requests and writes their new slots
into ``req_to_token``, and its roll-back when what runs after the core's commit (the
device table update, a copy-on-write copy, a host tier's transfer) fails."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpool._forksafe import acquire_interruptible
from kvpool.packed import PackedExtend
from kvpool.row_edits import lengths_before
from kvpool.sharing import apply_cow
from kvpool.tables import ExtendResult, update_req_to_token

__all__ = ["ExtendOps"]


class ExtendOps:
    """Mixed into ``KVPool``; uses its lock, allocator, tables and transfer runner."""

    allocator: Any
    req_to_token: Any
    _lock: Any
    _to_device: Any  # the pinned ring's copy (CUDA); None on CPU
    _enter_device_call: Any
    _table_np: np.ndarray | None  # the CPU req_to_token as numpy; None on a device
    _sharing: bool
    _transfers: Any  # the host tier's TransferRunner (None without a tier)
    _run_transfers: Any
    _own_result: Any


    def extend(self, handles: Any, counts: Any, tokens: Any = None) -> ExtendResult:
        """Grow requests by ``counts`` tokens and write their new slots into ``req_to_token``.
        See ``SlotAllocator.extend`` (the pool passes its own ``table``, ``cow``
        and ``out``; ``tokens`` is the allocator's); holds the pool's lock.

        The pool adds: one crossing into the core, then on CPU nothing more (the
        core writes the host table in place), on CUDA one host -> device copy and
        one table-kernel launch, with no device sync. When a request writes into
        a page another request holds (after ``fork``, or a ``truncate`` into a
        shared page), the copy-on-write copy runs here with ``copy_slots`` over
        every layer, and the table is updated, before this returns. A page only
        the prefix cache shares is written in place instead: its registration
        is dropped, so later prompts no longer hit it.

        Returns:
            ``ExtendResult(slots, out_cache_loc)``: the new slots flattened in
            request order, as a host int64 array and as an int64 tensor on the
            pool's device.

        Raises:
            TensorDeviceError: called while a CUDA graph is being captured on the
                pool's device (its host -> device copy cannot be captured).
            Atomic as the allocator's call, the table included. If the device
            table update, a copy-on-write copy or a host tier's transfer fails after
            the allocator committed (CPU or device), the requests are shortened back to
            their old lengths, keeping their prompts (``SlotAllocator.roll_back_extend``).
        """
        # acquire/release rather than `with`: this is the per-step call, and on CPython
        # the context-manager protocol costs more than the lock itself.
        lock = self._lock
        acquire_interruptible(lock)
        try:
            if self._to_device is not None:  # CUDA (staged through the pinned ring)
                self._enter_device_call("extend")
            if self._table_np is not None:  # CPU: the core wrote the table rows
                if tokens is None and not self._sharing:
                    slots, cow = self.allocator.extend(handles, counts, table=self._table_np), None
                else:
                    slots, cow = self.allocator.extend(handles, counts, table=self._table_np, tokens=tokens,
                                                       cow=True)
                try:  # (free on CPython 3.11+ when nothing raises: this is the per-step path)
                    if self._transfers is not None:
                        self._run_transfers()
                    if cow is not None:
                        apply_cow(self, cow, table_written=True)
                        cow = None  # copied: a roll-back has nothing left to copy
                    return self._own_result(slots)
                except BaseException:
                    # As on a device: the rows named pages whose bytes never came (a copy on
                    # write, an eviction's offload), and the caller never got the slots.
                    self._roll_back_extend(handles, lengths_before(self.allocator, handles, counts), cow,
                                           table_written=True)
                    raise
            packed, num_requests, cow = self.allocator.extend_packed(handles, counts, tokens=tokens)
            try:
                slots, dev = update_req_to_token(self.req_to_token, packed, num_requests, self._to_device)
                if self._transfers is not None:
                    self._run_transfers()
                # Inside the roll-back's reach too: its table write names the moved
                # positions' new slots, and a failed one would leave rows naming pages
                # the request no longer holds.
                apply_cow(self, cow, table_written=False)
            except BaseException:
                self._roll_back_extend(handles, PackedExtend.parse(packed, num_requests).starts, cow,
                                       table_written=False)
                raise
            return self._own_result(slots, dev)
        finally:
            lock.release()

    def _roll_back_extend(self, handles: Any, starts: np.ndarray, cow: np.ndarray | None, table_written: bool) -> None:
        """Undo a committed extend whose table update, copy or transfer failed (a CUDA OOM
        or launch error, a host tier's copy).

        Shortening to the old lengths ``starts`` with ``roll_back_extend``, last request
        first, pushes back exactly the pages taken, restoring the free stack's
        order (extend popped them first request first). A request whose shared
        last page was copied on write keeps its private copy, so that copy is run
        first (best effort: the device has just failed once). Cached pages the
        batch evicted stay evicted; their Removed events were already emitted.
        """
        try:
            self._run_transfers()  # the evictions' offloads: their host pages now hold those entries
            apply_cow(self, cow, table_written=table_written)
        except BaseException:  # noqa: BLE001 - the original error is the one to raise
            pass
        hs = np.asarray(handles, dtype=np.int64).reshape(-1)
        # Not truncate: that would make a prefix hit forget the rest of its prompt, and the
        # retried extend would then leave those positions unknown and uncacheable.
        self.allocator.roll_back_extend(hs[::-1].copy(), np.asarray(starts, dtype=np.int64)[::-1].copy())
