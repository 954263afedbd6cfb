"""KVPool: K/V tensors and a request-to-token table bound to a SlotAllocator.

The allocator (Rust) decides which slots each request owns; this layer owns
every torch tensor. It never keeps its own copy of ownership state and never
reads a device tensor back: ``req_to_token`` is a write-only mirror updated
with one batched write per ``extend``. Every tensor it keeps is created under
``persistent()`` (``inference_mode(False)`` then ``no_grad()``), so the pool
works the same whether it was built or is used under inference mode, no_grad,
grad mode, torch.compile or from another thread; it never changes the
caller's grad mode.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kvpool._core import InvalidArgumentError, SlotAllocator
from kvpool._eager import prepare as prepare_eager
from kvpool._forksafe import POOL
from kvpool._forksafe import track as track_for_fork
from kvpool._nopickle import NotPicklable
from kvpool.admission import AdmissionMixin
from kvpool.capacity import bytes_per_slot, resolve_num_pages, table_bytes
from kvpool.extending import ExtendOps
from kvpool.heads import shard_kv_heads
from kvpool.host_tier import HostTierMixin, resolve_host_pages
from kvpool.kernels import require_triton
from kvpool.layout import LAYOUTS, KVStorage, padded_row_stride
from kvpool.lifecycle import RequestOps
from kvpool.modes import persistent
from kvpool.out_of_memory import refuse_out_of_memory
from kvpool.pool_views import PoolViews
from kvpool.row_edits import RowEdits
from kvpool.rows import RowsMixin
from kvpool.sharing import SharingMixin
from kvpool.staging import PinnedRing
from kvpool.streams import CopyOrder, refuse_capture
from kvpool.tables import ExtendResult, PageTable, page_table_tensors
from kvpool.torch_types import CACHE_DTYPES, COMPUTE_DTYPES, FP8_DTYPES, as_device

__all__ = ["ExtendResult", "KVPool", "PageTable"]


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
    return int(value)


class KVPool(NotPicklable, PoolViews, RequestOps, ExtendOps, SharingMixin, AdmissionMixin, RowsMixin,
             HostTierMixin, RowEdits):
    """Per-layer K/V caches (or MLA latent caches) plus ``req_to_token``.

    Capacity: exactly one of ``num_pages`` / ``num_slots`` (totals, reserved
    page 0 included, as in ``SlotAllocator``), ``memory_bytes`` or
    ``memory_fraction`` (of the device's free memory, counting what torch's caching
    allocator holds unused, or on the CPU of the host's available memory, MemAvailable; budgets cover the K/V pages plus the tables). ``layout`` picks what ``k_buffer(layer)`` returns:
    ``"token"`` ``[num_slots, H, D]`` or ``"paged"`` ``[num_pages, P, H, D]``
    (same memory either way). MLA: give ``kv_lora_rank`` and
    ``qk_rope_head_dim``, ``num_kv_heads=1`` and ``head_dim`` = their sum.
    FP8 (``dtype=torch.float8_e4m3fn``): writes take ``compute_dtype`` rows
    (default bfloat16) and store ``clamp(x / scale)``; ``read`` multiplies back;
    scales are per layer in ``k_scale`` / ``v_scale`` (float32, initially 1);
    set them in place (``pool.k_scale[layer] = s`` or ``.copy_``), never by
    rebinding the attribute: writes and captured graphs read these tensors.

    Request operations, queries and counters (``open``, ``close``, ``lengths``,
    ``free_pages``, ``check``, ...) are the allocator's, forwarded (see
    ``kvpool.lifecycle.RequestOps``); ``pool.allocator`` is never needed for ordinary work.

    Shared pages: ``open_with_prefix`` starts requests on cached pages of a
    common prefix, ``cache`` / ``close(cache=True)`` publish pages, ``fork``
    shares a request's pages, and ``extend`` runs copy-on-write copies on the
    device (see ``kvpool.sharing``). ``hash_seed`` fixes the prefix hash (ranks
    and routers that must agree); ``handle_seed`` fixes the handle generations
    (random otherwise), so pools built with the same seed that make the same
    calls hand out the same handles (tensor-parallel ranks; ``tp_pool`` passes
    one agreed seed to both); ``kv_events=False`` stops recording events for
    ``take_events``. Retention priorities (``cache(handles, priority=,
    retain_s=)``, ``unpin``): ``max_pinned_pages`` bounds the pinned pages (a
    quarter of the pool by default) and ``manual_clock=True`` runs durations
    on a clock only ``set_clock`` moves (see ``SlotAllocator``).
    ``lazy_metadata=True`` leaves the allocator's metadata to be mapped on
    first use, for a pool sized far beyond what it will hold (construction is
    then cheaper and the first requests pay the page faults; see
    ``SlotAllocator``).

    Host tier: ``host_pages`` (reserved host page 0 included; 0 or None: no
    tier, and the pool behaves exactly as without one) or ``host_memory_bytes``
    (rounded down to whole host pages) adds page-major host storage below the
    device pages (pinned on CUDA), and ``host_policy`` (``"write_back"``,
    the default, or ``"write_through"``) says when cached pages are copied to
    it. Cached prefixes evicted from the device then hit from the host, and
    ``swap_out`` / ``swap_in`` move whole requests. Every call that can queue
    a transfer runs it before returning, under the lock, offloads then loads
    then copy-on-write copies (see ``kvpool.host_tier``, docs/tiers.md).

    Raises (constructor):
        InvalidArgumentError: a bad size, dtype, layout, device or capacity
            (nothing is allocated).
        TritonUnavailableError: a CUDA device and no usable Triton.

    Hybrid models: ``layer_types=[...]`` (Hugging Face names: ``"full_attention"``,
    ``"sliding_attention"``, ``"linear_attention"``, ``"mamba"``) with
    ``sliding_window=W`` and ``state_shapes={...}`` builds a ``kvpool.hybrid.HybridKVPool``
    instead: one group of pages (or state rows) per layer type, per-layer
    ``write`` / ``read`` / ``page_table`` / ``req_to_token[layer]`` (docs/hybrid.md).

    Tensor parallelism: ``tp_rank``/``tp_size`` with ``num_kv_heads`` the model's
    total; the pool holds ``num_kv_heads / tp_size`` heads (``num_kv_heads`` is
    then this rank's count, ``kv_head_start`` its first head; MLA replicates the
    latent cache). Moving requests between pools and checking that ranks agree
    are ``kvpool.distributed``'s (``send_request(pool, ...)``, ``tp_pool``), a
    layer above this one; see docs/distributed.md.

    Threads: one pool may be shared between threads. Every call that changes
    who owns what (``open``, ``admit``, ``extend``, ``truncate``, ``close``,
    ``cache``, ``unpin``, ``set_clock``, ``fork``, the ``open_with_*`` calls,
    ``evict``, ``clear_cache``, ``reset``, ``swap_out``, ``swap_in``; also ``kvpool.distributed``'s ``send_request`` / ``recv_request``)
    holds the pool's lock for its whole duration, copy-on-write copies
    included, so no thread can free and reuse a page before a copy has read it.
    Queries and counters take only the core's own lock; ``write`` and ``read``
    take none (a request's owner writes its own slots). The caller orders the
    rest: until another thread's writes into a request's slots have run, do not
    ``close``, ``truncate``, ``swap_out``, ``fork`` or ``cache`` it (``extend`` is fine: its new
    slots are not the ones being written), and never extend one request from two
    threads at once (docs/kernels-and-graphs.md, "Threads"). Under
    ``TRITON_INTERPRET=1`` (Triton's CPU interpreter, a test mode) run K/V calls from
    one thread: the interpreter is not thread-safe.

    Streams (CUDA): everything a pool call enqueues (H2D copies, the table
    kernel, copy-on-write copies) goes on the caller's current stream. An engine
    whose forward runs on another stream makes that stream wait for it
    (``wait_stream`` or an event) before its kernels read the tables or write
    K/V. Calls that stage host data (``extend``, ``admit``, ``page_table``,
    ``fork``, the ``open_with_*`` calls) raise ``TensorDeviceError`` while that
    stream is capturing a CUDA graph, before anything changes; with a host tier so
    do the calls that would queue transfers (``swap_out``, ``swap_in``; ``cache``
    and ``close(cache=True)`` under write_through, ``evict`` under write_back). See
    docs/kernels-and-graphs.md ("Streams and threads").
    """

    _pickle_refusal = "it owns this process's K/V tensors and allocator state"

    def __new__(cls, *args: Any, layer_types: Any = None, **kwargs: Any) -> Any:
        # Hybrid models (layer_types) get the grouped pool; every other call is
        # today's pool, built by __init__ as before.
        if layer_types is None:
            # None is each one's documented default (__init__'s signature): passed explicitly, it
            # asks for nothing, as when it is left out.
            stray = sorted(k for k in ("sliding_window", "state_shapes", "group_pages")
                           if kwargs.get(k) is not None)
            if stray:
                raise InvalidArgumentError(f"{', '.join(stray)} applies to hybrid pools: pass layer_types=[...] too")
            return super().__new__(cls)
        from kvpool.hybrid import HybridKVPool

        return HybridKVPool(*args, layer_types=layer_types, **kwargs)

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float16,
        device: Any = "cpu",
        page_size: int = 1,
        num_pages: int | None = None,
        num_slots: int | None = None,
        memory_bytes: int | None = None,
        memory_fraction: float | None = None,
        max_requests: int = 256,
        max_context_len: int = 4096,
        layout: str = "token",
        # Not None: KVPool.__new__ built a HybridKVPool instead, which takes these four (they
        # are here so that help(), inspect and type checkers take the documented hybrid call).
        layer_types: Sequence[str] | None = None,
        sliding_window: int | None = None,
        state_shapes: Mapping[str, Any] | None = None,
        group_pages: Mapping[str, int] | None = None,
        kv_lora_rank: int | None = None,
        qk_rope_head_dim: int | None = None,
        compute_dtype: torch.dtype | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        hash_seed: int | None = None,
        handle_seed: int | None = None,
        kv_events: bool = True,
        max_pinned_pages: int | None = None,
        manual_clock: bool = False,
        host_pages: int | None = None,
        host_memory_bytes: int | None = None,
        host_policy: str = "write_back",
        lazy_metadata: bool = False,
    ) -> None:
        prepare_eager()  # (torch.compile's eager wrappers, if Dynamo is loaded: see kvpool._eager)
        self.num_layers = _positive("num_layers", num_layers)
        # Tensor parallelism: num_kv_heads is the model's total; this rank keeps its shard.
        shard = shard_kv_heads(_positive("num_kv_heads", num_kv_heads), tp_rank, tp_size,
                               mla=kv_lora_rank is not None or qk_rope_head_dim is not None)
        self.tp_rank, self.tp_size = int(tp_rank), int(tp_size)
        self.total_kv_heads, self.kv_head_start, num_kv_heads = shard.total, shard.start, shard.heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = _positive("head_dim", head_dim)
        self.page_size = _positive("page_size", page_size)
        self.max_requests = _positive("max_requests", max_requests)
        self.max_context_len = _positive("max_context_len", max_context_len)
        if not isinstance(layout, str) or layout not in LAYOUTS:
            raise InvalidArgumentError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if not isinstance(dtype, torch.dtype) or dtype not in CACHE_DTYPES:
            # Before any allocation: float64 or an fnuz fp8 passed a floating-point test and was
            # refused only once the caches, the table and the allocator existed.
            raise InvalidArgumentError(f"dtype must be a floating torch.dtype the pool stores, one of "
                                       f"{[str(d) for d in CACHE_DTYPES]}, got {dtype!r}")
        self.layout, self.dtype, self.device = layout, dtype, as_device(device)
        if self.device.type not in ("cpu", "cuda"):
            # e.g. "meta" holds no data: every table update would fail after
            # the allocator committed.
            raise InvalidArgumentError(f"a KVPool lives on a 'cpu' or 'cuda' device, got {self.device}")
        require_triton(self.device)  # before any allocation: CUDA pools move K/V with Triton only
        self.fp8 = dtype in FP8_DTYPES
        if compute_dtype is None:
            compute_dtype = torch.bfloat16 if self.fp8 else dtype
        elif not isinstance(compute_dtype, torch.dtype):
            raise InvalidArgumentError(f"compute_dtype must be a torch.dtype, got {type(compute_dtype).__name__}")
        elif not self.fp8 and compute_dtype != dtype:
            raise InvalidArgumentError(f"compute_dtype {compute_dtype} differs from dtype {dtype}: only fp8 pools convert")
        elif compute_dtype not in COMPUTE_DTYPES:
            # (the fnuz/e8m0 fp8 formats are floating too: reads converted to them came back wrong)
            raise InvalidArgumentError(f"compute_dtype must be one of {', '.join(map(str, COMPUTE_DTYPES))} "
                                       f"(what an fp8 pool's reads convert to), got {compute_dtype!r}")
        self.compute_dtype = compute_dtype
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        self.mla = self._check_mla(kv_lora_rank, qk_rope_head_dim)

        self.bytes_per_slot = bytes_per_slot(num_layers, num_kv_heads, head_dim, dtype, mla=self.mla)
        scale_bytes = 0 if not self.fp8 else 4 * num_layers * (1 if self.mla else 2)
        self.table_bytes = table_bytes(max_requests, max_context_len)
        pages = resolve_num_pages(
            page_size=self.page_size, slot_bytes=self.bytes_per_slot, fixed_bytes=self.table_bytes + scale_bytes,
            num_pages=num_pages, num_slots=num_slots, memory_bytes=memory_bytes,
            memory_fraction=memory_fraction, device=self.device,
        )
        # Held for the whole of every call that changes ownership (see the class doc).
        # Reentrant: send/recv_request hold it around the pool calls they make.
        self._lock = threading.RLock()
        track_for_fork(self, "_lock", POOL)
        host = resolve_host_pages(self, host_pages, host_memory_bytes)
        # The allocator validates its own arguments; make it before any tensor
        # so a bad config fails without allocating device memory.
        self.allocator = SlotAllocator(
            pages, self.page_size, self.max_requests, self.max_context_len, hash_seed=hash_seed,
            handle_seed=handle_seed, kv_events=kv_events, max_pinned_pages=max_pinned_pages,
            manual_clock=manual_clock, host_pages=host, host_policy=host_policy, lazy_metadata=lazy_metadata,
        )
        # Set once a page can have two holders (fork, a prefix hit): from then
        # on extend asks the core for copy-on-write work.
        self._sharing = False
        # fork, swap_in, truncate, swap_out, close and reset count there, with the handles they
        # named: a KVPoolCache keeps its rows' page table and length across steps (``row_edits``).
        self._init_row_edits()
        self.num_pages, self.num_slots = pages, pages * self.page_size
        self.null_row = self.max_requests

        self._storage = KVStorage(
            num_layers=self.num_layers, num_pages=pages, page_size=self.page_size, heads=self.num_kv_heads,
            dim=self.head_dim, dtype=dtype, device=self.device, layout=layout, mla=self.mla,
        )
        with persistent():
            # Last row = null row: padded batch entries read it; nothing writes it.
            # A column slice of a wider table: rows sit an odd number of cache
            # lines apart (layout.padded_row_stride), not max_context_len * 4
            # bytes, which is a multiple of 4 KiB for power-of-two lengths.
            with refuse_out_of_memory("req_to_token", self.table_bytes, self.device, "use a smaller max_requests or max_context_len"):
                self.req_to_token = torch.zeros((self.max_requests + 1, padded_row_stride(self.max_context_len)),
                                                dtype=torch.int32, device=self.device)[:, : self.max_context_len]
            self.k_scale: torch.Tensor | None = None
            self.v_scale: torch.Tensor | None = None
            if self.fp8:
                self.k_scale = torch.ones(self.num_layers, dtype=torch.float32, device=self.device)
                # MLA has one latent cache, hence one scale (v_scale is the same tensor).
                self.v_scale = self.k_scale if self.mla else torch.ones_like(self.k_scale)
            # Views of detached aliases: the same storage, so a scale set in place later is
            # what the kernels read, but never autograd's (a scale assigned from a Parameter
            # in grad mode makes k_scale require grad, and a no_grad view of it then raises
            # in grad mode, halfway through a write).
            self._scales = [
                [s.detach()[i : i + 1] for i in range(self.num_layers)]
                for s in (self.k_scale, self.v_scale) if s is not None
            ]
        # On CPU the table is host memory: the core writes new slots straight into
        # this numpy view of it inside extend's one crossing (zero copy, no torch
        # op on the hot path). Elsewhere extend ships the core's packed result
        # with one copy to kvpool.kernels.write_req_to_token.
        self._table_np: np.ndarray | None = self.req_to_token.numpy() if self.device.type == "cpu" else None
        # CUDA: every host -> device copy (extend's packed update, page tables, host
        # slots given to write) goes through pinned buffers guarded by events: from
        # pageable memory the driver may synchronise with the stream to stage it.
        self._to_device = PinnedRing(self.device).to_device if self.device.type == "cuda" else None
        # CUDA: orders copy-on-write copies before later page hand-outs on other streams.
        self._order: CopyOrder | None = CopyOrder(self.device) if self.device.type == "cuda" else None
        self._init_rows()  # per-layer views, scales and geometry for write / read
        self._init_host_tier(host)

    def _enter_device_call(self, what: str) -> None:
        """Start of a call that stages host data and hands out pages, on a pool
        that stages through the pinned ring (CUDA); the lock is held.

        Refused during CUDA graph capture (before the core changes anything), and
        the caller's stream waits for earlier copy-on-write copies made on another.
        """
        refuse_capture(self.device, what)
        if self._order is not None:
            self._order.wait()
        if self._transfers is not None:  # and for the host tier's transfers
            self._transfers.wait()

    def _check_mla(self, rank: int | None, rope: int | None) -> bool:
        if rank is None and rope is None:
            return False
        if rank is None or rope is None:
            raise InvalidArgumentError("MLA needs both kv_lora_rank and qk_rope_head_dim (or neither)")
        width = _positive("kv_lora_rank", rank) + _positive("qk_rope_head_dim", rope)
        if self.num_kv_heads != 1 or self.head_dim != width:
            raise InvalidArgumentError(
                f"an MLA pool stores one latent head per slot: pass num_kv_heads=1 and "
                f"head_dim=kv_lora_rank+qk_rope_head_dim={width} "
                f"(got num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim})"
            )
        return True

    # ----- request operations that touch the tables ------------------------
    # (open, truncate, close, reset and the allocator's queries and counters
    # come from RequestOps; extend and its roll-back from ExtendOps)

    def page_table(self, handles: Any) -> PageTable:
        """FlashInfer's CSR page table of a batch as int32 tensors on the pool's device.
        See ``SlotAllocator.page_table``.

        Returns:
            ``PageTable(kv_indptr [B+1], kv_indices, kv_last_page_len [B])``
            (zero copy on CPU; on CUDA one H2D copy from pinned staging).

        Raises:
            TensorDeviceError: called while a CUDA graph is being captured on the
                pool's device (its host -> device copy cannot be captured).
        """
        if self._to_device is not None:
            refuse_capture(self.device, "page_table")
        return page_table_tensors(*self.allocator.page_table(handles), self.device, self._to_device)

    def __repr__(self) -> str:
        kind = f"mla(rank={self.kv_lora_rank}, rope={self.qk_rope_head_dim})" if self.mla else "mha"
        return (
            f"KVPool({kind}, layers={self.num_layers}, heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"dtype={self.dtype}, device={self.device}, layout={self.layout}, page_size={self.page_size}, "
            f"num_slots={self.num_slots}, nbytes={self.nbytes}, overhead_bytes={self.overhead_bytes})"
        )
