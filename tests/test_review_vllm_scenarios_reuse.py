"""vLLM v1 prefix-cache scenarios about block identity, on kvpool's SlotAllocator.

The companions of test_review_vllm_scenarios.py: the same content computed twice
(vLLM caches several blocks under one hash; kvpool keeps one copy, docs/allocator.md
*Duplicates*), a block rewritten after a rollback (test_hash_block_correct_reuse),
hash-collision defence, the page hash function (test_kv_cache_utils), prefix-cache
statistics and caching only computed (known) tokens (cache_blocks).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvpool import ContextTooLongError, GroupedAllocator, InvalidArgumentError, SlotAllocator, TooManyRequestsError
from kvpool._core import page_hashes

PAGE_SIZES = [1, 4, 16]


def make(p: int, num_pages: int = 64) -> SlotAllocator:
    return SlotAllocator(num_pages, p, max_requests=16, max_context_len=4096, hash_seed=7, handle_seed=7)


def block(p: int, *ids: int) -> list[int]:
    return [i for i in ids for _ in range(p)]


def preview(a: SlotAllocator, tokens: list[int], salt: int | None = None) -> int:
    p = a.page_size
    n = len(tokens) // p
    return a.match_chain_hashes(page_hashes(tokens, p, a.hash_seed, salt), tokens[: n * p], salt)


@pytest.mark.parametrize("p", PAGE_SIZES)
@pytest.mark.parametrize("first_closes", [False, True])
def test_same_prompt_computed_by_two_requests(p: int, first_closes: bool) -> None:
    """vLLM: two running requests miss on the same prompt (both scheduled before either
    cached it), so each computes its own copy of every block. kvpool keeps one entry per
    content: while the first copy is held, the second stays unregistered and goes FREE at
    its close; when nobody holds the first copy, the later one takes the entry over
    (Removed old page, Stored new page, the same hash) so the held copy stays the hit."""
    a = make(p)
    prompt = block(p, 1, 2, 3) + [9]
    full = len(prompt) // p
    hs, cached = a.open_with_prefix(prompt * 2, [len(prompt)] * 2)
    assert cached.tolist() == [0, 0]
    a.extend(hs, len(prompt))
    first, second = (a.pages(int(h)).tolist() for h in hs)
    assert not set(first) & set(second)
    a.cache(hs[:1])
    if first_closes:
        a.close(hs[:1])
    a.take_events()
    a.cache(hs[1:])
    ev = a.take_events()
    if first_closes:
        assert ev["kind"].tolist() == [1, 0] * full
        assert ev["page"].tolist() == [x for pair in zip(first[:full], second[:full]) for x in pair]
        assert a.evictable_pages == 0
    else:
        assert ev["kind"].tolist() == []
    a.close(hs[1:] if first_closes else hs)
    assert a.cached_pages == full and a.used_pages == 0
    h, cached = a.open_with_prefix(prompt, [len(prompt)])
    assert a.pages(int(h[0])).tolist() == (second if first_closes else first)[: cached[0] // p]
    a.check()


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_page_rewritten_after_rollback_stops_serving_its_old_tokens(p: int) -> None:
    """vLLM test_hash_block_correct_reuse: a block reused for other tokens must not keep its
    old hash. kvpool: a request truncated into a registered page it alone holds rewrites it
    in place after dropping the registration, so the old prompt hits only up to it."""
    a = make(p)
    old = block(p, 1, 2, 3)
    h, _ = a.open_with_prefix(old, [len(old)])
    h = int(h[0])
    a.extend(h, len(old))
    a.cache(h)
    cut = p + p // 2  # inside page 1 (at p = 1: the page boundary, nothing is rewritten)
    a.truncate(h, cut)
    a.extend(h, len(old) - cut, tokens=[7] * (len(old) - cut))
    a.cache(h)
    new = a.known_tokens(h).tolist()
    assert new == old[:cut] + [7] * (len(old) - cut)
    assert preview(a, new) == 3
    assert preview(a, old) == (1 if p > 1 else 3)  # at p = 1 the old pages went to the cache
    a.check()


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_a_hash_alone_never_matches(p: int) -> None:
    """vLLM test_hash_collision_defense: a block found under a hash must also hold the
    request's tokens. Chain hashes from another pool (match_chain_hashes) stand in for a
    collision: a right hash with other tokens, another salt, another seed or a page whose
    entry has another parent is a miss; a refused match opens nothing."""
    a = make(p)
    for t in (block(p, 1, 2), block(p, 3, 2)):
        h, _ = a.open_with_prefix(t, [len(t)])
        a.extend(h, len(t))
        a.cache(h)
        a.close(h)
    hx = page_hashes(block(p, 1, 2), p, a.hash_seed)
    hz = page_hashes(block(p, 3, 2), p, a.hash_seed)
    assert a.match_chain_hashes(hx, block(p, 1, 2)) == 2
    assert a.match_chain_hashes(hx, block(p, 1, 5)) == 1
    assert a.match_chain_hashes(hx, block(p, 5, 2)) == 0
    assert a.match_chain_hashes(np.concatenate([hx[:2], hz[2:]]), block(p, 1, 2)) == 1
    assert a.match_chain_hashes(hx, block(p, 1, 2), 9) == 0
    assert a.match_chain_hashes(page_hashes(block(p, 1, 2), p, 8), block(p, 1, 2)) == 0
    h, n = a.open_with_chain_hashes(hx, block(p, 5, 2))
    assert n == 0 and a.length(h) == 0 and a.pages(h).size == 0
    a.check()


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_page_hashes_chain_like_vllm_block_hashes(p: int) -> None:
    """vLLM test_kv_cache_utils (hash_block_tokens, request block hasher): one hash per full
    block, none for the partial tail, each depending on every token before it; the same
    seed gives the same hashes, a prefix's hashes are a prefix of the longer prompt's, and
    they are what the pool's chain_hashes and Stored events report."""
    tokens = list(range(3 * p + p // 2 + (p == 1)))
    hs = page_hashes(tokens, p, 5).reshape(-1, 2)
    assert len(hs) == len(tokens) // p
    assert page_hashes(tokens[: 2 * p], p, 5).reshape(-1, 2).tolist() == hs[:2].tolist()
    assert page_hashes(tokens, p, 5).tolist() == hs.ravel().tolist()
    assert (page_hashes(tokens, p, 6).reshape(-1, 2) != hs).any(axis=1).all()
    changed = [tokens[0] + 1000] + tokens[1:]
    assert (page_hashes(changed, p, 5).reshape(-1, 2) != hs).any(axis=1).all()
    a = SlotAllocator(64, p, max_requests=4, max_context_len=4096, hash_seed=5)
    h, _ = a.open_with_prefix(tokens, [len(tokens)])
    a.extend(h, len(tokens))
    mine, toks, salt = a.chain_hashes(int(h[0]))
    assert mine.tolist() == hs.ravel().tolist() and toks.tolist() == tokens[: len(hs) * p] and salt == 0
    a.cache(h)
    ev = a.take_events()
    assert np.stack([ev["hash_hi"], ev["hash_lo"]], 1).tolist() == hs.tolist()


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_prefix_cache_stats_count_queries_and_hits(p: int) -> None:
    """vLLM test_prefix_cache_stats: queries are prompt tokens looked up, hits the tokens
    served. kvpool: hit_tokens + miss_tokens add up to the prompt tokens open_with_prefix
    looked up; a fully cached prompt's recomputed last page is a miss."""
    a = make(p)
    prompt = block(p, 1, 2, 3) + [9]
    h, _ = a.open_with_prefix(prompt, [len(prompt)])
    assert (a.hit_tokens, a.miss_tokens) == (0, len(prompt))
    a.extend(h, len(prompt))
    a.cache(h)
    a.close(h)
    batch = prompt + block(p, 1, 2) + [0] + block(p, 4)
    lengths = [len(prompt), 2 * p + 1, p]
    hs, cached = a.open_with_prefix(batch, lengths)
    assert cached.tolist() == [(len(prompt) - 1) // p * p, 2 * p, 0]
    assert a.hit_tokens == sum(cached.tolist())
    assert a.hit_tokens + a.miss_tokens == 2 * len(prompt) + 3 * p + 1
    assert (a.stats().hit_tokens, a.stats().miss_tokens) == (a.hit_tokens, a.miss_tokens)


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_only_pages_of_known_tokens_are_cached(p: int) -> None:
    """vLLM cache_blocks caches only blocks of computed tokens with a hash. kvpool registers
    full pages whose token ids are all known, in a leading run: a decode step extended
    without token ids stops the run, and pages after it are never registered."""
    a = make(p)
    prompt = block(p, 1, 2)
    h, _ = a.open_with_prefix(prompt, [len(prompt)])
    h = int(h[0])
    a.extend(h, len(prompt))
    a.extend(h, p)  # token ids unknown (a caller that never passes tokens=)
    a.extend(h, p, tokens=[5] * p)
    a.cache(h)
    assert a.known_tokens(h).tolist() == prompt
    assert a.cached_pages == 2
    a.close(h, cache=True)
    assert a.cached_pages == 2 and a.free_pages == a.capacity_pages
    a.check()


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_salt_travels_in_stored_events(p: int) -> None:
    """vLLM test_kv_cache_events_with_lora: a BlockStored event carries the request's extra
    keys (LoRA). kvpool's Stored event carries the request's salt, on every page."""
    a = make(p)
    prompt = block(p, 1, 2)
    for salt in (3, None):
        h, _ = a.open_with_prefix(prompt, [len(prompt)], salt=salt)
        a.extend(h, len(prompt))
        a.cache(h)
        ev = a.take_events()
        assert ev["kind"].tolist() == [0, 0] and ev["salt"].tolist() == [salt or 0] * 2
        want = page_hashes(prompt, p, a.hash_seed, salt).reshape(-1, 2)
        assert np.stack([ev["hash_hi"], ev["hash_lo"]], 1).tolist() == want.tolist()


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_rolled_back_pages_are_released_tail_first(p: int) -> None:
    """vLLM frees a request's blocks in reverse order, so its tail is evicted first; the same
    must hold for the registered pages a rollback (rejected draft tokens) releases, which
    stay cached: the longest prefix survives eviction longest."""
    a = make(p, 1 + 6)
    tokens = list(range(1, 1 + 6 * p))
    h, _ = a.open_with_prefix(tokens, [len(tokens)])
    a.extend(h, len(tokens))
    a.cache(h)
    a.truncate(h, 2 * p)
    assert a.used_pages == 2 and a.evictable_pages == 4
    seen = [preview(a, tokens)]
    while a.evict(1):
        seen.append(preview(a, tokens))
    assert seen == [6, 5, 4, 3, 2]
    a.check()


def _pools(p: int, grouped: bool) -> list:
    if grouped:
        groups = [{"kind": "full", "num_pages": 9, "page_size": p},
                  {"kind": "sliding", "num_pages": 9, "page_size": p, "window": 2 * p}]
        return [GroupedAllocator(groups, max_requests=2, max_context_len=8 * p, hash_seed=7, handle_seed=7)
                for _ in range(2)]
    return [SlotAllocator(9, p, max_requests=2, max_context_len=8 * p, hash_seed=7, handle_seed=7)
            for _ in range(2)]


@pytest.mark.parametrize("p", PAGE_SIZES)
@pytest.mark.parametrize("grouped", [False, True])
def test_refused_batch_of_hits_holds_nothing(p: int, grouped: bool) -> None:
    """vLLM schedules a waiting request only once allocation succeeds, so a request that does
    not fit never touches the blocks it would hit. kvpool's open_with_prefix batch refused
    for any reason (rows, context length, salts, token ids) must not hold, touch or count
    its prompts' hits: a twin pool that never made the calls hits and evicts the same."""
    x, y = list(range(1, 1 + 4 * p)), list(range(50, 50 + 4 * p))
    twins = _pools(p, grouped)
    for a in twins:
        for t in (x, y):
            h, _ = a.open_with_prefix(t, [len(t)])
            a.extend(h, len(t))
            a.cache(h)
            a.close(h)
        a.open(1)  # one row left
    ref, a = twins
    calls = [
        (TooManyRequestsError, lambda: a.open_with_prefix(x + [0] + y + [0], [4 * p + 1] * 2)),
        (ContextTooLongError, lambda: a.open_with_prefix(y + [0] + [0] * 9 * p, [4 * p + 1, 9 * p])),
        (InvalidArgumentError, lambda: a.open_with_prefix(x + [0], [4 * p + 1], salt=[1, 2])),
        (InvalidArgumentError, lambda: a.open_with_prefix(x + [-1], [4 * p + 1])),
    ]
    for error, call in calls:
        with pytest.raises(error):
            call()
    assert a.stats() == ref.stats()
    seen = []
    for b in twins:
        hits = []
        while True:
            for t in (x, y):
                hs, cached = b.open_with_prefix(t + [0], [len(t) + 1])
                hits.append(int(cached[0]))
                b.close(hs)
            if not (b.evict(0, 1) if grouped else b.evict(1)):
                break
        b.check()
        seen.append(hits)
    assert seen[0] == seen[1] and seen[0][:2] == [4 * p, 4 * p]
