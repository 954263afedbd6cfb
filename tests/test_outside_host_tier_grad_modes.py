"""Outside-style grad-mode check of a KVPool's host tier: the pool built under one mode
(inference_mode, no_grad, grad enabled), its host tier first used (offload on eviction,
host hit, swap_out / swap_in) under another, then used again under a third, and from a
worker thread (which starts with neither mode): every call works, every byte comes back,
and no tensor the pool owns is an inference tensor or requires grad (``audit`` clean).
Existing tests build and use a pool under one mode; here the modes change between the
pool's construction, the tier's first use and later use (DESIGN.md, "Facts worth knowing").
"""

from __future__ import annotations

import itertools
import threading

import pytest
import torch
from _outside_host_tier import LAYERS, D, H, assert_holds, write_positions

import kvpool

MODES = {"inference": torch.inference_mode, "no_grad": torch.no_grad, "grad": torch.enable_grad}
PS = 4
PROMPT = list(range(100, 113))  # three full pages and one token


def make(policy):
    # 5 usable device pages: three flood requests of three pages push PROMPT's pages out.
    return kvpool.KVPool(LAYERS, H, D, dtype=torch.float32, page_size=PS, num_pages=6, max_requests=6,
                         max_context_len=48, host_pages=16, host_policy=policy, hash_seed=3)


def serve(pool, prompt, salt=0):
    hs, cached = pool.open_with_prefix(prompt, [len(prompt)], salt)
    r = pool.extend(hs, [len(prompt) - int(cached[0])])
    write_positions(pool, r.slots, prompt, salt, int(cached[0]))
    return int(hs[0]), int(cached[0])


def flood(pool, base):
    for i in range(3):
        h, _ = serve(pool, [base + 20 * i + j for j in range(12)])
        pool.close([h], cache=True)  # (cached, so each flood request evicts the older ones)


def first_use(pool):
    """The tier's first work: publish, push to the host, hit it from there, swap a request."""
    h, _ = serve(pool, PROMPT)
    pool.close([h], cache=True)
    flood(pool, 1000)
    h, cached = serve(pool, PROMPT)
    assert cached == 12 and pool.allocator.host_hit_tokens == 12
    pool.swap_out([h])
    flood(pool, 2000)
    pool.swap_in([h])
    assert_holds(pool, h, PROMPT, 0)
    return h


def later_use(pool, h):
    pool.extend([h], [1], [7])
    write_positions(pool, pool.slots(h)[-1:], PROMPT + [7], 0, len(PROMPT))
    pool.swap_out([h])
    flood(pool, 3000)
    pool.swap_in([h])
    assert_holds(pool, h, PROMPT + [7], 0)
    pool.close([h], cache=True)
    pool.evict(pool.num_pages)
    h2, cached = serve(pool, PROMPT + [7, 8])
    assert cached == 12
    assert_holds(pool, h2, PROMPT + [7, 8], 0)
    pool.close([h2])


def assert_plain_tensors(pool):
    for name, t in pool.named_tensors():
        assert not t.is_inference(), f"{name} is an inference tensor"
        assert not t.requires_grad, f"{name} requires grad"
    assert kvpool.audit(pool) == []


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
@pytest.mark.parametrize("built,first,later", list(itertools.product(MODES, MODES, MODES)),
                         ids=lambda m: m)
def test_a_tier_built_and_first_used_under_other_modes(policy, built, first, later):
    with MODES[built]():
        pool = make(policy)
    with MODES[first]():
        h = first_use(pool)
    assert pool.allocator.offloaded_pages > 0 and pool.allocator.loaded_pages > 0
    with MODES[later]():
        later_use(pool, h)
    pool.check()
    assert_plain_tensors(pool)


@pytest.mark.parametrize("built", list(MODES))
def test_a_worker_thread_uses_a_tier_built_under_a_mode(built):
    """A thread starts with neither mode, whatever the builder's was."""
    with MODES[built]():
        pool = make("write_back")
        errors = []

        def work():
            try:
                later_use(pool, first_use(pool))
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        t = threading.Thread(target=work)
        t.start()
        t.join()
    assert not errors, errors
    pool.check()
    assert_plain_tensors(pool)
