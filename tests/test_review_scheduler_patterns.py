"""Outside check of ``KVPool`` driven as a scheduler drives it (chunked prefill with ``cache()``
between chunks, speculative rollback, preemption by recompute and by swap, forks, aborts),
with the K/V of every position a function of its salt and token prefix, so that a prefix hit
must read back exactly what was written for those tokens. Findings pinned here."""

from __future__ import annotations

import pytest
import torch

import kvpool

P1_TOKENS = [3, 1, 2, 2]


def _rows(tokens, start, n):
    """K rows for positions ``[start, start + n)`` of ``tokens``: each a function of the prefix."""
    out = []
    for i in range(start, start + n):
        h = 17
        for t in tokens[: i + 1]:
            h = (h * 1_000_003 + t + 1) % 65_521
        out.append([float(h), float(i), float(tokens[i]), 1.0])
    return torch.tensor(out, dtype=torch.float32).view(n, 1, 4)


def _prefill(pool, tokens, *, cap):
    """open_with_prefix + the rest of the prompt written; returns (handle, hit)."""
    hs, cached = pool.open_with_prefix(tokens, [len(tokens)])
    h, c = int(hs[0]), int(cached[0])
    assert c == cap
    res = pool.extend([h], [len(tokens) - c], tokens=tokens[c:])
    k = _rows(tokens, c, len(tokens) - c)
    pool.write(0, res.out_cache_loc, k, -k)
    return h


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_duplicate_page_becomes_device_copy_once_the_other_copy_is_only_on_the_host(policy):
    """Request B recomputed a page A held (its prompt's last token: a hit never covers it), so
    B's ``cache()`` kept A's copy and left B's page unregistered. A then finished and its copy
    was evicted to the host (write_back) or dropped from the device with its host copy kept
    (write_through): the entry's only copy was on the host while B still held the same tokens
    on the device. B's next ``cache()`` left its page unregistered (the chain still walked
    through the live entry), so a new request on the same prompt hit that page only through a
    host load (one more device page and a copy), and missed it outright once no device page was
    free (``open_with_prefix`` hit 3 tokens of 4 while B held all 4). ``cache()`` now makes B's
    page the entry's device copy, as it does when it first meets a host-only duplicate."""
    p = kvpool.KVPool(1, 1, 4, dtype=torch.float32, page_size=1, num_pages=12, max_requests=8,
                      max_context_len=16, host_pages=8, host_policy=policy, hash_seed=1)
    T = P1_TOKENS
    a = _prefill(p, T, cap=0)
    p.cache([a])
    b = _prefill(p, T, cap=3)  # position 3 computed again: B's own page
    p.cache([b])
    assert p.stats().cached_pages == 4  # A's four; B's duplicate stays unregistered
    p.close([a], cache=True)
    assert p.evict(10) == 1  # A's last page: its entry keeps only its host copy
    assert p.stats().host_cached_pages == (1 if policy == "write_back" else 4)
    p.cache([b])
    assert p.stats().cached_pages == 4, "B's page did not become the entry's device copy"
    loaded = p.stats().loaded_pages
    h, c = p.open_with_prefix(T + [1], [5])
    assert c.tolist() == [4] and p.stats().loaded_pages == loaded, "a hit on B's content loaded from the host"
    assert p.slots(int(h[0])).tolist() == p.slots(b).tolist()
    p.close(h)
    # No device page free: the hit must still cover all four tokens B holds, with their K/V.
    p.admit([p.stats().free_pages])
    assert p.stats().free_pages == 0
    h, c = p.open_with_prefix(T + [0], [5])
    assert c.tolist() == [4]
    k, v = p.read(0, p.slots(int(h[0])))
    assert torch.equal(k, _rows(T, 0, 4)) and torch.equal(v, -_rows(T, 0, 4))
    p.check()


def test_duplicate_page_registered_by_close_once_the_other_copy_is_only_on_the_host():
    """The same through ``close(cache=True)``: B's page is kept as the entry's device copy
    instead of being freed, so the prompt hits on the device with no load."""
    p = kvpool.KVPool(1, 1, 4, dtype=torch.float32, page_size=1, num_pages=12, max_requests=8,
                      max_context_len=16, host_pages=8, host_policy="write_back", hash_seed=1)
    T = P1_TOKENS
    a = _prefill(p, T, cap=0)
    p.cache([a])
    b = _prefill(p, T, cap=3)
    p.cache([b])
    p.close([a], cache=True)
    assert p.evict(10) == 1
    p.close([b], cache=True)
    assert p.stats().cached_pages == 4
    loaded = p.stats().loaded_pages
    h, c = p.open_with_prefix(T + [2], [5])
    assert c.tolist() == [4] and p.stats().loaded_pages == loaded
    k, _ = p.read(0, p.slots(int(h[0])))
    assert torch.equal(k, _rows(T, 0, 4))
    p.check()
