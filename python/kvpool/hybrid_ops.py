"""Request operations of a hybrid ``KVPool`` (``kvpool.hybrid``); its queries are
``HybridQueries`` (``kvpool.hybrid_queries``).

Each is one call into the core's ``GroupedAllocator`` (all groups at once,
atomic, typed errors with nothing changed), holding the pool's lock for calls
that change ownership, followed by what the torch side owes the core: the new
slots into each group's table, and the copies the core queued (copy-on-write,
state zeroing, forks, checkpoints, restores), run before the call returns. The
table rows are written by ``HybridTables`` (``kvpool.hybrid_tables``), the copies
run by ``HybridCopies`` (``kvpool.hybrid_copies``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from kvpool._core import InvalidArgumentError
from kvpool.handle_args import frozen_handles
from kvpool.row_edits import lengths_before
from kvpool.staging import pool_to_device
from kvpool.streams import refuse_capture
from kvpool.validate import check_flag, check_layer

__all__ = ["HybridExtendResult", "HybridRequestOps"]


class HybridExtendResult(NamedTuple):
    """New slots of an ``extend``, per group (``pool.groups`` order; empty for a state group):
    host int64 arrays and int64 tensors on the pool's device. ``for_layer`` picks a layer's."""

    slots: list[np.ndarray]
    out_cache_loc: list[torch.Tensor]
    group_of_layer: tuple[int, ...]

    def for_layer(self, layer: int) -> torch.Tensor:
        """The new slots of ``layer``'s group, on the pool's device.

        Raises:
            LayerIndexError: ``layer`` is not an int in ``[0, num_layers)``.
        """
        return self.out_cache_loc[self.group_of_layer[check_layer(layer, len(self.group_of_layer))]]


def _refuse_priorities(priority: Any, retain_s: Any) -> None:
    # The plain pool's cache / close take these; an engine moved to a hybrid model
    # should hear why they do nothing here, not get a TypeError.
    if priority is not None or retain_s is not None:
        raise InvalidArgumentError(
            "retention priorities (priority=, retain_s=) are the plain pool's only: a pool built "
            "with layer_types evicts least recently used first; pass neither")


def _refuse_duplicates(handles: np.ndarray) -> None:
    seen: set[int] = set()
    for i, h in enumerate(handles.tolist()):
        if h in seen:
            raise InvalidArgumentError(f"handle {h} appears more than once in the batch (again at index {i}); "
                                       "name each request once")
        seen.add(h)


class HybridRequestOps:
    """Mixin: ``HybridKVPool``'s request operations (open, extend, admit, truncate, close, cache, ...)."""

    allocator: Any
    group_of_layer: tuple[int, ...]
    device: torch.device
    _lock: Any
    _tables_np: list[np.ndarray | None] | None
    _run_copies: Any
    _write_new_rows: Any
    group: Any
    _scatter: Any  # (the table rows: kvpool.hybrid_tables)
    _null_released: Any
    _forget_nulled: Any
    _rewrite_windows: Any
    _order: Any  # the CopyOrder of a CUDA pool; None on CPU
    _to_device: Any  # the pinned ring's copy (CUDA); None on CPU
    _open_copies: bool
    _note_edit: Any  # (kvpool.row_edits)

    def _enter_device_call(self, what: str) -> None:
        """Start of a call that copies host data to the device and hands out slots (the
        lock is held; CUDA only): refused during capture, before the core changes anything
        (its copies would fail there with the core committed), and the caller's stream
        waits for the copies made earlier on another."""
        refuse_capture(self.device, what)
        if self._order is not None:
            self._order.wait()

    # ----- request operations -------------------------------------------------

    def open(self, n: int = 1) -> np.ndarray:
        """Open ``n`` empty requests in every group (a state slot each, zeroed).
        See ``GroupedAllocator.open``."""
        with self._lock:
            if self._order is not None and self._open_copies:
                self._enter_device_call("open")
            handles = self.allocator.open(n)
            self._run_copies()
            self._forget_nulled(handles)
            return handles

    def _result(self, slots: list[np.ndarray]) -> HybridExtendResult:
        # Normal tensors even under inference mode, as the plain pool's: an engine may edit
        # them in place (padding) outside it.
        with torch.inference_mode(False):
            if self._to_device is None:
                loc = [torch.from_numpy(s) for s in slots]
            else:  # one copy through the pinned ring, as the plain pool's: nothing waits
                loc = pool_to_device(self, *slots)
        return HybridExtendResult(slots, loc, self.group_of_layer)

    def extend(self, handles: Any, counts: Any, tokens: Any = None) -> HybridExtendResult:
        """Grow requests by ``counts`` tokens in every group and write the new slots
        into each group's table; sliding groups release the pages that fell out
        of the window. See ``GroupedAllocator.extend``. Copy-on-write copies run
        here. Atomic as the core's call; if the device table write or a copy fails
        after the core committed (a CUDA OOM or launch error), the requests are
        rolled back where every group can (``_roll_back_extend``)."""
        handles = frozen_handles(handles)  # (read again after the core commits: convert once)
        with self._lock:
            if self._order is not None:
                self._enter_device_call("extend")
            if self._tables_np is not None:  # CPU: the core wrote the table rows
                slots = self.allocator.extend(handles, counts, tokens=tokens, tables=self._tables_np)
                try:
                    self._run_copies(handles)
                    return self._result(slots)
                except BaseException:  # as on a device (a copy on write whose bytes never came)
                    h = np.asarray(handles, dtype=np.int64).reshape(-1)
                    self._roll_back_extend(h, lengths_before(self.allocator, h, counts))
                    raise
            # The core checks the handles first (typed): converted unchecked, a str or a
            # ragged list is numpy's error, and float handles round into other ones.
            starts = self.allocator.lengths(handles)
            h = np.asarray(handles, dtype=np.int64).reshape(-1)
            slots = self.allocator.extend(h, counts, tokens=tokens)
            try:
                c = np.broadcast_to(np.asarray(counts, dtype=np.int64), h.shape)
                self._scatter(h, starts, c, slots)
                # The core releases window pages only of requests that grow: a count-0
                # request still holds them, and its row must keep their slots.
                grow = c > 0
                self._null_released(h[grow], starts[grow])
                self._run_copies(handles)
            except BaseException:
                self._roll_back_extend(h, starts)
                raise
            return self._result(slots)

    def _roll_back_extend(self, handles: np.ndarray, starts: np.ndarray) -> None:
        """Undo a committed extend whose device table write or copy failed (a CUDA OOM or
        launch error), as the plain pool does, where every group can: a sliding group takes
        back the window pages it released, a state group needs a checkpoint at the old
        length. Best effort, the original error being the one to raise: where a group
        cannot, the requests keep their new length and their rows past the failure read as
        the null page (docs/hybrid.md: close them)."""
        try:
            self.allocator.roll_back_extend(handles, starts)
            self._note_edit(handles)
            self._run_copies(handles)
            self._rewrite_windows(handles)
        except BaseException:  # noqa: BLE001 - the extend's error is the one to raise
            pass

    def _close_unreturned(self, handles: np.ndarray) -> None:
        """Close requests the core opened for a call whose table write or copy then failed:
        the caller never gets their handles, so nothing else would (best effort). Emptied
        first, last request first, so their pages go back on the free stacks in their old
        order, as the plain pool's; their copies not run yet are moot."""
        self._unrun = ()
        try:
            back = np.asarray(handles, dtype=np.int64).reshape(-1)[::-1].copy()
            self.allocator.truncate(back, np.zeros(back.shape[0], dtype=np.int64))
            self.allocator.close(back)
            self._note_edit(back)
        except BaseException:  # noqa: BLE001 - the call's error is the one to raise
            try:  # (an emptying the core refused: close them as they are)
                self.allocator.close(handles)
                self._note_edit(handles)
            except BaseException:  # noqa: BLE001
                pass

    def admit(self, counts: Any, tokens: Any = None) -> tuple[np.ndarray, HybridExtendResult]:
        """Open ``len(counts)`` requests and extend each (``open`` then ``extend``, atomic).
        See ``GroupedAllocator.admit``."""
        with self._lock:
            if self._order is not None:
                self._enter_device_call("admit")
            if self._tables_np is not None:
                handles, slots = self.allocator.admit(counts, tokens=tokens, tables=self._tables_np)
                try:
                    self._run_copies(handles)
                    return handles, self._result(slots)
                except BaseException:  # the caller never gets the handles
                    self._close_unreturned(handles)
                    raise
            handles, slots = self.allocator.admit(counts, tokens=tokens)
            try:
                c = np.asarray(counts, dtype=np.int64).reshape(-1)
                self._forget_nulled(handles)
                self._scatter(handles, np.zeros_like(c), c, slots)
                self._run_copies(handles)
            except BaseException:
                self._close_unreturned(handles)
                raise
            return handles, self._result(slots)

    def truncate(self, handles: Any, lengths: Any) -> None:
        """Shorten requests in every group. See ``GroupedAllocator.truncate``: a sliding
        group needs the new length's window still held or still cached (taken back, and
        its table rows rewritten here), a state group a checkpoint at exactly the new
        length (restored here); otherwise ``RollbackUnavailableError`` and nothing changes."""
        handles = frozen_handles(handles)  # (read again after the core commits: convert once)
        with self._lock:
            if self._order is not None:  # the rows rewritten and states restored are device copies
                self._enter_device_call("truncate")
            self.allocator.truncate(handles, lengths)
            self._note_edit(handles)
            self._run_copies(handles)
            self._rewrite_windows(handles)

    def _truncate_keeping_prompts(self, handles: Any, lengths: Any) -> None:
        """``truncate`` that leaves each request the prompt it was opened with
        (``GroupedAllocator.roll_back_extend``), under the pool's lock: a request cut back
        inside its prompt takes the prompt's token ids again as it extends past the cut,
        so ``cache`` publishes those positions as the prompt's in every group. The same
        window and checkpoint rules as ``truncate`` (a state group's slot is restored to
        the state at the cut here)."""
        handles = frozen_handles(handles)  # (read again after the core commits: convert once)
        with self._lock:
            if self._order is not None:
                self._enter_device_call("truncate")
            self.allocator.roll_back_extend(handles, lengths)
            self._note_edit(handles)
            self._run_copies(handles)
            self._rewrite_windows(handles)

    def close(self, handles: Any, cache: bool = False, priority: Any = None, retain_s: Any = None) -> None:
        """Close requests in every group. See ``GroupedAllocator.close``.
        ``priority`` / ``retain_s`` must be None, and ``cache=True`` is refused during
        capture as ``cache`` is: see ``cache``."""
        _refuse_priorities(priority, retain_s)
        cache = check_flag("cache", cache)  # (an array's truth value raised untyped)
        handles = frozen_handles(handles)  # (read again after the core commits: convert once)
        with self._lock:
            if cache and self._order is not None and self._open_copies:
                self._enter_device_call("close")  # state checkpoints: copies, as cache()'s
            self.allocator.close(handles, cache=cache)
            self._note_edit(handles)
            self._run_copies()

    def cache(self, handles: Any, priority: Any = None, retain_s: Any = None) -> None:
        """Publish requests' full pages (and state checkpoints) in every group.
        See ``GroupedAllocator.cache``; the checkpoint copies run here.

        Raises:
            InvalidArgumentError: a ``priority`` or ``retain_s``: a hybrid pool
                keeps no retention priorities (nothing is published).
            TensorDeviceError: a CUDA pool with state groups while its device is
                capturing a CUDA graph (as ``close(cache=True)``); nothing changed.
        """
        _refuse_priorities(priority, retain_s)
        with self._lock:
            if self._order is not None and self._open_copies:
                # A state group's checkpoints are device copies: inside a capture they would
                # only be recorded, and the core would register slots never written.
                self._enter_device_call("cache")
            self.allocator.cache(handles)
            self._run_copies()

    def unpin(self, handles: Any) -> int:
        """The plain pool's ``unpin``, for engine code shared by both pools: a hybrid pool
        pins nothing (``cache`` refuses ``priority=``), so once the handles are checked as
        the plain pool checks them this unpins no page and returns 0.

        Raises:
            InvalidHandleError: a handle is unknown, closed or stale.
            InvalidArgumentError: a duplicate handle.
        """
        with self._lock:
            self.allocator.lengths(handles)  # the handles' own typed errors
            _refuse_duplicates(np.asarray(handles).reshape(-1))
        return 0

    def set_clock(self, now: float) -> None:
        """Refused (``InvalidArgumentError``), as on a plain pool without ``manual_clock=True``:
        a hybrid pool keeps no retention priorities, so it has no clock to set."""
        raise InvalidArgumentError(
            f"set_clock({now!r}): a pool built with layer_types keeps no retention priorities and "
            "runs on no clock of its own; manual_clock=True and set_clock are the plain pool's only")

    def fork(self, handle: Any, n: int = 1) -> np.ndarray:
        """``n`` copies of a request in every group (shared pages; state copied here).
        See ``GroupedAllocator.fork``."""
        handle = frozen_handles(handle)  # (read again after the core commits: convert once)
        with self._lock:
            if self._order is not None:
                self._enter_device_call("fork")
            handles = self.allocator.fork(handle, n)
            self._note_edit(handle)
            self._fill_new_rows(handles)
            return handles

    def open_with_prefix(self, tokens: Any, lengths: Any, salt: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """Open requests on their longest prefix every group has cached (state restored
        from its checkpoint here). See ``GroupedAllocator.open_with_prefix``."""
        with self._lock:
            if self._order is not None:
                self._enter_device_call("open_with_prefix")
            a = self.allocator
            counted = a.hit_tokens, a.miss_tokens
            handles, cached = a.open_with_prefix(tokens, lengths, salt=salt)
            try:
                self._fill_new_rows(handles)
            except BaseException:  # closed again: the hit rate must not count their prompts
                a._uncount_opens(a.hit_tokens - counted[0], a.miss_tokens - counted[1])
                raise
            return handles, cached

    def _fill_new_rows(self, handles: np.ndarray) -> None:
        """The copies and table rows of requests a fork or a prefix hit just opened; if they
        fail (a CUDA OOM or launch error), the requests are closed again and it raises."""
        try:
            self._run_copies()
            self._write_new_rows(handles)
        except BaseException:
            self._close_unreturned(handles)
            raise

    def evict(self, layer: int, n: int) -> int:
        """Evict up to ``n`` cached pages (checkpoints) of ``layer``'s group, LRU first."""
        with self._lock:
            return self.allocator.evict(self.group(layer).index, n)

    def clear_cache(self) -> None:
        """Drop every cached page and checkpoint of every group."""
        with self._lock:
            self.allocator.clear_cache()

    def reset(self) -> None:
        """Close every request in every group."""
        with self._lock:
            self.allocator.reset()
            self._note_edit(None)
            self._run_copies()
