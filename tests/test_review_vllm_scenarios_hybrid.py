"""vLLM v1 hybrid KV-cache scenarios, replayed on kvpool's public GroupedAllocator API.

vLLM's SlidingWindowManager drops blocks that fall out of the window
(remove_skipped_blocks) and still serves a prefix hit when only the window before
the hit's end is cached (test_sliding_window_possible_cached_prefix,
test_prefill_hybrid_model); its MambaManager hits only where a state was kept.
kvpool's rule (docs/groups.md, *The hit rule where groups disagree*): a hit of
length L needs the anchor chain and every full group for [0, L), every sliding
group's pages for [L - W + 1, L) and every state group's checkpoint at L. The
expected hits below come from that rule and from the eviction order the docs
give (LRU per group; a window releases its pages in position order as it moves,
a close releases the rest last-first). Page sizes include 1.
"""

from __future__ import annotations

import math

import pytest

from kvpool import GroupedAllocator, PoolExhaustedError

PAGE_SIZES = [1, 4, 16]
N = 8  # pages of the prompt


def make(p: int, window: int, with_full: bool, sliding_pages: int = 64) -> GroupedAllocator:
    groups = [{"kind": "sliding", "num_pages": sliding_pages, "page_size": p, "window": window}]
    if with_full:
        groups.insert(0, {"kind": "full", "num_pages": 64, "page_size": p})
    return GroupedAllocator(groups, max_requests=8, max_context_len=4096, hash_seed=7, handle_seed=7)


def sliding_group(g: GroupedAllocator) -> int:
    return g.num_groups - 1


def needed(length: int, window: int, p: int) -> set[int]:
    """The sliding group's pages a hit of `length` needs: those covering [L - W + 1, L)."""
    lo = max(0, length - window + 1)
    return set(range(lo // p, -(-length // p))) if length > lo else set()


def expected_hit(cached: set[int], full_pages: int, prompt_len: int, window: int, p: int) -> int:
    """The longest L (a multiple of p, at most prompt_len - 1 and the full pages) whose window
    is cached; the full group is monotone, so searching down from its cap is the fixed point."""
    length = min(full_pages * p, (prompt_len - 1) // p * p)
    while length > 0 and not needed(length, window, p) <= cached:
        length -= p
    return length


def run(g: GroupedAllocator, tokens: list[int], chunk: int) -> tuple[int, int]:
    """Chunked prefill: open on the cached prefix, then compute and publish chunk by chunk,
    checking after each extend that the window released exactly the pages wholly before
    start - W + 1 (vLLM's remove_skipped_blocks) and holds every later one."""
    hs, cached = g.open_with_prefix(tokens, [len(tokens)])
    h, n = int(hs[0]), int(cached[0])
    s = sliding_group(g)
    p, window = g.groups[s]["page_size"], g.groups[s]["window"]
    while n < len(tokens):
        k = min(chunk, len(tokens) - n)
        g.extend(h, k)
        g.cache(h)
        pages = g.pages(h, s).tolist()
        gone = max(0, (n - window + 1) // p)
        assert pages[:gone] == [0] * gone and 0 not in pages[gone:]
        n += k
    return h, int(cached[0])


def prompt(p: int, n: int = N) -> list[int]:
    return [i for i in range(1, n + 1) for _ in range(p)]


def release_order(p: int, window: int, n: int = N) -> list[int]:
    """The sliding group's pages of a prompt prefilled one page per chunk then closed, oldest
    first in its LRU: the window's releases in position order, then the close's last-first."""
    released = max(0, ((n - 1) * p - window + 1) // p)
    return list(range(released)) + list(range(n - 1, released - 1, -1))


WINDOWS = [lambda p: 2 * p, lambda p: 2 * p + 1, lambda p: 3 * p - 1, lambda p: 1]


@pytest.mark.parametrize("p", PAGE_SIZES)
@pytest.mark.parametrize("w", range(len(WINDOWS)))
@pytest.mark.parametrize("with_full", [True, False])
def test_out_of_window_pages_evicted_and_the_hit_stands(p: int, w: int, with_full: bool) -> None:
    """vLLM test_prefill_hybrid_model: evicting sliding-window pages outside the window does
    not shorten the hit; evicting the window's own pages does, to the longest length whose
    window is still cached; the hit's out-of-window positions read as the null page."""
    window = WINDOWS[w](p)
    order = release_order(p, window)
    tokens = prompt(p)
    query = tokens + [0]
    for evicted in range(len(order) + 1):
        g = make(p, window, with_full)
        s = sliding_group(g)
        h, _ = run(g, tokens, p)
        g.close(h)
        assert g.evict(s, evicted) == evicted
        want = expected_hit(set(range(N)) - set(order[:evicted]), N, len(query), window, p)
        hs, cached = g.open_with_prefix(query, [len(query)])
        assert cached[0] == want, (evicted, order)
        pages = g.pages(int(hs[0]), s).tolist()
        keep = needed(want, window, p)
        assert [i for i, pg in enumerate(pages) if pg] == sorted(keep)
        if with_full:
            assert 0 not in g.pages(int(hs[0]), 0).tolist()
        g.check()


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_full_group_tail_evicted_shortens_the_hit(p: int) -> None:
    """vLLM: evicting the last block of every group shortens the hit by one block. With the
    full group's tail gone the hit is one page shorter, if that length's window is cached."""
    window = 2 * p
    g = make(p, window, True)
    h, _ = run(g, prompt(p), p)
    g.close(h)
    assert g.evict(0, 1) == 1
    _, cached = g.open_with_prefix(prompt(p) + [0], [N * p + 1])
    assert cached[0] == (N - 1) * p
    g.check()


@pytest.mark.parametrize("p", PAGE_SIZES)
@pytest.mark.parametrize("touched", [(4,), (4, 7), (2, 5), (3, 8)])
@pytest.mark.parametrize("with_full", [True, False])
def test_hit_is_the_longest_length_whose_window_is_cached(p: int, touched: tuple, with_full: bool) -> None:
    """vLLM test_sliding_window_possible_cached_prefix: cached windows with gaps between them
    ([T, T, F, T, F, F, T, T, F, F, F] hits 8 blocks). Hits on shorter prefixes make their
    windows the most recently used; evicting everything older leaves only those windows."""
    window = 2 * p
    g = make(p, window, with_full)
    s = sliding_group(g)
    tokens = prompt(p)
    h, _ = run(g, tokens, p)
    g.close(h)
    keep: set[int] = set()
    for pages in touched:
        short = tokens[: pages * p] + [0]
        hs, cached = g.open_with_prefix(short, [len(short)])
        assert cached[0] == pages * p
        g.close(hs)
        keep |= needed(pages * p, window, p)
    assert g.evict(s, N - len(keep)) == N - len(keep)
    assert g.evictable_pages(s) == len(keep)
    want = expected_hit(keep, N, N * p + 1, window, p)
    assert want == max(touched) * p
    _, cached = g.open_with_prefix(tokens + [0], [N * p + 1])
    assert cached[0] == want
    g.check()


@pytest.mark.parametrize("p", PAGE_SIZES)
@pytest.mark.parametrize("with_full", [True, False])
def test_preempted_hybrid_request_hits_its_own_window(p: int, with_full: bool) -> None:
    """vLLM preemption on a hybrid model: the re-admitted request hits its whole computed
    prefix, served by the pages of the window it held when it was preempted (the pages the
    window released before are cached but not needed)."""
    window = 2 * p + 1
    g = make(p, window, with_full)
    s = sliding_group(g)
    h, _ = run(g, prompt(p, 3), 3 * p)
    for t in range(4 * p + 1):  # decode past the window, caching each step
        g.extend(h, 1, tokens=[100 + t])
        g.cache(h)
        assert len([pg for pg in g.pages(h, s).tolist() if pg]) <= -(-window // p) + 1
    known = g.known_tokens(h).tolist()
    held = g.pages(h, s).tolist()
    g.close(h, cache=True)
    hs, cached = g.open_with_prefix(known, [len(known)])
    length = (len(known) - 1) // p * p
    assert cached[0] == length
    again = g.pages(int(hs[0]), s).tolist()
    assert [again[i] for i in sorted(needed(length, window, p))] == [held[i] for i in sorted(needed(length, window, p))]
    g.check()


@pytest.mark.parametrize(("full_p", "sliding_p", "window"), [(2, 4, 8), (4, 2, 8), (4, 6, 9), (1, 3, 4), (3, 1, 2)])
def test_mixed_page_sizes_hit_in_lcm_steps_while_out_of_window_pages_go(full_p: int, sliding_p: int, window: int) -> None:
    """vLLM hybrid groups of different block sizes hit in steps of their lcm. Each hit here
    makes its window the most recently used, so eviction takes every out-of-window page
    first (the hit stands), then a window page (no shorter length has its window: a miss)."""
    g = GroupedAllocator([{"kind": "full", "num_pages": 128, "page_size": full_p},
                          {"kind": "sliding", "num_pages": 128, "page_size": sliding_p, "window": window}],
                         max_requests=8, max_context_len=4096, hash_seed=7)
    step = g.hit_step
    assert step == full_p * sliding_p // math.gcd(full_p, sliding_p)
    tokens = list(range(1, 1 + N * step))
    h, _ = g.open_with_prefix(tokens, [len(tokens)])
    for _ in range(N):
        g.extend(h, step)
        g.cache(h)
    g.close(h)
    hits = []
    while True:
        hs, cached = g.open_with_prefix(tokens + [0], [len(tokens) + 1])
        hits.append(int(cached[0]))
        g.close(hs)
        if g.evict(1, 1) == 0:
            break
    out_of_window = len(tokens) // sliding_p - len(needed(len(tokens), window, sliding_p))
    assert hits == [len(tokens)] * (out_of_window + 1) + [0] * (len(hits) - out_of_window - 1)
    assert len(hits) == len(tokens) // sliding_p + 1
    g.check()


def snapshot(g: GroupedAllocator, handles: list[int]) -> tuple:
    return (g.stats(), [[g.pages(h, k).tolist() for k in range(g.num_groups)] for h in handles])


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_refusal_in_the_sliding_group_changes_no_group(p: int) -> None:
    """vLLM allocate_slots returns None (nothing allocated) when any group is short. kvpool
    raises PoolExhaustedError naming the group, and every group is as before: a twin pool
    that never made the refused calls evicts the same pages afterwards."""
    window = 2 * p
    twins = [make(p, window, True, sliding_pages=1 + 6) for _ in range(2)]
    for g in twins:
        h, _ = run(g, prompt(p, 4), p)
        g.close(h)
    ref, g = twins
    hs, cached = g.open_with_prefix(prompt(p, 4) + [0], [4 * p + 1])
    h = int(hs[0])
    before = snapshot(g, [h])
    with pytest.raises(PoolExhaustedError, match="group 1"):
        g.extend(h, 7 * p)  # fine for the full group; a prefill chunk this long overflows the window's
    with pytest.raises(PoolExhaustedError, match="group 1"):
        g.admit([7 * p])
    assert snapshot(g, [h]) == before
    g.close(h)
    hr, _ = ref.open_with_prefix(prompt(p, 4) + [0], [4 * p + 1])
    ref.close(hr)
    assert snapshot(g, []) == snapshot(ref, [])
    for b in twins:
        b.check()
        assert b.evict(1, 3) == 3  # the same victims in both: the same hits after
    hits = [b.open_with_prefix(prompt(p, k) + [0], [k * p + 1])[1].tolist() for b in twins for k in (2, 3, 4)]
    assert hits[:3] == hits[3:]
    assert snapshot(g, []) == snapshot(ref, [])


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_state_group_hits_only_at_a_checkpoint(p: int) -> None:
    """vLLM MambaManager: a hybrid hit needs the state at exactly its length. kvpool keeps a
    checkpoint when cache() runs at a multiple of checkpoint_every (docs/groups.md), so a
    one-shot prefill leaves none inside it and a chunked one leaves one per multiple."""
    groups = [{"kind": "full", "num_pages": 64, "page_size": p},
              {"kind": "state", "num_slots": 32, "checkpoint_every": 2 * p}]
    for chunk, want in ((N * p + 1, 0), (p, N * p)):
        g = GroupedAllocator(groups, max_requests=8, max_context_len=4096, hash_seed=7)
        tokens = prompt(p) + [0]
        hs, _ = g.open_with_prefix(tokens, [len(tokens)])
        n = 0
        while n < len(tokens):
            k = min(chunk, len(tokens) - n)
            g.extend(hs, k)
            g.take_copies(1)
            g.cache(hs)
            g.take_copies(1)
            n += k
        g.close(hs)
        _, cached = g.open_with_prefix(tokens + [1], [len(tokens) + 1])
        assert cached[0] == want
        _, cached = g.open_with_prefix(prompt(p, 5) + [1], [5 * p + 1])
        assert cached[0] == (0 if chunk > p else 4 * p)
        g.check()


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_a_hit_does_not_count_its_own_checkpoint_as_room(p: int) -> None:
    """vLLM test_prefill_not_enough_free_blocks_with_computed_blocks, for a state group: the
    only evictable state slot is the checkpoint the hit restores from, so the hit cannot
    take it as the request's slot; the refusal changes nothing, and a prompt that misses
    may still evict the checkpoint for its slot."""
    groups = [{"kind": "full", "num_pages": 64, "page_size": p},
              {"kind": "state", "num_slots": 1 + 2, "checkpoint_every": 0}]
    g = GroupedAllocator(groups, max_requests=8, max_context_len=4096, hash_seed=7)
    tokens = prompt(p, 2)
    h, _ = g.open_with_prefix(tokens, [len(tokens)])
    g.extend(h, len(tokens))
    g.cache(h)
    g.take_copies(1)
    g.close(h)
    running = g.open(1)
    assert (g.free_pages(1), g.evictable_pages(1)) == (1, 1)
    before = (g.stats(), g.state_slots(running, 1).tolist(), g.pages(int(running[0]), 0).tolist())
    # The message names why the group's one evictable slot did not count.
    with pytest.raises(PoolExhaustedError, match=r"group 1 \(state\) exhausted: the call needs 1 of its state "
                       r"slots \(one per request\) but only 0 are free or evictable \(1 more is the checkpoint "
                       r"a prefix hit of this call restores from, which the call cannot evict\)"):
        g.open_with_prefix(tokens + [0], [len(tokens) + 1])
    assert (g.stats(), g.state_slots(running, 1).tolist(), g.pages(int(running[0]), 0).tolist()) == before
    _, cached = g.open_with_prefix([99] * (p + 1), [p + 1])
    assert cached[0] == 0 and g.cached_pages(1) == 0
    g.check()


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_clear_cache_with_a_hybrid_request_running(p: int) -> None:
    """vLLM reset_prefix_cache refuses while blocks are in use; kvpool's clear_cache drops
    every group's cache and keeps held pages (documented design, asserted as such)."""
    g = make(p, 2 * p, True)
    h, _ = run(g, prompt(p), p)
    held = [g.pages(h, k).tolist() for k in range(2)]
    g.clear_cache()
    assert [g.pages(h, k).tolist() for k in range(2)] == held
    assert g.cached_pages(0) == 0 and g.cached_pages(1) == 0
    _, cached = g.open_with_prefix(prompt(p) + [0], [N * p + 1])
    assert cached[0] == 0
    g.cache(h)  # the running request publishes its pages again
    g.check()
