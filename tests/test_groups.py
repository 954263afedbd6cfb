"""GroupedAllocator from Python: its arguments, per-group tables, page tables
and copies, the pool-wide admission figures, and typed refusals that leave
every group as it was."""

import numpy as np
import pytest

import kvpool
from kvpool import GroupedAllocator

FULL, SLIDING, STATE = 0, 1, 2


def hybrid(state_slots=8, sliding_pages=64, window=5, ps=4):
    return GroupedAllocator(
        [{"kind": "full", "num_pages": 64, "page_size": ps},
         {"kind": "sliding", "num_pages": sliding_pages, "page_size": ps, "window": window},
         {"kind": "state", "num_slots": state_slots}],
        max_requests=8, max_context_len=64, hash_seed=7)


def test_groups_describe_the_pool():
    a = hybrid()
    assert a.num_groups == 3 and a.anchor_group == 0 and a.anchor_page_size == 4 and a.hit_step == 4
    assert a.groups == [
        {"kind": "full", "num_pages": 64, "page_size": 4},
        {"kind": "sliding", "num_pages": 64, "page_size": 4, "window": 5},
        {"kind": "state", "num_slots": 8, "checkpoint_every": 4},
    ]
    b = GroupedAllocator([{"kind": "sliding", "num_pages": 9, "page_size": 2, "window": 3}], 4, 16)
    assert b.anchor_group is None and b.anchor_page_size == 2
    assert "sliding" in repr(b)


@pytest.mark.parametrize("groups", [
    [],
    [{"kind": "full"}],
    [{"kind": "fulll", "num_pages": 8}],
    [{"kind": "full", "num_pages": 8, "window": 3}],
    [{"kind": "sliding", "num_pages": 8, "page_size": 2}],
    [{"kind": "sliding", "num_pages": 8, "page_size": 2, "window": 0}],
    [{"kind": "state", "num_slots": 8}],
    [{"kind": "full", "num_pages": 8, "page_size": 4}, {"kind": "state", "num_slots": 8, "checkpoint_every": 6}],
    [{"kind": "full", "num_pages": -1}],
    ["full"],
    None,
])
def test_bad_groups_are_typed_errors(groups):
    with pytest.raises(kvpool.InvalidArgumentError):
        GroupedAllocator(groups, 4, 16)


def test_extend_writes_each_groups_table_and_pads_released_positions():
    a = hybrid()
    tables = [np.full((8, 64), -9, np.int32), np.full((8, 64), -9, np.int32), None]
    h, outs = a.admit([10], tokens=list(range(1, 11)), tables=tables)
    row = int(a.rows(h)[0])
    for g in (FULL, SLIDING):
        assert tables[g][row, :10].tolist() == outs[g].tolist() == a.slots(h[0], g).tolist()
    assert outs[STATE].size == 0
    (s,) = a.state_slots(h, STATE)
    assert [x.tolist() for x in a.take_copies(STATE)] == [[-1], [s]]
    # The next token attends to positions 6..10: positions 0..3 are released
    # and read as the null page's slots, in the table too.
    outs = a.extend(h, 1, tokens=[11], tables=tables)
    assert tables[SLIDING][row, :4].tolist() == [0, 1, 2, 3]
    assert tables[SLIDING][row, :11].tolist() == a.slots(h[0], SLIDING).tolist()
    assert a.pages(h[0], SLIDING).tolist()[0] == 0
    assert tables[FULL][row, :11].tolist() == a.slots(h[0], FULL).tolist()
    indptr, indices, last = a.page_table(h, SLIDING)
    assert indices.tolist() == [p for p in a.pages(h[0], SLIDING).tolist() if p] and last.tolist() == [3]
    assert a.page_table(h, FULL)[1].size == 3


def test_tables_are_checked_before_anything_changes():
    a = hybrid()
    t = np.zeros((8, 64), np.int32)
    h, _ = a.admit([3])
    before = a.slots(h[0], FULL).tolist()
    for tables in ([t, t, None], [t], [t, None, np.zeros((8, 64), np.int32)], [np.zeros((2, 2), np.int32), None, None]):
        with pytest.raises(kvpool.InvalidArgumentError):
            a.extend(h, 1, tables=tables)
    assert a.slots(h[0], FULL).tolist() == before and a.length(h[0]) == 3
    a.check()


def test_a_hit_fills_every_groups_table():
    a = hybrid()
    prompt = list(range(1, 14))
    h, cached = a.open_with_prefix(prompt, [13])
    assert cached.tolist() == [0]
    for t in prompt:
        a.extend(h, 1, tokens=[t])
        a.cache(h)
    a.close(h, cache=True)
    a.take_copies(STATE)  # the checkpoints' copies (run before the next step)
    h, cached = a.open_with_prefix(prompt + [99], [14])
    assert cached.tolist() == [12]
    for g in (FULL, SLIDING):
        t = np.full((8, 64), -9, np.int32)
        a.fill_table(h, t, g)
        row = int(a.rows(h)[0])
        assert t[row, :12].tolist() == a.slots(h[0], g).tolist()
    src, dst = a.take_copies(STATE)
    assert dst.tolist() == a.state_slots(h, STATE).tolist() and src[0] > 0
    assert a.pending_copies(STATE) == 0
    with pytest.raises(kvpool.InvalidArgumentError):
        a.fill_table(h, np.zeros((8, 64), np.int32), STATE)
    with pytest.raises(kvpool.InvalidArgumentError):
        a.slots(h[0], STATE)
    with pytest.raises(kvpool.InvalidArgumentError):
        a.state_slots(h, FULL)
    with pytest.raises(kvpool.InvalidArgumentError):
        a.free_pages(3)


def snapshot(a, hs):
    out = [a.open_requests]
    for g in range(a.num_groups):
        out += [a.free_pages(g), a.used_pages(g), a.cached_pages(g), a.evictable_pages(g), a.pending_copies(g)]
        for h in hs:
            out.append((a.state_slots([h], g) if a.groups[g]["kind"] == "state" else a.slots(h, g)).tolist())
    return out


def test_refusals_name_the_group_and_change_nothing():
    a = hybrid(state_slots=3)
    h = a.open(2)
    a.extend(h, 6)
    before = snapshot(a, h)
    for call in (lambda: a.open(1), lambda: a.fork(h[0], 1), lambda: a.admit([2]),
                 lambda: a.open_with_prefix([1, 2, 3], [3])):
        with pytest.raises(kvpool.PoolExhaustedError, match=r"group 2 \(state\)"):
            call()
        assert snapshot(a, h) == before
    with pytest.raises(kvpool.RollbackUnavailableError, match=r"group 2 \(state\)"):
        a.truncate(h[:1], 5)
    assert snapshot(a, h) == before
    a.truncate(h[:1], 0)  # the empty state is always there
    assert a.length(h[0]) == 0
    a.check()
    assert kvpool.RollbackUnavailableError is kvpool.errors.RollbackUnavailableError
    assert issubclass(kvpool.RollbackUnavailableError, kvpool.KVPoolError)


def test_an_anchor_chain_short_of_pages_is_named_with_what_sizes_it():
    """It was "group 2 (anchor)" in a pool of groups 0 and 1, an index every per-group call
    refuses, and said nothing of anchor_pages=."""
    a = GroupedAllocator([{"kind": "sliding", "num_pages": 20, "page_size": 2, "window": 3},
                          {"kind": "sliding", "num_pages": 20, "page_size": 3, "window": 5}],
                         max_requests=4, max_context_len=64, anchor_pages=4)
    with pytest.raises(kvpool.PoolExhaustedError, match=r"the token-only anchor chain \(group 2, past the layer "
                       r"groups\) exhausted: .* \(size the anchor with anchor_pages="):
        a.admit([4])
    assert a.open_requests == 0
    a.check()



@pytest.mark.parametrize("anchor_pages", [0, 1, 2**31, 2**40])
def test_anchor_pages_out_of_range_is_refused_whichever_group_holds_the_anchor(anchor_pages):
    """anchor_pages=0 or 1 was accepted beside a full group (the value goes unused there)
    and refused on an all-sliding pool, where 2**31 was reported as num_pages: both
    pools now refuse the same values, naming anchor_pages and its range."""
    full_anchor = [{"kind": "full", "num_pages": 16, "page_size": 4},
                   {"kind": "sliding", "num_pages": 16, "page_size": 4, "window": 8}]
    all_sliding = [{"kind": "sliding", "num_pages": 16, "page_size": 4, "window": 8}]
    for groups in (full_anchor, all_sliding):
        with pytest.raises(kvpool.InvalidArgumentError,
                           match=rf"^anchor_pages must be in \[2, 2147483647\] .*got {anchor_pages}$"):
            GroupedAllocator(groups, 4, 64, anchor_pages=anchor_pages)
        # In range, both take it (beside a full group it goes unused).
        GroupedAllocator(groups, 4, 64, anchor_pages=2).check()

def test_admission_figures():
    a = hybrid(state_slots=3, sliding_pages=5)
    assert a.admissible_requests == 2
    assert a.admissible_tokens() == 16 == a.admissible_tokens(SLIDING)
    assert a.admissible_tokens(FULL) == 63 * 4
    h, _ = a.admit([8])
    assert a.admissible_requests == 1 and a.admissible_tokens() == 8
    assert a.capacity_pages(SLIDING) == 4 and a.used_pages(SLIDING) == 2
    a.close(h)
    assert a.admissible_requests == 2 and a.metadata_bytes > 0


def test_events_come_from_the_anchor_chain():
    a = hybrid()
    h, _ = a.admit([8], tokens=list(range(8)))
    a.cache(h)
    ev = a.take_events()
    assert int((ev["kind"] == 0).sum()) == 2  # two Stored pages of 4 tokens
    assert a.dropped_events == 0 and isinstance(a.hash_seed, int)
