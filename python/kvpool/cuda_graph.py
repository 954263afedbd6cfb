"""DecodeGraphRunner: capture an engine's decode step in CUDA graphs, one per batch-size bucket.

A decode step is hundreds of small launches (per layer: projections, attention,
the K/V store into the pool). Captured once per bucket, a step costs one graph
replay. The runner owns the step's inputs as static device buffers, pads each
real batch up to the smallest bucket that fits, copies the inputs in, replays,
and returns the real rows.

Padding (so padded entries are harmless and never touch a live request):
  input_ids 0, positions 0,
  out_cache_loc 0  — slot 0 lies in page 0, which the allocator never hands out:
                     padded tokens' K/V land there (the SGLang convention),
  req_rows pool.null_row — an all-zero req_to_token row: padded requests "own" slot 0,
  seq_lens pad_seq_len (default 1) — each padded request attends to one token
                     (slot 0). 1 rather than 0 because many attention kernels
                     divide by the length or assume >= 1; the rows are discarded.

Grad mode: graphs are keyed by the caller's mode (inference_mode / no_grad /
grad) and captured and replayed in that mode, so outputs are the same kind of
tensor the eager step would return. Static buffers are created in persistent
mode (inference_mode(False) then no_grad()), so they are normal tensors that
accept in-place copies in every mode.

Inputs: host inputs (lists, numpy arrays, CPU tensors) are checked on the host:
integers only, every value within int64 (a uint64 2**64 - 1 would otherwise wrap to
-1, which for out_cache_loc means padding: a silently skipped write), and
out_cache_loc below the pool's num_slots, as ``KVPool.write`` checks host slots.
They are packed into one array and staged through the pool's pinned ring
(``kvpool.staging.PinnedRing``), so the host never waits for an earlier step's
copy and may run several steps ahead of the GPU. Device inputs are copied
device-to-device unchecked (a check would sync).

Outputs: a replay returns views into its graph's output tensors, and every
bucket's graph allocates from one shared private memory pool (so that the
buckets together cost about as much memory as the largest). Replaying another
bucket may therefore reuse, and overwrite, the memory of this bucket's outputs:
a returned output is valid until the next run() of ANY bucket (the SGLang /
vLLM convention). Consume it (sample, copy to host) before the next step, clone
it to keep it, or pass copy_outputs=True to get fresh tensors from every run()
at the cost of one device copy per output. The runner uses the current CUDA
stream and is not thread-safe (one runner per thread).
On CPU, or with enable_graphs=False, the same padding and buffers are used and
the step runs eagerly, so results are identical to the graph path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np
import torch

from kvpool._core import InvalidArgumentError, InvariantError
from kvpool._nopickle import NotCopyable
from kvpool.graph_inputs import INPUT_NAMES, apart_from, check_inputs
from kvpool.graph_outputs import slice_rows as _slice_rows
from kvpool.kernels._guard import on_device
from kvpool.modes import persistent
from kvpool.staging import PinnedRing, to_device
from kvpool.torch_types import as_device
from kvpool.validate import check_flag, check_pool, is_int

__all__ = ["DecodeGraphRunner", "default_buckets", "grad_mode"]

LOC = INPUT_NAMES.index("out_cache_loc")
# Device inputs of these dtypes load with one torch.stack into the int64 buffer; torch does not
# promote uint16/uint32 inputs, which keep a copy each.
_STACKED = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})


#: The largest batch ``default_buckets`` plans for (engines capture a few hundred);
#: past it the list itself (one graph per bucket) would not fit in memory.
MAX_DEFAULT_BATCH = 1 << 20


def default_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8, up to (and covering) max_batch_size."""
    if not is_int(max_batch_size) or not 1 <= max_batch_size <= MAX_DEFAULT_BATCH:
        raise InvalidArgumentError(f"max_batch_size must be an int in [1, {MAX_DEFAULT_BATCH}], "
                                   f"got {type(max_batch_size).__name__} {max_batch_size!r}")
    max_batch_size = int(max_batch_size)
    out = [b for b in (1, 2, 4, 8) if b < max_batch_size]
    b = 16
    while b < max_batch_size:
        out.append(b)
        b += 8
    out.append(max_batch_size if max_batch_size <= 8 else -(-max_batch_size // 8) * 8)
    return sorted(set(out))


def grad_mode() -> str:
    """The calling thread's grad mode: 'inference_mode', 'no_grad' or 'grad'."""
    if torch.is_inference_mode_enabled():
        return "inference_mode"
    return "grad" if torch.is_grad_enabled() else "no_grad"


# What the step returns, and run() with it; Any where unnamed (a bare `DecodeGraphRunner`
# annotation, which --strict would refuse without the default; typing's needs Python 3.13).
if TYPE_CHECKING:
    from typing_extensions import TypeVar as _TypeVar
    _Out = _TypeVar("_Out", default=Any)
else:
    _Out = TypeVar("_Out")


class DecodeGraphRunner(NotCopyable, Generic[_Out]):
    """Run ``step(input_ids, positions, req_rows, out_cache_loc, seq_lens) -> logits``
    through per-bucket CUDA graphs (or eagerly on CPU / with enable_graphs=False).

    ``step`` receives five int64 device tensors of length ``bucket`` (static
    buffers: never keep references expecting their contents to stay; passing one back
    to ``run`` as an input is fine, it is copied before the load) and must
    write K/V through the pool with device-side ops only (no .item(), no
    allocation-dependent host logic) to be capturable. Its output (a tensor, or a
    tuple/list of tensors) is sliced to the real batch along dim 0; it stays valid
    until the next ``run()`` of any bucket unless ``copy_outputs=True``.
    """

    _copy_refusal = "its graphs run on its own static buffers, which a copy would share; build another runner"

    def __init__(
        self,
        pool: Any,
        step: Callable[..., _Out],
        max_batch_size: int,
        buckets: Sequence[int] | None = None,
        enable_graphs: bool = True,
        debug: bool = False,
        *,
        pad_seq_len: int = 1,
        warmup_iters: int = 2,
        copy_outputs: bool = False,
    ) -> None:
        check_pool(pool, "DecodeGraphRunner", ("device", "null_row"))
        if getattr(pool, "groups", None) is not None:  # a hybrid pool: one out_cache_loc per group, not one
            raise InvalidArgumentError("DecodeGraphRunner takes a plain kvpool.KVPool: a hybrid pool's step has one "
                                       "out_cache_loc per layer group (ExtendResult.out_cache_loc is a list), and "
                                       "the runner stages and range-checks one; run a hybrid pool's decode eagerly")
        if not callable(step):
            raise InvalidArgumentError(f"step must be callable, got {type(step).__name__}")
        if not is_int(max_batch_size) or not 1 <= max_batch_size <= MAX_DEFAULT_BATCH:
            raise InvalidArgumentError(f"max_batch_size must be a positive int (at most {MAX_DEFAULT_BATCH}), "
                                       f"got {type(max_batch_size).__name__} {max_batch_size!r}")
        max_batch_size = int(max_batch_size)
        enable_graphs = check_flag("enable_graphs", enable_graphs)
        debug = check_flag("debug", debug)
        copy_outputs = check_flag("copy_outputs", copy_outputs)
        if buckets is None:
            buckets = default_buckets(max_batch_size)
        else:
            given = buckets
            if not isinstance(given, (list, tuple, range, np.ndarray)) or not all(is_int(b) for b in given):
                raise InvalidArgumentError(f"buckets must be positive ints, got {given!r}")
            buckets = sorted({int(b) for b in given})
            if not buckets or buckets[0] < 1 or buckets[-1] > MAX_DEFAULT_BATCH:
                raise InvalidArgumentError(f"buckets must be positive ints (at most {MAX_DEFAULT_BATCH}), got {buckets!r}")
            if buckets[-1] < max_batch_size:
                raise InvalidArgumentError(
                    f"largest bucket {buckets[-1]} < max_batch_size {max_batch_size}: "
                    "a full batch would have no graph"
                )
        if not is_int(pad_seq_len) or not 0 <= pad_seq_len < 1 << 63:
            raise InvalidArgumentError(f"pad_seq_len must be an int >= 0 (and < 2**63: seq_lens are int64), "
                                       f"got {pad_seq_len!r}")
        ctx = getattr(pool, "max_context_len", None)
        if is_int(ctx) and pad_seq_len > ctx:  # padded rows would read past their table row
            raise InvalidArgumentError(f"pad_seq_len {pad_seq_len} is past the pool's max_context_len {int(ctx)}: "
                                       f"padded rows must carry a length a real row may have, [0, {int(ctx)}]")
        if not is_int(warmup_iters) or warmup_iters < 1:
            raise InvalidArgumentError(f"warmup_iters must be an int >= 1, got {warmup_iters!r}")
        self.pool, self.step = pool, step
        self.max_batch_size, self.buckets = max_batch_size, list(buckets)
        self.device = as_device(pool.device)
        self.use_graphs = bool(enable_graphs) and self.device.type == "cuda"
        self.debug, self.warmup_iters = bool(debug), int(warmup_iters)
        self.copy_outputs = bool(copy_outputs)
        width = self.buckets[-1]
        # Python ints for the per-step fill_() calls (indexing the tensor and
        # converting with int() cost a tensor op and .item() per row every run()).
        self._pad_vals = (0, 0, int(pool.null_row), 0, int(pad_seq_len))
        num_slots = getattr(pool, "num_slots", None)
        self._num_slots = int(num_slots) if num_slots is not None else None
        max_context_len = getattr(pool, "max_context_len", None)
        self._max_context_len = int(max_context_len) if is_int(max_context_len) else None
        with persistent():
            self._pad = torch.tensor(self._pad_vals, dtype=torch.int64, device="cpu")
            self._pad_dev = self._pad.to(self.device)
            self._static = torch.empty((len(INPUT_NAMES), width), dtype=torch.int64, device=self.device)
            # Every input's pad value across the widest bucket: a step's padding is one slice of it.
            self._pad_wide = self._pad_dev.view(-1, 1).expand(-1, width)
            self._static.copy_(self._pad_wide)
        # Host inputs -> device: the pool's pinned ring (a true async DMA, and a buffer
        # is reused only once its copy has run), so run() never waits for the previous
        # step's copy. None on CPU: the inputs are written straight into the buffers.
        self._to_device: Callable[[np.ndarray], torch.Tensor] | None = None
        if self.device.type == "cuda":
            self._to_device = getattr(pool, "_to_device", None) or PinnedRing(self.device).to_device
        # Per-bucket views of the static buffer, made once (the buffer never moves).
        self._bucket_views: dict[int, tuple[torch.Tensor, ...]] = {}
        # The pool's record of slots it may trust while unchanged: after run() loads
        # host-checked values into out_cache_loc, the step's writes skip a second check.
        self._trust_slots: Callable[..., None] | None = getattr(pool, "_trust_slots", None)
        self._graphs: dict[tuple[str, int], tuple[Any, Any]] = {}
        self._mempool: Any = None
        self._ptrs: list[int] | None = None

    # ----- public API ------------------------------------------------------

    def bucket_for(self, n: int) -> int:
        """The bucket ``run`` pads a batch of ``n`` requests to: the smallest of ``buckets`` >= ``n``.

        Raises:
            InvalidArgumentError: ``n`` is not an int in [0, max_batch_size].
        """
        if not is_int(n) or n < 0:
            raise InvalidArgumentError(f"n must be a batch size, an int in [0, {self.max_batch_size}], "
                                       f"got {type(n).__name__} {n!r}")
        if n > self.max_batch_size:  # (as run says: buckets may reach past max_batch_size)
            raise InvalidArgumentError(f"batch of {n} exceeds max_batch_size {self.max_batch_size}")
        return next(b for b in self.buckets if b >= n)  # (the largest bucket covers max_batch_size)

    @property
    def captured(self) -> list[tuple[str, int]]:
        """(grad mode, bucket) pairs that have a graph."""
        return sorted(self._graphs)

    def capture(self, buckets: Sequence[int] | None = None) -> None:
        """Capture graphs for `buckets` (None: all of them; an empty sequence: none) in
        the caller's grad mode, largest first so smaller graphs reuse the shared private
        memory pool. No-op on CPU / with graphs disabled."""
        # Checked on every device, so that a call that works on CPU works on a GPU.
        if buckets is not None and not isinstance(buckets, (list, tuple, range, np.ndarray)):
            raise InvalidArgumentError(f"buckets must be a sequence of the runner's buckets {self.buckets}, "
                                       f"got {type(buckets).__name__} {buckets!r}")
        # (an engine that filtered its list down to nothing asks for no graphs, not all of them)
        todo = list(self.buckets) if buckets is None else list(buckets)
        for b in todo:
            if not is_int(b) or b not in self.buckets:
                raise InvalidArgumentError(f"{b!r} is not one of the buckets {self.buckets}")
        if not self.use_graphs:
            return
        todo = sorted(todo, reverse=True)
        with on_device(self.device):  # capture on the pool's device, whichever is current
            for b in todo:
                self._capture(grad_mode(), b)

    def run(self, input_ids: Any, positions: Any, req_rows: Any, out_cache_loc: Any, seq_lens: Any) -> _Out:
        """Run one decode step for a real batch of n = len(input_ids) requests.

        Inputs: 1-D integer tensors (any device), numpy arrays or lists of length n.
        Returns the step's output sliced to the first n rows: views into graph memory
        that the next run() of any bucket may overwrite, or fresh tensors when the
        runner was made with copy_outputs=True."""
        n, args = self._check_inputs((input_ids, positions, req_rows, out_cache_loc, seq_lens))
        bucket = self.bucket_for(n)
        # Copies, the step's launches and the replay all go to the pool's device's
        # current stream, even when another device is current.
        with on_device(self.device):
            return self._run(args, n, bucket)

    __call__ = run

    def _run(self, args: list[torch.Tensor], n: int, bucket: int) -> Any:
        key = (grad_mode(), bucket)
        capture = self.use_graphs and key not in self._graphs
        if capture:
            # The capture below resets the static buffers: an input that is a view of them (one
            # a step was handed) must be copied now, or the second load would read pad values.
            args = apart_from(self._static, args)
        self._load_inputs(args, n, bucket)
        if not self.use_graphs:
            return _slice_rows(self.step(*self._views(bucket)), n, self.copy_outputs)
        if capture:
            self._capture(*key)  # lazily; call capture() up front to keep this off the serving path
            self._load_inputs(args, n, bucket)  # warm-up/capture left pad values in the buffers
        if self.debug:
            self._check_addresses()
        graph, out = self._graphs[key]
        graph.replay()
        return _slice_rows(out, n, self.copy_outputs)

    # ----- internals -------------------------------------------------------

    def _views(self, bucket: int) -> tuple[torch.Tensor, ...]:
        views = self._bucket_views.get(bucket)
        if views is None:
            views = tuple(self._static[i, :bucket] for i in range(len(INPUT_NAMES)))
            self._bucket_views[bucket] = views
        return views

    def _check_inputs(self, args: Sequence[Any]) -> tuple[int, list[Any]]:
        """Validate before touching any buffer (``graph_inputs.check_inputs``)."""
        return check_inputs(args, self.device, self._num_slots, self._pad_vals[2], self._max_context_len,
                            self.max_batch_size)

    def _load_inputs(self, args: list[Any], n: int, bucket: int) -> None:
        """Copy the real rows into the static buffers and pad [n, bucket)."""
        static = self._static
        args = apart_from(static, args)
        if all(type(a) is torch.Tensor and a.dtype in _STACKED for a in args):  # all on the device
            # One stack into the buffer's rows and one copy of the padding: two launches where
            # a copy and a fill per input took ten, at ~6 µs of host time each on a GPU box.
            torch.stack(args, out=static[:, :n])
            if n < bucket:
                static[:, n:bucket].copy_(self._pad_wide[:, : bucket - n])
            return
        host = []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):  # on the device
                static[i, :n].copy_(a)
                static[i, n:bucket].fill_(self._pad_vals[i])
            else:
                host.append((i, a))
        if not host:
            return
        if self._to_device is None:  # CPU pool: write straight into the static buffer
            for i, a in host:
                static[i, :n].copy_(torch.from_numpy(a))
                static[i, n:bucket].fill_(self._pad_vals[i])
            loc = next((a for i, a in host if i == LOC), None)
            if self._trust_slots is not None and loc is not None and self._num_slots is not None:
                # Every out_cache_loc value was checked below num_slots (graph_inputs), and
                # the padding is slot 0: the step's pool.write calls need not check again.
                self._trust_slots(self._views(bucket)[LOC], negative=bool(loc.size) and int(loc.min()) < 0)
            return
        packed = np.empty((len(host), bucket), dtype=np.int64)
        for j, (i, a) in enumerate(host):
            packed[j, :n] = a
            packed[j, n:] = self._pad_vals[i]
        staged = to_device(packed, self.device, self._to_device)  # one DMA for every host input, on this stream
        if len(host) == len(INPUT_NAMES):
            static[:, :bucket].copy_(staged)
        else:
            for j, (i, _) in enumerate(host):
                static[i, :bucket].copy_(staged[j])

    def _reset_static(self) -> None:
        self._static.copy_(self._pad_dev.view(-1, 1).expand_as(self._static))

    def _capture(self, mode: str, bucket: int) -> None:
        if mode != grad_mode():  # pragma: no cover - internal misuse
            raise InvariantError(f"capture for {mode} requested while the thread is in {grad_mode()}")
        if self.debug and self._ptrs is not None:
            # (else this capture would record moved addresses, hiding the move from older graphs)
            self._check_addresses()
        # Warm up (and capture) on pad values: every write goes to slot 0 / the null row.
        self._reset_static()
        views = self._views(bucket)
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            # Same tensors, shapes and alignment as the capture: every Triton
            # kernel compiles and loads here, never inside the capture.
            for _ in range(self.warmup_iters):
                self.step(*views)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()  # shared by every bucket
        graph = torch.cuda.CUDAGraph()
        # Captured on this runner's device: without stream=, torch.cuda.graph uses one
        # process-wide stream made on whichever device was current at the process's first
        # capture, so a runner on cuda:1 would record into a cuda:0 graph.
        with torch.cuda.graph(graph, pool=self._mempool, stream=side):
            out = self.step(*views)
        self._graphs[(mode, bucket)] = (graph, out)
        self._ptrs = self._addresses()

    def _addresses(self) -> list[int]:
        ptrs = [self._static.data_ptr()]
        for name in ("k_buffers", "v_buffers"):
            bufs = getattr(self.pool, name, None)
            if bufs is not None:
                ptrs.extend(t.data_ptr() for t in bufs)
        table = getattr(self.pool, "req_to_token", None)
        if isinstance(table, torch.Tensor):
            ptrs.append(table.data_ptr())
        return ptrs

    def _check_addresses(self) -> None:
        now = self._addresses()
        if now != self._ptrs:
            raise InvariantError(
                "a buffer captured in a CUDA graph moved (static inputs, pool K/V buffers or "
                "req_to_token have new addresses); replaying would read/write freed memory. "
                "Recreate the runner after replacing pool tensors."
            )
