"""``KVPoolCache``'s batch-wide row edits, as transformers calls them: ``crop`` (speculative
decoding, a retried step), beam search's ``reorder_cache``, ``batch_select_indices`` and
``batch_repeat_interleave``. Each checks its argument in full and the cache's state (a forward
cut short, rows lost) before it changes anything, then acts on every row's pool request
through ``BatchRequests`` (``truncate``, ``reorder``)."""

from __future__ import annotations

import operator
from typing import Any

import numpy as np
import torch

from kvpool.errors import (
    IncompleteForwardError,
    InvalidArgumentError,
    LayerIndexError,
    TensorDeviceError,
    TensorDtypeError,
    TensorShapeError,
    TooManyRequestsError,
)
from kvpool.integrations._shared_rows import check_in_step, stored_by_all

__all__ = ["BatchEdits"]


def _token_count(n: Any) -> int:
    """``crop``'s count as an int (a Python or numpy int, or a 0-d integer tensor)."""
    if isinstance(n, bool) or (isinstance(n, torch.Tensor) and (n.ndim or n.is_floating_point())):
        raise InvalidArgumentError(f"crop takes an int count of tokens, got {n!r}")
    try:
        return operator.index(n)
    except TypeError:
        raise InvalidArgumentError(f"crop takes an int count of tokens, got {type(n).__name__} {n!r}") from None


def _layer_index(layer_idx: Any, layers: int) -> int:
    """A query's layer index as an int (a numpy int or a 0-d integer tensor too); anything else
    (a bool, float, str, None), or a negative index before the first of ``layers`` (transformers'
    ``IndexError``), is a ``LayerIndexError`` rather than transformers' ``TypeError``."""
    if not isinstance(layer_idx, bool) and not (isinstance(layer_idx, torch.Tensor) and (
            layer_idx.ndim or layer_idx.is_floating_point() or layer_idx.dtype == torch.bool)):
        try:
            i = operator.index(layer_idx)
        except TypeError:
            pass
        else:
            if i >= -layers:
                return i
            raise LayerIndexError(f"layer_idx {i}: the cache has layers [0, {layers}) (a negative index counts "
                                  f"from the end, down to -{layers})")
    raise LayerIndexError(f"layer_idx takes an int layer index, got {type(layer_idx).__name__} {layer_idx!r}")


class BatchEdits:
    """The row edits of ``KVPoolCache``, and the checks that its state allows one (a mixin over
    the cache's ``requests`` and ``_pool_layers``)."""

    requests: Any
    _pool_layers: list[Any]
    pool: Any
    # The layers a reset() (or close()) between two layers of a forward left without the step
    # the others stored: this forward's updates from them are refused (``_check_reset_mid_step``).
    _reset_mid: frozenset[int] | None = None

    def _mark_reset_mid_step(self) -> None:
        """Before ``reset``: when some layers stored the last step and others not (a forward
        under way, or one cut short), remember the others. Should the forward go on, their
        updates would otherwise open new rows and attend to their own tokens alone."""
        req = self.requests
        n, states = req.length, getattr(self, "_state_layers", None)
        if n == 0 and self._reset_mid is not None:
            return  # (a second reset()/close() of the emptied cache keeps what the first noted)
        # Whether each layer stored the forward under way (or the last one, when none is).
        done = {layer.layer_idx: layer.seen == n for layer in self._pool_layers}
        if states:  # (a hybrid cache: its linear-attention layers count as well, by their stamps)
            steps = req.steps
            # Before the step's first attention layer extends the rows, the state layers in front
            # of it that ran stamped the step to come; none of the attention layers has run yet.
            if any(s.before_attention and s._stamp == steps + 1 for s in states):
                done = dict.fromkeys(done, False)
                done.update((s.layer_idx, s.before_attention and s._stamp == steps + 1) for s in states)
            else:
                done.update((s.layer_idx, s._stamp == steps) for s in states)
        order = sorted(done)
        behind = [i for i in order if not done[i]]
        # (the layers after the ones that ran: a forward goes through its layers in order)
        tail = order[len(order) - len(behind):]
        self._reset_mid = frozenset(behind) if 0 < len(behind) < len(order) and behind == tail else None

    def _check_reset_mid_step(self, layer_idx: int) -> None:
        """An update after a reset between two layers of a forward: from a layer left behind, the
        rest of that forward, refused (``IncompleteForwardError``, nothing opened); from any
        other, a new forward, which goes on."""
        behind, self._reset_mid = self._reset_mid, None
        if behind is not None and layer_idx in behind:
            raise IncompleteForwardError(
                f"layer {layer_idx}: the cache was reset (or closed) during this forward, after the layers before "
                f"layer {min(behind)} had stored its step; the forward's other layers have no rows to attend to. Run "
                "the forward again from its first layer (the cache starts a new batch), or reset the cache between "
                "forwards")

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """``Cache.get_seq_length``: the tokens layer ``layer_idx`` holds (0 past the last layer; a
        negative index counts from the end)."""
        if type(layer_idx) is not int or layer_idx < 0:
            layer_idx = _layer_index(layer_idx, len(self.layers))  # type: ignore[attr-defined]
        return super().get_seq_length(layer_idx)  # type: ignore[misc]

    def get_mask_sizes(self, query_length: Any, layer_idx: int) -> tuple[int, int]:
        """``Cache.get_mask_sizes``, with ``layer_idx`` checked as ``get_seq_length`` checks it."""
        if type(layer_idx) is not int or layer_idx < 0:
            layer_idx = _layer_index(layer_idx, len(self.layers))  # type: ignore[attr-defined]
        return super().get_mask_sizes(query_length, layer_idx)  # type: ignore[misc]

    def _set_seen(self, n: int) -> None:
        for layer in self._pool_layers:
            layer.seen = n

    def _check_between_steps(self, what: str) -> None:
        self._check_not_broken(what)
        check_in_step(self._pool_layers, self.requests.length, what)

    def _check_not_broken(self, what: str) -> None:
        """A step that failed half-made (``BatchRequests.begin_step``) refuses all but reset/close,
        before any check that would advise a crop no count can make."""
        if getattr(self.requests, "broken", None) is not None:
            self.requests.check_broken(what)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens of every row (``pool.truncate``).

        Same convention as ``DynamicCache`` in 5.x: a non-positive count. After a forward
        cut short (an exception in a layer), the count is from the length that forward
        extended the rows to (``get_seq_length()``), and it must drop at least the
        unfinished step, which every layer then forgets; a crop that would keep part of
        it raises ``IncompleteForwardError`` (nothing changed).
        """
        n = _token_count(tokens_to_remove)
        self._check_not_broken(f"crop({n})")
        if n > 0:
            raise InvalidArgumentError(f"crop({n}): pass a negative count of tokens to remove, "
                                       "as DynamicCache.crop does")
        if n == 0:
            return
        req = self.requests
        target = max(0, req.length + n)
        if target > stored_by_all(self._pool_layers):
            self._check_between_steps(f"crop({n}) would keep part of the unfinished step")
        req.truncate(target)
        self._set_seen(req.length)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row j continues row ``beam_idx[j]`` (beam search). Needs ``pool.fork`` when a row
        continues more than once; raises ``NotImplementedError`` on a pool without it."""
        self._check_between_steps("reorder_cache")
        self.requests.reorder(self._rows_of(beam_idx, "reorder_cache", mask=False))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows ``indices`` (an index or boolean tensor); the others are closed."""
        self._check_between_steps("batch_select_indices")
        self.requests.reorder(self._rows_of(indices, "batch_select_indices", mask=True))

    def _rows_of(self, indices: Any, what: str, *, mask: bool) -> list[int]:
        """Row indices as ints: integer indices (or, with ``mask``, one bool per row). Raises
        the typed error for float indices or a mask of the wrong length, which would
        otherwise pick rows silently."""
        try:
            idx = torch.as_tensor(indices, device=indices.device if isinstance(indices, torch.Tensor) else "cpu")
        except (TypeError, ValueError, RuntimeError):
            raise TensorDtypeError(f"{what} takes a tensor of integer row indices, got {type(indices).__name__}") \
                from None
        if idx.device.type == "meta":  # (no values to read: .tolist() raised NotImplementedError)
            raise TensorDeviceError(f"{what} takes row indices with values, got a tensor on the meta device")
        if idx.dtype == torch.bool and mask:
            h = self.requests.handles
            if h is not None and tuple(idx.shape) != (h.shape[0],):
                raise TensorShapeError(f"{what}: a boolean mask needs one entry per row ({h.shape[0]} rows), "
                                       f"got shape {list(idx.shape)}")
            idx = idx.nonzero().reshape(-1)
        elif idx.dtype == torch.bool or idx.is_floating_point() or idx.is_complex():
            raise TensorDtypeError(f"{what} takes integer row indices{' or a boolean mask' if mask else ''}, "
                                   f"got {idx.dtype}")
        return [int(i) for i in idx.reshape(-1).tolist()]

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row becomes ``repeats`` consecutive rows (forks when the rows hold tokens)."""
        if isinstance(repeats, bool) or not isinstance(repeats, (int, np.integer)) or repeats < 0:
            raise InvalidArgumentError(f"batch_repeat_interleave takes repeats >= 0 (an int), got {repeats!r}")
        self._check_between_steps("batch_repeat_interleave")
        if self.requests.handles is not None:
            # (refused before a list of b * repeats rows is built: 2**63 never returned; Python ints,
            # as a numpy int's product wraps)
            b, n, most = int(self.requests.handles.shape[0]), int(repeats), int(self.pool.max_requests)
            if b * n > most:
                raise TooManyRequestsError(
                    f"too many requests: batch_repeat_interleave({n}) makes {b} x {n} = {b * n} rows, more than the "
                    f"pool's max_requests={most}: give the pool rows for every beam (max_requests)")
            self.requests.reorder([i for i in range(b) for _ in range(repeats)])
