"""SGLang's radix-cache expectations through KVPool's tensors on CPU: what a hit serves is the K/V
its prefix wrote, after pressure, priorities and a host round trip (HiCache's load_back), and a
locked request's K/V survives pressure that evicts everything else."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvpool

P = 4


def make(**kw) -> kvpool.KVPool:
    return kvpool.KVPool(1, 1, 4, dtype=torch.float32, num_pages=9, page_size=P, max_requests=4,
                         max_context_len=64, manual_clock=True, **kw)


def kv_of(tokens) -> torch.Tensor:
    return torch.tensor(tokens, dtype=torch.float32)[:, None, None].expand(-1, 1, 4).contiguous()


def run(pool, prompt, close=True, **close_kw):
    """Prefix hit, then the prefill writes K = the token id (V = -K) at the new slots."""
    h, c = pool.open_with_prefix(np.array(prompt), [len(prompt)])
    step = pool.extend(h, len(prompt) - int(c[0]))
    pool.write(0, step.out_cache_loc, kv_of(prompt[int(c[0]):]), -kv_of(prompt[int(c[0]):]))
    if close:
        pool.close(h, **close_kw)
    pool.check()
    return h, int(c[0])


def served(pool, prompt) -> tuple[int, torch.Tensor]:
    h, c = pool.open_with_prefix(np.array(prompt), [len(prompt)])
    slots = torch.as_tensor(pool.slots(int(h[0])))
    k = pool.k_buffer(0)[slots][:, 0, 0].clone()
    assert torch.equal(pool.v_buffer(0)[slots][:, 0, 0], -k)
    pool.close(h)
    return int(c[0]), k


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_an_evicted_prefix_comes_back_from_the_host_with_its_own_kv(policy):
    pool = make(host_pages=9, host_policy=policy)
    A = list(range(100, 112))
    run(pool, A + [1], cache=True)
    assert pool.evict(8) == 3
    run(pool, list(range(500, 532)))  # every device page rewritten with other K/V, not cached
    hit, k = served(pool, A + [2])
    assert hit == 12 and pool.host_hit_tokens == 12
    assert k.tolist() == [float(t) for t in A]


def test_a_locked_requests_kv_survives_pressure_that_evicts_the_rest():
    pool = make()
    run(pool, list(range(100, 108)) + [1], cache=True)
    run(pool, list(range(200, 208)) + [1], cache=True)
    h, _ = run(pool, list(range(100, 108)) + [9, 9, 9], close=False)  # locks the first prompt's 2 pages
    before = pool.k_buffer(0)[torch.as_tensor(pool.slots(int(h[0])))].clone()
    run(pool, list(range(700, 700 + pool.free_slots)))  # takes every free and evictable page
    assert pool.evictable_pages == 0 and served(pool, list(range(200, 208)) + [1])[0] == 0
    assert torch.equal(pool.k_buffer(0)[torch.as_tensor(pool.slots(int(h[0])))], before)
    hit, k = served(pool, list(range(100, 108)) + [3])
    assert hit == 8 and k.tolist() == [float(t) for t in range(100, 108)]
    pool.close(h)
    pool.check()


def test_a_high_priority_prefix_keeps_serving_its_kv_through_pressure():
    pool = make()
    system = list(range(100, 108))
    run(pool, system + [1], cache=True, priority=80)
    for i in range(6):  # 6 default-priority prompts of 2 full pages through 8 pages
        run(pool, list(range(1000 * (i + 1), 1000 * (i + 1) + 8)) + [1], cache=True)
    hit, k = served(pool, system + [2])
    assert hit == 8 and k.tolist() == [float(t) for t in system]
    assert served(pool, list(range(1000, 1008)) + [1])[0] == 0, "the oldest default prompt went"


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
@pytest.mark.parametrize("path", ["extend", "admit"])
def test_pressure_that_evicts_a_prefix_offloads_it_before_overwriting(policy, path):
    """The eviction happens inside the call that then writes the pages: the host copy must be
    taken before the step's writes (offloads run first)."""
    pool = make(host_pages=9, host_policy=policy)
    A = list(range(100, 112))
    run(pool, A + [1], cache=True)
    if path == "extend":
        run(pool, list(range(500, 532)))
    else:
        h, step = pool.admit([32])
        pool.write(0, step.out_cache_loc, kv_of([7] * 32), -kv_of([7] * 32))
        pool.close(h)
    hit, k = served(pool, A + [2])
    assert hit == 12 and pool.host_hit_tokens == 12
    assert k.tolist() == [float(t) for t in A]


def test_a_host_hit_that_evicts_another_prefix_keeps_both():
    pool = make(host_pages=9)  # write_back
    A, B = list(range(100, 116)), list(range(200, 216))
    run(pool, A + [1], cache=True)
    assert pool.evict(8) == 4  # A on the host only
    run(pool, B + [1], cache=True)
    run(pool, list(range(300, 316)) + [1], cache=True)  # the device is now full of B and this one
    for prompt in (A, B, A):  # each hit loads its pages back, evicting (offloading) the other's
        hit, k = served(pool, prompt + [2])
        assert hit == 16 and k.tolist() == [float(t) for t in prompt], prompt[0]
    pool.check()


def test_swa_pool_hits_serve_their_kv_in_both_layer_kinds_after_eviction():
    """SGLang's SWARadixCache through HybridKVPool: a hit serves the full layer's K/V for the
    whole prefix and the sliding layer's for its window, after the sliding group lost a page."""
    pool = kvpool.KVPool(2, 1, 4, dtype=torch.float32, layer_types=["sliding_attention", "full_attention"],
                         sliding_window=8, page_size=4, num_pages=17, max_requests=4, max_context_len=64)
    A = list(range(100, 124))
    h, _ = pool.open_with_prefix(np.array(A), [24])
    step = pool.extend(h, 24)
    for layer in (0, 1):
        pool.write(layer, step.for_layer(layer), kv_of(A), -kv_of(A))
    pool.close(h, cache=True)
    assert pool.evict(0, 1) == 1  # the sliding group's oldest page: the chain's tail, tokens 20..23

    def hit(prompt):
        g, c = pool.open_with_prefix(np.array(prompt), [len(prompt)])
        n = int(c[0])
        full = pool.k_buffer(1)[torch.as_tensor(pool.slots(int(g[0]), 1))][:, 0, 0].tolist()
        window = pool.k_buffer(0)[torch.as_tensor(pool.slots(int(g[0]), 0))][max(0, n - 7):, 0, 0].tolist()
        pool.close(g)
        return n, full, window
    n, full, window = hit(A + [0])
    assert n == 20 and full == [float(t) for t in A[:20]] and window == [float(t) for t in A[13:20]]
    pool.check()
