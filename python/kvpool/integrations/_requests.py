"""The pool side of ``KVPoolCache``: one pool request per batch row, and the step's slots.

Kept apart from the transformers adapter so that it imports no transformers: this is
plain KVPool bookkeeping (open, extend, gather, truncate, fork, close) for a batch
whose rows all hold the same number of tokens, which is how a transformers cache
sees a batch (left padding included: pad tokens are ordinary, masked positions).
A step's own pool calls (``begin_step``, ``flush``) are ``BatchSteps``' (``_batch_steps``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvpool._core import InvalidArgumentError
from kvpool.errors import TensorDeviceError, TensorDtypeError, TensorShapeError
from kvpool.integrations._batch_steps import BatchSteps
from kvpool.integrations._pages import StepPages
from kvpool.integrations._pending import store_below
from kvpool.integrations._pool_views import index_tensor
from kvpool.integrations._reorder import batch_mismatch, reorder_rows, repeat_prefix_rows
from kvpool.integrations._row_checks import close_rows, pool_lock
from kvpool.integrations._shared_rows import WeakLayers
from kvpool.kernels._common import check_dense
from kvpool.validate import check_flag

STRIDED = torch.strided  # (a module global: the per-layer test reads it as one lookup)
PREFIX_NEEDS_CORE = (
    "prefix reuse (prefix_ids=) needs shared pages: KVPool.open_with_prefix, which this pool "
    "object does not have (every kvpool.KVPool does); build the cache without prefix_ids"
)


def check_kv_type(name: str, x: torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
    """A step's K or V is of the pool's dtype and on its device (one error class each, for the
    plain and the hybrid cache alike)."""
    if x.dtype != dtype:
        raise TensorDtypeError(f"{name} is {x.dtype}; the pool takes {dtype} rows (build the pool with the model's "
                               f"dtype; an fp8 pool with compute_dtype={x.dtype})")
    if x.device != device:
        raise TensorDeviceError(f"{name} is on {x.device}; the pool is on {device}")


def check_not_empty(key_states: torch.Tensor) -> None:
    """A step's K/V ``[B, H, T, D]`` hold at least one row and one token: an empty batch would
    open no request, and an empty step extends nothing (the page table has no slot to read)."""
    b, _, t, _ = key_states.shape
    if b < 1:
        raise TensorShapeError(f"key_states has {b} rows: a step needs at least one row (batch >= 1)")
    if t < 1:
        raise TensorShapeError(f"key_states has {t} tokens: a step stores at least one token per row")


def prefix_tokens(prefix_ids: Any) -> tuple[int, int, np.ndarray]:
    """``prefix_ids`` checked (a dense ``[batch, prompt_len]`` tensor of integer ids with values, at
    least one of each), as ``(batch, prompt_len, the ids flat as int64)``."""
    if not isinstance(prefix_ids, torch.Tensor) or prefix_ids.ndim != 2 or prefix_ids.shape[1] < 1:
        raise TensorShapeError("prefix_ids must be a [batch, prompt_len] tensor of token ids (no padding)")
    if prefix_ids.is_floating_point() or prefix_ids.is_complex() or prefix_ids.dtype == torch.bool:
        raise TensorDtypeError(f"prefix_ids must hold integer token ids, got {prefix_ids.dtype}")
    check_dense(prefix_ids, "prefix_ids")
    if prefix_ids.device.type == "meta":
        raise TensorDeviceError("prefix_ids is a meta tensor (shapes only, no token ids); pass the prompt's ids")
    b, t = prefix_ids.shape
    if b < 1:
        raise TensorShapeError("prefix_ids has no rows: pass at least one row of prompt token ids")
    return b, t, prefix_ids.detach().reshape(-1).cpu().numpy().astype(np.int64)


class BatchRequests(BatchSteps):
    """Pool requests of a batch: ``handles[i]`` holds row i's K/V, ``length`` tokens each.

    A step (one forward) is started by the first layer that sees it: ``begin_step(T)``
    extends every row by T tokens with ONE ``pool.extend`` and brings the batch's page
    table up to date (``StepPages``; the step's calls are ``BatchSteps``'); every layer then
    stores its new K/V into the step's slots and reads every row's K/V back through that table.
    """

    broken: str | None = None  # why a half-made step refuses all but close (``check_broken``)
    # The cache's layers (each with ``seen``), held weakly (each layer holds these requests): a
    # step starts only once every one has stored the last, so a forward cut short is refused
    # rather than built on (none: not checked).
    layers = WeakLayers()

    def __init__(self, pool: Any, *, layer_buffers: bool = True) -> None:
        layer_buffers = check_flag("layer_buffers", layer_buffers)
        if getattr(pool, "mla", False):
            raise InvalidArgumentError(
                "KVPoolCache stores per-head K and V; this pool is an MLA (latent) pool. "
                "Build a KVPool without kv_lora_rank/qk_rope_head_dim")
        self.pool = pool
        self.device = torch.device(pool.device)
        # On a CPU pool a tensor's ``is_cpu`` says what comparing its ``device`` would, without
        # making a device object (the fast path tests both K/V at every update).
        self.on_cpu = self.device.type == "cpu"
        self.cuda = self.device.type == "cuda"
        self.dtype, self.heads, self.head_dim = pool.compute_dtype, pool.num_kv_heads, pool.head_dim
        self.handles: np.ndarray | None = None  # int64 [B]
        self.prefix_unstarted = False  # rows opened on prefix_ids, no forward since
        self.length = 0
        self.prefix_mode = False
        self.cached_lens: np.ndarray | None = None  # prefix hits per row, when prefix_mode
        self._rows: torch.Tensor | None = None  # the rows' req_to_token rows (fp8 pools read through it)
        # This step's slots, row-major [B*T]: on the host, and as an index tensor on the pool's
        # device when a store needs one (None while the store views do).
        self.step_slots: np.ndarray | None = None
        self.new_slots: torch.Tensor | None = None
        self.before = -1  # the rows' length before this step
        self.step_shape: tuple[int, ...] = ()  # this step's K/V shape [B, H, T, D]
        # Per layer, this step's K and V destinations as [B, H, T, D] views of the caches
        # (StepPages.dst), when the step's slots are one strided run; else None and the
        # layers store through the pool's index store at new_slots, unless ``later``: the
        # layers add the step's tokens to their buffers, and ``flush`` stores them in the
        # pool from there (StepPages.later, store_tokens).
        self.dst: tuple[Any, Any] | None = None
        self.later = False
        # fp8 pools read K/V back dequantized through pool.read and a per-token index.
        self.fp8 = bool(getattr(pool, "fp8", False))
        self.slot_idx: torch.Tensor | None = None   # [B, length] long, this step (fp8 only)
        self.pages = None if self.fp8 else StepPages(pool, layer_buffers=layer_buffers)
        # KVPool's store without write()'s argument checks, which kv_ok / check_kv make here
        # (K/V in attention's [B, H, T, D] layout); None: a pool without it, use write().
        self.store = getattr(pool, "_store_bhtd", None)
        # Steps that store through StepPages need only the host slots of their extend.
        self.host_extend = self.pages is not None and hasattr(pool, "_extend_host")
        # Whether layers after a step's first may take KVPoolCache.update's short way: never in a
        # step under grad mode (``grad``), whose layers return copies (``_shared_rows.owned``).
        self.can_fast = self.pages is not None and self.store is not None
        self.fast = self.can_fast
        self.grad = False
        self.batch = -1  # rows opened (-1: none yet)
        # The rows were opened by this forward's first update and have held no token yet: a
        # first step that fails closes them again, leaving the pool as it was.
        self._fresh = False
        self._shared = False  # some row may share a page (prefix hit, fork)
        # The pool's count of calls that change requests (``kvpool.row_edits``) when the rows were
        # last checked: a step compares it, and looks further only when another call named the rows.
        self._edits = 0
        # A decode step's extend writes its slots here (the allocator's ``out=``) rather than
        # into a new array, and names one row by its int: the step is the host call the cache
        # makes most, and each array it makes or reads is host time. So ``step_slots`` of a
        # decode step is overwritten by the next one: whatever must outlive the step copies it.
        self._decode_slots: np.ndarray | None = None
        self._handle_arg: Any = None
        # Decode steps taken from a deferred plan (StepPages.take_deferred) that the core has
        # not been extended by yet, and (``unstored``) the slots, per row, of the last tokens the
        # core holds but the pool's caches do not (steps whose store StepPages defers, ``later``):
        # ``flush`` extends the core and stores them all.
        self.deferred = 0
        self.unstored: list[np.ndarray] = []  # [B, tokens] slot arrays, oldest first
        self._moved = False  # a counted call named the rows since ``unstored`` was taken

    # -- opening ------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        if self.handles is None:
            raise AttributeError("no rows yet: the batch size is learned at the first update")
        return int(self.handles.shape[0])

    def _set_handles(self, handles: np.ndarray) -> None:
        self.handles = np.ascontiguousarray(handles, dtype=np.int64)
        self.prefix_unstarted = False  # (open_with_prefix sets it once the rows are in place)
        self._edits = getattr(self.pool, "_row_edits", 0)  # (the cache's own calls: the rows are as it left them)
        self.batch = self.handles.shape[0]
        self._decode_slots = np.empty(self.batch, dtype=np.int64)
        self._handle_arg = int(self.handles[0]) if self.batch == 1 else self.handles
        if not self.batch:  # (an empty select): no K/V matches, so check_kv refuses an empty batch
            self.batch = -1
        self.slot_idx = self.dst = None
        self.later = False
        self.unstored = []  # flushed by whoever edited the rows (or a step cut short, dropped)
        self.before = -1  # no step under way: every layer takes the full update
        if self.pages is not None:
            self.pages.reset(self.handles.shape[0], private=not self._shared)
        else:
            self._rows = index_tensor(self.pool.rows(self.handles).astype(np.int64), getattr(self.pool, "_to_device", None),
                                      self.device)

    def ensure_open(self, batch: int) -> None:
        if self.handles is None:
            self._set_handles(self.pool.open(batch))
            self._fresh = True
        elif batch != self.handles.shape[0] and not repeat_prefix_rows(self, batch):
            raise TensorShapeError(batch_mismatch(batch, self.handles.shape[0]))

    def open_with_prefix(self, prefix_ids: torch.Tensor, salt: int | None) -> None:
        """Open one request per row of ``prefix_ids`` [B, T] on the longest cached prefix.

        Rows share one length in a transformers cache, so every row keeps only the
        shortest hit (the others are cut back to it, keeping their prompts; cutting into
        a shared page is copy-on-write in the core).
        """
        if not hasattr(self.pool, "open_with_prefix"):
            raise NotImplementedError(PREFIX_NEEDS_CORE)
        b, t, tokens = prefix_tokens(prefix_ids)
        handles, cached = self.pool.open_with_prefix(tokens, np.full(b, t, dtype=np.int64), salt=salt)
        cached = np.asarray(cached, dtype=np.int64)
        common = int(cached.min())
        if int(cached.max()) > common:
            # Keeping the prompts: a longer row recomputes its hit past ``common`` from the
            # prompt's token ids, so close(cache=True) publishes those pages again (truncate
            # would make them unknown positions, and the pages it let go are evictable).
            shorten = getattr(self.pool, "_truncate_keeping_prompts", self.pool.truncate)
            shorten(handles, np.full(b, common, dtype=np.int64))
        self._shared = True
        self._set_handles(handles)
        self.length, self.prefix_mode, self.cached_lens = common, True, cached
        self.prefix_unstarted = True  # until a forward: generate may still expand the batch

    # -- a step -------------------------------------------------------------------------
    def kv_ok(self, key_states: Any, value_states: Any) -> bool:
        """Whether a step's K/V are what ``check_kv`` accepts for the open rows (the test run at
        every update; anything else goes through ``check_kv`` and ``ensure_open``)."""
        if not (isinstance(key_states, torch.Tensor) and isinstance(value_states, torch.Tensor)):
            return False
        ks = key_states.shape
        return (key_states.layout is STRIDED and value_states.layout is STRIDED
                and key_states.dtype == self.dtype and value_states.dtype == self.dtype and len(ks) == 4
                and ks == value_states.shape and ks[0] == self.batch and ks[1] == self.heads
                and ks[2] > 0 and ks[3] == self.head_dim and key_states.device == self.device
                and value_states.device == self.device)

    def check_kv(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Raise the typed error of what is wrong with a step's K/V."""
        pool = self.pool
        for name, x in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(x, torch.Tensor) or x.ndim != 4:
                raise TensorShapeError(f"{name} must be a [batch, kv_heads, tokens, head_dim] tensor")
            check_dense(x, name)
            if x.shape[1] != pool.num_kv_heads or x.shape[3] != pool.head_dim:
                raise TensorShapeError(
                    f"{name} has {x.shape[1]} kv heads of dim {x.shape[3]}; the pool was built for "
                    f"num_kv_heads={pool.num_kv_heads}, head_dim={pool.head_dim} "
                    "(use pool_for_model(model) to size it from the model's config)")
            check_kv_type(name, x, pool.compute_dtype, self.device)
        if key_states.shape != value_states.shape:
            raise TensorShapeError(f"key_states {list(key_states.shape)} and value_states "
                                   f"{list(value_states.shape)} differ")
        check_not_empty(key_states)

    def write(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Store the step's K/V [B, H, T, D] of ``layer`` at the step's slots with ``pool.write``
        (or, for a step the pool gets from the layer buffers at the next flush, add it there)."""
        if self.later:
            assert self.pages is not None
            self.pages.add(layer, key_states, value_states)
            return
        b, h, t, d = key_states.shape
        k = key_states.transpose(1, 2).reshape(b * t, h, d)  # row-major like the extend's slots
        v = value_states.transpose(1, 2).reshape(b * t, h, d)
        self.pool.write(layer, self.step_slots if self.new_slots is None else self.new_slots, k, v)

    def gather(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's K/V of ``layer`` in token order, as [B, kv_heads, length, head_dim]."""
        if self.pages is not None:
            return self.pages.kv(layer)
        idx = self.slot_idx
        assert idx is not None
        h, d = self.pool.num_kv_heads, self.pool.head_dim
        k, v = self.pool.read(layer, idx.reshape(-1))
        k, v = k.view(*idx.shape, h, d), v.view(*idx.shape, h, d)
        return k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()

    # -- whole-batch edits --------------------------------------------------------------
    def truncate(self, length: int) -> None:
        if self.handles is None or length == self.length:
            return
        if not 0 <= length < self.length:
            raise InvalidArgumentError(f"cannot crop to {length} tokens: the cache holds {self.length}")
        # (rows truncated through the pool are not refused: a crop to their length goes on from there)
        # Under the pool's lock from the check to the stores: another thread's close of these rows
        # between the truncate and store_below would let a new request take their slots first.
        with pool_lock(self.pool):
            self.check_edits(lengths=False)
            self.flush()
            self.pool.truncate(self.handles, np.full(self.handles.shape[0], length, dtype=np.int64))
            if self.deferred or self.unstored:  # (the flush declined: rows truncated through the pool)
                store_below(self, length)
        self.length = length
        self._set_handles(self.handles)  # the page table is read again at the next step

    def reorder(self, sources: Sequence[int]) -> None:
        """Row j continues row ``sources[j]``; rows nobody continues are closed
        (``_reorder.reorder_rows``)."""
        reorder_rows(self, sources)

    def close(self) -> None:
        """Give every row's pages back (prompt pages stay in the prefix cache in prefix mode,
        unless the last forward was cut short: some layers never stored its tokens, so its
        pages are not published; those published before it stay cached)."""
        self.broken = None  # (its rows go with the rest)
        if self.handles is not None:
            publish = self.prefix_mode and self.length > 0 and all(x.seen == self.length for x in self.layers)
            # Deferred steps and stores are dropped with the rows: their pages are freed whole, and
            # a prefix-mode batch (the one that publishes) defers none (its rows share pages).
            self.deferred, self.unstored = 0, []
            handles, self.handles, self._rows, self.slot_idx, self.dst = self.handles, None, None, None, None
            self.later = False
            self.before = -1
            self.batch = -1
            if self.pages is not None:
                self.pages.release()
            close_rows(self.pool, handles, publish)
        self.length = 0
        self.prefix_mode, self.cached_lens, self._shared, self._fresh = False, None, False, False
