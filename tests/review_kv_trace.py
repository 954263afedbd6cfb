"""The driver and reference of tests/test_review_kv_integrity.py (see its doc): a seeded random
trace of one plain ``KVPool``'s calls, each request's written values kept per position, and
after every step a read-back of every live request through every read path."""

from __future__ import annotations

import itertools
import threading
from collections import defaultdict

import numpy as np
import torch

import kvpool
from kvpool import KVPool
from kvpool.kernels import gather_kv

L, H, D, MAX_REQ, MAX_CTX = 2, 2, 4, 8, 48
RANK = 6  # MLA pools: kv_lora_rank, with a rope part of H * D - RANK (one latent head)
SHIFT = 3 * torch.arange(H * D)
BASE = [1, 2, 1, 1, 2, 2, 1, 2, 1, 1, 2, 1, 1, 1, 2, 2, 1, 2, 2, 1] * 2
PAGES = {1: 56, 3: 20, 16: 7}  # small: extends evict and run out


def code(vals, layer):
    """Each row spells ``val * L + layer`` in base-8 digits, one an element: exact in every
    dtype a pool takes (fp8 included), and distinct per value and layer."""
    x = torch.tensor(vals, dtype=torch.int64).view(-1, 1) * L + layer
    return ((x >> SHIFT) & 7).view(-1, H, D).float()


def decode(row):
    return int((row.reshape(-1).to(torch.int64) << SHIFT).sum()) // L


class Req:
    def __init__(self, salt, prompt):
        self.salt, self.prompt, self.toks, self.vals = salt, list(prompt), [], []

    def key(self, i):
        t = self.toks[: i + 1]
        return None if None in t else (self.salt, tuple(t))

    def copy(self):
        r = Req(self.salt, self.prompt)
        r.toks, r.vals = list(self.toks), list(self.vals)
        return r


class Trace:
    """One driver: its own requests on a pool that may be shared with another driver."""

    def __init__(self, rng, pool, seen, counter, *, salts=(None, 7), cap=MAX_REQ - 1, solo=True, sharing=True):
        self.rng, self.p, self.seen, self.counter, self.salts = rng, pool, seen, counter, salts
        self.sharing = sharing  # False: admit with token ids, cache and truncate only (the pool's _sharing stays off)
        self.cap, self.solo = cap, solo  # requests this driver keeps; the only driver of its pool
        self.P, self.mla, self.cdt = pool.page_size, pool.mla, pool.compute_dtype
        self.reqs: dict[int, Req] = {}
        self.closed: list[int] = []

    def fresh(self):
        return next(self.counter)

    def rows(self, vals, layer, *, grad=False):
        """``write``'s row arguments for ``vals``: ``(k, v)``, or ``(kv,)`` on an MLA pool."""
        c = code(vals, layer)
        out = (c.view(-1, 1, H * D),) if self.mla else (c, 7 - c)
        return tuple(x.to(self.cdt).requires_grad_(grad) for x in out)

    def expect(self, vals, layer):
        """What ``read`` gives back for ``vals`` (as float32)."""
        k = code(vals, layer)
        if self.mla:
            k = k.view(-1, 1, H * D)
            return k, k[..., :RANK]
        return k, 7 - k

    # ----- writes ----------------------------------------------------------------
    def write(self, slots, vals):
        """Store ``vals`` at ``slots`` (one extend's), in a random form ``write`` takes."""
        p, rng, n = self.p, self.rng, len(slots)
        form = int(rng.integers(0, 9))
        sl, vl = np.asarray(slots, dtype=np.int64), list(vals)
        if form == 1 and n > 1:  # permuted
            perm = rng.permutation(n)
            sl, vl = sl[perm], [vl[i] for i in perm]
        if form == 2:  # padding and page-0 rows mixed in, with garbage rows
            extra = [-1, -5, 0, self.P - 1]
            sl = np.concatenate([sl, np.array(extra, dtype=np.int64)])
            vl = vl + [10**6] * len(extra)
        for layer in range(L):
            args = self.rows(vl, layer, grad=form in (3, 4) and torch.is_grad_enabled())
            if form == 4:  # non-contiguous rows
                args = tuple(x.transpose(0, 1).contiguous().transpose(0, 1) for x in args)
            if form == 5:
                s = torch.from_numpy(sl).to(torch.int32)
            elif form == 6:
                s = torch.from_numpy(np.repeat(sl, 2))[::2]  # strided
            elif form == 7:
                s = sl.tolist()
            else:
                s = torch.from_numpy(sl) if form != 0 else sl
            if form == 8 and n > 1:  # split in two calls
                h = n // 2
                p.write(layer, s[:h], *(x[:h] for x in args))
                p.write(layer, s[h:], *(x[h:] for x in args))
            else:
                p.write(layer, s, *args)

    def int_args(self, hs, counts, toks):
        """extend's handles, counts and tokens as an engine may hold them: lists, numpy arrays,
        torch tensors (strided, int32 counts and ids), one count for all."""
        form = int(self.rng.integers(0, 4))
        if form == 1:
            return np.array(hs), np.array(counts, dtype=np.int32), None if toks is None else np.array(toks, dtype=np.int64)
        if form == 2:
            def t(x, dt):
                return torch.tensor(x, dtype=dt).repeat_interleave(2)[::2]
            return t(hs, torch.int64), t(counts, torch.int32), None if toks is None else t(toks, torch.int32)
        if form == 3 and len(set(counts)) == 1:
            return hs, counts[0], toks
        return hs, counts, toks

    def new_vals(self, h, start, n):
        r, out = self.reqs[h], []
        for i in range(start, start + n):
            val = self.fresh()
            r.vals.append(val)
            key = r.key(i)
            if key is not None:
                self.seen[key].add(val)
            out.append(val)
        return out

    def extend(self, hs, counts, *, use_own=True):
        p, rng = self.p, self.rng
        toks_all, with_tokens = [], bool(rng.integers(0, 2))
        for h, n in zip(hs, counts):
            r = self.reqs[h]
            for i in range(len(r.toks), len(r.toks) + n):
                t = r.prompt[i] if i < len(r.prompt) else (int(rng.integers(1, 3)) if with_tokens else None)
                toks_all.append(t)
        before = self.snapshot() if self.solo and rng.integers(0, 4) == 0 else None
        try:
            res = p.extend(*self.int_args(hs, counts, toks_all if with_tokens else None))
        except (kvpool.PoolExhaustedError, kvpool.ContextTooLongError):
            if before is not None:
                self.same(before, "a refused extend")
            return
        at, vals = 0, []
        for h, n in zip(hs, counts):
            r = self.reqs[h]
            start = len(r.toks)
            r.toks += toks_all[at : at + n]
            vals += self.new_vals(h, start, n)
            at += n
        if use_own and rng.integers(0, 2):
            for layer in range(L):
                p.write(layer, res.out_cache_loc, *self.rows(vals, layer))
        else:
            self.write(res.slots, vals)

    def open_prompts(self, prompts, salt):
        """open_with_prefix, the hits checked and adopted, then the rest prefilled."""
        p = self.p
        try:
            hs, cached = p.open_with_prefix(np.concatenate(prompts), [len(x) for x in prompts], salt=salt)
        except kvpool.TooManyRequestsError:
            return []
        for h, c, pr in zip(hs.tolist(), cached.tolist(), prompts):
            r = self.reqs[h] = Req(salt, pr)
            r.toks = pr[:c]
            if c:
                got = p.read(0, p.slots(h))[0].float()
                for i in range(c):
                    val = decode(got[i])
                    assert val in self.seen[r.key(i)], f"a hit served K/V of another prefix at {i}"
                    r.vals.append(val)
        hs = hs.tolist()
        self.extend(hs, [len(self.reqs[h].prompt) - len(self.reqs[h].toks) for h in hs])
        return hs

    def open_chain(self, src):
        """open_with_chain_hashes of a live request's chain (as a receiving pool would),
        sometimes extended to a length in the same call."""
        p, rng, P = self.p, self.rng, self.P
        hashes, chain, salt = p.chain_hashes(src)
        chain = chain.tolist()
        # Under the pool's (reentrant) lock: another thread's cache or evict between the match
        # and the open would change how many pages the open shares, and the rows written past
        # them would land in shared pages.
        with p._lock:
            cached = p.match_chain_hashes(hashes, chain, salt) * P
            length = min(MAX_CTX, cached + int(rng.integers(0, P + 3))) if rng.integers(0, 2) else None
            try:
                h = p.open_with_chain_hashes(hashes, chain, salt, None, length)
            except (kvpool.PoolExhaustedError, kvpool.TooManyRequestsError):
                return
        r = self.reqs[h] = Req(self.reqs[src].salt, chain)
        r.toks = chain[:cached]
        got = p.read(0, p.slots(h)[:cached])[0].float()
        for i in range(cached):
            assert decode(got[i]) in self.seen[r.key(i)], f"a chain hit served K/V of another prefix at {i}"
            r.vals.append(decode(got[i]))
        if length is not None and length > cached:
            r.toks += [chain[i] if i < len(chain) else None for i in range(cached, length)]
            self.write(p.slots(h)[cached:], self.new_vals(h, cached, length - cached))

    # ----- steps -----------------------------------------------------------------
    def step(self):
        p, rng, live = self.p, self.rng, sorted(self.reqs)
        op = int(rng.integers(0, 14))
        if not self.sharing and op in (0, 1, 2, 7):
            op = 3 if op < 7 else 8  # no prefix hit, no fork: extend's path without copy-on-write
        if len(live) >= self.cap - 1 and op < 4:
            op = 10  # room for the next opens
        if op <= 2 and len(self.reqs) < self.cap:
            k = int(rng.integers(1, 3))
            salt = self.salts[int(rng.integers(0, len(self.salts)))]
            prompts = [BASE[: int(rng.integers(1, 2 * self.P + 6))] for _ in range(k)]
            for pr in prompts:
                if rng.integers(0, 3) == 0:
                    pr[-1] = 3  # diverges at its last token
            self.open_prompts(prompts, salt)
        elif op == 3 and len(self.reqs) < self.cap:
            counts = [int(x) for x in rng.integers(0, 2 * self.P + 2, size=int(rng.integers(1, 3)))]
            toks = [BASE[:n] for n in counts] if rng.integers(0, 2) else None  # admit never hits
            try:
                hs, res = p.admit(counts, tokens=None if toks is None else sum(toks, []))
            except (kvpool.PoolExhaustedError, kvpool.TooManyRequestsError):
                return
            vals = []
            for i, (h, n) in enumerate(zip(hs.tolist(), counts)):
                self.reqs[h] = Req(None, [])
                self.reqs[h].toks = [None] * n if toks is None else list(toks[i])
                vals += self.new_vals(h, 0, n)
            self.write(res.slots, vals)
        elif op in (4, 5, 6) and live:
            hs = list(rng.choice(live, size=min(len(live), int(rng.integers(1, 4))), replace=False))
            hs = [int(h) for h in hs]
            counts = [int(rng.integers(0, self.P + 3)) for _ in hs]
            self.extend(hs, counts)
        elif op == 7 and live and len(self.reqs) < self.cap:
            h = live[int(rng.integers(0, len(live)))]
            r = self.reqs[h]
            n = int(rng.integers(1, 3)) if len(self.reqs) + 1 < self.cap else 1
            kids = p.fork(h, n).tolist()  # the children take the rest of its prompt too
            for kid in kids:
                self.reqs[kid] = r.copy()
            self.extend(kids + [h], [int(rng.integers(0, 3)) for _ in range(len(kids) + 1)])
        elif op == 8 and live:
            h = live[int(rng.integers(0, len(live)))]
            r = self.reqs[h]
            n = int(rng.integers(0, len(r.toks) + 1)) if rng.integers(0, 4) else 0
            p.truncate([h], [n])
            if n < len(r.toks):  # truncating to the current length keeps the prompt (documented)
                del r.prompt[n:]
            del r.toks[n:], r.vals[n:]
        elif op == 9 and live:
            p.cache([live[int(rng.integers(0, len(live)))]])
        elif op in (10, 11) and live:
            h = live[int(rng.integers(0, len(live)))]
            p.close([h], cache=bool(rng.integers(0, 4)))
            del self.reqs[h]
            self.closed.append(h)
        elif op == 13 and live and self.sharing and len(self.reqs) < self.cap:
            self.open_chain(live[int(rng.integers(0, len(live)))])
        elif op == 12:
            if rng.integers(0, 4):
                p.evict(int(rng.integers(0, 3)))
            else:
                p.clear_cache()

    # ----- checks ----------------------------------------------------------------
    def verify(self):
        p, P, full = self.p, self.P, self.solo
        if full:
            p.check()
        hs = sorted(self.reqs)
        if hs:
            pt = p.page_table(hs)
            indptr, idx, last = pt.kv_indptr.tolist(), pt.kv_indices.tolist(), pt.kv_last_page_len.tolist()
        for i, h in enumerate(hs):
            r = self.reqs[h]
            n = len(r.vals)
            assert p.length(h) == n == len(r.toks)
            known = r.toks.index(None) if None in r.toks else n
            assert p.known_tokens(h).tolist()[:known] == r.toks[:known]
            slots = p.slots(h)
            row = int(p.rows([h])[0])
            assert p.req_to_token[row, :n].tolist() == slots.tolist(), "req_to_token row differs from slots"
            pages = idx[indptr[i] : indptr[i + 1]]
            assert pages == p.pages(h).tolist()
            from_pt = [pg * P + o for pg in pages for o in range(P)][: (len(pages) - 1) * P + last[i]] if pages else []
            assert from_pt == slots.tolist(), "page table differs from slots"
            if not n:
                continue
            assert slots.min() >= P, "a request holds a slot of the reserved page 0"
            st = torch.from_numpy(slots)
            for layer in range(L):
                wk, wv = self.expect(r.vals, layer)
                k, v = (x.float() for x in p.read(layer, slots))
                assert torch.equal(k, wk) and torch.equal(v, wv), f"request {h} layer {layer}: read differs"
                # The views hold what was stored: fp8 pools store x / scale.
                ks, vs = (float(p.k_scale[layer]), float(p.v_scale[layer])) if p.fp8 else (1.0, 1.0)
                kb, vb = p.k_buffer(layer), p.v_buffer(layer)
                # indexed as bytes: torch 2.4 has no CPU indexing of fp8
                kb8, vb8 = kb.view(torch.uint8), vb.view(torch.uint8)
                if p.layout == "paged":
                    k, v = kb8[st // P, st % P], vb8[st // P, st % P]
                else:
                    k, v = kb8[st], vb8[st]
                k, v = k.view(kb.dtype).float() * ks, v.view(vb.dtype).float() * vs
                assert torch.equal(k, wk) and torch.equal(v, wv), f"request {h} layer {layer}: views differ"
                c = [x[layer].view(torch.uint8)[st].view(x.dtype).float() for x in p.caches]
                assert torch.equal(c[0] * ks, wk)
                assert torch.equal(c[-1] * vs if not self.mla else c[0][..., :RANK] * ks, wv)
                k, v = gather_kv(kb, None if self.mla else vb, st, out_dtype=torch.float32,
                                 k_scale=ks if p.fp8 else None, v_scale=None if self.mla or not p.fp8 else vs)
                assert torch.equal(k.float(), wk), f"request {h} layer {layer}: gather differs"
                assert self.mla or torch.equal(v.float(), wv), f"request {h} layer {layer}: gather differs"
        if full:
            assert sum(len(set(p.pages(h).tolist())) for h in hs) >= p.stats().used_pages - p.stats().cached_pages

    def snapshot(self):
        p, s = self.p, self.p.stats()
        stats = {n: getattr(s, n) for n in dir(s) if not n.startswith("_") and not callable(getattr(s, n))}
        live = {h: (p.length(h), p.slots(h).tolist(), p.known_tokens(h).tolist()) for h in self.reqs}
        return stats, live, p.req_to_token.clone(), [c.clone() for c in p.caches]

    def same(self, before, what):
        after = self.snapshot()
        assert before[0] == after[0], f"{what} changed the stats"
        assert before[1] == after[1], f"{what} changed a request"
        assert torch.equal(before[2], after[2]), f"{what} changed req_to_token"
        for a, b in zip(before[3], after[3]):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{what} changed K/V bytes"  # (torch 2.4: no fp8 equal)


KINDS = {"f32": {}, "bf16": {"dtype": torch.bfloat16}, "fp8": {"dtype": torch.float8_e4m3fn},
         "mla": {"dtype": torch.float16, "kv_lora_rank": RANK, "qk_rope_head_dim": H * D - RANK}}
KINDS["fp8-mla"] = {**KINDS["mla"], "dtype": torch.float8_e4m3fn}


def make_pool(page_size, layout, num_pages=None, seed=1, device_tables=False, kind="f32"):
    kw = {"dtype": torch.float32, **KINDS[kind]}
    heads, dim = (1, H * D) if kind.endswith("mla") else (H, D)
    p = KVPool(L, heads, dim, page_size=page_size, num_pages=num_pages or PAGES[page_size],
               max_requests=MAX_REQ, max_context_len=MAX_CTX, layout=layout, hash_seed=seed, **kw)
    if device_tables:
        p._table_np = None  # the table path CUDA pools take: extend_packed, table writes, apply_cow's
    return p


def counter(start=1):
    return itertools.count(start)


def run_trace(seed, page_size, layout, steps, device_tables=False, pool_mode=None, kind="f32", scales=None,
              sharing=True):
    with pool_mode() if pool_mode else torch.no_grad():
        p = make_pool(page_size, layout, device_tables=device_tables, kind=kind)
    if scales is not None:  # set in place, as the pool's doc says
        p.k_scale.copy_(torch.tensor(scales[0]))
        if not p.mla:
            p.v_scale.copy_(torch.tensor(scales[1]))
    t = Trace(np.random.default_rng(seed), p, defaultdict(set), counter(), sharing=sharing)
    for _ in range(steps):
        t.step()
        t.verify()
    if not sharing:  # what the unshared trace registered (truncated into, rewritten) is hit right
        assert not p._sharing
        for n in range(2, 2 * t.P + 3):
            if len(t.reqs) < t.cap:
                t.open_prompts([BASE[:n]], None)
                t.verify()
    return t


class Seen(defaultdict):
    """``seen`` shared by two drivers: a missing key's set is made under a lock (two threads
    making it at once would each keep their own)."""

    def __init__(self):
        super().__init__(set)
        self._lock = threading.Lock()

    def __missing__(self, key):
        with self._lock:
            return self.setdefault(key, set())
