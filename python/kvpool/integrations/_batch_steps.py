"""A ``KVPoolCache`` batch's steps: ``begin_step`` extends every row by the step's tokens with
one pool call (or, inside a page the rows own, defers it) and brings the page table up to date;
``flush`` brings the core and the pool's caches up to the tokens the cache holds; ``check_edits``
follows pool calls the cache did not make. A mixin over ``BatchRequests``' state (``_requests``
has the whole story)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch

from kvpool.errors import ContextTooLongError, TensorDeviceError
from kvpool.integrations._pages import StepPages
from kvpool.integrations._pending import flush_locked, undo_flush
from kvpool.integrations._pool_views import index_tensor
from kvpool.integrations._row_checks import check_context, check_rows, refuse_broken
from kvpool.integrations._shared_rows import check_in_step
from kvpool.streams import current_raw_stream, refuse_capture

__all__ = ["BatchSteps"]


class BatchSteps:
    """The step half of ``BatchRequests``."""

    # BatchRequests' state this half reads (made by BatchRequests.__init__ and _set_handles).
    broken: str | None
    pool: Any
    device: torch.device
    cuda: bool
    heads: int
    head_dim: int
    handles: np.ndarray | None
    prefix_unstarted: bool
    length: int
    prefix_mode: bool
    _rows: torch.Tensor | None
    step_slots: np.ndarray | None
    new_slots: torch.Tensor | None
    before: int
    step_shape: tuple[int, ...]
    dst: tuple[Any, Any] | None
    later: bool
    slot_idx: torch.Tensor | None
    pages: StepPages | None
    host_extend: bool
    can_fast: bool
    fast: bool
    grad: bool
    batch: int
    _fresh: bool
    _shared: bool
    _edits: int
    _decode_slots: np.ndarray | None
    _handle_arg: Any
    layers: Sequence[Any]
    deferred: int
    unstored: list[np.ndarray]
    _moved: bool
    close: Callable[[], None]

    def begin_step(self, tokens: int, grad: bool | None = None) -> None:
        """Extend every row by ``tokens`` slots (all-or-nothing), bring the page table up to
        date and make the step's stores (``dst`` or ``new_slots``) and attention's K/V
        (``gather``). ``grad``: whether the step runs under grad mode (None: ask torch)."""
        assert self.handles is not None
        if self.broken is not None:  # (a reorder that lost rows: no step on what is left of them)
            self.check_broken("KVPoolCache.update")
        self.prefix_unstarted = False
        stream = None
        if self.cuda:
            # A deferred step makes no pool call, and a flush would be recorded into the graph
            # rather than run: refuse a capture before anything changes, as extend does.
            try:
                refuse_capture(self.device, "KVPoolCache.update")
            except TensorDeviceError:
                if self._fresh:  # (rows opened for this step: closed, as a refused extend does)
                    self.close()
                raise
            stream = current_raw_stream(self.device)
        self.grad = torch.is_grad_enabled() if grad is None else grad
        self.fast = self.can_fast and not self.grad
        check_in_step(self.layers, self.length, "a new forward")
        if getattr(self.pool, "_row_edits", 0) != self._edits:
            self.check_edits()  # (before the deferred steps' short way, which makes no pool call)
        try:
            check_context(self.pool, self.length, tokens)
        except ContextTooLongError:
            if self._fresh:  # (rows opened for this step: closed, as a refused extend does)
                self.close()
            raise
        pages = self.pages
        if tokens == 1 and pages is not None and pages.deferring:
            # Inside the page the rows last extended into: the token goes to the layer
            # buffers, and the core and the pool catch up at ``flush`` (one extend a page).
            before = self.before = self.length
            self.length = before + 1
            self.deferred += 1
            pages.take_deferred(before + 1)
            pages.steps_on = stream
            self.dst, self.later = None, True
            self.step_shape = (self.batch, self.heads, 1, self.head_dim)
            return
        caught_up = self.deferred
        if caught_up or self.unstored:
            self.flush()
        pool = self.pool
        if self.prefix_mode and self.length > 0:
            # The previous step has run, so its pages hold valid K/V: publish the
            # prompt's full pages for the next request that shares them.
            pool.cache(self.handles)
        with getattr(pool, "_lock", None) or nullcontext():
            # Checked again with the extend under the pool's lock: another thread's fork/truncate/close
            # of the rows since would go unseen (a table from before a copy on write, a stale length).
            if getattr(pool, "_row_edits", 0) != self._edits:
                self.check_edits()
                pages = self.pages
            # On a CPU pool the step needs only the host slots (stores go through views of the
            # caches, or the pool's index store with an index tensor StepPages makes).
            try:
                if not self.host_extend:
                    slots = None
                elif tokens == 1:
                    slots = pool._extend_host(self._handle_arg, 1, self._decode_slots)
                else:
                    slots = pool._extend_host(self.handles, tokens)
                if slots is None:
                    ext = pool.extend(self.handles, tokens)
                    slots, self.new_slots = ext.slots, ext.out_cache_loc
                else:
                    self.new_slots = None
            except BaseException:
                if caught_up:  # a refused step leaves the pool as it was, deferred steps included
                    undo_flush(self, caught_up)
                if self._fresh:
                    self.close()
                raise
        self._fresh = False
        self.step_slots = slots
        before = self.before = self.length
        length = self.length = before + tokens
        try:  # (free on CPython 3.11+ when nothing raises)
            if pages is None:
                assert self._rows is not None
                self.slot_idx = pool.req_to_token[self._rows, :length].long()
                return
            pages.advance(self.handles, before, length, slots)
            pages.steps_on = stream  # (after the flush above, which followed the earlier steps' stream)
            self.dst = pages.dst
            self.later = pages.later
            if pages.later:  # (a copy: a decode step's extend writes the next step's slots in place)
                self.unstored.append(slots.reshape(self.batch, tokens).copy())
            if self.dst is None and self.new_slots is None and not self.later:
                loc = pages.loc
                self.new_slots = index_tensor(slots) if loc is None else loc
            self.step_shape = (self.batch, self.heads, tokens, self.head_dim)
        except BaseException as err:
            # The rows are extended and the step's views half made (an OOM growing a layer
            # buffer, say): no layer stored it, so no crop counted from get_seq_length() can
            # drop it, and the next forward would take the half-made step for its own.
            self.broken = (f"a step failed after the pool extended the rows, before any layer stored it "
                           f"({type(err).__name__}: {err})")
            self.fast = False  # (every layer's next call then goes the checked way, which refuses)
            raise

    def begin_deferred(self, pages: StepPages, layers: Sequence[Any]) -> bool:
        """``begin_step(1, grad=False)`` of a deferred decode step (``pages.deferring``) on a CPU
        pool, the short way (``KVPoolCache.update``, outside grad mode; most steps of a
        ``generate``): its checks inline (``layers``: the cache's, which ``self.layers`` holds
        weakly) and the step; or False, nothing changed, when a check would do more than pass:
        then ``begin_step`` goes its whole way, and refuses or follows. Between two steps the
        model's weights evict the cache's code and data, so each call and lookup costs."""
        pool, length = self.pool, self.length
        if (self.broken is not None or self.cuda or getattr(pool, "_row_edits", 0) != self._edits
                or length >= pool.max_context_len):  # (check_broken, check_edits, check_context)
            return False
        for layer in layers:  # (check_in_step)
            if layer.seen != length:
                return False
        self.prefix_unstarted = False
        self.grad, self.fast = False, self.can_fast
        self.before = length
        self.length = length + 1
        self.deferred += 1
        pages.take_deferred(length + 1)
        pages.steps_on = None
        self.dst, self.later = None, True
        self.step_shape = (self.batch, self.heads, 1, self.head_dim)
        return True

    def check_broken(self, what: str) -> None:
        """Refuse everything but ``reset``/``close`` after a step failed half-made (``begin_step``)."""
        refuse_broken(self.broken, what)

    def check_edits(self, *, lengths: bool = True) -> None:
        """A pool call the cache did not make changed some request since the rows were last
        checked (``kvpool.row_edits``). If it named these rows (or is too far back to tell):
        refuse what the cache cannot follow (``check_rows``: closed, swapped out, or with
        ``lengths`` truncated), and follow the rest: a fork shares their pages and a swap_in
        moves them (the row's next extend into a shared page copies it on write), so the table
        is read from the allocator at every step from now on, as for rows opened on a prefix
        hit, and the buffers gathered again. Nothing changes when it refuses."""
        pool, handles = self.pool, self.handles
        now = getattr(pool, "_row_edits", 0)
        if now == self._edits:
            return
        if handles is not None and handles.shape[0] and pool._edited_since(self._edits, handles):
            check_rows(pool, handles, self.length - self.deferred if lengths else None, self.deferred)
            self._shared = True
            self._moved = bool(self.deferred or self.unstored)  # (their slots: re-read at the flush)
            if self.pages is not None:
                self.pages.reset(handles.shape[0], private=False)
        self._edits = now

    def flush(self) -> None:
        """Bring the core and the pool's caches up to the rows' tokens: one extend by the deferred
        decode steps (their slots are in pages the rows already own, so it needs no new page) and
        one store, from the layer buffers, of every token whose step has run on every layer
        since the last flush. Called before anything reads or edits the rows in the pool, and
        at a step that needs a new page. A step under way (some layer has yet to add its
        tokens) is stored by the next flush."""
        self.check_broken("KVPoolCache")
        n = self.deferred
        if not n and not self.unstored:
            return
        assert self.handles is not None and self.pages is not None
        pool = self.pool
        if self.cuda:
            refuse_capture(self.device, "KVPoolCache.flush")  # (its store would be recorded, not run)
        # Locked from the edit check to the store: another thread's fork/truncate/close of the rows
        # in between would store the tokens at slots the rows no longer own (a copy on write moved).
        with getattr(pool, "_lock", None) or nullcontext():
            flush_locked(self, n)
