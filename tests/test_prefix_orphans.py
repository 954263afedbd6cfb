"""A request truncated inside a page that it alone holds, and recomputed, writes
that page in place: the page's registration goes, and the pages registered after
it stay as orphans (no lookup reaches them: each is verified against its
parent's registration, which is gone). When the request recomputes their
content, each orphan gives way to the recomputed page, so the request's chain
goes on and a later prompt hits all of it again."""

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
def test_pages_after_a_page_rewritten_in_place_register_and_hit_again(P):
    a = kvpool.SlotAllocator(16, P, 8, 8 * P, hash_seed=SEED)
    mirror = EventMirror(P, SEED)
    full = np.arange(100, 100 + 3 * P + 1, dtype=np.int64)  # 3 full pages + 1 token
    h, _ = a.open_with_prefix(full, [len(full)])
    a.extend(h, len(full))
    a.close(h, cache=True)
    r, c = a.open_with_prefix(full, [len(full)])
    assert int(c[0]) == 3 * P
    # Back to the first token, then the same ids again: page 0 is written in
    # place (its registration goes), pages 1 and 2 are recomputed.
    a.truncate(r, 1)
    a.extend(r, 3 * P, tokens=full[1:3 * P + 1])
    a.cache(r)
    a.check()
    mirror.apply(a.take_events())
    assert hit_of(a, full) == 3 * P, "while the request is open"
    # The registered pages are the request's; the orphans' pages went free.
    assert a.cached_pages == 3
    assert sorted(mirror.on_tier[0].values()) == sorted(a.pages(int(r[0]))[:3].tolist())
    # The chain goes on past them: a page decoded next registers too.
    a.extend(r, P, tokens=np.arange(500, 500 + P))
    a.close(r, cache=True)
    a.check()
    mirror.apply(a.take_events())
    longer = np.concatenate([full, np.arange(500, 500 + P)])
    assert hit_of(a, longer) == 4 * P, "after the request closed"
    assert len(mirror.on_tier[0]) == a.cached_pages == 4
