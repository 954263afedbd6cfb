"""KVPool with shared pages: prefix hits and forks show in req_to_token and the
page table, copy-on-write copies run on the device (CPU here; the Triton
interpreter in interp_pool_cases.py), a forked request that diverges reads
back exactly its own K/V, typed errors change nothing, and grad modes hold."""

import numpy as np
import pytest
import torch

import kvpool

H, D, LAYERS = 2, 4, 2


def make(page_size=4, table_path="host", **kw):
    """A CPU pool. ``table_path="device"`` makes it update req_to_token the way a
    device pool does (extend_packed, and rows written from slots() after hits and
    forks) instead of having the core write the numpy view of a CPU table."""
    pool = kvpool.KVPool(LAYERS, H, D, dtype=torch.float32, num_pages=32, page_size=page_size, max_requests=8,
                         max_context_len=64, **kw)
    if table_path == "device":
        pool._table_np = None
    return pool


def kv_for(tokens, layer):
    """Deterministic K/V rows of a token sequence (position and token dependent)."""
    t = torch.tensor(tokens, dtype=torch.float32)
    pos = torch.arange(len(tokens), dtype=torch.float32)
    base = (t * 10 + pos + layer * 1000).view(-1, 1, 1).expand(-1, H, D)
    return base.clone(), -base.clone()


def write(pool, slots, tokens, start):
    """Writes the K/V of `tokens` (positions start..) at `slots` in every layer."""
    for layer in range(LAYERS):
        k, v = kv_for(tokens, layer)
        pool.write(layer, torch.as_tensor(slots), k[start:], v[start:])


def assert_reads(pool, h, tokens):
    """The request's slots hold exactly the K/V of its own token sequence."""
    slots = pool.slots(h)
    assert len(slots) == len(tokens)
    row = pool.rows([h])[0]
    assert pool.req_to_token[row, : len(slots)].tolist() == slots.tolist()
    for layer in range(LAYERS):
        k, v = pool.read(layer, slots)
        ek, ev = kv_for(tokens, layer)
        assert torch.equal(k, ek) and torch.equal(v, ev)


def serve(pool, prompt, salt=None):
    h, cached = pool.open_with_prefix(prompt, [len(prompt)], salt)
    r = pool.extend(h, len(prompt) - int(cached[0]))
    write(pool, r.slots, prompt, int(cached[0]))
    return h, int(cached[0])


@pytest.mark.parametrize("table_path", ["host", "device"])
def test_shared_system_prompt_hits_and_fills_the_table(table_path):
    pool = make(table_path=table_path)
    system = list(range(100, 112))
    h1, c1 = serve(pool, system + [1, 2, 3])
    assert c1 == 0
    assert_reads(pool, h1[0], system + [1, 2, 3])
    pool.close(h1, cache=True)
    assert pool.cached_pages == 3 and pool.evictable_pages == 3
    h2, c2 = serve(pool, system + [7, 8])
    assert c2 == 12 and pool.hit_tokens == 12
    assert_reads(pool, h2[0], system + [7, 8])
    t = pool.page_table(h2)
    assert t.kv_indices.tolist() == pool.pages(h2[0]).tolist()
    pool.check()


@pytest.mark.parametrize("table_path", ["host", "device"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_fork_then_diverge_reads_back_own_kv(page_size, table_path):
    pool = make(page_size, table_path)
    prompt = [5, 6, 7, 8, 9, 10]
    h, _ = serve(pool, prompt)
    kids = pool.fork(h[0], 2)
    seqs = {int(h[0]): list(prompt), int(kids[0]): list(prompt), int(kids[1]): list(prompt)}
    for x in seqs:
        assert_reads(pool, x, seqs[x])
    # Three decode steps, each request sampling a different token.
    for step in range(3):
        hs = list(seqs)
        toks = [20 + 10 * i + step for i in range(3)]
        r = pool.extend(hs, 1, tokens=toks)
        for i, x in enumerate(hs):
            seqs[x].append(toks[i])
            write(pool, r.slots[i : i + 1], seqs[x], len(seqs[x]) - 1)
        pool.check()
    for x in seqs:
        assert_reads(pool, x, seqs[x])
        assert pool.known_tokens(x).tolist() == seqs[x]
    if page_size == 4:
        # 6 tokens = one full shared page + a half page that two of the three copied.
        assert pool.pages(h[0])[0] == pool.pages(kids[0])[0] == pool.pages(kids[1])[0]
        assert len({pool.pages(x)[1] for x in seqs}) == 3


def test_truncate_into_a_shared_page_copies_before_writing():
    pool = make()
    prompt = list(range(30, 38))
    h = pool.open(1)  # no remembered prompt: the kid may write other tokens
    write(pool, pool.extend(h, 8, tokens=prompt).slots, prompt, 0)
    kid = pool.fork(h[0], 1)
    pool.truncate(kid, 5)
    r = pool.extend(kid, 2, tokens=[1, 2])
    write(pool, r.slots, prompt[:5] + [1, 2], 5)
    assert_reads(pool, int(kid[0]), prompt[:5] + [1, 2])
    assert_reads(pool, int(h[0]), prompt)


def snapshot(pool, hs):
    s = pool.stats()
    per = [(pool.slots(h).tolist(), pool.known_tokens(h).tolist()) for h in hs]
    return (s.free_pages, s.cached_pages, s.evictable_pages, s.open_requests, s.hit_tokens, s.miss_tokens,
            pool.req_to_token.clone(), per, pool.allocator.pending_copies)


def same(a, b):
    assert a[:6] == b[:6] and torch.equal(a[6], b[6]) and a[7:] == b[7:]


@pytest.mark.parametrize("call,exc", [
    (lambda p, h: p.open_with_prefix([1, 2, 3], [2, 2]), kvpool.InvalidArgumentError),
    (lambda p, h: p.open_with_prefix([1, 2, 3], [3], salt=1.5), kvpool.InvalidArgumentError),
    (lambda p, h: p.open_with_prefix([1, 2, 3], [3], salt="tenant"), kvpool.InvalidArgumentError),
    (lambda p, h: p.open_with_prefix([1, -2, 3], [3]), kvpool.InvalidArgumentError),
    (lambda p, h: p.extend(h, 1, tokens=[1]), kvpool.InvalidArgumentError),
    (lambda p, h: p.extend(h[:1], 2, tokens=[1, 2, 3]), kvpool.InvalidArgumentError),
    (lambda p, h: p.evict(-1), kvpool.InvalidArgumentError),
    (lambda p, h: p.evict(1.5), kvpool.InvalidArgumentError),
    (lambda p, h: p.fork(h[0], -1), kvpool.InvalidArgumentError),
    (lambda p, h: p.fork(h[0], 99), kvpool.TooManyRequestsError),
])
def test_typed_errors_change_nothing(call, exc):
    pool = make()
    h, _ = serve(pool, list(range(10)))
    h = list(h) + list(pool.fork(h[0], 1))
    before = snapshot(pool, h)
    with pytest.raises(exc):
        call(pool, h)
    same(snapshot(pool, h), before)
    pool.check()


def test_closed_and_stale_handles_are_rejected_for_fork_and_cache():
    pool = make()
    h, _ = serve(pool, list(range(10)))
    closed = int(h[0])
    pool.close(h)
    before = snapshot(pool, [])
    with pytest.raises(kvpool.InvalidHandleError, match="closed"):
        pool.fork(closed)
    with pytest.raises(kvpool.InvalidHandleError, match="closed"):
        pool.cache([closed])
    h2 = pool.open(1)  # reuses the row: the old handle is now stale
    assert pool.rows(h2)[0] == closed & 0xFFFFFFFF
    with pytest.raises(kvpool.InvalidHandleError, match="stale"):
        pool.fork(closed)
    with pytest.raises(kvpool.InvalidHandleError, match="stale"):
        pool.cache([closed])
    pool.close(h2)
    same(snapshot(pool, []), before)


@pytest.mark.parametrize("mode", ["inference", "no_grad", "grad"])
def test_sharing_obeys_grad_modes(mode):
    ctx = {"inference": torch.inference_mode, "no_grad": torch.no_grad, "grad": torch.enable_grad}[mode]
    pool = make()
    with ctx():
        h, _ = serve(pool, list(range(9)))
        kid = pool.fork(h[0], 1)
        r = pool.extend(kid, 1, tokens=[3])
        write(pool, r.slots, list(range(9)) + [3], 9)
        pool.close(h, cache=True)
    for _, t in pool.named_tensors():
        assert not t.is_inference() and not t.requires_grad
    assert_reads(pool, int(kid[0]), list(range(9)) + [3])


def test_events_and_counters_reach_the_pool():
    pool = make(hash_seed=5)
    h, _ = serve(pool, list(range(9)))
    pool.close(h, cache=True)
    ev = pool.take_events()
    assert ev["kind"].tolist() == [0, 0] and ev["page"].dtype == np.int32
    assert ev["token_ids"].tolist() == list(range(8))
    assert pool.allocator.hash_seed == 5
    assert pool.evict(10) == 2
    assert pool.take_events()["kind"].tolist() == [1, 1]
    pool.clear_cache()
    assert pool.take_events()["kind"].tolist() == [2]


def test_chain_hashes_match_only_verified_pages_across_pools():
    """The prefix-aware transfer hooks: a receiver with the same hash_seed shares the
    cached pages; another seed, another salt or other tokens under the right hashes
    miss; bad input is a typed error that changes nothing."""
    system = list(range(100, 112))  # 3 pages of 4
    src, dst, other = make(hash_seed=9), make(hash_seed=9), make(hash_seed=10)
    for p in (dst, other):
        h, _ = serve(p, system + [1])
        p.close(h, cache=True)
    hs, _ = serve(src, system + [5, 6, 7, 8, 9])
    hashes, tokens, salt = src.chain_hashes(int(hs[0]))
    assert hashes.dtype == np.uint64 and len(hashes) == 2 * 4 and tokens.tolist() == system + [5, 6, 7, 8]
    assert dst.match_chain_hashes(hashes, tokens, salt) == 3
    assert other.match_chain_hashes(hashes, tokens, salt) == 0, "another hash_seed misses"
    assert dst.match_chain_hashes(hashes, tokens, 1) == 0, "another salt misses"
    forged = tokens.copy()
    forged[5] += 1  # the right hashes, other tokens in page 1: only page 0 matches
    assert dst.match_chain_hashes(hashes, forged, salt) == 1
    before = (dst.free_pages, dst.open_requests, dst.cached_pages)
    for bad in [(hashes[:3], tokens), (hashes, tokens[:-1]), (hashes.astype(np.float64), tokens),
                (hashes, tokens * 0 - 1)]:
        with pytest.raises(kvpool.InvalidArgumentError):
            dst.open_with_chain_hashes(*bad, salt)
    with pytest.raises(kvpool.InvalidArgumentError):
        dst.open_with_chain_hashes(hashes, tokens, salt, max_pages=-1)
    assert (dst.free_pages, dst.open_requests, dst.cached_pages) == before
    d = dst.open_with_chain_hashes(hashes, tokens, salt, max_pages=2)
    assert dst.length(d) == 8
    r = dst.extend([d], 9)  # the rest of the request: its token ids come from the chain
    write(dst, r.slots, system + [5, 6, 7, 8, 9], 8)
    assert_reads(dst, d, system + [5, 6, 7, 8, 9])
    assert dst.known_tokens(d).tolist()[:16] == system + [5, 6, 7, 8]
    dst.cache([d])  # received pages join dst's index
    assert dst.cached_pages == 4
    dst.close([d])
    dst.check()


@pytest.mark.parametrize("kv_events", [True, False])
def test_kv_events_false_stops_recording_events(kv_events):
    """docs/allocator.md: ``kv_events=False`` turns the events off; a pool
    records a Stored event per registered page otherwise."""
    pool = make(kv_events=kv_events)
    h, _ = pool.open_with_prefix(np.arange(9), [9])
    pool.extend(h, 9)
    pool.cache(h)
    pool.close(h)
    pool.clear_cache()
    kinds = pool.take_events()["kind"]
    assert len(kinds) == (3 if kv_events else 0)  # two Stored, one Cleared
