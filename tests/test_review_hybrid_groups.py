"""Outside review of hybrid pools (sliding window + full + linear-attention state).

Every K/V row and state row holds a value computed from the request's whole prefix
(a from-scratch run stores exactly that), so a hit or a rollback that served another
prefix's rows, or the wrong window, reads a different value.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from kvpool import KVPool
from kvpool._core import GroupedAllocator, InvalidArgumentError, SlotAllocator
from kvpool.errors import KVPoolError

W, P = 8, 4
TYPES = ["sliding_attention", "full_attention", "linear_attention", "sliding_attention"]
ATTN = (0, 1, 3)


def make(**kw):
    args = dict(layer_types=TYPES, sliding_window=W, state_shapes={"s": (3,)}, dtype=torch.float32,
                page_size=P, num_pages=64, max_requests=4, max_context_len=128)
    args.update(kw)
    return KVPool(4, 2, 8, **args)


def kv_value(tokens, pos, layer):
    """What a from-scratch run stores at ``pos``: a function of the prefix [0, pos]."""
    return float(zlib.crc32(str(list(tokens[: pos + 1])).encode()) % 1_000_003 * 8 + layer)


def state_value(tokens):
    return float(zlib.crc32(str(list(tokens)).encode()) % 1_000_003) if len(tokens) else 0.0


def step(pool, h, tokens, new):
    """Extend request ``h`` (now ``tokens``) by ``new`` and store what the model would."""
    return store(pool, h, tokens, new, pool.extend([h], len(new), tokens=np.asarray(new, dtype=np.int64)))


def store(pool, h, tokens, new, res):
    start, full = len(tokens), list(tokens) + list(new)
    for layer in ATTN:
        x = torch.tensor([kv_value(full, start + i, layer) for i in range(len(new))])
        x = x.view(-1, 1, 1).expand(-1, 2, 8).contiguous()
        pool.write(layer, res.for_layer(layer), x, x)
    pool.state(2, "s")[pool.state_slots([h], 2)] = state_value(full)
    return full


def assert_reads(pool, h, tokens):
    """Every position a layer attends to next reads the from-scratch value; the state too."""
    n = len(tokens)
    assert pool.length(h) == n
    for layer in ATTN:
        slots = pool.slots(h, layer)
        np.testing.assert_array_equal(pool.req_to_token[layer][pool.rows([h])[0], :n].numpy(), slots)
        k, v = pool.read(layer, slots)
        need = range(n) if layer == 1 else range(max(0, n - W + 1), n)
        got = [k[p, 0, 0].item() for p in need]
        assert got == [kv_value(tokens, p, layer) for p in need], (layer, n)
        assert torch.equal(k, v)
    assert pool.state(2, "s")[pool.state_slots([h], 2)][0, 0].item() == state_value(tokens)


def test_a_long_prefix_hits_what_the_docs_promise_and_reads_what_a_fresh_run_stores():
    # Room for every checkpoint (at multiples of the hit step, 4): nothing is evicted.
    pool = make(group_pages={"linear_attention": 24})
    tokens: list[int] = []
    h = pool.open(1)[0]
    tokens = step(pool, h, tokens, list(range(100, 113)))
    pool.cache([h])
    for i in range(113, 160):  # decode, publishing each step as KVPoolCache does
        tokens = step(pool, h, tokens, [i])
        pool.cache([h])
        for layer in (0, 3):  # the window's pages only: flat in the sequence length
            assert pool.held_tokens(h, layer) <= (-(-(W - 1) // P) + 1) * P
        for layer in range(4):
            assert pool.free_pages(layer) + pool.used_pages(layer) == pool.capacity_pages(layer)
    assert pool.held_tokens(h, 1) == 60 and pool.used_pages(0) <= 3
    pool.close([h])
    pool.check()
    # cache() saw every length from 13 to 60: checkpoints at 16, 20, .., 60.
    for shared in (59, 41, 30, 17):
        prompt = np.array(tokens[:shared] + [7, 7], dtype=np.int64)
        (g,), (hit,) = pool.open_with_prefix(prompt, [len(prompt)])
        assert hit == shared // P * P, shared
        assert_reads(pool, int(g), tokens[: int(hit)])
        own = step(pool, int(g), tokens[: int(hit)], prompt[int(hit): int(hit) + 2].tolist())
        assert_reads(pool, int(g), own)
        pool.close([g])
    pool.check()


def test_a_request_closed_without_earlier_publishes_hits_only_its_last_window():
    """Window pages released before any cache() went back to the free list: only the
    final length (its window held at close) can be served, and a shorter share misses."""
    pool = make()
    tokens: list[int] = []
    h = pool.open(1)[0]
    tokens = step(pool, h, tokens, list(range(10, 22)))
    for i in range(22, 42):
        tokens = step(pool, h, tokens, [i])
    pool.close([h], cache=True)  # at 32, a multiple of the hit step: a checkpoint there
    (g,), (hit,) = pool.open_with_prefix(np.array(tokens + [1], dtype=np.int64), [len(tokens) + 1])
    assert hit == 32
    assert_reads(pool, int(g), tokens)
    (g2,), (hit2,) = pool.open_with_prefix(np.array(tokens[:20] + [1], dtype=np.int64), [21])
    assert hit2 == 0  # the full group holds [0, 20), but neither the window nor a checkpoint at 20 is cached
    pool.check()


def _snapshot(pool, handles):
    return ([t.clone() for _, t in pool.named_tensors()],
            [(pool.free_pages(x), pool.used_pages(x), pool.cached_pages(x)) for x in range(4)],
            sorted((pool.length(h), tuple(pool.slots(h, 0)), tuple(pool.slots(h, 1)),
                    tuple(pool.state_slots([h], 2))) for h in handles))


@pytest.mark.parametrize("seed,device_tables", [(3, False), (8, False), (5, True)])
def test_a_random_trace_keeps_every_groups_rows_and_refusals_change_nothing(seed, device_tables):
    """admit / extend / cache / close / fork / truncate / prefix hits / evict on a small pool
    (refusals happen): after every call each request reads its own prefix's values, and its
    table rows are its slots (``device_tables``: the scatter path pools off the CPU take)."""
    rng = np.random.default_rng(seed)
    pool = make(max_requests=6, num_pages=30, group_pages={"sliding_attention": 14, "linear_attention": 9},
                page_size={"sliding_attention": 2, "full_attention": 4})
    if device_tables:
        pool._tables_np = None
    live: dict[int, list[int]] = {}
    prompts: dict[int, list[int]] = {}
    seen: list[list[int]] = []
    refused = 0
    for _ in range(120):
        hs = list(live)
        op = "close" if len(hs) >= 5 else rng.choice(["admit", "extend", "extend", "close", "fork", "truncate",
                                                      "prefix", "prefix", "evict"])
        if op in ("extend", "close", "fork", "truncate") and not hs:
            op = "admit"
        h = hs[int(rng.integers(len(hs)))] if hs else -1
        before = _snapshot(pool, hs)
        try:
            if op == "admit":
                new = rng.integers(0, 3, int(rng.integers(1, 12))).tolist()
                (a,), res = pool.admit([len(new)], tokens=np.array(new))
                live[int(a)] = store(pool, int(a), [], new, res)
            elif op == "extend":
                new = rng.integers(0, 3, int(rng.choice([1, 2, 4, 5]))).tolist()
                known, n = prompts.get(h, []), len(live[h])
                new = [known[n + i] if n + i < len(known) else t for i, t in enumerate(new)]
                live[h] = step(pool, h, live[h], new)
                seen.append(list(live[h]))
                if rng.random() < 0.7:
                    pool.cache([h])
            elif op == "close":
                pool.close([h], cache=bool(rng.integers(2)))
                del live[h]
            elif op == "fork":
                (c,) = pool.fork(h, 1)
                live[int(c)], prompts[int(c)] = list(live[h]), list(prompts.get(h, []))
            elif op == "truncate":
                n = int(rng.integers(0, len(live[h]) + 1))
                pool.truncate([h], [n])
                if n < len(live[h]):
                    prompts.pop(h, None)  # truncate drops the prompt; roll_back_extend keeps it
                live[h] = live[h][:n]
            elif op == "prefix":
                src = seen[int(rng.integers(len(seen)))] if seen else []
                n = int(rng.integers(1, 40))
                prompt = (src + rng.integers(0, 3, 40).tolist())[:n]
                (a,), (hit,) = pool.open_with_prefix(np.array(prompt, dtype=np.int64), [n])
                live[int(a)], prompts[int(a)] = prompt[: int(hit)], prompt
            else:
                pool.evict(int(rng.choice([0, 1, 2])), int(rng.integers(1, 4)))
        except KVPoolError:
            refused += 1
            after = _snapshot(pool, hs)
            assert all(torch.equal(a, b) for a, b in zip(before[0], after[0])), op
            assert before[1:] == after[1:], op
        pool.check()
        for x, tokens in live.items():
            assert_reads(pool, x, tokens)
    assert refused > 0


def test_a_page_size_for_a_state_layer_is_a_typed_error():
    """docs/hybrid.md: a page_size key that no page group has is an InvalidArgumentError; a
    state layer type was dropped without a word, as a typo would be."""
    with pytest.raises(InvalidArgumentError, match=r"'linear_attention', a state layer type.*'full_attention'"):
        make(page_size={"linear_attention": 7, "full_attention": 4, "sliding_attention": 4})
    assert make(page_size={"full_attention": 4, "sliding_attention": 2}).page_size_of(0) == 2


@pytest.mark.parametrize("key,value,least", [
    ("window", -1, 1), ("num_pages", -8, 2), ("page_size", -1, 1), ("num_slots", -3, 2),
    ("checkpoint_every", -1, 0),
])
def test_a_negative_group_size_is_told_its_least_value(key, value, least):
    """Told ">= 0" for window=-1, a caller who tries 0 is only refused again."""
    groups = [{"kind": "full", "num_pages": 8, "page_size": 4},
              {"kind": "sliding", "num_pages": 8, "page_size": 4, "window": 8},
              {"kind": "state", "num_slots": 5, "checkpoint_every": 4}]
    i = {"window": 1, "num_slots": 2, "checkpoint_every": 2}.get(key, 0)
    groups[i][key] = value
    with pytest.raises(InvalidArgumentError, match=rf'groups\[{i}\]\["{key}"\] must be >= {least}, got {value}'):
        GroupedAllocator(groups, 2, 64)
    groups[i][key] = least
    if least > 0:  # the least value itself is accepted
        GroupedAllocator(groups, 2, 64)


@pytest.mark.parametrize("page_size", [np.int64(2), {"full_attention": np.int32(2), "sliding_attention": 2}])
def test_num_slots_takes_a_numpy_int_page_size_as_the_plain_pool_does(page_size):
    """A numpy int page_size beside num_slots was refused as "num_slots must be a multiple of
    page_size" (40 is one), though num_pages= and the plain pool take it."""
    pool = make(page_size=page_size, num_pages=None, num_slots=np.int64(40))
    assert pool.capacity_pages(1) + 1 == 20 and type(pool.group(1).num_pages) is int
    plain = KVPool(2, 2, 8, dtype=torch.float32, page_size=np.int64(2), num_slots=40)
    assert plain.num_pages == 20
    with pytest.raises(InvalidArgumentError, match="num_slots must be a multiple of page_size"):
        make(page_size=True, num_pages=None, num_slots=40)


def test_max_pinned_pages_zero_asks_for_no_pins_on_a_hybrid_pool_as_on_a_plain_one():
    """A plain pool takes max_pinned_pages=0 as "no pinning"; a hybrid pool (which keeps no
    priorities) refused it and took only None."""
    assert KVPool(1, 1, 4, num_pages=8, max_pinned_pages=0).max_pinned_pages == 0
    for zero in (0, np.int64(0)):
        make(max_pinned_pages=zero).check()
    for bad in (1, False):
        with pytest.raises(InvalidArgumentError, match="max_pinned_pages"):
            make(max_pinned_pages=bad)


@pytest.mark.parametrize("num_pages", [4, 64])
def test_a_numpy_num_pages_plans_the_groups_a_python_int_does(num_pages):
    """num_pages=np.int64(N) stayed a numpy int in LayerGroup.num_pages, and the sliding group's
    cap (what the full group's tokens can fill) checked isinstance(int), so a small numpy
    num_pages sized the sliding group as if there were no full group."""
    want = make(num_pages=num_pages).groups
    for n in (np.int64(num_pages), np.int32(num_pages)):
        got = make(num_pages=n).groups
        assert got == want
        assert all(type(g.num_pages) is int for g in got)


@pytest.mark.parametrize("num_pages", ["64", 64.0, True])
def test_a_hybrid_num_pages_that_is_no_int_is_a_typed_error(num_pages):
    """A str reached check_slot_ids' arithmetic as a TypeError."""
    with pytest.raises(InvalidArgumentError, match=r"^num_pages must be an int, got "):
        make(num_pages=num_pages)


@pytest.mark.parametrize("make,key,least", [
    (lambda v: SlotAllocator(v), "num_pages", 2),
    (lambda v: SlotAllocator(8, page_size=v), "page_size", 1),
    (lambda v: SlotAllocator(8, max_requests=v), "max_requests", 1),
    (lambda v: SlotAllocator(8, max_context_len=v), "max_context_len", 1),
    (lambda v: SlotAllocator(8, host_pages=v), "host_pages", 0),
    (lambda v: GroupedAllocator([{"kind": "full", "num_pages": 8}], v), "max_requests", 1),
    (lambda v: GroupedAllocator([{"kind": "full", "num_pages": 8}], 2, v), "max_context_len", 1),
    (lambda v: GroupedAllocator([{"kind": "sliding", "num_pages": 8, "window": 4}], anchor_pages=v),
     "anchor_pages", 2),
])
def test_a_negative_pool_size_is_told_its_least_value(make, key, least):
    """The allocators' own sizes, as the groups' above: told ">= 0" for num_pages=-1, a caller
    who tried 0 was only refused again."""
    with pytest.raises(InvalidArgumentError, match=rf"^{key} must be >= {least}, got -3$"):
        make(-3)
    if least:
        with pytest.raises(InvalidArgumentError, match=key):
            make(least - 1)


@pytest.mark.parametrize("kw,match", [
    (dict(num_pages=-3), r"^num_pages must be >= 2 \(page 0 is reserved\), got -3$"),
    (dict(num_slots=-3), r"^num_slots must be >= 8 \(two pages of page_size=4: page 0 is reserved\), got -3$"),
])
@pytest.mark.parametrize("hybrid", [False, True], ids=["plain", "hybrid"])
def test_a_negative_kvpool_size_is_told_its_least_value(kw, match, hybrid):
    """KVPool's own check of the same sizes still said "num_pages must be
    >= 0, got -3" (0 is refused next), and a hybrid pool named the core's groups[0]["num_pages"],
    not the argument the caller gave."""
    args = dict(dtype=torch.float32, page_size=4, max_requests=2, max_context_len=16, **kw)
    if hybrid:
        args.update(layer_types=["full_attention", "sliding_attention"], sliding_window=4)
    with pytest.raises(InvalidArgumentError, match=match):
        KVPool(2, 1, 2, **args)
    if hybrid and "num_pages" in kw:
        with pytest.raises(InvalidArgumentError, match=r"^num_pages must be >= 2 \(page 0 is reserved\), got 1$"):
            KVPool(2, 1, 2, **dict(args, num_pages=1))


def test_a_budget_past_the_slot_ids_is_told_to_lower_the_budget():
    """A hybrid pool sized by memory_bytes past 2**31 slots was told a num_pages to use, an
    argument the caller did not give (the plain pool names memory_bytes)."""
    kw = dict(dtype=torch.float16, layer_types=["full_attention", "sliding_attention"], sliding_window=8)
    with pytest.raises(InvalidArgumentError, match=r"^memory_bytes gives the full_attention layers \d+ pages.*"
                       r"use a smaller memory_bytes, one that gives these layers at most 2147483647 pages$"):
        KVPool(2, 1, 2, memory_bytes=2**31 * 8 + 10**9, **kw)
    with pytest.raises(InvalidArgumentError, match=r"use at most num_pages=2147483647 for this group"):
        KVPool(2, 1, 2, num_pages=2**31 + 5, **kw)
