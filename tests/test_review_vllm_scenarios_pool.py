"""vLLM v1 prefix-cache scenarios on a CPU KVPool: a hit must serve the K/V its prefix computed.

vLLM's manager tests check block ids; what an engine relies on is that the slots
a hit hands back hold the keys and values the earlier request wrote for that very
prefix. Every position's K here is a fingerprint of the whole prefix up to it (as
a real K depends on every token before it), so a hit served from another prompt's,
an evicted or an overwritten page reads back wrong values. Plain pools and hybrid
(sliding-window + full) pools, page sizes 1, 4 and 16.
"""

from __future__ import annotations

import pytest
import torch

import kvpool

PAGE_SIZES = [1, 4, 16]


def fingerprints(tokens: list[int]) -> list[float]:
    out, x = [], 0
    for t in tokens:
        x = (x * 31 + t + 1) % 1_000_003
        out.append(float(x))
    return out


def make(p: int, hybrid: bool) -> kvpool.KVPool:
    kw = dict(num_kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu", page_size=p, num_pages=64,
              max_requests=8, max_context_len=512, hash_seed=7, handle_seed=7)
    if hybrid:
        return kvpool.KVPool(num_layers=2, layer_types=["sliding_attention", "full_attention"],
                             sliding_window=2 * p + 1, **kw)
    return kvpool.KVPool(num_layers=2, **kw)


def slots(pool: kvpool.KVPool, h: int, layer: int) -> list[int]:
    return (pool.slots(h, layer) if hasattr(pool, "groups") else pool.slots(h)).tolist()


def attended(pool: kvpool.KVPool, layer: int, length: int) -> range:
    """Positions a next token at `length` reads: all, or a sliding layer's last W - 1."""
    window = getattr(pool, "sliding_window", None)
    if hasattr(pool, "groups") and pool.group(layer).kind == "sliding":
        return range(max(0, length - window + 1), length)
    return range(length)


def compute(pool: kvpool.KVPool, h: int, tokens: list[int], start: int, n: int) -> None:
    """One engine step: extend by n, write every layer's K/V for positions [start, start + n)."""
    res = pool.extend(h, n, tokens=tokens[start:start + n])
    fp = torch.tensor(fingerprints(tokens)[start:start + n])
    for layer in range(pool.num_layers):
        loc = res.for_layer(layer) if hasattr(res, "for_layer") else res.out_cache_loc
        k = (fp + 1000 * layer).view(n, 1, 1).expand(n, 1, 2).contiguous()
        pool.write(layer, loc, k, -k)


def assert_serves(pool: kvpool.KVPool, h: int, tokens: list[int], length: int) -> None:
    fp = fingerprints(tokens)
    for layer in range(pool.num_layers):
        pos = list(attended(pool, layer, length))
        s = slots(pool, h, layer)
        k, v = pool.read(layer, [s[i] for i in pos])
        want = torch.tensor([fp[i] + 1000 * layer for i in pos])
        assert torch.equal(k[:, 0, 0], want), (layer, pos)
        assert torch.equal(v[:, 0, 1], -want)


def prefill(pool: kvpool.KVPool, tokens: list[int], chunk: int) -> tuple[int, int]:
    hs, cached = pool.open_with_prefix(tokens, [len(tokens)])
    h, n = int(hs[0]), int(cached[0])
    while n < len(tokens):
        k = min(chunk, len(tokens) - n)
        compute(pool, h, tokens, n, k)
        pool.cache(h)
        n += k
    return h, int(cached[0])


@pytest.mark.parametrize("p", PAGE_SIZES)
@pytest.mark.parametrize("hybrid", [False, True])
def test_hit_serves_the_shared_prefix_kv(p: int, hybrid: bool) -> None:
    """vLLM test_prefill on K/V: the second prompt's hit reads the first's values of the
    shared system prompt, its table row names those slots, and its own suffix is its own."""
    pool = make(p, hybrid)
    system = list(range(1, 3 * p + 2))
    a = system + [50] * (p + 1)
    b = system + [60] * (2 * p)
    ha, _ = prefill(pool, a, p)
    pool.close(ha)
    hb, cached = pool.open_with_prefix(b, [len(b)])
    hb, cached = int(hb[0]), int(cached[0])
    assert cached == len(system) // p * p
    assert_serves(pool, hb, b, cached)
    for layer in range(pool.num_layers):
        table = pool.req_to_token[layer] if hybrid else pool.req_to_token
        row = table[int(pool.rows([hb])[0])]
        s = slots(pool, hb, layer)
        for i in attended(pool, layer, cached):
            assert int(row[i]) == s[i]
    compute(pool, hb, b, cached, len(b) - cached)
    assert_serves(pool, hb, b, len(b))
    pool.check()


@pytest.mark.parametrize("p", PAGE_SIZES)
@pytest.mark.parametrize("hybrid", [False, True])
def test_preempted_request_reads_back_its_own_kv(p: int, hybrid: bool) -> None:
    """vLLM preemption by recompute: the re-admitted request's hit reads the K/V it wrote
    before it was preempted, while other requests churned the pool in between."""
    pool = make(p, hybrid)
    tokens = list(range(7, 7 + 2 * p + 1))
    h, _ = prefill(pool, tokens, 2 * p + 1)
    for t in range(3 * p):
        tokens.append(100 + t)
        compute(pool, h, tokens, len(tokens) - 1, 1)
        pool.cache(h)
    pool.close(h, cache=True)
    for i in range(3):  # unrelated traffic, within what the pool has free
        other, _ = prefill(pool, [200 + i] * (2 * p + 1), p)
        pool.close(other, cache=True)
    hs, cached = pool.open_with_prefix(tokens, [len(tokens)])
    assert int(cached[0]) == (len(tokens) - 1) // p * p
    assert_serves(pool, int(hs[0]), tokens, int(cached[0]))
    pool.check()


@pytest.mark.parametrize("p", [4, 16])
@pytest.mark.parametrize("hybrid", [False, True])
def test_fork_copies_the_shared_partial_page_before_a_write(p: int, hybrid: bool) -> None:
    """vLLM parallel sampling shares a prompt's full blocks; kvpool's fork also shares the
    partial last page and copies it on the first write. Both requests then read their own
    last token and the shared values before it."""
    pool = make(p, hybrid)
    tokens = list(range(1, 2 * p + 3))
    h, _ = prefill(pool, tokens, len(tokens))
    kid = int(pool.fork(h, 1)[0])
    mine, theirs = tokens + [7], tokens + [8]
    compute(pool, kid, theirs, len(tokens), 1)
    compute(pool, h, mine, len(tokens), 1)
    assert_serves(pool, h, mine, len(mine))
    assert_serves(pool, kid, theirs, len(theirs))
    pool.check()
