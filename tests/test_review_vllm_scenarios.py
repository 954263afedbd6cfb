"""vLLM v1 KV-cache-manager scenarios, replayed on kvpool's public SlotAllocator API.

vLLM's tests (tests/v1/core/test_prefix_caching.py, test_kv_cache_utils.py, the
block-pool tests) encode what an engine expects of a prefix cache. Each test here
names the vLLM test it translates. Where kvpool's documented design differs on
purpose, the test asserts kvpool's documented behaviour and says so. Page sizes
include 1, where every token is a full page and there is never a partial page.
The hybrid (sliding-window) scenarios are in test_review_vllm_scenarios_hybrid.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvpool import InvalidArgumentError, InvalidHandleError, PoolExhaustedError, SlotAllocator
from kvpool._core import page_hashes

PAGE_SIZES = [1, 4, 16]


def make(p: int, num_pages: int) -> SlotAllocator:
    # Fixed seeds: two allocators making the same calls are twins (handles and hashes).
    return SlotAllocator(num_pages, p, max_requests=16, max_context_len=4096, hash_seed=7, handle_seed=7)


def block(p: int, *ids: int) -> list[int]:
    """One full page of token `i` per id (vLLM's `[i for i in range(3) for _ in range(16)]`)."""
    return [i for i in ids for _ in range(p)]


def prefill(a: SlotAllocator, tokens: list[int], salt: int | None = None) -> tuple[int, int]:
    """An engine's prefill: open on the cached prefix, compute the rest, publish it."""
    h, cached = a.open_with_prefix(tokens, [len(tokens)], salt=salt)
    a.extend(h, len(tokens) - int(cached[0]))
    a.cache(h)
    return int(h[0]), int(cached[0])


def preview(a: SlotAllocator, tokens: list[int], salt: int | None = None) -> int:
    """Pages of `tokens` the pool would serve, read-only (it touches no LRU position)."""
    p = a.page_size
    n = len(tokens) // p
    return a.match_chain_hashes(page_hashes(tokens, p, a.hash_seed, salt), tokens[: n * p], salt)


class ReuseOrder:
    """The order docs/allocator.md (*Page policy*, *Shared pages*) promises pages come back
    in: FREE pages off a LIFO stack (a release pushes a request's pages last-first, so
    they come back in their old order), then CACHED pages least recently released first
    (a release appends last-first, so a chain's tail is evicted before its head)."""

    def __init__(self, num_pages: int) -> None:
        self.stack = list(range(num_pages - 1, 0, -1))
        self.lru: list[int] = []
        self.refs: dict[int, int] = {}

    def hold(self, pages: list[int]) -> None:
        for pg in pages:
            if pg in self.stack:
                self.stack.remove(pg)
            elif pg in self.lru:
                self.lru.remove(pg)
            self.refs[pg] = self.refs.get(pg, 0) + 1

    def release(self, pages: list[int], registered: set[int]) -> None:
        for pg in reversed(pages):
            self.refs[pg] -= 1
            if self.refs[pg] == 0:
                (self.lru if pg in registered else self.stack).append(pg)

    def take_all(self) -> list[int]:
        return self.stack[::-1] + self.lru


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_prefill_shares_full_pages_then_reuses_free_before_lru_tail_first(p: int) -> None:
    """vLLM test_prefill: a hit covers full pages only, holds them (shared), and once every
    request is freed a cache-missing request takes the free pages first, then evicts the
    cached ones least recently used first, each chain tail-first ([5, 4, 6, ..., 3, 2, 1])."""
    common = block(p, 0, 1, 2)
    tails = [[100 + i for i in range(7)], [200 + i for i in range(5)], [300 + i for i in range(6)]]
    used = 3 + sum(-(-len(t) // p) for t in tails)
    a = make(p, 1 + used + 3)
    model = ReuseOrder(a.num_pages)
    registered: set[int] = set()
    pages: list[list[int]] = []
    handles: list[int] = []
    for i, tail in enumerate(tails):
        h, cached = prefill(a, common + tail)
        assert cached == (0 if i == 0 else 3 * p)
        pg = a.pages(h).tolist()
        if i:
            assert pg[:3] == pages[0][:3]  # the hit is the very pages request 0 computed
        model.hold(pg)
        registered |= set(pg[: len(common + tail) // p])
        pages.append(pg)
        handles.append(h)
        if i == 1:
            # vLLM's get_num_common_prefix_blocks: requests 0 and 1 share exactly the 3 full pages.
            assert [x == y for x, y in zip(pages[0], pg)][:4] == [True, True, True, False]
            a.close(handles[0])  # as vLLM: free(req0), then free(req1)
            a.close(handles[1])
            for req in pages:
                model.release(req, registered)
    a.close(handles[2])
    model.release(pages[2], registered)
    assert a.used_pages == 0 and a.free_pages == a.capacity_pages
    assert a.cached_pages == len(registered)
    a.check()
    big, _ = a.admit([a.capacity_slots], tokens=[10_000 + i for i in range(a.capacity_slots)])
    assert a.pages(int(big[0])).tolist() == model.take_all()
    assert preview(a, common) == 0
    a.check()


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_decode_registers_a_page_only_once_it_is_full(p: int) -> None:
    """vLLM test_decode: decoding fills the partial last page in place; a page takes a block
    hash (here: a registration, which a later prompt can hit) only once it is full."""
    a = make(p, 64)
    prompt = block(p, 0, 1, 2) + [7] * (p - 1)
    h, _ = prefill(a, prompt)
    for step in range(2 * p + 1):
        before = a.pages(h).tolist()
        a.extend(h, 1, tokens=[500 + step])
        a.cache(h)
        n = a.length(h)
        after = a.pages(h).tolist()
        assert after[: len(before)] == before  # the partial page is filled in place, not moved
        assert len(after) == -(-n // p)
        assert a.cached_pages == n // p
        known = a.known_tokens(h).tolist()
        assert preview(a, known) == n // p
        assert preview(a, known[:-1] + [999]) == (n - 1) // p  # the last page needs its last token
    a.close(h, cache=True)
    a.check()


@pytest.mark.parametrize("p", PAGE_SIZES)
@pytest.mark.parametrize("via", ["evict", "extend"])
@pytest.mark.parametrize("touch", [False, True])
def test_eviction_is_lru_across_requests_and_tail_first_within_one(p: int, via: str, touch: bool) -> None:
    """vLLM test_evict / free-queue order: the request freed first is evicted first, each
    from its tail; a hit on a cached prefix makes it the most recently used again."""
    a = make(p, 1 + 8)  # room for exactly the two requests' pages: no FREE page is left
    xs, ys = block(p, 1, 2, 3, 4), block(p, 5, 6, 7, 8)
    hx, _ = prefill(a, xs)
    hy, _ = prefill(a, ys)
    a.close([hx])
    a.close([hy])
    first, second = xs, ys
    if touch:
        h, cached = a.open_with_prefix(xs + [0], [len(xs) + 1])
        assert cached[0] == len(xs)
        a.close(h)
        first, second = ys, xs
    assert a.free_pages == 8 and a.evictable_pages == 8
    seen = []
    taker = None
    for _ in range(8):
        if via == "evict":
            assert a.evict(1) == 1
        elif taker is None:
            taker = int(a.admit([p], tokens=[9] * p)[0][0])
        else:
            a.extend(taker, p, tokens=[9] * p)
        seen.append((preview(a, first), preview(a, second)))
    assert seen == [(3, 4), (2, 4), (1, 4), (0, 4), (0, 3), (0, 2), (0, 1), (0, 0)]
    a.check()


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_a_page_hits_only_under_the_parent_it_was_computed_under(p: int) -> None:
    """vLLM hash_block_tokens chains each block's hash through its parent's: the same page
    content after a different prefix is a miss, and a page whose parent was evicted is not
    served. kvpool keeps a ghost of the evicted parent (docs/allocator.md, *Ghosts*): once
    the parent is recomputed, the cached child serves again (vLLM's child would too: its
    hash is unchanged)."""
    a = make(p, 32)
    x, y, z = block(p, 1), block(p, 2), block(p, 3)
    hx, _ = prefill(a, x)
    a.cache(hx, priority=10)  # x is evicted before y, y (older) stays
    a.close(hx)
    hxy, cached = prefill(a, x + y + [0])
    assert cached == p
    a.close(hxy)
    assert preview(a, x + y) == 2
    assert preview(a, z + y) == 0  # same content as page y, other parent
    assert preview(a, x + z) == 1
    assert a.evict(1) == 1
    assert preview(a, x) == 0 and preview(a, x + y) == 0  # y stays cached, unreachable
    assert a.cached_pages == (2 * p + 1) // p - 1  # y (and at p = 1 the page of token 0)
    h, cached = a.open_with_prefix(x + y + [0], [2 * p + 1])
    assert cached[0] == 0
    a.close(h)
    hx2, _ = prefill(a, x)
    a.close(hx2)
    assert preview(a, x + y) == 2
    h, cached = a.open_with_prefix(x + y + [0], [2 * p + 1])
    assert cached[0] == 2 * p
    a.check()


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_a_hit_it_holds_is_never_its_own_eviction_victim(p: int) -> None:
    """vLLM test_computed_blocks_not_evicted: with no free page left, a request that hits a
    cached page and needs one more evicts another cached page, never the one it hit."""
    a = make(p, 1 + 2)
    hx, _ = prefill(a, block(p, 1))
    a.close(hx)  # x is the least recently used page
    hy, _ = prefill(a, block(p, 2))
    a.close(hy)
    x_page, y_page = 1, 2
    hs, cached = a.open_with_prefix(block(p, 1, 3) + [0], [2 * p + 1])
    assert cached[0] == p
    h = int(hs[0])
    a.extend(h, p)
    assert a.pages(h).tolist() == [x_page, y_page]
    assert preview(a, block(p, 2)) == 0 and preview(a, block(p, 1)) == 1
    with pytest.raises(PoolExhaustedError):
        a.extend(h, 1)  # nothing evictable is left: the held hit is not taken
    a.check()


def state(a: SlotAllocator, handles: list[int]) -> tuple:
    return (a.stats(), [(a.length(h), a.pages(h).tolist()) for h in handles if a.is_open(h)])


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_refused_allocation_after_a_hit_changes_nothing(p: int) -> None:
    """vLLM test_prefill_not_enough_free_blocks_with_computed_blocks: a request whose hit pages
    are cached (evictable) asks for more than the pool can give. The refusal must leave
    every count and the eviction order as they were; a twin pool that never made the
    refused calls is the reference."""
    twins = [make(p, 1 + 10), make(p, 1 + 10)]
    for a in twins:
        for ids in ((1, 2, 3), (4, 5), (6, 7, 8, 9)):
            h, _ = prefill(a, block(p, *ids))
            a.close(h)
    ref, a = twins
    chain = block(p, 1, 2, 3)
    hashes = page_hashes(chain, p, a.hash_seed)
    with pytest.raises(PoolExhaustedError):  # 3 pages held by the hit + 8 more > 10
        a.open_with_chain_hashes(hashes, chain, length=3 * p + 8 * p)
    with pytest.raises(PoolExhaustedError):
        a.admit([3 * p, 8 * p + 1])
    assert state(a, []) == state(ref, [])
    hs = []
    for b in twins:
        h, cached = b.open_with_prefix(chain + [0], [3 * p + 1])
        assert cached[0] == 3 * p
        hs.append(int(h[0]))
    with pytest.raises(PoolExhaustedError):
        a.extend(hs[1], 8 * p + 1)  # 7 pages are FREE + evictable beside the 3 it holds
    assert state(a, [hs[1]]) == state(ref, [hs[0]])
    for b in twins:
        b.check()
        b.admit([7 * p], tokens=[0] * (7 * p))  # the same victims, in the same order
    assert state(a, [hs[1]]) == state(ref, [hs[0]])
    assert [preview(b, block(p, 1, 2, 3)) for b in twins] == [3, 3]


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_cache_salt_separates_every_page_of_the_chain(p: int) -> None:
    """vLLM test_cache_key_salting (cache_salt, LoRA id): the salt enters the first page's
    hash and so every page's after it; only the same salt hits. kvpool has no per-page
    extra keys (vLLM's multimodal hashes): its per-request salt is the counterpart, and an
    engine gives image placeholders distinct token ids."""
    a = make(p, 64)
    prompt = block(p, 1, 2, 3)
    h, _ = prefill(a, prompt, salt=11)
    a.close(h)
    h0 = page_hashes(prompt, p, a.hash_seed, 11).reshape(-1, 2)
    h1 = page_hashes(prompt, p, a.hash_seed, 12).reshape(-1, 2)
    assert all((h0[i] != h1[i]).any() for i in range(3))
    assert preview(a, prompt, 11) == 3 and preview(a, prompt, 12) == 0 and preview(a, prompt) == 0
    hs, cached = a.open_with_prefix((prompt + [0]) * 3, [3 * p + 1] * 3, salt=[12, 11, 0])
    assert cached.tolist() == [0, 3 * p, 0]
    a.close(hs)
    h, _ = prefill(a, prompt)  # salt None is salt 0, a tenant of its own
    a.close(h)
    assert preview(a, prompt, 0) == 3 and preview(a, prompt, None) == 3 and preview(a, prompt, 11) == 3
    a.check()


@pytest.mark.parametrize("p", PAGE_SIZES)
@pytest.mark.parametrize("extra", [0, 1, 2])
def test_a_full_hit_leaves_the_last_token_to_compute(p: int, extra: int) -> None:
    """vLLM get_computed_blocks: a prompt whose every page is cached still recomputes its last
    token (max_cache_hit_length = len - 1), in whole pages; a partial last page is never
    registered, so it goes FREE, not CACHED, when its request closes."""
    a = make(p, 64)
    prompt = block(p, 1, 2, 3) + [9] * extra
    h, _ = prefill(a, prompt)
    a.close(h, cache=True)
    assert a.cached_pages == len(prompt) // p
    _, cached = a.open_with_prefix(prompt, [len(prompt)])
    assert cached[0] == (len(prompt) - 1) // p * p
    a.check()


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_preempted_request_readmitted_hits_its_own_pages(p: int) -> None:
    """vLLM preemption (recompute): a preempted request's blocks go to the cache; when it is
    scheduled again it hits them, minus what pressure evicted meanwhile (its tail first)."""
    a = make(p, 1 + 8)
    prompt = block(p, 1, 2, 3) + [4] * (p // 2)
    h, _ = prefill(a, prompt)
    for t in range(2 * p):
        a.extend(h, 1, tokens=[40 + t])
        a.cache(h)
    known = a.known_tokens(h).tolist()
    own = a.pages(h).tolist()
    full = len(known) // p
    a.close(h, cache=True)  # preempted
    h2, cached = a.open_with_prefix(known, [len(known)])
    assert cached[0] == min(full, (len(known) - 1) // p) * p
    assert a.pages(int(h2[0])).tolist() == own[: cached[0] // p]
    a.extend(h2, len(known) - int(cached[0]))
    assert a.known_tokens(int(h2[0])).tolist() == known
    a.close(h2, cache=True)  # preempted again; another request takes 2 pages
    a.admit([(a.free_pages - a.evictable_pages + 2) * p])
    assert preview(a, known) == full - 2
    h3, cached = a.open_with_prefix(known, [len(known)])
    assert cached[0] == (full - 2) * p
    assert a.pages(int(h3[0])).tolist() == own[: full - 2]
    a.check()


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_common_prefix_pages_of_running_requests(p: int) -> None:
    """vLLM get_num_common_prefix_blocks (cascade attention): the leading pages every running
    request holds. kvpool has no such call; an engine reads it from `pages`: requests on a
    cached system prompt share exactly its full pages; a fork shares every page until a
    writer copies the shared partial one."""
    a = make(p, 64)
    system = block(p, 1, 2)
    h0, _ = prefill(a, system + [5] * (p + 1))
    hs = [h0] + [prefill(a, system + [6 + i] * (p + 2))[0] for i in range(3)]

    def common(handles: list[int]) -> int:
        rows = [a.pages(h).tolist() for h in handles]
        n = 0
        while all(len(r) > n and r[n] == rows[0][n] for r in rows):
            n += 1
        return n

    assert common(hs) == 2
    kids = a.fork(hs[1], 2).tolist()
    assert common([hs[1], *kids]) == len(a.pages(hs[1]))
    partial = a.length(hs[1]) % p != 0
    a.extend(kids[0], 1)
    assert common([hs[1], *kids]) == len(a.pages(hs[1])) - partial
    assert common(hs + kids) == 2
    a.take_copies()
    a.check()


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_clear_cache_with_requests_running(p: int) -> None:
    """vLLM reset_prefix_cache refuses (returns False) while any block is in use. kvpool's
    clear_cache is documented to succeed anyway: it drops every index entry, frees the
    cached pages, leaves held pages with their requests, and a later cache() of a running
    request registers its pages again. Asserted as documented, not as vLLM's refusal."""
    a = make(p, 64)
    run, _ = prefill(a, block(p, 1, 2, 3) + [0])
    done, _ = prefill(a, block(p, 4, 5))
    a.close(done)
    held = a.pages(run).tolist()
    a.take_events()
    a.clear_cache()
    assert a.take_events()["kind"].tolist() == [2]  # one Cleared
    assert a.pages(run).tolist() == held and a.used_pages == len(held)
    assert a.cached_pages == 0 and a.free_pages == a.capacity_pages - len(held)
    assert preview(a, block(p, 1, 2, 3)) == 0 and preview(a, block(p, 4, 5)) == 0
    a.check()
    a.cache(run)
    assert preview(a, block(p, 1, 2, 3)) == 3
    a.check()


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_double_free_is_refused_and_changes_nothing(p: int) -> None:
    """vLLM block-pool double-free tests: freeing a request twice must not free its pages
    twice. kvpool: a closed handle is stale (InvalidHandleError); a batch naming one
    handle twice is InvalidArgumentError; neither changes anything."""
    a = make(p, 64)
    h, _ = prefill(a, block(p, 1, 2) + [3])
    other, _ = prefill(a, block(p, 1, 2) + [4])
    with pytest.raises(InvalidArgumentError):
        a.close([h, h])
    a.close(h)
    before = state(a, [other])
    with pytest.raises(InvalidHandleError):
        a.close(h)
    with pytest.raises(InvalidHandleError):
        a.close([other, h])
    assert state(a, [other]) == before
    assert a.is_open(other)
    a.check()


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_events_name_the_chain_and_its_evictions(p: int) -> None:
    """vLLM test_kv_cache_events: BlockStored per new full block with its parent's hash,
    BlockRemoved when evicted, AllBlocksCleared on reset."""
    a = make(p, 1 + 4)
    prompt = block(p, 1, 2, 3) + [0] * (p - 1)
    h, _ = prefill(a, prompt)
    ev = a.take_events()
    want = page_hashes(prompt, p, a.hash_seed).reshape(-1, 2)
    assert ev["kind"].tolist() == [0, 0, 0]
    assert np.stack([ev["hash_hi"], ev["hash_lo"]], 1).tolist() == want.tolist()
    assert np.stack([ev["parent_hi"], ev["parent_lo"]], 1).tolist() == [[0, 0], *want[:2].tolist()]
    assert ev["page"].tolist() == a.pages(h).tolist()[:3]
    a.close(h)
    assert a.evict(2) == 2
    ev = a.take_events()
    assert ev["kind"].tolist() == [1, 1]  # Removed, tail first
    assert np.stack([ev["hash_hi"], ev["hash_lo"]], 1).tolist() == want[[2, 1]].tolist()
    a.clear_cache()
    assert a.take_events()["kind"].tolist() == [2]
