"""The ``shared-prefix`` demo workload: requests share system prompts, and some fork.

Requests are one of a few system prompts plus their own user turn; a share of
them asks for several continuations (parallel sampling), served by ``fork``.
``PrefixEngine`` is the demo engine with kvpool's prefix cache turned on:

- admission: ``open_with_prefix(prompt)`` gives the request the longest cached
  full-page prefix (never its last token); only the rest is prefilled, at its
  positions, reading the cached prefix's K/V through the request's table row;
- after the prefill: ``cache`` publishes the prompt's full pages, and a request
  with n continuations ``fork``s n - 1 more requests that share its pages (the
  partly filled last page is copied on write by the first extend into it);
  continuation k starts from the k-th most likely token (greedy afterwards), so
  the continuations diverge the way sampled ones do;
- decode: ``extend(handles, 1)``, as the default engine (without ``tokens=``: no request resends
  its output, so only the prompt's pages are worth publishing);
- release: ``close(handles, cache=True)``;
- preemption (``admission="optimistic"``): a preempted continuation is recomputed
  as that same continuation (its rank's first token), and a forking request
  preempted after its fork comes back alone, since its continuations still exist.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvpool import TooManyRequestsError
from kvpool.demo.engine import Engine
from kvpool.demo.requests import Request


@dataclass(eq=False)  # (compared by identity, as Request)
class ForkRequest(Request):
    """A request that may ask for several continuations (``n``); ``rank`` picks a fork's first token."""

    n: int = 1
    rank: int = 0
    cached_len: int = 0  # prompt tokens served by the prefix cache at admission
    forks: list[ForkRequest] = field(default_factory=list)
    last_logits: Any = None  # the prefill's last-position logits (a fork's first token comes from them)
    # A continuation forked onto a partly filled last page: its first extend copies
    # that page (copy-on-write), one page more than its length says it needs.
    copies_last_page: bool = False

    def reset(self) -> None:
        super().reset()
        self.copies_last_page = False  # recomputed alone, on pages of its own


@dataclass
class PrefixStats:
    prompt_tokens: int = 0  # every continuation's prompt (n per forked request)
    hit_tokens: int = 0  # served by the prefix cache at admission
    forked_tokens: int = 0  # shared by fork instead of prefilled
    forks: int = 0

    @property
    def saved_tokens(self) -> int:
        return self.hit_tokens + self.forked_tokens

    def to_dict(self) -> dict[str, Any]:
        share = self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        saved = self.saved_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return {"prompt_tokens": self.prompt_tokens, "hit_tokens": self.hit_tokens,
                "forked_tokens": self.forked_tokens, "forks": self.forks, "hit_rate": share,
                "prefill_tokens_saved": self.saved_tokens, "prefill_saved_share": saved}


def shared_prefix_requests(
    n: int, *, vocab_size: int, system_prompts: int, system_len: tuple[int, int], user_len: tuple[int, int],
    output_len: tuple[int, int], fork_share: float, fork_n: tuple[int, int], seed: int,
) -> list[ForkRequest]:
    """``n`` requests, each a seeded system prompt (one of ``system_prompts``) plus its own user turn;
    a ``fork_share`` of them ask for ``fork_n`` continuations."""
    if n < 0 or system_prompts < 1 or not 0.0 <= fork_share <= 1.0:
        raise ValueError("need n >= 0, system_prompts >= 1 and 0 <= fork_share <= 1")
    for name, (lo, hi) in (("system_len", system_len), ("user_len", user_len), ("output_len", output_len),
                           ("fork_n", fork_n)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} range must satisfy 1 <= min <= max, got {lo}..{hi}")
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, vocab_size, size=int(rng.integers(system_len[0], system_len[1] + 1)))
               for _ in range(system_prompts)]
    out = []
    for i in range(n):
        sysp = systems[int(rng.integers(0, system_prompts))]
        user = rng.integers(0, vocab_size, size=int(rng.integers(user_len[0], user_len[1] + 1)))
        k = int(rng.integers(fork_n[0], fork_n[1] + 1)) if rng.random() < fork_share else 1
        out.append(ForkRequest(rid=i, prompt=np.concatenate([sysp, user]).astype(np.int64),
                               max_new_tokens=int(rng.integers(output_len[0], output_len[1] + 1)), n=k))
    return out


def _first_token(logits: torch.Tensor, rank: int) -> int:
    """Continuation ``rank``'s first token: the rank-th most likely (0: the greedy one)."""
    if rank == 0:
        return int(logits.argmax())
    order = torch.argsort(logits, descending=True)
    return int(order[rank % len(order)])


class PrefixEngine(Engine):
    """The demo engine with prefix caching and fork (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prefix = PrefixStats()

    def check_fits(self, requests: Any) -> None:
        """Each request with all its continuations on pages of their own must fit an empty pool."""
        super().check_fits(requests)
        cap = self.raw_pool.capacity_pages
        for r in requests:
            n = getattr(r, "n", 1)
            if n > self.max_running or n * self.pages_for(r.final_length) > cap:
                raise ValueError(
                    f"request {r.rid} asks for {n} continuations of up to {r.final_length} tokens "
                    f"({n * self.pages_for(r.final_length)} pages of {self.page_size}) but the pool holds "
                    f"{cap} pages and {self.max_running} requests run at once; enlarge the pool or "
                    "lower --fork-n")

    def _reserved_pages(self, running: list[Request]) -> int:
        # A fork family of k requests sharing a partly filled last page takes k - 1
        # copies of it on its first decode step, pages that final_length - length does
        # not count: without them a request admitted meanwhile takes those pages and
        # "reserve" admission preempts after all.
        pages = super()._reserved_pages(running)
        if self.admission == "reserve":
            pages += sum(1 for r in running if isinstance(r, ForkRequest) and r.copies_last_page and not r.done)
        return pages

    def _decode(self, waiting: deque[Request], running: list[Request]) -> int:
        produced = super()._decode(waiting, running)
        for r in running:  # every unfinished request has extended: its copy is made
            if isinstance(r, ForkRequest):
                r.copies_last_page = False
        return produced

    def _admit_and_prefill(self, waiting: deque[Request], running: list[Request]) -> int:
        produced = 0
        while waiting and len(running) < self.max_running:
            req = waiting[0]
            assert isinstance(req, ForkRequest)
            # A forking request preempted after its fork comes back alone: its
            # continuations exist (running, or waiting to be recomputed themselves).
            opens = 1 if req.forks else req.n
            if len(running) + opens > self.max_running:
                break
            need = opens * self.pages_for(req.final_length)
            if self.raw_pool.free_pages - self._reserved_pages(running) < need:
                self.stats.steps_blocked_by_pool += 1
                break
            try:
                handles, cached = self.pool.open_with_prefix(req.prompt, [len(req.prompt)])
            except TooManyRequestsError:
                break
            handle, cached_len = int(handles[0]), int(cached[0])
            req.cached_len = cached_len
            ext = self.pool.extend([handle], len(req.prompt) - cached_len)
            waiting.popleft()
            req.handle, req.length = handle, len(req.prompt)
            req.row = int(self.pool.rows(handle)[0])
            produced += self._prefill_suffix(req, cached_len, ext.out_cache_loc)
            self.pool.cache([handle])
            self.prefix.prompt_tokens += opens * len(req.prompt)
            self.prefix.hit_tokens += cached_len
            running.append(req)
            if opens > 1:
                produced += self._fork(req, running)
        return produced

    def _prefill_suffix(self, req: ForkRequest, start: int, out_cache_loc: torch.Tensor) -> int:
        """Prefill positions start..len-1; the cached prefix's K/V come from the request's table row."""
        n = len(req.prompt)
        ids = torch.from_numpy(req.prompt[start:]).to(self.device)[None]
        positions = torch.arange(start, n, device=self.device)[None]
        rows = torch.tensor([req.row], device=self.device)
        logits = self.model.forward_pool(self.pool, ids, positions, rows, out_cache_loc, n,
                                         last_only=not self.record)[0]
        req.last_logits = logits[-1]
        # A continuation recomputed after preemption starts where _fork started it.
        req.output.append(_first_token(logits[-1], req.rank))
        self.stats.prefill_tokens += n - start
        self.stats.generated_tokens += 1
        if self.record:
            req.logits.append(logits.cpu())
        return 1

    def _fork(self, parent: ForkRequest, running: list[Request]) -> int:
        kids = self.pool.fork(parent.handle, parent.n - 1)
        rows = self.pool.rows(kids)
        for rank, (h, row) in enumerate(zip(kids.tolist(), rows.tolist()), start=1):
            kid = ForkRequest(rid=parent.rid, prompt=parent.prompt, max_new_tokens=parent.max_new_tokens,
                              n=1, rank=rank)
            kid.handle, kid.row, kid.length, kid.cached_len = int(h), int(row), parent.length, len(parent.prompt)
            kid.output.append(_first_token(parent.last_logits, rank))
            kid.copies_last_page = parent.length % self.page_size != 0
            parent.forks.append(kid)
            running.append(kid)
            self.stats.generated_tokens += 1
        self.prefix.forked_tokens += (parent.n - 1) * len(parent.prompt)
        self.prefix.forks += parent.n - 1
        return parent.n - 1

    def _release(self, running: list[Request]) -> list[Request]:
        finished = [r for r in running if r.done]
        if finished:
            self.pool.close(np.array([r.handle for r in finished], dtype=np.int64), cache=True)
            for r in finished:
                r.handle, r.row = None, -1
            self.stats.requests_done += sum(1 for r in finished if getattr(r, "rank", 0) == 0)
        return [r for r in running if not r.done]
