"""KV events in vLLM's wire format: the msgpack payload, its mapping, and the
Removed-only-when-no-copy-is-left rule (kvpool.events, _core.encode_kv_events)."""

import inspect

import numpy as np
import pytest

import kvpool
from kvpool import _core

msgspec = pytest.importorskip("msgspec", reason="the events extra (msgspec) is not installed")
from kvpool.events import LocalEventPublisher, schema

P = 4
SEED = 11


def pool(pages=64, **kw):
    return kvpool.SlotAllocator(pages, P, 8, 256, hash_seed=SEED, **kw)


def admit(a, tokens, salt=0, cache=True, close=True):
    """open_with_prefix + extend over the rest + cache (+ close): what a step does."""
    tokens = np.asarray(tokens, dtype=np.int64)
    h, c = a.open_with_prefix(tokens, [len(tokens)], salt=salt)
    a.extend(h, len(tokens) - int(c[0]))
    if cache:
        a.cache(h)
    if close:
        a.close(h)
    return h, int(c[0])


def wire_hash(hi, lo):
    return ((int(hi) << 64) | int(lo)).to_bytes(16, "big")


def test_payload_is_the_events_mapped_as_documented():
    """Raw msgpack, field by field: no vLLM, no schema classes (always runs)."""
    a = pool()
    admit(a, np.arange(100, 113), salt=7)
    admit(a, np.arange(200, 208))
    a.evict(2)
    a.clear_cache()
    ev = a.take_events()
    payload, stored, removed, cleared = _core.encode_kv_events(ev, 12.5, 3)
    assert (stored, removed, cleared) == (5, 2, 1)
    batch = msgspec.msgpack.decode(payload)
    ts, events, rank = batch  # KVEventBatch is array_like: [ts, events, data_parallel_rank]
    assert (ts, rank) == (12.5, 3)
    assert [e["type"] for e in events] == ["BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared"]
    h = [wire_hash(hi, lo) for hi, lo in zip(ev["hash_hi"], ev["hash_lo"])]
    s0, s1, r, c = events
    # The fields vLLM always sends are there, in its order; optional ones only when set.
    assert list(s0) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                        "medium", "lora_name", "extra_keys"]
    assert s0["block_hashes"] == h[0:3] and s0["parent_block_hash"] is None
    assert s0["token_ids"] == list(range(100, 112)) and s0["block_size"] == P
    assert s0["extra_keys"] == [["7"], ["7"], ["7"]], "the salt, once per block, as a str (as vLLM's keys are)"
    assert (s0["lora_id"], s0["lora_name"], s0["medium"]) == (None, None, "GPU")
    assert "extra_keys" not in s1 and s1["block_hashes"] == h[3:5] and s1["token_ids"] == list(range(200, 208))
    assert r == {"type": "BlockRemoved", "block_hashes": h[5:7], "medium": "GPU"}
    assert set(h[5:7]) <= set(h[:5]), "Removed names hashes that were Stored"
    assert c == {"type": "AllBlocksCleared"}
    # The chain's own parent links: page k's parent is page k-1.
    np.testing.assert_array_equal(ev["parent_lo"][1:3], ev["hash_lo"][0:2])


def test_schema_mirror_decodes_like_vllms_definition():
    a = pool()
    admit(a, np.arange(100, 113), salt=-3)
    a.evict(1)
    payload, *_ = _core.encode_kv_events(a.take_events(), 1.0)
    b = schema.decoder().decode(payload)
    assert b.data_parallel_rank is None
    stored, removed = b.events
    assert isinstance(stored, schema.BlockStored) and isinstance(removed, schema.BlockRemoved)
    assert stored.extra_keys == [("-3",)] * 3 and stored.parent_block_hash is None
    assert removed.block_hashes == [stored.block_hashes[2]], "the chain's tail is evicted first"


def test_vllm_decodes_the_payload_with_its_own_classes():
    kv = pytest.importorskip("vllm.distributed.kv_events", reason="vLLM is not importable here")
    a = pool()
    admit(a, np.arange(100, 113), salt=7)
    h, _ = admit(a, np.arange(100, 121), close=False)  # another salt: its own chain of 5 pages
    a.evict(3)
    a.clear_cache()
    ev = a.take_events()
    payload, stored, removed, cleared = _core.encode_kv_events(ev, 2.0, 1)
    b = msgspec.msgpack.Decoder(kv.KVEventBatch).decode(payload)
    assert (b.ts, b.data_parallel_rank) == (2.0, 1)
    kinds = [type(e).__name__ for e in b.events]
    assert kinds == ["BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared"]
    s0, s1, r, _ = b.events
    assert isinstance(s0, kv.BlockStored) and isinstance(r, kv.BlockRemoved) and isinstance(b.events[3],
                                                                                          kv.AllBlocksCleared)
    hashes = [wire_hash(x, y) for x, y in zip(ev["hash_hi"], ev["hash_lo"])]
    assert s0.block_hashes + s1.block_hashes == hashes[:8]
    assert s0.token_ids == list(range(100, 112)) and s1.token_ids == list(range(100, 120))
    assert (s0.block_size, s0.medium, s0.lora_id, s0.group_idx) == (P, kv.MEDIUM_GPU, None, None)
    assert s0.extra_keys == [("7",)] * 3 and s1.extra_keys is None
    assert len(r.block_hashes) == 3 and removed == 3 and stored == 8 and cleared == 1
    # The same bytes through kvpool's own mirror give equal values.
    mine = schema.decoder().decode(payload)
    assert [msgspec.structs.asdict(e) for e in mine.events] == [msgspec.structs.asdict(e) for e in b.events]


def test_medium_and_group_come_from_the_arrays_when_present():
    a = pool()
    admit(a, np.arange(100, 113))
    a.evict(3)
    ev = a.take_events()
    ev["medium"] = np.array([0, 0, 1, 0, 1, 1], dtype=np.uint8)  # 3 Stored, then 3 Removed
    ev["group_idx"] = np.array([2, 2, 2, 5, 5, -1], dtype=np.int64)
    events = msgspec.msgpack.decode(_core.encode_kv_events(ev, 0.0)[0])[1]
    # A change of medium or group starts a new wire event; -1 omits group_idx.
    assert [(e["type"], len(e["block_hashes"]), e["medium"], e.get("group_idx")) for e in events] == [
        ("BlockStored", 2, "GPU", 2), ("BlockStored", 1, "CPU", 2), ("BlockRemoved", 1, "GPU", 5),
        ("BlockRemoved", 1, "CPU", 5), ("BlockRemoved", 1, "CPU", None)]
    assert events[1]["parent_block_hash"] == wire_hash(ev["hash_hi"][1], ev["hash_lo"][1])


@pytest.mark.parametrize("change, match", [
    (lambda ev: ev.pop("salt"), 'no "salt" array'),
    (lambda ev: ev.__setitem__("hash_hi", ev["hash_hi"].astype(np.int64)), "uint64"),
    (lambda ev: ev.__setitem__("kind", np.array([0, 9, 1], dtype=np.uint8)), "kind\\[1\\] = 9"),
    (lambda ev: ev.__setitem__("token_ids", ev["token_ids"][:-1]), "token_ids has 7 ids"),
    (lambda ev: ev.__setitem__("salt", ev["salt"][:2]), '"salt".* has 2 entries but kind has 3'),
    (lambda ev: ev.__setitem__("medium", np.array([0, 3, 0])), "medium\\[1\\] = 3"),
    (lambda ev: ev["token_ids"].__setitem__(5, -3), "token_ids\\[5\\] = -3 is negative"),
])
def test_bad_event_arrays_are_typed_errors(change, match):
    a = pool()
    admit(a, np.arange(8))
    a.evict(1)
    ev = a.take_events()
    change(ev)
    with pytest.raises(kvpool.InvalidArgumentError, match=match):
        _core.encode_kv_events(ev, 0.0)


@pytest.mark.parametrize("int_hashes", [False, True])
def test_every_wire_event_fits_the_room_the_encoder_makes_for_it(int_hashes):
    """The encoder reserves, fallibly, the most each wire event can write before writing it
    (kv_events_wire.rs: 177 + 28 a page + 9 a token id for BlockStored, 71 + 18 a page for
    BlockRemoved, 23 for AllBlocksCleared; 24 for the batch around them), so that its writes
    never grow the buffer (a growth that cannot be made aborts the process). Every event
    here is its own wire event with every optional field at its longest."""
    n, per = 300, 3
    kind = np.tile(np.array([0, 1, 2], dtype=np.uint8), n // 3)
    rng = np.random.default_rng(5)
    stored = int((kind == 0).sum())
    ev = {
        "kind": kind,
        "hash_hi": rng.integers(0, 2**63, n, dtype=np.uint64) | np.uint64(2**63),
        "hash_lo": rng.integers(0, 2**63, n, dtype=np.uint64) | np.uint64(2**63),
        "parent_hi": rng.integers(1, 2**63, n, dtype=np.uint64),  # no event continues the one before
        "parent_lo": rng.integers(1, 2**63, n, dtype=np.uint64),
        "page": np.arange(n, dtype=np.int32),
        "num_tokens": np.where(kind == 0, per, 0).astype(np.int32),
        "salt": np.full(n, -(2**63), dtype=np.int64),
        "token_ids": np.full(stored * per, 2**31 - 1, dtype=np.int32),  # the largest id: 5 bytes
        "medium": np.full(n, 2, dtype=np.uint8),  # "STORAGE", the longest name
        "group_idx": np.full(n, 2**62, dtype=np.int64),
    }
    payload, st, rm, cl = _core.encode_kv_events(ev, 1.5, 2**63 - 1, int_block_hashes=int_hashes)
    assert (st, rm, cl) == (n // 3, n // 3, n // 3)
    events = msgspec.msgpack.decode(payload)[1]
    assert len(events) == n, "each event is its own wire event"
    room = 24 + (n // 3) * ((177 + 28 + 9 * per) + (71 + 18) + 23)
    assert len(payload) <= room, (len(payload), room)


def test_take_events_msgpack_equals_take_then_encode():
    a, b = pool(), pool()
    for x in (a, b):
        admit(x, np.arange(100, 113), salt=7)
        admit(x, np.arange(300, 317))
        x.evict(4)
    fast = a.take_events_msgpack(5.0, 2)
    slow = _core.encode_kv_events(b.take_events(), 5.0, 2)
    assert fast == slow
    empty = a.take_events_msgpack(5.0)
    assert empty[1:] == (0, 0, 0) and msgspec.msgpack.decode(empty[0]) == [5.0, [], None]


def test_removed_is_sent_only_when_no_copy_is_left():
    """Two requests compute the same page; the second copy stays unregistered
    (the index keeps one entry per content). Its close frees it silently; the
    Removed event comes when the registered copy is evicted, and from then on
    the pool no longer serves the page."""
    a = pool()
    pub = LocalEventPublisher(a)
    dec = schema.decoder()
    toks = np.arange(500, 509)  # 2 full pages + 1
    # Both admitted in one step, before either is cached: each computes its own pages.
    (h1, h2), _ = a.open_with_prefix(np.concatenate([toks, toks]), [len(toks)] * 2)
    h1, h2 = np.array([h1]), np.array([h2])
    a.extend(np.concatenate([h1, h2]), len(toks))
    a.cache(h1)
    a.cache(h2)  # duplicates: the existing entries stay, no Stored
    pub.publish()
    (msg,) = pub.drain()
    stored = dec.decode(msg[2]).events
    assert [type(e).__name__ for e in stored] == ["BlockStored"] and len(stored[0].block_hashes) == 2
    pages1, pages2 = set(a.pages(int(h1[0]))[:2].tolist()), set(a.pages(int(h2[0]))[:2].tolist())
    assert not pages1 & pages2, "two copies of each page"
    a.close(h2)  # the unregistered copies are freed: nothing to tell a router
    assert pub.publish() == 0
    hashes, tokens, salt = _core.page_hashes(toks, P, SEED), toks[:8], 0
    assert a.match_chain_hashes(hashes, tokens, salt) == 2
    a.close(h1)  # the registered copies become CACHED ...
    assert pub.publish() == 0
    assert a.evict(10) == 2  # ... and are evicted: now no copy is left
    assert pub.publish() == 2
    (msg,) = pub.drain()
    (rm,) = dec.decode(msg[2]).events
    assert isinstance(rm, schema.BlockRemoved) and sorted(rm.block_hashes) == sorted(stored[0].block_hashes)
    assert a.match_chain_hashes(hashes, tokens, salt) == 0
    a.check()


def test_sequence_numbers_are_monotonic_and_empty_steps_send_nothing():
    a = pool()
    pub = LocalEventPublisher(a, topic="kv")
    assert pub.publish() == 0 and pub.drain() == []
    admit(a, np.arange(8))
    assert pub.publish() == 2
    assert pub.publish() == 0
    a.evict(1)
    assert pub.publish() == 1
    msgs = pub.drain()
    assert [(t, int.from_bytes(s, "big")) for t, s, _ in msgs] == [(b"kv", 0), (b"kv", 1)]
    assert all(len(s) == 8 for _, s, _ in msgs)
    assert [s for _, s, _ in pub.replay(1)] == [msgs[1][1]] and pub.replay(2) == []
    assert (pub.batches, pub.events, pub.stored_pages, pub.removed_pages) == (2, 3, 2, 1)


def test_an_overflowed_backlog_is_one_all_blocks_cleared_and_a_dropped_count():
    a, twin = (kvpool.SlotAllocator(1025, 1, 2, 1024, hash_seed=SEED) for _ in range(2))
    pub = LocalEventPublisher(a)
    rng = np.random.default_rng(0)
    recorded = 0  # what `a` records, counted on a twin drained as it goes
    while recorded <= 1 << 16:  # more events than the backlog keeps (max(num_pages, 65536))
        toks = rng.integers(0, 1 << 20, size=1001)  # 1000 Stored, and Removed for what they evict
        admit(a, toks)
        admit(twin, toks)
        recorded += len(twin.take_events()["kind"])
    assert pub.dropped_events > 0
    n = pub.publish()
    (msg,) = pub.drain()
    events = schema.decoder().decode(msg[2]).events
    assert isinstance(events[0], schema.AllBlocksCleared)
    assert all(not isinstance(e, schema.AllBlocksCleared) for e in events[1:])
    assert n == 1 + sum(len(e.block_hashes) for e in events[1:])
    assert pub.dropped_events + n - 1 == recorded, "every event is either sent or counted as dropped"
    assert pub.cleared == 1


def test_module_function_stubs_carry_the_runtime_docstrings():
    import ast
    from pathlib import Path

    stub = ast.parse((Path(_core.__file__).parent / "_core.pyi").read_text())
    fns = {n.name: n for n in stub.body if isinstance(n, ast.FunctionDef)}
    for name in ("page_hashes", "encode_kv_events"):
        runtime = inspect.getdoc(getattr(_core, name)).split("\n\n", 1)[1].strip()
        assert ast.get_docstring(fns[name]).strip() == runtime, name


def test_after_an_overflow_removed_events_may_name_pages_the_consumer_forgot():
    """The docs' promise after an overflowed backlog: Removed events that follow the
    AllBlocksCleared may name pages stored before it (registered all along); a consumer
    that skips those ends holding only pages the pool caches, and every page stored since."""
    a = kvpool.SlotAllocator((1 << 16) + 1, 1, 2, 1 << 16, hash_seed=SEED)
    pub = LocalEventPublisher(a)
    admit(a, np.arange((1 << 16) - 8))  # a backlog just below the cap of 65536 events
    a.evict(100)  # its Removed events overflow it
    admit(a, np.arange(1 << 20, (1 << 20) + 51))
    assert pub.dropped_events > 0
    pub.publish()
    held, unknown = set(), 0
    for _, _, payload in pub.drain():
        for e in schema.decoder().decode(payload).events:
            if isinstance(e, schema.AllBlocksCleared):
                held.clear()
            elif isinstance(e, schema.BlockRemoved):
                unknown += sum(h not in held for h in e.block_hashes)
                held.difference_update(e.block_hashes)
            else:
                held.update(e.block_hashes)
    assert unknown > 0, "the Removed events after the overflow name pages stored before it"
    toks = np.arange(1 << 20, (1 << 20) + 51)
    words = _core.page_hashes(toks, 1, SEED)
    assert held == {wire_hash(hi, lo) for hi, lo in zip(words[0::2], words[1::2])}
    assert a.match_chain_hashes(words, toks) == 51, "and the pool caches each page the consumer holds"
