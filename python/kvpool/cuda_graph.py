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

Returned outputs of a replay are views into the graph's static output: valid
until the next run() of the same bucket; clone them to keep them. The runner
uses the current CUDA stream and is not thread-safe (one runner per thread).
On CPU, or with enable_graphs=False, the same padding and buffers are used and
the step runs eagerly, so results are identical to the graph path.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from kvpool._core import InvalidArgumentError, InvariantError
from kvpool.errors import TensorDeviceError, TensorDtypeError, TensorShapeError
from kvpool.modes import persistent
from kvpool.torch_types import as_device

__all__ = ["DecodeGraphRunner", "default_buckets", "grad_mode"]

# Rows of the static [5, max_bucket] int64 input buffer, in step() argument order.
INPUT_NAMES = ("input_ids", "positions", "req_rows", "out_cache_loc", "seq_lens")


def default_buckets(max_batch_size: int) -> List[int]:
    """1, 2, 4, 8, then multiples of 8, up to (and covering) max_batch_size."""
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


def _slice_rows(out: Any, n: int) -> Any:
    if isinstance(out, torch.Tensor):
        return out[:n]
    if isinstance(out, (tuple, list)):
        return type(out)(_slice_rows(o, n) for o in out)
    return out


class DecodeGraphRunner:
    """Run ``step(input_ids, positions, req_rows, out_cache_loc, seq_lens) -> logits``
    through per-bucket CUDA graphs (or eagerly on CPU / with enable_graphs=False).

    ``step`` receives five int64 device tensors of length ``bucket`` (static
    buffers: never keep references expecting their contents to stay) and must
    write K/V through the pool with device-side ops only (no .item(), no
    allocation-dependent host logic) to be capturable. Its output (a tensor, or a
    tuple/list of tensors) is sliced to the real batch along dim 0.
    """

    def __init__(
        self,
        pool: Any,
        step: Callable[..., Any],
        max_batch_size: int,
        buckets: Optional[Sequence[int]] = None,
        enable_graphs: bool = True,
        debug: bool = False,
        *,
        pad_seq_len: int = 1,
        warmup_iters: int = 2,
    ) -> None:
        if not callable(step):
            raise InvalidArgumentError(f"step must be callable, got {type(step).__name__}")
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, (int, np.integer)) or max_batch_size < 1:
            raise InvalidArgumentError(f"max_batch_size must be a positive int, got {max_batch_size!r}")
        max_batch_size = int(max_batch_size)
        if buckets is None:
            buckets = default_buckets(max_batch_size)
        else:
            buckets = sorted({int(b) for b in buckets})
            if not buckets or buckets[0] < 1:
                raise InvalidArgumentError(f"buckets must be positive ints, got {buckets!r}")
            if buckets[-1] < max_batch_size:
                raise InvalidArgumentError(
                    f"largest bucket {buckets[-1]} < max_batch_size {max_batch_size}: "
                    "a full batch would have no graph"
                )
        if pad_seq_len < 0 or warmup_iters < 1:
            raise InvalidArgumentError("pad_seq_len must be >= 0 and warmup_iters >= 1")
        self.pool, self.step = pool, step
        self.max_batch_size, self.buckets = max_batch_size, list(buckets)
        self.device = as_device(pool.device)
        self.use_graphs = bool(enable_graphs) and self.device.type == "cuda"
        self.debug, self.warmup_iters = bool(debug), int(warmup_iters)
        width = self.buckets[-1]
        # Python ints for the per-step fill_() calls (indexing the tensor and
        # converting with int() cost a tensor op and .item() per row every run()).
        self._pad_vals = (0, 0, int(pool.null_row), 0, int(pad_seq_len))
        with persistent():
            self._pad = torch.tensor(self._pad_vals, dtype=torch.int64)
            self._pad_dev = self._pad.to(self.device)
            self._static = torch.empty((len(INPUT_NAMES), width), dtype=torch.int64, device=self.device)
            self._static.copy_(self._pad_dev.view(-1, 1).expand(-1, width))
            self._staging: Optional[torch.Tensor] = None
            if self.device.type == "cuda":
                # Pinned: the H2D copy is a true async DMA, no pageable bounce.
                self._staging = torch.empty((len(INPUT_NAMES), width), dtype=torch.int64, pin_memory=True)
        self._copy_done = torch.cuda.Event() if self.device.type == "cuda" else None
        self._copy_pending = False
        self._graphs: Dict[Tuple[str, int], Tuple[Any, Any]] = {}
        self._mempool: Any = None
        self._ptrs: Optional[List[int]] = None

    # ----- public API ------------------------------------------------------

    def bucket_for(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise InvalidArgumentError(f"batch of {n} exceeds max_batch_size {self.max_batch_size}")

    @property
    def captured(self) -> List[Tuple[str, int]]:
        """(grad mode, bucket) pairs that have a graph."""
        return sorted(self._graphs)

    def capture(self, buckets: Optional[Sequence[int]] = None) -> None:
        """Capture graphs for `buckets` (default all) in the caller's grad mode,
        largest first so smaller graphs reuse the shared private memory pool.
        No-op on CPU / with graphs disabled."""
        if not self.use_graphs:
            return
        for b in sorted(buckets or self.buckets, reverse=True):
            if b not in self.buckets:
                raise InvalidArgumentError(f"{b} is not one of the buckets {self.buckets}")
            self._capture(grad_mode(), b)

    def run(self, input_ids: Any, positions: Any, req_rows: Any, out_cache_loc: Any, seq_lens: Any) -> Any:
        """Run one decode step for a real batch of n = len(input_ids) requests.

        Inputs: 1-D integer tensors (any device), numpy arrays or lists of length n.
        Returns the step's output sliced to the first n rows."""
        n, args = self._check_inputs((input_ids, positions, req_rows, out_cache_loc, seq_lens))
        bucket = self.bucket_for(n)
        self._load_inputs(args, n, bucket)
        if not self.use_graphs:
            return _slice_rows(self.step(*self._views(bucket)), n)
        key = (grad_mode(), bucket)
        if key not in self._graphs:
            self._capture(*key)  # lazily; call capture() up front to keep this off the serving path
            self._load_inputs(args, n, bucket)  # warm-up/capture left pad values in the buffers
        if self.debug:
            self._check_addresses()
        graph, out = self._graphs[key]
        graph.replay()
        return _slice_rows(out, n)

    __call__ = run

    # ----- internals -------------------------------------------------------

    def _views(self, bucket: int) -> Tuple[torch.Tensor, ...]:
        return tuple(self._static[i, :bucket] for i in range(len(INPUT_NAMES)))

    def _check_inputs(self, args: Sequence[Any]) -> Tuple[int, List[torch.Tensor]]:
        """Validate before touching any buffer; host inputs become CPU int tensors."""
        out, lens = [], []
        for name, a in zip(INPUT_NAMES, args):
            t = a if isinstance(a, torch.Tensor) else torch.from_numpy(np.asarray(a))
            if t.dim() != 1:
                raise TensorShapeError(f"{name} must be 1-D, got shape {list(t.shape)}")
            if t.numel() and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
                raise TensorDtypeError(f"{name} must be integers, got {t.dtype}")
            out.append(t)
            lens.append(t.shape[0])
        n = lens[0]
        if any(x != n for x in lens):
            raise TensorShapeError(f"inputs must have equal lengths, got {dict(zip(INPUT_NAMES, lens))}")
        if n < 1:
            raise InvalidArgumentError("empty batch: nothing to run")
        if n > self.max_batch_size:
            raise InvalidArgumentError(f"batch of {n} exceeds max_batch_size {self.max_batch_size}")
        for name, t in zip(INPUT_NAMES, out):
            if t.device.type != "cpu" and t.device != self.device:
                raise TensorDeviceError(f"{name} is on {t.device}, the pool on {self.device}")
        return n, out

    def _load_inputs(self, args: Sequence[torch.Tensor], n: int, bucket: int) -> None:
        """Copy the real rows into the static buffers and pad [n, bucket)."""
        static = self._static
        host_rows = []
        for i, a in enumerate(args):
            if a.device.type != "cpu":
                static[i, :n].copy_(a)
                static[i, n:bucket].fill_(self._pad_vals[i])
            else:
                host_rows.append((i, a))
        if not host_rows:
            return
        if self._staging is None:  # CPU pool: write straight into the static buffer
            for i, t in host_rows:
                static[i, :n].copy_(t)
                static[i, n:bucket].fill_(self._pad_vals[i])
            return
        assert self._copy_done is not None  # set whenever _staging is (CUDA pools)
        if self._copy_pending:
            # The previous async copy may still be reading the staging buffer.
            self._copy_done.synchronize()
        staging = self._staging
        for i, t in host_rows:
            staging[i, :n].copy_(t)
            staging[i, n:bucket].fill_(self._pad_vals[i])
        if len(host_rows) == len(INPUT_NAMES):
            static.copy_(staging, non_blocking=True)  # one DMA for all inputs
        else:
            for i, _ in host_rows:
                static[i].copy_(staging[i], non_blocking=True)
        self._copy_done.record()
        self._copy_pending = True

    def _reset_static(self) -> None:
        self._static.copy_(self._pad_dev.view(-1, 1).expand_as(self._static))

    def _capture(self, mode: str, bucket: int) -> None:
        if mode != grad_mode():  # pragma: no cover - internal misuse
            raise InvariantError(f"capture for {mode} requested while the thread is in {grad_mode()}")
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
        with torch.cuda.graph(graph, pool=self._mempool):
            out = self.step(*views)
        self._graphs[(mode, bucket)] = (graph, out)
        self._ptrs = self._addresses()

    def _addresses(self) -> List[int]:
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
