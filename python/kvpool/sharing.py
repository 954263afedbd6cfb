"""Shared pages on the torch side: ``KVPool.open_with_prefix`` and ``fork``
write the shared pages' slots into the new requests' ``req_to_token`` rows,
and ``apply_cow`` runs an extend's copy-on-write work on the device: one
``copy_slots`` over every layer's caches and the moved positions' table
entries. Host arrays go to the device with one copy each; nothing is read back.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvpool.kernels import copy_slots, write_req_to_token

__all__ = ["SharingMixin", "apply_cow"]


def _dev(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device, non_blocking=True)


def write_rows(req_to_token: torch.Tensor, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray,
               slots: np.ndarray) -> None:
    """``req_to_token[rows[i], starts[i]:starts[i]+counts[i]]`` = the next counts[i] of ``slots``."""
    if len(slots) == 0:
        return
    d = req_to_token.device
    write_req_to_token(req_to_token, _dev(rows, d), _dev(starts, d), _dev(counts, d), _dev(slots, d))


def apply_cow(pool: Any, cow: np.ndarray | None, table_written: bool) -> None:
    """Run one extend's copy-on-write work: ``cow`` is ``[rows | positions | src | dst]``.

    Copies each moved slot's K/V (every layer) to its new slot, and, unless the
    core already wrote the host table, points the moved positions' table
    entries at the new slots.
    """
    if cow is None:
        return
    m = len(cow) // 4
    rows, pos, src, dst = cow[:m], cow[m : 2 * m], cow[2 * m : 3 * m], cow[3 * m :]
    device = pool.device
    caches = [c for group in pool._storage.flat for c in group]
    copy_slots(caches, _dev(src, device), _dev(dst, device))
    if not table_written:
        write_rows(pool.req_to_token, rows, pos, np.ones(m, dtype=np.int64), dst)


class SharingMixin:
    """Mixin: ``KVPool``'s prefix-cache and fork calls that touch the tables."""

    allocator: Any
    req_to_token: torch.Tensor
    _sharing: bool

    def _write_prefixes(self, handles: np.ndarray, lengths: np.ndarray) -> None:
        """Write the slots of each request's first ``lengths[i]`` positions into its row."""
        keep = np.nonzero(lengths > 0)[0]
        if len(keep) == 0:
            return
        hs = handles[keep]
        slots = np.concatenate([self.allocator.slots(h)[: lengths[i]] for h, i in zip(hs, keep)])
        rows = self.allocator.rows(hs)
        write_rows(self.req_to_token, rows, np.zeros(len(hs), dtype=np.int64), lengths[keep], slots)

    def open_with_prefix(self, tokens: Any, lengths: Any, salt: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """Open one request per prompt, each starting on the longest cached prefix
        of full pages of its prompt (at least one token is always left to compute:
        ``cached_len <= length - 1``, rounded down to a page boundary).

        The shared pages' slots are written into the new rows of ``req_to_token``
        (and show in ``page_table``); the request's length is its ``cached_len``.
        The prompt's token ids are remembered: extend the request by
        ``length - cached_len`` to prefill the rest, then ``cache`` (or
        ``close(cache=True)``) to publish its pages.

        Args:
            tokens: the prompts' token ids, concatenated.
            lengths: each prompt's length.
            salt: None, an int for all, or one int per prompt (LoRA id, tenant,
                cache salt); different salts never share pages.

        Returns:
            ``(handles, cached_lens)``, int64 arrays.

        Raises:
            InvalidArgumentError: tokens and lengths disagree, a token id out of
                range, a salt of the wrong type.
            ContextTooLongError: a prompt longer than ``max_context_len``.
            TooManyRequestsError: not enough free rows. Nothing changes on any error.
        """
        handles, cached = self.allocator.open_with_prefix(tokens, lengths, salt)
        self._sharing = True
        self._write_prefixes(handles, cached)
        return handles, cached

    def fork(self, handle: Any, n: int = 1) -> np.ndarray:
        """Open ``n`` requests sharing all of ``handle``'s pages and known tokens
        (parallel sampling, beam search). Their ``req_to_token`` rows get the
        parent's slots. A shared, partly filled last page is copy-on-write: the
        first holder that extends into it gets a private copy (``extend`` runs
        the copy on the device before it returns).

        Returns:
            int64 array of ``n`` new handles.

        Raises:
            InvalidHandleError: ``handle`` is unknown, closed or stale.
            TooManyRequestsError: not enough free rows.
            InvalidArgumentError: ``n`` is negative or not an int.
        """
        kids = self.allocator.fork(handle, n)
        self._sharing = True
        if len(kids):
            length = self.allocator.length(handle)
            self._write_prefixes(kids, np.full(len(kids), length, dtype=np.int64))
        return kids
