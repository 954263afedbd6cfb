"""A request whose hit was cut shorter than what the pool has cached recomputes
pages that are registered already. When nobody holds the cached copy, the
request's copy takes over its registration, so eviction cannot take the prompt's
cached pages (and with them the request's chain) while the request still holds
the same content: a later request on the prompt hits all of it."""

import numpy as np
import pytest
from interactions_common import EventMirror

import kvpool

SEED = 5
STORED, REMOVED = 0, 1  # take_events()["kind"]


def allocator(P, **kw):
    # 11 usable pages: the filler below takes every page an extend can have.
    return kvpool.SlotAllocator(12, P, 8, 12 * P, hash_seed=SEED, **kw)


def prompt(P):
    return np.arange(100, 100 + 4 * P + 1, dtype=np.int64)  # 4 full pages + 1 token


def hit_of(a, toks):
    h, c = a.open_with_prefix(toks, [len(toks)])
    a.close(h)
    a.check()
    return int(c[0])


def fill(a, mirror):
    """A request takes every page an extend can have (evicting what is cached),
    then closes without caching."""
    n = a.free_pages * a.page_size
    h, _ = a.open_with_prefix(np.arange(9000, 9000 + n), [n])
    a.extend(h, n)
    a.check()
    a.close(h)
    a.check()
    mirror.apply(a.take_events())


def recompute(a, P, mirror):
    """Prompt served and cached; then request B opens on its first 2 pages and one
    token, extends over the rest with the prompt's ids and caches."""
    full = prompt(P)
    h, _ = a.open_with_prefix(full, [len(full)])
    a.extend(h, len(full))
    a.close(h, cache=True)
    short = full[: 2 * P + 1]
    b, c = a.open_with_prefix(short, [len(short)])
    assert int(c[0]) == 2 * P
    a.extend(b, 1)
    a.extend(b, 2 * P, tokens=full[2 * P + 1:])
    a.cache(b)
    a.check()
    mirror.apply(a.take_events())
    return b


def device_pages(mirror):
    return sorted(mirror.on_tier[0].values())


@pytest.mark.parametrize("P", [1, 16])
def test_a_recomputed_duplicate_keeps_the_prompt_hitting(P):
    a = allocator(P)
    mirror = EventMirror(P, SEED)
    b = recompute(a, P, mirror)
    fill(a, mirror)
    full = prompt(P)
    assert hit_of(a, full) == 4 * P, "while B is open"
    # The registered pages are B's, and the events name them.
    n = len(full) // P
    assert a.cached_pages == n
    assert device_pages(mirror) == sorted(a.pages(int(b[0]))[:n].tolist())
    a.close(b, cache=True)
    a.check()
    mirror.apply(a.take_events())
    assert hit_of(a, full) == 4 * P, "after B closed"
    assert len(device_pages(mirror)) == a.cached_pages == n
    # Every page the events name: a hash chain of the tokens they carry.
    assert len(list(mirror.pages())) == n


def test_the_take_over_is_a_removed_and_a_stored_of_the_same_hash():
    P = 4
    a = allocator(P)
    mirror = EventMirror(P, SEED)
    full = prompt(P)
    h, _ = a.open_with_prefix(full, [len(full)])
    a.extend(h, len(full))
    a.close(h, cache=True)
    first = a.take_events()
    mirror.apply(first)
    old = dict(mirror.on_tier[0])
    b, _ = a.open_with_prefix(full[: 2 * P + 1], [2 * P + 1])
    a.extend(b, 2 * P + 1, tokens=full[2 * P:])
    a.cache(b)
    ev = a.take_events()
    mirror.apply(ev)
    kinds = ev["kind"].tolist()
    assert kinds == [REMOVED, STORED] * 2
    hashes = list(zip(ev["hash_hi"].tolist(), ev["hash_lo"].tolist()))
    assert hashes[0] == hashes[1] and hashes[2] == hashes[3]
    b_pages = a.pages(int(b[0])).tolist()
    for k, hsh in zip((2, 3), (hashes[0], hashes[2])):
        assert old[hsh] != b_pages[k] and mirror.on_tier[0][hsh] == b_pages[k]
    # The old copies went back FREE: only B's pages are in use.
    assert a.used_pages == 5 and a.evictable_pages == 0
    a.check()


def test_a_copy_another_request_holds_stays_shared():
    """Another holder of the cached copy: the recomputed page stays unregistered
    (nothing moves, no event)."""
    P = 4
    a = allocator(P)
    full = prompt(P)
    h, _ = a.open_with_prefix(full, [len(full)])
    a.extend(h, len(full))
    a.cache(h)
    a.take_events()
    b, _ = a.open_with_prefix(full[: 2 * P + 1], [2 * P + 1])
    a.extend(b, 2 * P + 1, tokens=full[2 * P:])
    a.cache(b)
    assert len(a.take_events()["kind"]) == 0
    assert a.cached_pages == 4
    registered = set(a.pages(int(h[0]))[:4].tolist())
    assert not registered & set(a.pages(int(b[0]))[2:4].tolist())
    a.close(np.concatenate([h, b]), cache=True)
    a.check()
