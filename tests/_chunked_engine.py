"""A small continuous-batching engine with chunked prefill, written against the torch
``KVPool`` directly (not ``KVPoolCache``), driving a real tiny transformers model; the
outside checks in ``test_review_engine_chunked*.py`` run it.

Each step mixes prompt chunks of 3-7 tokens with other requests' decode tokens in one
``pool.extend`` and one forward pass over the flattened batch: the model's own modules
(embedding, norms, projections, rotary embedding, MLP, LM head), with only the attention
done here: every layer stores its new K/V with ``pool.write`` and attends over K/V read
back from the pool, through ``req_to_token`` rows and ``k_buffer`` views, or through
``page_table`` and ``kvpool.kernels.gather_kv``. Admission is ``open_with_prefix`` (one
call per step), prompt pages are published with ``cache`` after every chunk and every
request with ``close(cache=True)``; a request asking for two continuations ``fork``s after
its prefill; when pages run out the newest request is swapped to the host tier (or, with
no host room, closed and recomputed)."""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from _hf_models import VOCAB  # noqa: I001  (skips without transformers)

import kvpool
from kvpool.demo.attention import attend
from kvpool.errors import PoolExhaustedError, RollbackUnavailableError
from kvpool.kernels import gather_kv


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Autouse in the test modules that import it."""
    # One intra-op thread: these matmuls are tiny, and CI's 2 cores are shared.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)



@dataclass
class Req:
    rid: int
    prompt: list[int]
    max_new: int
    arrival: int
    n: int = 1  # continuations (2: the prefill forks one more)
    rank: int = 0  # a fork child's first token is the rank-th most likely
    follow_up: list[int] | None = None  # next turn's user tokens, sent once this one finishes
    parent: Req | None = None  # the turn this one follows
    salt: int = 0  # prompts under different salts never share pages
    probe_at: int | None = None  # a speculative probe: the position its rejected drafts follow
    handle: int = -1
    seq: int = -1  # admission order (victims are the newest)
    cached: int = 0  # prompt tokens the prefix cache served at admission
    done: int = 0  # prompt positions in the pool
    out: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def prefilling(self) -> bool:
        return self.done < len(self.prompt)

    @property
    def length(self) -> int:
        """Tokens the pool should hold: the prompt so far, then every output token fed back."""
        return self.done if self.prefilling else len(self.prompt) + len(self.out) - 1


class ChunkedEngine:
    def __init__(self, model, pool: kvpool.KVPool, read: str, seed: int, max_running: int = 5) -> None:
        self.model, self.pool, self.read, self.max_running = model, pool, read, max_running
        cfg = model.config
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.rope = sys.modules[type(model.model).__module__].apply_rotary_pos_emb
        self.rng = random.Random(seed)
        self.hit_step = self.pool_hit_step()
        self.cache_chunks = True
        self.send_prompt_ids = False
        self.t = 0
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.swapped: list[Req] = []
        self.finished: list[Req] = []
        self.next_seq = 0
        self.next_rid = 1000
        self.counts = dict(swap_out=0, swap_in=0, recomputed=0, dropped_swapped=0, forks=0, mixed_steps=0, chunks=0)

    # ----- scheduling ------------------------------------------------------------

    def step(self) -> None:
        self.t += 1
        pool = self.pool
        if self.swapped:  # all of them in one call if they fit, else the oldest first, one by one
            try:
                pool.swap_in([r.handle for r in self.swapped])
                back = list(self.swapped)
            except PoolExhaustedError:
                back = []
                for r in self.swapped:
                    try:
                        pool.swap_in([r.handle])
                    except PoolExhaustedError:
                        break
                    back.append(r)
            for r in back:
                assert not pool.is_swapped(r.handle)
                self.swapped.remove(r)
                self.running.append(r)
            self.counts["swap_in"] += len(back)
        ready = [] if self.swapped else [r for r in self.waiting if r.arrival <= self.t]
        ready = ready[:max(0, self.max_running - len(self.running))]
        if ready:  # one call for the step's new requests (prompts of a batch may hit each other's pages)
            handles, cached = pool.open_with_prefix(np.concatenate([r.prompt for r in ready]).astype(np.int64),
                                                    [len(r.prompt) for r in ready], [r.salt for r in ready])
            for r, h, c in zip(ready, handles, cached):
                self.waiting.remove(r)
                r.handle, r.cached, r.done = int(h), int(c), int(c)
                assert 0 <= r.cached <= len(r.prompt) - 1 and r.cached % self.hit_step == 0
                r.seq, self.next_seq = self.next_seq, self.next_seq + 1
                self.running.append(r)
        if not self.running:
            return
        plan = []  # (request, first position, token ids)
        for r in self.running:
            if r.prefilling:
                n = min(self.rng.randint(3, 7), len(r.prompt) - r.done)
                plan.append((r, r.done, r.prompt[r.done:r.done + n]))
            else:
                plan.append((r, r.length, [r.out[-1], *self.drafts(r)]))
        while True:
            handles = [r.handle for r, _, _ in plan]
            try:
                # A step of prompt chunks only leaves the ids to the prompts open_with_prefix remembered.
                tokens = None if all(r.prefilling for r, _, _ in plan) and not self.send_prompt_ids \
                    else [t for _, _, ids in plan for t in ids]
                res = pool.extend(handles, [len(ids) for _, _, ids in plan], tokens=tokens)
                break
            except PoolExhaustedError:
                if len(plan) == 1:
                    # Swapped requests keep their shared pages on the device: drop the newest
                    # (its K/V is lost; it is recomputed) until the one left fits.
                    assert self.swapped, "one request alone must always fit the pool"
                    victim = self.swapped.pop()
                    self.pool.close([victim.handle])
                    self.recompute(victim)
                    self.counts["dropped_swapped"] += 1
                    continue
                victim = max(plan, key=lambda p: p[0].seq)
                plan.remove(victim)
                self.preempt(victim[0])
        self.counts["mixed_steps"] += len({r.prefilling for r, _, _ in plan}) == 2
        self.counts["chunks"] += sum(r.prefilling for r, _, _ in plan)
        rows = self.forward(plan, res)
        for (r, _, ids), logits in zip(plan, rows):
            if r.prefilling:
                logits = logits[-1]
                r.done += len(ids)
                if r.prefilling:
                    continue
                r.out.append(int(torch.argsort(logits, descending=True)[r.rank]))
                r.logits.append(logits)
                if r.n == 2:
                    self.fork(r, logits)
            else:
                self.accept(r, logits)
        # Publish every prompt page a chunk completed, so requests admitted meanwhile hit it.
        if self.cache_chunks:
            pool.cache([r.handle for r, _, _ in plan if r in self.running and r.length <= len(r.prompt)])
        for r in [r for r in self.running if len(r.out) >= r.max_new]:
            pool.close([r.handle], cache=True)
            self.running.remove(r)
            self.finished.append(r)
            if r.follow_up is not None:
                self.waiting.append(Req(self.next_rid, r.prompt + r.out + r.follow_up, r.max_new,
                                        arrival=self.t + 1, parent=r, salt=r.salt))
                self.next_rid += 1
        self.check_invariants()

    def drafts(self, r: Req) -> list[int]:
        """Tokens a decoding request feeds after its last one (a speculative engine's guesses)."""
        return []

    def accept(self, r: Req, logits: torch.Tensor) -> None:
        """A decoding request's step: its next token from the logits of what it fed."""
        r.out.append(int(logits[-1].argmax()))
        r.logits.append(logits[-1])

    def preempt(self, r: Req) -> None:
        """Swap ``r`` to the host; with no host room, close it (publishing what it wrote) and
        recompute it later from its prompt (a fork child then takes its rank-th token again)."""
        self.running.remove(r)
        try:
            self.pool.swap_out([r.handle])
        except PoolExhaustedError:
            self.pool.close([r.handle], cache=True)
            self.recompute(r)
            self.counts["recomputed"] += 1
            return
        assert self.pool.is_swapped(r.handle)
        self.counts["swap_out"] += 1
        self.swapped.append(r)

    def recompute(self, r: Req) -> None:
        r.handle, r.done, r.out, r.logits = -1, 0, [], []
        self.waiting.insert(0, r)

    def fork(self, r: Req, logits: torch.Tensor) -> None:
        kid = int(self.pool.fork(r.handle, 1)[0])
        second = int(torch.argsort(logits, descending=True)[1])
        child = Req(self.next_rid, list(r.prompt), r.max_new, r.arrival, rank=1, salt=r.salt, handle=kid, seq=r.seq,
                    cached=r.cached, done=r.done, out=[second], logits=[logits])
        r.n = 1  # recomputed after a preemption, it does not fork again
        self.next_rid += 1
        self.running.append(child)
        self.counts["forks"] += 1

    # ----- the model, attending over the pool ------------------------------------------

    # What a hybrid pool's engine overrides (one group of pages for every layer here).
    def pool_hit_step(self) -> int:
        return self.pool.page_size  # prefix hits are whole pages

    def group_key(self, layer: int) -> int:
        return 0

    def new_slots(self, res, layer: int) -> torch.Tensor:
        return res.out_cache_loc

    def mask(self, layer: int, pos: torch.Tensor, width: int) -> torch.Tensor:
        """[N, W] bool: a query at position p sees the request's tokens 0..p."""
        return torch.arange(width)[None] <= pos[:, None]

    def kv_index(self, plan, layer: int) -> torch.Tensor:
        """[B, W] slots of each request's tokens in order (W = longest request after this
        step), read from req_to_token or rebuilt from the CSR page table."""
        pool = self.pool
        lens = [start + len(ids) for _, start, ids in plan]
        width = max(lens)
        handles = [r.handle for r, _, _ in plan]
        assert (pool.lengths(handles) == np.asarray(lens)).all()
        if self.read == "table":
            rows = torch.as_tensor(pool.rows(handles))
            return pool.req_to_token[rows, :width].long()
        pt = pool.page_table(handles)
        ps = pool.page_size
        idx = torch.full((len(plan), width), -1, dtype=torch.long)
        for b, n in enumerate(lens):
            pages = pt.kv_indices[pt.kv_indptr[b]:pt.kv_indptr[b + 1]].long()
            assert len(pages) == -(-n // ps) and int(pt.kv_last_page_len[b]) == n - (len(pages) - 1) * ps
            slots = (pages[:, None] * ps + torch.arange(ps)).flatten()[:n]
            assert (slots.numpy() == pool.slots(handles[b])).all()
            idx[b, :n] = slots
        return idx

    def gather(self, layer: int, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pool, shape = self.pool, (*idx.shape, self.kv_heads, self.head_dim)
        if self.read == "table":
            k = pool.k_buffer(layer).reshape(-1, self.kv_heads, self.head_dim)
            v = pool.v_buffer(layer).reshape(-1, self.kv_heads, self.head_dim)
            return k[idx], v[idx]
        k, v = gather_kv(pool.k_buffer(layer), pool.v_buffer(layer), idx.flatten())
        return k.view(shape), v.view(shape)

    def forward(self, plan, res) -> list[torch.Tensor]:
        """One pass over every new token of the step; each request's logits [its new tokens, vocab]."""
        m = self.model.model
        ids = torch.tensor([[t for _, _, toks in plan for t in toks]])
        pos = torch.tensor([[start + i for _, start, toks in plan for i in range(len(toks))]])
        owner = torch.tensor([b for b, (_, _, toks) in enumerate(plan) for _ in toks])
        n = ids.shape[1]
        views = {}  # by group: [N, W] slots (each token reads its own request's), [N, 1, W] mask
        x = m.embed_tokens(ids)
        cos, sin = m.rotary_emb(x, pos)
        for i, layer in enumerate(m.layers):
            if self.group_key(i) not in views:
                idx = self.kv_index(plan, i)[owner]
                views[self.group_key(i)] = idx, self.mask(i, pos[0], idx.shape[1])[:, None]
            idx, mask = views[self.group_key(i)]
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(1, n, self.heads, self.head_dim)
            k = attn.k_proj(h).view(1, n, self.kv_heads, self.head_dim)
            v = attn.v_proj(h).view(1, n, self.kv_heads, self.head_dim)
            q, k = self.rope(q, k, cos, sin, unsqueeze_dim=2)
            self.pool.write(i, self.new_slots(res, i), k[0].contiguous(), v[0].contiguous())
            keys, values = self.gather(i, idx)
            o = attend(q[0].unsqueeze(1), keys, values, mask)  # [N, 1, Hq, D]
            x = x + attn.o_proj(o.reshape(1, n, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        logits = self.model.lm_head(m.norm(x))[0].float()
        return list(logits.split([len(toks) for _, _, toks in plan]))

    # ----- invariants ---------------------------------------------------------------------

    def check_invariants(self) -> None:
        pool = self.pool
        pool.check()
        s = pool.stats()
        assert s.free_pages + s.used_pages == pool.capacity_pages
        assert s.open_requests == len(self.running) + len(self.swapped)
        assert s.host_free_pages <= pool.host_pages - 1
        assert pool.allocator.pending_offloads == pool.allocator.pending_loads == 0
        assert pool.allocator.pending_copies == 0
        live = self.running + self.swapped
        if live:
            want = np.asarray([r.length for r in live])
            assert (pool.lengths([r.handle for r in live]) == want).all()
        assert all(pool.is_swapped(r.handle) for r in self.swapped)
        if not self.swapped:
            held = set()
            for r in self.running:
                held.update(int(p) for p in pool.pages(r.handle))
            assert s.used_pages == len(held), "used_pages != distinct pages the open requests hold"

    def run(self, requests: list[Req], max_steps: int = 400) -> None:
        self.waiting = list(requests)
        while self.waiting or self.running or self.swapped:
            self.step()
            assert self.t < max_steps, "the engine stopped making progress"


def workload(seed: int) -> list[Req]:
    """Two system prompts, user turns of 2-6 tokens, staggered arrivals; two requests fork,
    three have a follow-up turn, and one repeats another's prompt under its own salt."""
    g = random.Random(seed)
    systems = [[g.randrange(3, VOCAB) for _ in range(g.randint(9, 13))] for _ in range(2)]
    out = []
    for i in range(10):
        user = [g.randrange(3, VOCAB) for _ in range(g.randint(2, 6))]
        out.append(Req(i, systems[i % 2] + user, max_new=g.randint(5, 9), arrival=i // 2 + 1,
                       n=2 if i in (2, 5) else 1,
                       follow_up=[g.randrange(3, VOCAB) for _ in range(3)] if i in (0, 3, 7) else None))
    # Request 0's prompt again, arriving later under another salt: it must miss every page.
    out.append(Req(len(out), list(out[0].prompt), max_new=4, arrival=7, salt=1))
    return out


def check_against_full_forward(model, req: Req) -> None:
    """Each output token is the model's greedy pick (rank 1 for a fork's first) over the whole
    sequence with no cache, and the engine's logits match the full forward's."""
    seq = req.prompt + req.out[:-1]
    full = model(torch.tensor([seq])).logits[0].float()
    for k, tok in enumerate(req.out):
        row = full[len(req.prompt) - 1 + k]
        torch.testing.assert_close(req.logits[k], row, atol=1e-4, rtol=1e-4,
                                   msg=lambda m: f"request {req.rid} token {k}: {m}")
        rank = req.rank if k == 0 else 0
        want = int(torch.argsort(row, descending=True)[rank])
        assert tok == want, f"request {req.rid} token {k}: engine {tok}, full forward {want}"



def check_drained(pool: kvpool.KVPool) -> None:
    """Every request closed: nothing held; with the cache cleared, every page free on both tiers."""
    s = pool.stats()
    assert s.open_requests == 0 and s.used_pages == 0 and s.free_pages == pool.capacity_pages
    pool.clear_cache()
    pool.check()
    s = pool.stats()
    assert s.cached_pages == 0 and s.evictable_pages == 0 and s.free_pages == pool.capacity_pages
    assert s.host_cached_pages == 0 and s.host_free_pages == pool.host_pages - 1



class SpeculativeEngine(ChunkedEngine):
    """Decoding requests also feed 1-3 draft tokens (the model's own greedy ones, one of them
    often corrupted) and keep the prefix the model agrees with. Before cutting the rejected
    drafts back with ``truncate``, it publishes their pages with ``cache`` (their K/V is right
    for those tokens); a later request then runs through the rejected drafts (a probe), so a
    registration left naming a page rewritten after the cut would show as wrong logits."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pending: dict[int, list[int]] = {}
        self.counts.update(spec=0, accepted=0, truncated=0, probes=0)

    def drafts(self, r: Req) -> list[int]:
        d: list[int] = []
        if self.rng.random() < 0.6 and len(r.out) < r.max_new - 1:
            for _ in range(self.rng.randint(1, 3)):
                d.append(int(self.model(torch.tensor([r.prompt + r.out + d])).logits[0, -1].argmax()))
            if self.rng.random() < 0.6:
                j = self.rng.randrange(len(d))
                d[j] = 3 + (d[j] - 3 + self.rng.randrange(1, VOCAB - 3)) % (VOCAB - 3)
        self.pending[r.rid] = d
        return d

    def accept(self, r: Req, logits: torch.Tensor) -> None:
        d = self.pending.pop(r.rid)
        if not d:
            return super().accept(r, logits)
        fed = r.prompt + r.out + d
        at = len(r.prompt) + len(r.out) - 1  # the position of the last token before the drafts
        preds = logits.argmax(-1).tolist()
        a = 0
        while a < len(d) and preds[a] == d[a]:
            a += 1
        r.out += preds[:a + 1]
        r.logits += list(logits[:a + 1])
        del r.out[r.max_new:], r.logits[r.max_new:]
        self.counts["spec"] += 1
        self.counts["accepted"] += a
        self.pool.cache([r.handle])
        keep = len(r.prompt) + len(r.out) - 1
        if self.pool.length(r.handle) != keep:
            self.pool.truncate([r.handle], [keep])
            self.counts["truncated"] += 1
            if a < len(d) and self.counts["probes"] < 8:
                probe = Req(self.next_rid, fed + [self.rng.randrange(3, VOCAB)], 3, arrival=self.t + 1, salt=r.salt,
                            probe_at=at)
                self.next_rid += 1
                self.waiting.append(probe)
                self.counts["probes"] += 1


class RewindingEngine(SpeculativeEngine):
    """Now and then a decoding request is cut back (``truncate``) to a length inside its last
    few prompt tokens or its output, possibly into pages a fork shares or the prefix cache
    registered, and continues with a new tail of 1-4 tokens as its prompt (tokens sent with
    every extend, since the pool forgets the old prompt past the cut). A probe prompt then runs
    through the old content past the cut: a registration left on a page rewritten in place
    would show as wrong logits. A hybrid pool may refuse the cut (RollbackUnavailableError,
    nothing changed)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.send_prompt_ids = True
        self.counts.update(rewinds=0, refused=0)

    def step(self) -> None:
        for r in list(self.running):
            if r.prefilling or len(r.out) < 2 or self.counts["rewinds"] >= 10 or self.rng.random() > 0.1:
                continue
            old = r.prompt + r.out[:-1]  # what the pool holds
            cut = self.rng.randint(max(1, len(r.prompt) - 8), len(old) - 1)
            try:
                self.pool.truncate([r.handle], [cut])
            except RollbackUnavailableError:
                assert self.pool.length(r.handle) == len(old)
                self.counts["refused"] += 1
                continue
            tail = [self.rng.randrange(3, VOCAB) for _ in range(self.rng.randint(1, 4))]
            r.prompt, r.done, r.out, r.logits, r.max_new = old[:cut] + tail, cut, [], [], max(2, r.max_new - 2)
            self.counts["rewinds"] += 1
            probe = Req(self.next_rid, old[:cut + 6] + [self.rng.randrange(3, VOCAB)], 3, arrival=self.t + 1,
                        salt=r.salt, probe_at=cut)
            self.next_rid += 1
            self.waiting.append(probe)
        super().step()
