"""Shared pages on the torch side: ``KVPool.open_with_prefix`` and ``fork``
write the shared pages' slots into the new requests' ``req_to_token`` rows,
and ``apply_cow`` runs an extend's copy-on-write work on the device: one
``copy_slots`` over every layer's caches and the moved positions' table
entries. Each call's host arrays go to the device with one copy
(``kvpool.staging.pool_to_device``); nothing is read back.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvpool.handle_args import frozen_handles
from kvpool.kernels import copy_slots, write_req_to_token
from kvpool.staging import pool_to_device

__all__ = ["SharingMixin", "apply_cow"]


def write_rows(pool: Any, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray, slots: np.ndarray) -> None:
    """``req_to_token[rows[i], starts[i]:starts[i]+counts[i]]`` = the next counts[i] of ``slots``."""
    if len(slots) == 0:
        return
    write_req_to_token(pool.req_to_token, *pool_to_device(pool, rows, starts, counts, slots))


def apply_cow(pool: Any, cow: np.ndarray | None, table_written: bool) -> None:
    """Run one extend's copy-on-write work: ``cow`` is ``[rows | positions | src | dst]``.

    Copies each moved slot's K/V (every layer) to its new slot, and, unless the
    core already wrote the host table, points the moved positions' table
    entries at the new slots. The caller holds the pool's lock: a copy's source
    page may have no other holder left, and must not be handed out again before
    the copy has read it.
    """
    if cow is None:
        return
    m = len(cow) // 4
    rows, pos, src, dst = cow[:m], cow[m : 2 * m], cow[2 * m : 3 * m], cow[3 * m :]
    caches = [c for group in pool._storage.flat for c in group]
    if table_written:
        src_d, dst_d = pool_to_device(pool, src, dst)
        copy_slots(caches, src_d, dst_d)
    else:
        src_d, dst_d, rows_d, pos_d, ones_d = pool_to_device(pool, src, dst, rows, pos, np.ones(m, dtype=np.int64))
        copy_slots(caches, src_d, dst_d)
        write_req_to_token(pool.req_to_token, rows_d, pos_d, ones_d, dst_d)
    pool.copied_slots += m  # kvpool.metrics: copy bytes = copied_slots * bytes_per_slot
    order = getattr(pool, "_order", None)
    if order is not None:  # CUDA: later hand-outs on other streams wait for these copies
        order.copied()


class SharingMixin:
    """Mixin: ``KVPool``'s prefix-cache and fork calls that touch the tables."""

    allocator: Any
    req_to_token: torch.Tensor
    _sharing: bool  # read and set under _lock only
    _note_edit: Any  # (kvpool.row_edits)
    _table_np: np.ndarray | None  # the CPU req_to_token as numpy; None on a device
    copied_slots: int = 0  # slots copy-on-write copied so far (every layer's K and V), cumulative
    _lock: Any  # the pool's RLock (see KVPool: threads)
    _to_device: Any  # the pinned ring's copy (CUDA); None on CPU
    _enter_device_call: Any
    _transfers: Any  # the host tier's TransferRunner (None without a tier)
    _run_transfers: Any

    def _write_prefixes(self, handles: np.ndarray, lengths: np.ndarray) -> None:
        """Write the slots of each request's first ``lengths[i]`` positions into its row."""
        keep = np.nonzero(lengths > 0)[0]
        if len(keep) == 0:
            return
        hs = handles[keep]
        slots = np.concatenate([self.allocator.slots(h)[: lengths[i]] for h, i in zip(hs, keep)])
        rows = self.allocator.rows(hs)
        write_rows(self, rows, np.zeros(len(hs), dtype=np.int64), lengths[keep], slots)

    def _write_prefixes_or_close(self, handles: np.ndarray, lengths: np.ndarray) -> None:
        """``_write_prefixes`` for requests this call just opened; if the table write
        fails (a CUDA OOM or launch error), close them, last first, so that no request
        the caller never got a handle for keeps holding pages, then re-raise."""
        try:
            self._write_prefixes(handles, lengths)
        except BaseException:
            try:  # best effort: host hits' loads go to pages that closing hands back to the cache
                if self._transfers is not None:
                    self._run_transfers()
            except BaseException:  # noqa: BLE001 - the original error is the one to raise
                pass
            self.allocator.close(np.asarray(handles, dtype=np.int64)[::-1].copy())
            raise

    def _run_transfers_or_close(self, handles: np.ndarray) -> None:
        """``_run_transfers`` for requests this call just opened; if the transfers fail
        (their hits' pages never got their bytes; the cache is cleared), close them,
        last first, and re-raise."""
        try:
            self._run_transfers()
        except BaseException:
            self.allocator.close(np.asarray(handles, dtype=np.int64)[::-1].copy())
            raise

    def open_with_prefix(self, tokens: Any, lengths: Any, salt: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """Open one request per prompt on the longest cached prefix of its prompt.
        See ``SlotAllocator.open_with_prefix``; holds the pool's lock.

        The pool adds: the shared pages' slots are written into the new rows of
        ``req_to_token`` (on CUDA with one host -> device copy), so they show in
        the tables as well as in ``page_table``. Extend each request by
        ``length - cached_len`` to prefill the rest, then ``cache`` (or
        ``close(cache=True)``) to publish its pages.

        Raises:
            TensorDeviceError: called while a CUDA graph is being captured on the
                pool's device (before anything changes).
            If the device table write or a host hit's load fails after the
            allocator opened the requests (a CUDA OOM or launch error), they are
            closed again (a failed load also clears the prefix cache).
        """
        with self._lock:
            if self._to_device is not None:  # CUDA (staged through the pinned ring)
                self._enter_device_call("open_with_prefix")
            if self._table_np is not None and self._transfers is None:  # nothing after the core can fail
                handles, cached = self.allocator.open_with_prefix(tokens, lengths, salt, table=self._table_np)
                self._sharing = True
                return handles, cached
            counted = self._counted_hits()
            try:
                if self._table_np is not None:
                    handles, cached = self.allocator.open_with_prefix(tokens, lengths, salt, table=self._table_np)
                else:
                    handles, cached = self.allocator.open_with_prefix(tokens, lengths, salt)
                    self._write_prefixes_or_close(handles, cached)
                if self._transfers is not None:  # host hits' loads (and the offloads their pages caused)
                    self._run_transfers_or_close(handles)
            except BaseException:
                self._uncount_since(counted)
                raise
            self._sharing = True
            return handles, cached

    def _counted_hits(self) -> tuple[int, int, int]:
        a = self.allocator
        return a.hit_tokens, a.miss_tokens, a.host_hit_tokens

    def _uncount_since(self, counted: tuple[int, int, int]) -> None:
        """Take back what an open counted before it was undone: its requests were closed
        unreturned, so the hit rate an engine logs must not count their prompts."""
        now = self._counted_hits()
        self.allocator._uncount_opens(*(n - c for n, c in zip(now, counted)))

    def fork(self, handle: Any, n: int = 1) -> np.ndarray:
        """Open ``n`` requests sharing all of ``handle``'s pages and known tokens
        (parallel sampling, beam search). See ``SlotAllocator.fork``; holds the
        pool's lock.

        The pool adds: the new rows of ``req_to_token`` get the parent's slots,
        and when a holder later extends into the shared, partly filled last page,
        ``extend`` runs its copy-on-write copy on the device before it returns.

        Raises:
            TensorDeviceError: called while a CUDA graph is being captured on the
                pool's device (before anything changes).
            If the device table write fails after the allocator opened the
            children (a CUDA OOM or launch error), they are closed again.
        """
        handle = frozen_handles(handle)  # (read again after the core commits: convert once)
        with self._lock:
            if self._to_device is not None:  # CUDA (staged through the pinned ring)
                self._enter_device_call("fork")
            if self._table_np is not None:  # a CPU table: the core writes the rows
                kids = self.allocator.fork(handle, n, table=self._table_np)
                self._sharing = True
                self._note_edit(handle)
                return kids
            kids = self.allocator.fork(handle, n)
            self._sharing = True
            if len(kids):
                length = self.allocator.length(handle)
                self._write_prefixes_or_close(kids, np.full(len(kids), length, dtype=np.int64))
            self._note_edit(handle)
            return kids

    # Prefix-aware transfer between pools (kvpool.distributed.kv_transfer).

    def chain_hashes(self, handle: Any) -> tuple[np.ndarray, np.ndarray, int]:
        """A request's leading full pages of known tokens (hashes under this pool's
        ``hash_seed``, token ids, salt), for a prefix-aware transfer.
        See ``SlotAllocator.chain_hashes``."""
        return self.allocator.chain_hashes(handle)

    def match_chain_hashes(self, hashes: Any, tokens: Any, salt: Any = None) -> int:
        """How many leading pages of another pool's chain (``chain_hashes``) this pool
        caches, as a Python int. See ``SlotAllocator.match_chain_hashes``."""
        return int(self.allocator.match_chain_hashes(hashes, tokens, salt))

    def open_with_chain_hashes(self, hashes: Any, tokens: Any, salt: Any = None,
                               max_pages: int | None = None, length: int | None = None) -> int:
        """Open a request holding the leading pages of a chain that this pool caches,
        and with ``length`` extend it to ``length`` tokens in the same atomic call.
        See ``SlotAllocator.open_with_chain_hashes``; holds the pool's lock.

        The pool adds: the request's ``req_to_token`` row shows the shared pages
        (and with ``length`` the new ones, and the evictions' offloads run).

        Returns:
            The new handle only (``length(handle)`` says how many tokens it holds;
            without ``length``, how many it shares). With ``length``, the count it shares
            is what ``match_chain_hashes`` said just before only if no other call changed
            the prefix cache in between (another thread's ``cache``, ``evict`` or
            page-taking call): a threaded engine orders those itself, as
            ``kvpool.distributed.recv_request`` does by holding the pool's lock across
            both, or a page it counted as shared may be fresh and never written.

        Raises:
            TensorDeviceError: called while a CUDA graph is being captured on the
                pool's device (before anything changes).
        """
        with self._lock:
            if self._to_device is not None:  # CUDA (staged through the pinned ring)
                self._enter_device_call("open_with_chain_hashes")
            counted = self._counted_hits()
            try:
                if length is None:
                    handle, cached = self.allocator.open_with_chain_hashes(hashes, tokens, salt, max_pages)
                    filled = cached
                else:
                    handle, cached = self.allocator.open_with_chain_hashes(hashes, tokens, salt, max_pages, length)
                    filled = int(self.allocator.length(handle))
                if self._transfers is not None:
                    self._run_transfers_or_close(np.array([handle], dtype=np.int64))
                if cached:
                    self._sharing = True
                self._write_prefixes_or_close(np.array([handle], dtype=np.int64), np.array([filled], dtype=np.int64))
            except BaseException:
                self._uncount_since(counted)
                raise
            return int(handle)
