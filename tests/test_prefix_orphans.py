"""A request truncated inside a page that it alone holds, and recomputed: where
cached pages continue that page (its registration has live children), the
request writes into a copy of it and the cache keeps the page and its chain, so
the whole chain keeps hitting. Unregistered to write in place, the page would
leave the pages after it as orphans that no lookup reaches (each is verified
against its parent's registration), until a recompute replaced them. Recomputing
the same ids registers nothing twice: the request's copy is a duplicate of the
kept page, and its later pages take over the unheld copies' registrations."""

import numpy as np
import pytest
from interactions_common import EventMirror

import kvpool

SEED = 3


def hit_of(a, toks):
    h, c = a.open_with_prefix(toks, [len(toks)])
    a.close(h)
    a.check()
    return int(c[0])


@pytest.mark.parametrize("P", [2, 16])
def test_a_truncated_page_with_cached_children_keeps_the_chain_hitting(P):
    a = kvpool.SlotAllocator(16, P, 8, 8 * P, hash_seed=SEED)
    mirror = EventMirror(P, SEED)
    full = np.arange(100, 100 + 3 * P + 1, dtype=np.int64)  # 3 full pages + 1 token
    h, _ = a.open_with_prefix(full, [len(full)])
    a.extend(h, len(full))
    a.close(h, cache=True)
    r, c = a.open_with_prefix(full, [len(full)])
    assert int(c[0]) == 3 * P
    old = a.pages(int(r[0]))[:3].tolist()
    # Back to the first token, then the same ids again: page 0 is copied (its
    # children are cached), pages 1 and 2 are recomputed.
    a.truncate(r, 1)
    a.extend(r, 3 * P, tokens=full[1:3 * P + 1])
    a.check()
    new = a.pages(int(r[0]))[:3].tolist()
    assert new[0] != old[0] and a.pending_copies == 1
    assert hit_of(a, full) == 3 * P, "the kept chain, before the recompute registers"
    a.cache(r)
    a.check()
    mirror.apply(a.take_events())
    assert hit_of(a, full) == 3 * P, "while the request is open"
    # Page 0 stays the cache's (its copy waits on it); the request's pages 1
    # and 2 took over the old pages' registrations, which nobody held.
    assert a.cached_pages == 3
    assert sorted(mirror.on_tier[0].values()) == sorted([old[0], *new[1:]])
    a.take_copies()
    # The chain goes on past them: a page decoded next registers too.
    a.extend(r, P, tokens=np.arange(500, 500 + P))
    a.close(r, cache=True)
    a.check()
    mirror.apply(a.take_events())
    longer = np.concatenate([full, np.arange(500, 500 + P)])
    assert hit_of(a, longer) == 4 * P, "after the request closed"
    assert len(mirror.on_tier[0]) == a.cached_pages == 4
