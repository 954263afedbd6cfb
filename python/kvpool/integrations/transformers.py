"""A Hugging Face transformers (5.x) ``Cache`` whose keys and values live in a ``KVPool``.

```python
pool = pool_for_model(model, max_tokens=8192, page_size=16)       # built outside inference mode
with KVPoolCache(pool) as cache:
    out = model.generate(**inputs, cache=cache, max_new_tokens=32)  # past_key_values=cache before 5.24
```

How it maps onto the pool:

- one pool request per batch row, opened at the first ``update`` (the batch size is
  learned there) and closed by ``close()`` / the ``with`` block / ``reset()``;
- with layer buffers (on a pool whose caches are one allocation, as ``KVPool``'s are, CPU or
  CUDA), decode steps inside a page the rows own are deferred:
  the pool catches up once a page, and before any edit or ``handles`` (``flush``);
- each forward extends every row once (one ``pool.extend`` for the batch, done by the
  first layer that sees the step), every layer stores its new K/V into those slots
  (two copies into views of the caches when the slots are one strided run, else the
  pool's store; with layer buffers, the steps of rows that share no page, read through layer
  buffers, are not stored by their layers: ``flush`` stores every such step since the
  last flush from the buffers in one copy; the K/V are checked here, once per update) and
  returns the rows' full K/V as ``[batch, kv_heads, tokens, head_dim]``, the shape
  attention expects:
  strided views of the pool's own memory when every row's pages are consecutive (one
  request on a pool handing out pages in order; not with layer buffers on such a pool,
  which always reads those), else each layer's own buffer of its
  rows' K/V, which each step adds its tokens to and which is gathered from the pages
  only when it grows or the rows change (``_pages.StepPages``; ``layer_buffers=False``:
  one staging buffer gathered at every step). Either is valid until the next ``update``;
- left padding: pad tokens are stored like any other token and masked by the model's
  attention mask, exactly as ``DynamicCache`` does, so every row has the same length
  and the returned K/V line up with the 2-D attention mask. The price is one slot per
  pad token (at most the spread of prompt lengths per row);
- ``crop`` truncates every row (``pool.truncate``); beam search's ``reorder_cache``
  keeps a row that continues once and ``pool.fork``s one that continues several times
  (shared pages), or raises ``NotImplementedError`` on a pool without ``fork``;
- ``prefix_ids=`` (with a pool that has ``open_with_prefix``) opens the rows on their
  longest cached prefix (a batch: the shortest of its rows' hits, since rows share one
  length); ``generate`` then computes only the remaining prompt tokens, and ``close()``
  publishes every row's prompt pages for the next request.

Grad modes: the pool's tensors and the cache's own (staging buffer, layer buffers and the
views kept with them, which a closed cache leaves to the pool's next cache) are made outside
inference mode, so ``generate`` (under ``no_grad``) works equally under ``inference_mode()``.
Under grad mode each layer returns copies (``_shared_rows.owned``) that attention may save
for its backward while the cache goes on storing (docs/transformers.md).
"""

from __future__ import annotations

import sys
import warnings
import weakref
from typing import Any

import numpy as np  # (annotations: KVPoolCache.handles / cached_lens)
import torch

# transformers 5.21+ need Python 3.11: on 3.10 pip stops at 5.20, so 'kvpool[hf]' cannot install there.
if sys.version_info >= (3, 11):
    _PYTHON_HINT = ""
else:
    _PYTHON_HINT = f" (transformers 5.21+ need Python 3.11+; this is Python {sys.version_info[0]}.{sys.version_info[1]})"

try:
    import transformers
    from transformers.cache_utils import Cache, CacheLayerMixin  # noqa: F401 - part of the version check (KVPoolLayer uses it)
    from transformers.utils import is_torch_available
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        f"kvpool.integrations.transformers needs transformers>=5.23,<6: pip install 'kvpool[hf]'{_PYTHON_HINT}") from e

# 5.23: the cache-layer API this module implements (Cache.is_dummy, 5.23; get_layer_types_and_kwargs,
# 5.15); before, KVPoolCache failed with AttributeErrors on its first use.
if not (5, 23) <= tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit()) < (6,):
    raise ImportError(f"kvpool.integrations.transformers targets the transformers 5.x cache-layer API of 5.23 on; "
                      f"found transformers {transformers.__version__}: pip install 'kvpool[hf]' (transformers>=5.23,<6)"
                      f"{_PYTHON_HINT}")
# transformers >= 5.20 turns its torch support off below torch 2.6 (its models become placeholders).
if not is_torch_available():
    raise ImportError(f"transformers {transformers.__version__} does not run on torch {torch.__version__} (it disabled "
                      f"its PyTorch support; 5.23 needs torch>=2.6): pip install 'kvpool[hf]' (torch>=2.6)")

from kvpool._nopickle import NotPicklable
from kvpool.errors import CopyRefusedError, InvalidArgumentError, LayerIndexError
from kvpool.integrations._batch_edits import BatchEdits
from kvpool.integrations._cache_copy import SHALLOW_COPY, deep_copy
from kvpool.integrations._cache_layer import FixedLayerKinds, KVPoolLayer
from kvpool.integrations._hybrid import HybridRequests, PoolAttentionLayer, PoolStateLayer, hybrid_layers
from kvpool.integrations._model_pool import pool_for_model
from kvpool.integrations._pool_views import release_buffers
from kvpool.integrations._reorder import BEAM_NEEDS_FORK
from kvpool.integrations._requests import PREFIX_NEEDS_CORE, STRIDED, BatchRequests
from kvpool.integrations._shared_rows import LayerList
from kvpool.integrations._state_calls import StateCalls
from kvpool.pool import KVPool
from kvpool.validate import check_flag, check_pool, init_signature

__all__ = ["BEAM_NEEDS_FORK", "PREFIX_NEEDS_CORE", "HybridKVPoolCache", "KVPoolCache", "KVPoolLayer", "pool_for_model",
           "release_buffers"]


def _warn_if_dropped_open(cache: Any) -> None:
    """A ``ResourceWarning`` when ``cache`` is collected with rows still open (as Python warns of
    an unclosed file): their requests stay open in the pool for good, and a shared pool then
    refuses new requests after ``max_requests`` / batch such caches. Not closed here: a
    collection may run inside another pool call on this thread, in the middle of its work."""
    weakref.finalize(cache, _dropped_open, cache.requests, cache.pool)


def _dropped_open(requests: Any, pool: Any) -> None:
    # (No pool call: the rows' handles say enough, and this may run inside one.)
    if requests.handles is not None:
        warnings.warn(f"a KVPoolCache holding {requests.handles.shape[0]} rows was dropped without close(): their "
                      f"requests stay open in {pool!r}; close() the cache, or use it in a with block",
                      ResourceWarning, stacklevel=1)


class KVPoolCache(NotPicklable, BatchEdits, FixedLayerKinds, Cache):
    """A transformers ``Cache`` backed by a ``KVPool``: pass it to ``generate`` (or a
    model's forward) as ``cache=`` (``past_key_values=`` before transformers 5.24).

    Args:
        pool: a ``KVPool`` with one layer per model layer, the model's ``num_key_value_heads``
            and ``head_dim``, and the model's dtype (``pool_for_model`` builds one).
        prefix_ids: optional ``[batch, prompt_len]`` prompt token ids, without padding (not a
            left-padded batch's ``input_ids``: the cache never sees the mask, and would publish the
            pads' K/V under their token ids; see docs/transformers.md). With a
            pool that has ``open_with_prefix``, rows open on their longest cached prefix
            and ``generate`` computes only the rest; raises ``NotImplementedError`` otherwise.
        salt: optional int64 mixed into the prefix hash (tenant, LoRA id; or one per row), with ``prefix_ids``.
        layer_buffers: each layer keeps its rows' K/V gathered in a buffer of its own and adds
            each step's tokens to it, as ``DynamicCache`` keeps its tensors (the fastest, and the
            default: decode steps inside a page are deferred, see ``flush``; the memory of one
            more copy of the batch's K/V, up to twice that just after a buffer grew, on the
            pool's device). On a pool whose caches are not one allocation, only when the rows'
            pages are not one strided run. ``False``: no such copy; the layers read the pool in
            place when the rows' pages are one strided run (one request on a pool handing out
            pages in order), else share one staging buffer gathered at every step.

    Use each cache for one batch and close it (``with`` block, ``close()``) to give the
    pages back. Errors are the pool's typed ``KVPoolError`` subclasses.

    ``copy.deepcopy(cache)`` (transformers' prompt reuse: one prefilled cache, a copy per
    ``generate``) returns a new cache of the same class on the same pool (never copied) whose
    rows are ``pool.fork``s of these (shared pages, copy-on-write), with the same length and
    options: each copy and the original go on, and close, independently. Refused, nothing
    changed, after a forward cut short or while one is under way, or when the pool has no rows
    left for the forks. ``copy.copy`` raises ``CopyRefusedError`` (a shallow copy would share,
    and close twice, the rows); ``pickle`` is refused.
    """

    _pickle_refusal = "it holds requests of a KVPool of this process"

    def __new__(cls, pool: Any = None, **kwargs: Any) -> Any:
        # A hybrid pool (KVPool(layer_types=...)) gets the cache whose layers follow its groups.
        if cls is KVPoolCache and getattr(pool, "groups", None) is not None:
            return super().__new__(HybridKVPoolCache)
        return super().__new__(cls)

    def __init__(self, pool: KVPool, *, prefix_ids: torch.Tensor | None = None, salt: int | None = None,
                 layer_buffers: bool = True) -> None:
        check_pool(pool, "KVPoolCache")
        self.requests = BatchRequests(pool, layer_buffers=layer_buffers)
        self._pool_layers = LayerList(KVPoolLayer(self.requests, i) for i in range(pool.num_layers))
        self.requests.layers = self._pool_layers
        super().__init__(layers=list(self._pool_layers))
        self._fix_layer_kinds()  # (transformers reads them at every step)
        _warn_if_dropped_open(self)
        self._hit = 0  # the tokens the rows were opened on (a prefix hit)
        if prefix_ids is not None:
            self.requests.open_with_prefix(prefix_ids, salt)
            self._set_seen(self.requests.length)
            self._hit = self.requests.length
        elif salt is not None:
            raise InvalidArgumentError("salt= only applies with prefix_ids= (it keys the prefix lookup): "
                                       "pass prefix_ids= too, or no salt")

    def __deepcopy__(self, memo: dict[int, Any]) -> KVPoolCache:
        """A new cache on the same pool holding forks of these rows (see the class docstring)."""
        return deep_copy(self, memo)  # type: ignore[no-any-return]

    def __copy__(self) -> KVPoolCache:
        raise CopyRefusedError(f"cannot copy a {type(self).__name__} shallowly: {SHALLOW_COPY}")

    def activate_past_recording(self, **kwargs: Any) -> None:
        """``Cache.activate_past_recording``, which assisted decoding calls before its first forward;
        refused (``InvalidArgumentError``) on rows opened on a prefix hit that no forward extended:
        that forward takes the whole prompt whatever the cache holds, so the hit's tokens would be
        stored twice and the tokens generated wrong."""
        if self._hit and self.requests.length == self._hit:
            raise InvalidArgumentError(
                f"assisted decoding (an assistant model, prompt lookup) recomputes the whole prompt in its first "
                f"forward, but these rows were opened on a cached prefix of {self._hit} tokens: open the cache "
                "without prefix_ids= for assisted decoding, or generate without an assistant")
        super().activate_past_recording(**kwargs)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``KVPoolLayer.update`` of layer ``layer_idx`` (what the model calls, once per layer
        per forward).

        The common case goes the short way: K/V of the pool's dtype, heads and head dim on its
        device, not requiring grad, for the open rows, outside grad mode; the first layer of a
        forward starts the step, every layer then stores into the step's slots (two copies into
        views of the caches when the slots are one strided run, else the pool's index store; or,
        with layer buffers and rows that share no page, adds its tokens to its
        layer buffer alone, for ``flush`` to store in the pool) and gets the rows' K/V. Anything
        else (the first forward, a new batch, a wrong tensor, a layer out of step, grad mode)
        goes through ``KVPoolLayer.update``, which checks it in full and raises the typed error.
        """
        req = self.requests
        try:
            layer = self._pool_layers[layer_idx]
            if layer_idx < 0:  # (a list counts from the end; no model layer has a negative index)
                raise IndexError
        except (IndexError, TypeError):
            raise LayerIndexError(f"layer_idx {layer_idx!r}: the pool has layers [0, {len(self._pool_layers)})") \
                from None
        if not (isinstance(key_states, torch.Tensor) and isinstance(value_states, torch.Tensor)):
            return layer.update(key_states, value_states, *args, **kwargs)  # raises the typed error
        seen, ks = layer.seen, key_states.shape
        if seen == req.before:  # a later layer of the step under way (req.fast: not under grad mode)
            ok = ks == req.step_shape
        else:  # the first layer of a step: any number of new tokens (grad mode: see owned)
            ok = (seen == req.length and len(ks) == 4 and ks[0] == req.batch and ks[1] == req.heads
                  and ks[3] == req.head_dim and ks[2] > 0 and not torch.is_grad_enabled())
        if (ok and req.fast and value_states.shape == ks and key_states.layout is STRIDED
                and value_states.layout is STRIDED and key_states.dtype == req.dtype
                and value_states.dtype == req.dtype and not (key_states.requires_grad or value_states.requires_grad)
                and (key_states.is_cpu and value_states.is_cpu if req.on_cpu
                     else key_states.device == req.device and value_states.device == req.device)):
            pages = req.pages
            # (a deferred decode step: begin_step's checks and the step, the short way, when they pass)
            if seen != req.before and not (ks[2] == 1 and pages.deferring  # type: ignore[union-attr]  # (req.fast)
                                           and req.begin_deferred(pages, self._pool_layers)):
                req.begin_step(ks[2], False)
            decode = pages._decode  # type: ignore[union-attr]  # (req.fast)
            if decode is not None:
                # A deferred decode step (most steps of a generate): the token goes to the layer
                # buffers alone. One lookup for both, as the model's forward since this layer's
                # last call has evicted the cache's objects from the CPU's caches.
                dk, dv, out = decode[layer_idx]
                dk.copy_(key_states)
                dv.copy_(value_states)
                layer.seen = req.length
                layer.is_initialized = True
                return out
            dst = req.dst
            if dst is not None:
                dst[0][layer_idx].copy_(key_states)
                dst[1][layer_idx].copy_(value_states)
            elif not req.later:  # (later: pages.kv adds it to the buffers; flush stores it in the pool)
                req.store(layer_idx, req.new_slots, key_states, value_states)  # type: ignore[misc]  # (req.fast)
            layer.seen = req.length
            layer.is_initialized = True
            if pages._plain:  # type: ignore[union-attr]  # (req.fast): views made by the step, nothing to fill
                return pages._views[layer_idx]  # type: ignore[union-attr, index]
            return pages.kv(layer_idx, key_states, value_states)  # type: ignore[union-attr]
        if self._reset_mid is not None:
            self._check_reset_mid_step(layer_idx)
        return layer.update(key_states, value_states, *args, **kwargs)

    # -- what the pool holds ------------------------------------------------------------
    @property
    def pool(self) -> KVPool:
        return self.requests.pool

    @property
    def handles(self) -> np.ndarray | None:
        """Pool handles of the rows (int64 array), or None before the first update.

        The pool then holds every token the cache does (``flush``), so the handles can be
        read through the pool's own calls."""
        self.flush()
        h = self.requests.handles
        return None if h is None else h.copy()

    def flush(self) -> None:
        """Bring the pool up to every token the cache holds.

        With layer buffers, rows that share no page (a cache without
        ``prefix_ids=`` and no fork yet) are stored into the pool from the buffers rather than
        by each layer, and a decode step inside a page the rows already own does not even
        extend their requests: the pool's lengths and caches catch up (one extend, one store)
        at the next step that needs a page or brings several tokens, and before ``crop``,
        ``reorder_cache``, ``batch_select_indices``, ``batch_repeat_interleave`` and
        ``handles``. A step or fork refused after the catch-up undoes it. Between two layers
        of a step, this stores what the layers that ran hold, and the next flush the rest.
        Call this before reading the rows through the pool with handles taken earlier."""
        self.requests.flush()

    @property
    def cached_lens(self) -> np.ndarray | None:
        """Per row, how many prompt tokens came from the prefix cache (prefix mode), else None."""
        return self.requests.cached_lens

    # -- transformers' cache operations ---------------------------------------------------
    def get_max_length(self, layer_idx: int | None = None) -> int:
        return int(self.pool.max_context_len)

    def reset(self) -> None:
        """Close every row's request; the cache can then serve a new batch."""
        self._mark_reset_mid_step()
        self.requests.close()
        self._set_seen(0)
        self._hit = 0

    def close(self) -> None:
        """Give the rows' pages back to the pool (idempotent)."""
        self.reset()

    def __enter__(self) -> KVPoolCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        h = self.requests.handles
        rows = 0 if h is None else h.shape[0]
        return f"KVPoolCache(rows={rows}, length={self.requests.length}, pool={self.pool!r})"


# Its layers follow the pool's groups (``_hybrid``): full and sliding attention layers, and
# linear-attention layers whose state lives in the pool; the batch-wide operations (crop,
# reorder, select, reset) act on the pool's requests as KVPoolCache's do.
# help() and inspect: the constructor's parameters, not those of the __new__ that routes hybrid pools.
KVPoolCache.__signature__ = init_signature(KVPoolCache)  # type: ignore[attr-defined]


class HybridKVPoolCache(StateCalls, KVPoolCache):
    """A ``KVPoolCache`` over a hybrid pool (see ``KVPoolCache`` for the arguments).

    ``prefix_ids=`` opens the rows on the longest prefix every group has cached
    (pages, window, state checkpoint); see docs/hybrid.md.
    """

    def __init__(self, pool: Any, *, prefix_ids: torch.Tensor | None = None, salt: int | None = None,
                 layer_buffers: bool = True) -> None:
        # layer_buffers: KVPoolCache's argument, taken so that KVPoolCache(pool, ...) builds this
        # cache with the same arguments; its layers gather through their groups' tables.
        check_pool(pool, "HybridKVPoolCache")
        if getattr(pool, "groups", None) is None:
            raise InvalidArgumentError("HybridKVPoolCache takes a hybrid pool (KVPool(layer_types=...)); this one "
                                       "has no layer groups: use KVPoolCache(pool)")
        check_flag("layer_buffers", layer_buffers)
        convs = [n for n in pool.state_shapes if n.startswith("conv")]
        self.requests = HybridRequests(pool)  # type: ignore[assignment]
        layers = hybrid_layers(self.requests, max(1, len(convs)))
        self._pool_layers = LayerList(x for x in layers if isinstance(x, PoolAttentionLayer))  # type: ignore[misc]
        self.requests.layers = self._pool_layers
        self._state_layers = LayerList(x for x in layers if isinstance(x, PoolStateLayer))
        self.requests.state_layers = self._state_layers
        Cache.__init__(self, layers=layers)
        self._fix_layer_kinds()
        _warn_if_dropped_open(self)
        self._hit = 0
        if prefix_ids is not None:
            self.requests.open_with_prefix(prefix_ids, salt)
            self._set_seen(self.requests.length)
            self._hit = self.requests.length
            if self.requests.length > 0:
                for layer in self._state_layers:
                    layer.resume()
        elif salt is not None:
            raise InvalidArgumentError("salt= only applies with prefix_ids= (it keys the prefix lookup): "
                                       "pass prefix_ids= too, or no salt")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's own ``update`` (its group's slots and window)."""
        try:
            layer = self.layers[layer_idx]
            if layer_idx < 0:  # (as KVPoolCache.update)
                raise IndexError
        except (IndexError, TypeError):
            raise LayerIndexError(f"layer_idx {layer_idx!r}: the pool has layers [0, {len(self.layers)})") from None
        if self._reset_mid is not None:
            self._check_reset_mid_step(layer_idx)
        return layer.update(key_states, value_states, *args, **kwargs)

    def _check_between_steps(self, what: str) -> None:
        super()._check_between_steps(what)
        self.requests.check_states(what, started=False)  # type: ignore[attr-defined]  # (HybridRequests)

    def crop(self, tokens_to_remove: int) -> None:
        """As ``KVPoolCache.crop``; the pool refuses (``RollbackUnavailableError``, nothing
        changed) a length whose window it released or that has no state checkpoint."""
        super().crop(tokens_to_remove)
        if self.requests.length == 0:
            for layer in self._state_layers:
                layer.reset()

    def reset(self) -> None:
        """Close every row's request; the cache can then serve a new batch."""
        super().reset()
        for layer in self._state_layers:
            layer.reset()

    def __repr__(self) -> str:
        h = self.requests.handles
        rows = 0 if h is None else h.shape[0]
        return f"KVPoolCache(hybrid, rows={rows}, length={self.requests.length}, pool={self.pool!r})"


HybridKVPoolCache.__signature__ = init_signature(HybridKVPoolCache)  # type: ignore[attr-defined]
