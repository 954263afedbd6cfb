"""Every array the bindings return is checked against a value computed
another way: chain hashes and event hashes against a plain-Python xxh3
chain (the documented `h_i = xxh3_128(seed, h_{i-1} || tokens of page i)`),
page tables against pages() and lengths(), packed extends against a twin
pool's plain extend, copy-on-write pairs against the slots of the holders
before and after, stats() against the properties and the calls made, and
table rows written by open_with_prefix and fork against slots()."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from kvpool import SlotAllocator

M64 = (1 << 64) - 1
# The chain's root: a fixed tag in the high half, the salt's bits in the low.
ROOT_TAG = 0x6B76_706F_6F6C_0001


def reference_chain(seed: int, salt: int, tokens, page_size: int) -> list[int]:
    """The 128-bit chain hash of each full page of `tokens`."""
    parent = (ROOT_TAG << 64) | (salt & M64)
    out = []
    for k in range(len(tokens) // page_size):
        page = np.asarray(tokens[k * page_size : (k + 1) * page_size], dtype="<i4").tobytes()
        parent = xxhash.xxh3_128_intdigest(parent.to_bytes(16, "little") + page, seed=seed)
        out.append(parent)
    return out


def words(hashes: list[int]) -> list[int]:
    return [w for h in hashes for w in (h >> 64, h & M64)]


def joined(hi, lo) -> list[int]:
    return [(int(a) << 64) | int(b) for a, b in zip(hi, lo)]


# 1 and 16 take the core's fixed-size paths, 3 the general one, 200 (past
# 128 tokens) the streaming one.
@pytest.mark.parametrize("page_size", [1, 3, 16, 200])
def test_chain_hashes_are_the_documented_xxh3_chain(page_size: int) -> None:
    seed = 0x1234_5678_9ABC_DEF0
    a = SlotAllocator(64, page_size=page_size, max_requests=4, max_context_len=8 * page_size, hash_seed=seed)
    rng = np.random.default_rng(page_size)
    for salt in (0, -7, 2**40 + 3):
        n = 3 * page_size + 1
        tokens = rng.integers(0, 2**31, n)
        h, cached = a.open_with_prefix(tokens, [n], salt=salt)
        a.extend(h, n - int(cached[0]))
        hashes, toks, s = a.chain_hashes(h[0])
        assert hashes.dtype == np.uint64 and toks.dtype == np.int32
        assert s == salt
        full = n // page_size * page_size  # a partial last page is not in the chain
        assert toks.tolist() == tokens[:full].tolist()
        assert hashes.tolist() == words(reference_chain(seed, salt, tokens, page_size))
        a.close(h)
    a.check()


def test_take_events_report_what_was_stored_removed_and_cleared() -> None:
    seed, ps, salt = 77, 4, 2**33 + 5
    a = SlotAllocator(16, page_size=ps, max_requests=4, max_context_len=64, hash_seed=seed)
    tokens = list(range(500, 514))  # three full pages and two tokens
    h, _ = a.open_with_prefix(tokens, [14], salt=salt)
    a.extend(h, 14)
    pages = a.pages(h[0]).tolist()
    a.close(h, cache=True)
    e = a.take_events()
    want = reference_chain(seed, salt, tokens, ps)
    assert {k: v.dtype for k, v in e.items()} == {
        "kind": np.uint8, "hash_hi": np.uint64, "hash_lo": np.uint64, "parent_hi": np.uint64,
        "parent_lo": np.uint64, "page": np.int32, "num_tokens": np.int32, "salt": np.int64,
        "token_ids": np.int32, "medium": np.uint8,
    }
    assert e["kind"].tolist() == [0, 0, 0]
    assert e["medium"].tolist() == [0, 0, 0]  # no host tier: every event is about the device
    assert joined(e["hash_hi"], e["hash_lo"]) == want
    assert joined(e["parent_hi"], e["parent_lo"]) == [0] + want[:-1]
    assert e["page"].tolist() == pages[:3]
    assert e["num_tokens"].tolist() == [ps] * 3
    assert e["salt"].tolist() == [salt] * 3
    assert e["token_ids"].tolist() == tokens[:12]

    assert (a.cached_pages, a.evictable_pages) == (3, 3)
    assert a.evict(2) == 2  # the chain's tail first
    assert (a.cached_pages, a.evictable_pages) == (1, 1)
    e = a.take_events()
    assert e["kind"].tolist() == [1, 1]
    assert joined(e["hash_hi"], e["hash_lo"]) == [want[2], want[1]]
    assert e["page"].tolist() == [pages[2], pages[1]]
    assert e["salt"].tolist() == [salt, salt]
    assert joined(e["parent_hi"], e["parent_lo"]) == [0, 0] and e["num_tokens"].tolist() == [0, 0]
    assert e["token_ids"].size == 0

    a.clear_cache()
    e = a.take_events()
    assert e["kind"].tolist() == [2]
    assert all(e[k].tolist() == [0] for k in e if k not in ("kind", "token_ids")) and e["token_ids"].size == 0
    assert all(v.size == 0 for v in a.take_events().values())
    a.check()


def test_chain_hashes_survive_a_round_trip_to_another_pool() -> None:
    """chain_hashes' (hi, lo) words, read back by match_chain_hashes and
    open_with_chain_hashes, find exactly the receiver's own pages."""
    seed, ps = 9, 4
    src, dst = (SlotAllocator(32, page_size=ps, max_requests=4, max_context_len=64, hash_seed=seed) for _ in range(2))
    system = list(range(100, 112))  # three pages
    h, _ = dst.open_with_prefix(system + [1], [13], salt=3)
    dst.extend(h, 13)
    dst_pages = dst.pages(h[0]).tolist()
    dst.close(h, cache=True)
    hs, _ = src.open_with_prefix(system + [5, 6, 7, 8, 9], [17], salt=3)
    src.extend(hs, 17)
    hashes, tokens, salt = src.chain_hashes(hs[0])
    assert dst.match_chain_hashes(hashes, tokens, salt) == 3
    assert dst.match_chain_hashes(hashes.view(np.int64), tokens, salt) == 3  # the same bits as int64
    d, n = dst.open_with_chain_hashes(hashes, tokens, salt)
    assert n == 12 and dst.length(d) == 12
    assert dst.pages(d).tolist() == dst_pages[:3]
    assert dst.known_tokens(d).tolist() == system
    dst.close([d])
    dst.check()


def test_page_table_is_each_requests_pages_in_csr_form() -> None:
    ps = 4
    a = SlotAllocator(64, page_size=ps, max_requests=8, max_context_len=64)
    h = a.open(5)
    a.extend(h, [0, 4, 5, 9, 16])
    a.truncate(h[3:4], 7)
    batch = h[[2, 0, 4, 2, 3, 1]]  # any order, repeats included
    indptr, indices, last = a.page_table(batch)
    assert [x.dtype for x in (indptr, indices, last)] == [np.int32] * 3
    pages = [a.pages(x).tolist() for x in batch]
    lengths = a.lengths(batch).tolist()
    assert lengths == [5, 0, 16, 5, 7, 4]
    assert indptr.tolist() == np.cumsum([0] + [len(p) for p in pages]).tolist()
    assert indices.tolist() == [p for ps_ in pages for p in ps_]
    assert last.tolist() == [0 if n == 0 else (n - 1) % ps + 1 for n in lengths]
    # pages() and slots() agree: slot = page * page_size + offset, in order.
    for x, p, n in zip(batch, pages, lengths):
        assert a.slots(x).tolist() == [q * ps + o for q in p for o in range(ps)][:n]
        assert len(p) == -(-n // ps)


def twin_pools(**kw):
    kw = dict(page_size=4, max_requests=8, max_context_len=64, handle_seed=3) | kw
    return SlotAllocator(64, **kw), SlotAllocator(64, **kw)


@pytest.mark.parametrize("b", [1, 2, 3, 4])
def test_extend_packed_is_extend_plus_each_requests_row_start_count_and_offset(b: int) -> None:
    a, twin = twin_pools()
    for p in (a, twin):
        h = p.open(4)
        p.extend(h, [1, 4, 6, 0])
    batch = h[[2, 0, 3, 1][:b]]
    counts = [3, 5, 2, 0][:b]
    starts = a.lengths(batch).tolist()
    packed, nb, cow = a.extend_packed(batch, counts)
    want = twin.extend(batch, counts)
    s = b + (b & 1)
    assert nb == b and cow is None and packed.dtype == np.int64
    assert packed.size == 4 * s + sum(counts)
    rows, st, cn, off = (packed[k * s : (k + 1) * s] for k in range(4))
    assert rows[:b].tolist() == a.rows(batch).tolist()
    assert st[:b].tolist() == starts
    assert cn[:b].tolist() == counts
    assert off[:b].tolist() == np.cumsum([0] + counts[:-1]).tolist()
    assert [seg[b:].tolist() for seg in (rows, st, cn, off)] == [[0] * (s - b)] * 4  # padding
    assert packed[4 * s :].tolist() == want.tolist()
    assert [a.slots(x).tolist() for x in batch] == [twin.slots(x).tolist() for x in batch]


def test_extend_packed_reports_copy_on_write_as_extend_does() -> None:
    a, twin = twin_pools()
    for p in (a, twin):
        parent = p.open(1)
        p.extend(parent, 6)  # a full page and a half-full one
        kid = p.fork(parent[0], 1)
    packed, nb, cow = a.extend_packed(kid, 1)
    slots, want_cow = twin.extend(kid, 1, cow=True)
    assert packed[4 * 2 :].tolist() == slots.tolist()
    assert cow.tolist() == want_cow.tolist()
    assert a.pending_copies == twin.pending_copies == 0


@pytest.mark.parametrize("counts", [[3], [3, 0, 5], [4, 1]])
def test_admit_packed_is_admit_plus_the_table_update(counts: list[int]) -> None:
    a, twin = twin_pools()
    for p in (a, twin):
        p.extend(p.open(2), [5, 2])
    handles, packed, b = a.admit_packed(counts)
    want_handles, want_slots = twin.admit(counts)
    assert handles.tolist() == want_handles.tolist() and b == len(counts)
    s = b + (b & 1)
    rows, st, cn, off = (packed[k * s : (k + 1) * s] for k in range(4))
    assert rows[:b].tolist() == a.rows(handles).tolist()
    assert st[:b].tolist() == [0] * b
    assert cn[:b].tolist() == counts
    assert off[:b].tolist() == np.cumsum([0] + counts[:-1]).tolist()
    assert [seg[b:].tolist() for seg in (rows, st, cn, off)] == [[0] * (s - b)] * 4
    assert packed[4 * s :].tolist() == want_slots.tolist()
    assert np.concatenate([a.slots(x) for x in handles]).tolist() == want_slots.tolist()


def test_copy_on_write_pairs_move_the_shared_positions_to_the_new_page() -> None:
    ps = 4
    a = SlotAllocator(32, page_size=ps, max_requests=4, max_context_len=32)
    parent = a.open(1)
    a.extend(parent, 6)  # positions 4, 5 in a half-full page
    before = a.slots(parent[0]).tolist()
    kid = a.fork(parent[0], 1)
    assert a.slots(kid[0]).tolist() == before
    new = a.extend(kid, 1)
    src, dst = a.take_copies()
    after = a.slots(kid[0]).tolist()
    assert src.tolist() == before[4:6]
    assert dst.tolist() == after[4:6]
    assert after[:4] == before[:4] and after[6] == new[0]  # the full page stays shared
    assert a.pages(kid[0])[1] != a.pages(parent[0])[1]
    assert a.slots(parent[0]).tolist() == before
    assert [x.size for x in a.take_copies()] == [0, 0]

    kid2 = a.fork(parent[0], 1)  # shares the half-full page again
    slots, cow = a.extend(kid2, 2, cow=True)
    m = cow.size // 4
    rows, positions, c_src, c_dst = (cow[k * m : (k + 1) * m].tolist() for k in range(4))
    assert m == 2 and rows == [int(a.rows(kid2)[0])] * 2 and positions == [4, 5]
    assert c_src == before[4:6] and c_dst == a.slots(kid2[0]).tolist()[4:6]
    assert slots.tolist() == a.slots(kid2[0]).tolist()[6:8]
    assert a.pending_copies == 0
    a.check()


def test_stats_agree_with_the_properties_and_the_calls_made() -> None:
    ps = 4
    a = SlotAllocator(33, page_size=ps, max_requests=4, max_context_len=64, hash_seed=1)
    prompt = list(range(10, 23))  # 13 tokens
    h1, c1 = a.open_with_prefix(prompt, [13])
    a.extend(h1, 13)
    a.close(h1, cache=True)  # three pages cached
    h2, c2 = a.open_with_prefix(prompt + prompt[:3], [13, 3])
    a.extend(h2, [13 - int(c2[0]), 3])
    st = a.stats()
    fields = ["free_pages", "used_pages", "free_slots", "used_slots", "open_requests", "admissible_tokens",
              "metadata_bytes", "cached_pages", "evictable_pages", "hit_tokens", "miss_tokens"]
    for f in fields:
        assert getattr(st, f) == getattr(a, f), f
    assert c1.tolist() == [0] and c2.tolist() == [12, 0]
    assert (st.hit_tokens, st.miss_tokens) == (12, 13 + 1 + 3)
    assert st.open_requests == 2
    held = {p for x in h2 for p in a.pages(x).tolist()}
    assert st.used_pages == len(held) == 4 + 1
    assert st.used_slots == st.used_pages * ps
    assert st.cached_pages == 3 and st.evictable_pages == 0  # all three held again
    assert st.free_pages == 32 - st.used_pages and st.free_slots == st.free_pages * ps
    assert st.metadata_bytes > 0
    r = repr(st)
    assert all(f"{f}={getattr(st, f)}" in r for f in fields)


def test_known_tokens_are_the_leading_positions_with_ids() -> None:
    a = SlotAllocator(64, page_size=4, max_requests=4, max_context_len=64)
    prompt = list(range(10, 20))
    h, _ = a.open_with_prefix(prompt, [10])
    assert a.known_tokens(h[0]).tolist() == []  # nothing written yet
    a.extend(h, 4)
    assert a.known_tokens(h[0]).tolist() == prompt[:4]
    a.extend(h, 8)  # the prompt's rest, then two positions without ids
    assert a.known_tokens(h[0]).tolist() == prompt
    a.extend(h, 2, tokens=[7, 8])  # after a gap: not leading
    assert a.known_tokens(h[0]).tolist() == prompt
    a.truncate(h, 6)
    assert a.known_tokens(h[0]).tolist() == prompt[:6]
    g = a.open(1)
    a.extend(g, 3, tokens=[1, 2, 3])
    assert a.known_tokens(g[0]).dtype == np.int32 and a.known_tokens(g[0]).tolist() == [1, 2, 3]


def test_table_rows_written_by_open_with_prefix_and_fork_are_the_requests_slots() -> None:
    """Several prompts in one call, misses before and after hits: each new
    request's row holds its own cached prefix, the rest of the row untouched."""
    a = SlotAllocator(64, page_size=4, max_requests=8, max_context_len=32, hash_seed=2)
    table = np.full((8, 32), -1, dtype=np.int32)
    system = list(range(1, 14))  # 13 tokens: 12 cacheable
    h, _ = a.open_with_prefix(system, [13])
    a.extend(h, 13)
    a.close(h, cache=True)
    prompts = [list(range(50, 59)), system, list(range(70, 75)), system[:8] + [99, 98, 97]]
    hs, cached = a.open_with_prefix(sum(prompts, []), [len(p) for p in prompts], table=table)
    assert cached.tolist() == [0, 12, 0, 8]
    for x, c in zip(hs, cached.tolist()):
        row = int(a.rows([x])[0])
        assert table[row, :c].tolist() == a.slots(x).tolist() and a.length(x) == c
        assert (table[row, c:] == -1).all()
    kids = a.fork(hs[1], 2, table=table)
    for k in kids:
        row = int(a.rows([k])[0])
        assert table[row, :12].tolist() == a.slots(hs[1]).tolist() == a.slots(k).tolist()
        assert (table[row, 12:] == -1).all()
    a.check()


def test_extend_with_starts_returns_each_requests_length_before() -> None:
    a = SlotAllocator(64, page_size=4, max_requests=4, max_context_len=64)
    h = a.open(3)
    a.extend(h, [2, 0, 7])
    before = a.lengths(h).tolist()
    slots, starts = a.extend_with_starts(h[[2, 0]], [3, 1])
    assert starts.tolist() == [before[2], before[0]]
    assert slots.tolist() == a.slots(h[2]).tolist()[7:10] + a.slots(h[0]).tolist()[2:3]


def test_lengths_and_rows_of_a_batch_longer_than_a_chunk() -> None:
    """lengths() and rows() answer a chunk of handles at a time: every
    chunk lands at its own place."""
    a = SlotAllocator(64, page_size=4, max_requests=8, max_context_len=64)
    h = a.open(5)
    a.extend(h, [3, 0, 9, 1, 4])
    rng = np.random.default_rng(0)
    pick = rng.integers(0, 5, 5000)
    assert a.lengths(h[pick]).tolist() == [[3, 0, 9, 1, 4][i] for i in pick]
    assert a.rows(h[pick]).tolist() == a.rows(h)[pick].tolist()
