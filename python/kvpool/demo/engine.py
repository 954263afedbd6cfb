"""Continuous batching over a kvpool: admit, prefill, decode one token per step, release.

Each loop iteration (a "step"):
  1. admit waiting requests first-come-first-served while there is a free running
     slot and the pool can hold the request's whole future (its final length), so a
     running request can never run the pool dry mid-decode;
  2. prefill each admitted request: ``pool.admit([prompt_len])`` (open + extend in
     one call) then one forward pass that stores the prompt's K/V with ``pool.write``;
  3. decode every running request by one token: ONE ``pool.extend(handles, 1)`` for
     the whole batch, then the decode step (through DecodeGraphRunner when asked);
  4. ``pool.close`` the finished ones, which returns their pages at once.
If the pool still runs out (``admission="optimistic"``, or a bug), PoolExhaustedError
is caught: the newest request is preempted (closed, requeued, recomputed later).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvpool import PoolExhaustedError, TooManyRequestsError
from kvpool.demo.requests import Request
from kvpool.demo.timing import TimedPool


class DecodeStep:
    """The decode step in DecodeGraphRunner's signature.

    step(input_ids [B], positions [B], req_rows [B], out_cache_loc [B], seq_lens [B])
    -> logits [B, vocab]. ``width`` is how many req_to_token columns attention
    gathers: the engine sets it to the longest running request when eager; ``None``
    means the whole table, the fixed shape a captured graph needs. Causality comes
    from ``positions`` (= seq_lens - 1 for real rows; padded rows read the null row).
    """

    def __init__(self, model: Any, pool: Any, width: int | None = None) -> None:
        self.model, self.pool, self.width = model, pool, width

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, req_rows: torch.Tensor,
                 out_cache_loc: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        width = self.width if self.width is not None else self.pool.req_to_token.shape[1]
        logits = self.model.forward_pool(self.pool, input_ids[:, None], positions[:, None],
                                         req_rows, out_cache_loc, width)
        return logits[:, 0]


@dataclass
class RunStats:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0          # tokens produced by decode steps
    generated_tokens: int = 0       # output tokens the requests keep (first one comes from prefill)
    recomputed_tokens: int = 0      # output tokens a preemption threw away (generated again later)
    requests_done: int = 0
    preemptions: int = 0
    steps_blocked_by_pool: int = 0  # steps where the next request waited for pool room
    elapsed_s: float = 0.0
    step_s: float = 0.0             # wall time inside steps (excludes setup/warmup)
    occupancy: list[float] = field(default_factory=list)       # used pages / capacity
    token_occupancy: list[float] = field(default_factory=list)  # stored tokens / capacity slots
    batch_sizes: list[int] = field(default_factory=list)
    pool_seconds: dict[str, float] = field(default_factory=dict)
    pool_calls: dict[str, int] = field(default_factory=dict)


class Engine:
    def __init__(self, model: Any, pool: Any, *, max_running: int, use_cuda_graph: bool = False,
                 admission: str = "reserve", record: bool = False) -> None:
        if admission not in ("reserve", "optimistic"):
            raise ValueError(f"admission must be 'reserve' or 'optimistic', got {admission!r}")
        if not 1 <= max_running <= pool.max_requests:
            raise ValueError(f"max_running must be in 1..{pool.max_requests} "
                             f"(the pool's max_requests), got {max_running}")
        self.model, self.raw_pool = model, pool
        self.pool = TimedPool(pool)
        self.page_size = int(pool.page_size)
        self.max_running, self.admission, self.record = max_running, admission, record
        self.device = torch.device(pool.device)
        self.step_fn = DecodeStep(model, self.pool, width=None if use_cuda_graph else 0)
        self.runner: Callable[..., torch.Tensor] = self.step_fn
        if use_cuda_graph:
            from kvpool.cuda_graph import DecodeGraphRunner  # only needed on this path
            # The runner owns the static input buffers and the captured graphs; on CPU
            # it calls the step eagerly with the same padded inputs.
            self.runner = DecodeGraphRunner(pool, self.step_fn, max_running)
        self.stats = RunStats()

    # -- sizing ------------------------------------------------------------------------
    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def check_fits(self, requests: Iterable[Request]) -> None:
        """Every request must fit in an empty pool, else it could never be admitted."""
        cap_pages, max_ctx = self.raw_pool.capacity_pages, self.raw_pool.max_context_len
        for r in requests:
            if r.final_length > max_ctx or self.pages_for(r.final_length) > cap_pages:
                raise ValueError(
                    f"request {r.rid} needs {r.final_length} tokens "
                    f"({self.pages_for(r.final_length)} pages of {self.page_size}) but the pool "
                    f"holds {cap_pages} pages and max_context_len={max_ctx}; "
                    "enlarge the pool or shorten the requests")

    def _reserved_pages(self, running: list[Request]) -> int:
        if self.admission != "reserve":
            return 0
        return sum(self.pages_for(r.final_length) - self.pages_for(r.length) for r in running)

    # -- the loop ----------------------------------------------------------------------
    def run(self, requests: list[Request], progress: Any = None) -> RunStats:
        self.check_fits(requests)
        capture = getattr(self.runner, "capture", None)
        if capture is not None:
            # Capture every bucket's graph now (a no-op on CPU) so that no step pays
            # for compilation or capture, and so capture sees the caller's grad mode.
            capture()
        waiting: deque[Request] = deque(requests)
        running: list[Request] = []
        t_start = time.perf_counter()
        while waiting or running:
            t0 = time.perf_counter()
            produced = self._admit_and_prefill(waiting, running)
            if running:
                produced += self._decode(waiting, running)
            # Sampled before release: the pages this step actually used.
            self._sample(running)
            running[:] = self._release(running)
            self.stats.step_s += time.perf_counter() - t0
            self.stats.steps += 1
            if progress is not None:
                progress.update(produced)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stats.elapsed_s = time.perf_counter() - t_start
        self.stats.pool_seconds = dict(self.pool.seconds)
        self.stats.pool_calls = dict(self.pool.calls)
        return self.stats

    def _admit_and_prefill(self, waiting: deque[Request], running: list[Request]) -> int:
        produced = 0
        while waiting and len(running) < self.max_running:
            req = waiting[0]
            need = self.pages_for(req.final_length if self.admission == "reserve"
                                  else len(req.prompt))
            if self.raw_pool.free_pages - self._reserved_pages(running) < need:
                self.stats.steps_blocked_by_pool += 1
                break
            try:
                # open + prefill extend in one call; refused, it changes nothing.
                handles, ext = self.pool.admit([len(req.prompt)])
            except TooManyRequestsError:
                # Only if something else holds rows of this pool: wait for one to close.
                break
            except PoolExhaustedError:
                # Only reachable when admission is optimistic: wait for room.
                self.stats.steps_blocked_by_pool += 1
                break
            handle = int(handles[0])
            waiting.popleft()
            req.handle, req.length = handle, len(req.prompt)
            req.row = int(self.pool.rows(handle)[0])
            produced += self._prefill(req, ext.out_cache_loc)
            running.append(req)
        return produced

    def _prefill(self, req: Request, out_cache_loc: torch.Tensor) -> int:
        assert req.handle is not None  # admitted before prefill
        n = len(req.prompt)
        ids = torch.from_numpy(req.prompt).to(self.device)[None]
        positions = torch.arange(n, device=self.device)[None]
        rows = torch.tensor([req.row], device=self.device)
        logits = self.model.forward_pool(self.pool, ids, positions, rows, out_cache_loc, n,
                                         last_only=not self.record)[0]
        req.output.append(int(logits[-1].argmax()))
        self.stats.prefill_tokens += n
        self.stats.generated_tokens += 1
        if self.record:
            req.logits.append(logits.cpu())
            req.slots_seen.update(int(s) for s in self.raw_pool.slots(req.handle))
        return 1

    def _decode(self, waiting: deque[Request], running: list[Request]) -> int:
        batch = [r for r in running if not r.done]
        if not batch:
            return 0
        while True:
            handles = np.fromiter((r.handle for r in batch), dtype=np.int64, count=len(batch))
            try:
                ext = self.pool.extend(handles, 1)
                break
            except PoolExhaustedError:
                victim = self._preempt(waiting, running)
                batch = [r for r in batch if r is not victim]
                if not batch:
                    return 0
        lengths = np.fromiter((r.length + 1 for r in batch), dtype=np.int64, count=len(batch))
        last = np.fromiter((r.output[-1] for r in batch), dtype=np.int64, count=len(batch))
        # input_ids, positions, req_rows, out_cache_loc, seq_lens: built on the host, where
        # the scheduler already knows them, so nothing is read back from the device.
        rows = np.fromiter((r.row for r in batch), dtype=np.int64, count=len(batch))
        host = np.stack([last, lengths - 1, rows, ext.slots, lengths])
        if self.runner is self.step_fn:
            self.step_fn.width = int(lengths.max())
            dev = torch.from_numpy(host).to(self.device)  # one host->device copy
            logits = self.step_fn(dev[0], dev[1], dev[2], dev[3], dev[4])
        else:
            # The runner stages host inputs in pinned memory and copies them into its
            # static buffers with one DMA, then pads and replays.
            logits = self.runner(*host)
        next_tokens = logits.argmax(-1).tolist()
        for i, (r, tok) in enumerate(zip(batch, next_tokens)):
            r.length += 1
            r.output.append(tok)
            if self.record:
                r.logits.append(logits[i : i + 1].cpu())
                r.slots_seen.add(int(ext.slots[i]))
        self.stats.decode_tokens += len(batch)
        self.stats.generated_tokens += len(batch)
        self.stats.batch_sizes.append(len(batch))
        return len(batch)

    def _preempt(self, waiting: deque[Request], running: list[Request]) -> Request:
        # Newest unfinished request first: it has the least work to redo.
        victim = next(r for r in reversed(running) if not r.done)
        running.remove(victim)
        self.pool.close([victim.handle])
        # Its outputs so far are thrown away and generated again: not counted twice.
        self.stats.generated_tokens -= len(victim.output)
        self.stats.recomputed_tokens += len(victim.output)
        victim.reset()
        waiting.appendleft(victim)
        self.stats.preemptions += 1
        return victim

    def _release(self, running: list[Request]) -> list[Request]:
        finished = [r for r in running if r.done]
        if finished:
            self.pool.close(np.array([r.handle for r in finished], dtype=np.int64))
            for r in finished:
                r.handle, r.row = None, -1
            self.stats.requests_done += len(finished)
        return [r for r in running if not r.done]

    def _sample(self, running: list[Request]) -> None:
        a = self.raw_pool
        self.stats.occupancy.append(a.used_pages / a.capacity_pages)
        self.stats.token_occupancy.append(sum(r.length for r in running) / a.capacity_slots)
