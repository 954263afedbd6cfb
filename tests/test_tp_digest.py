"""What TPPool's digest and its divergence check compute (distributed/tp.py), in one process.

The digest folds every recorded call (its name, arguments, keyword arguments and
result, or the error it raised) and a snapshot of the allocator's counters; twin
pools making the same calls agree, and a difference in any one of those parts
changes it. ``verify`` exchanges three words per rank (the digest's two int64
words and the call count) and names the first rank whose words differ from the
group's first rank. The group here is a one-process gloo group; other ranks'
words are supplied by a patched ``all_gather``.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from sys import path as _path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import kvpool
import kvpool.distributed.tp as tp_module
from kvpool.distributed import RankDivergenceError, TPPool

_path.insert(0, str(Path(__file__).parent))
import _dist  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

PROMPT = list(range(200, 216))


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    if dist.is_initialized():  # pragma: no cover - another module left one behind
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_dist.free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    yield
    dist.destroy_process_group()


def twin() -> TPPool:
    pool = kvpool.KVPool(1, 2, 4, dtype=torch.float32, page_size=4, num_pages=32, max_requests=8,
                         max_context_len=64, hash_seed=5, handle_seed=9, manual_clock=True)
    return TPPool(pool)


def workload(p: TPPool) -> None:
    """Every recorded call once, as an engine would make them."""
    hs, _ = p.admit([5, 3], tokens=list(range(8)))
    p.extend(hs, 1)
    h, _ = p.open_with_prefix(PROMPT, [16])
    p.extend(h, 16, tokens=PROMPT)
    p.cache(h)
    hashes, tokens, salt = p.chain_hashes(int(h[0]))
    kid = p.fork(hs[0], 1)
    p.truncate(kid, 2)
    p.close(h, cache=True)
    g = p.open_with_chain_hashes(hashes, tokens, salt)
    p.close([g])
    p.evict(1)
    p.clear_cache()
    p.close(kid)
    p.open(1)


@pytest.mark.parametrize("name", ["admit", "evict", "clear_cache", "open_with_chain_hashes", "unpin", "set_clock"])
def test_tppool_records_the_calls_it_forwards(name):
    p = twin()
    assert name in tp_module.MUTATING_CALLS and name in vars(p), f"{name} is not wrapped"
    before = (p.calls, p.digest())
    workload(p)
    assert p.calls > before[0]
    # The wrapper is recorded: calling it changes the call count and the digest.
    q = twin()
    workload(q)
    calls, digest = q.calls, q.digest()
    if name == "admit":
        q.admit([1])
    elif name == "evict":
        q.evict(0)
    elif name == "clear_cache":
        q.clear_cache()
    elif name == "unpin":
        assert q.unpin([]) == 0
    elif name == "set_clock":
        q.set_clock(2.5)
    else:
        q.open_with_chain_hashes(np.zeros(0, np.uint64), np.zeros(0, np.int64))
    assert q.calls == calls + 1 and q.digest() != digest


def test_twins_agree_and_the_wrapped_results_are_the_pools():
    a, b = twin(), twin()
    workload(a)
    workload(b)
    assert a.digest() == b.digest() and a.calls == b.calls
    bare = twin().inner  # the same calls on the bare pool hand out the same handles and slots
    hs, res = bare.admit([5, 3], tokens=list(range(8)))
    hs2, res2 = twin().admit([5, 3], tokens=list(range(8)))
    assert hs.tolist() == hs2.tolist() and res.slots.tolist() == res2.slots.tolist()


def test_a_tppool_of_a_tppool_is_refused():
    """It was accepted and recorded every call twice; the wrapped one is left as it was."""
    q = twin()
    calls, digest = q.calls, q.digest()
    with pytest.raises(kvpool.InvalidArgumentError, match="already a TPPool"):
        TPPool(q)
    q.admit([2], tokens=[1, 2])
    assert q.calls == calls + 1 and q.digest() != digest


def _diverge(change) -> tuple[bytes, bytes]:
    a, b = twin(), twin()
    for p in (a, b):
        workload(p)
    change(a, b)
    return a.digest(), b.digest()


def test_same_counters_but_other_slots_change_the_digest():
    """b's free stack is in another order (bypassing the wrapper), so the same admit
    hands it other slots with every counter equal: only the folded result differs."""
    def change(a, b):
        for p, order in ((a, slice(None)), (b, slice(None, None, -1))):
            hs = p.inner.open(2)
            p.inner.extend(hs, 4)
            for h in np.asarray(hs)[order]:
                p.inner.close([h])
        ra, rb = a.admit([4]), b.admit([4])
        assert ra[1].slots.tolist() != rb[1].slots.tolist()
        assert (a.free_pages, a.used_slots, a.open_requests) == (b.free_pages, b.used_slots, b.open_requests)
    da, db = _diverge(change)
    assert da != db


def test_other_lengths_and_keywords_change_the_digest():
    def lengths(a, b):
        for p, n in ((a, 3), (b, 2)):  # same page held either way: counters agree
            hs = p.admit([4])[0]
            p.truncate(hs, n)
    def keyword(a, b):
        for p, cache in ((a, True), (b, False)):  # nothing known to cache: counters agree
            hs = p.admit([4])[0]
            p.close(hs, cache=cache)
    for change in (lengths, keyword):
        da, db = _diverge(change)
        assert da != db, change.__name__


class FailingPool:
    """A pool whose extend always raises ``error`` (counters fixed), for the fold of failures."""

    device = "cpu"
    free_pages = used_pages = open_requests = used_slots = 0

    def __init__(self, error: Exception) -> None:
        self.error = error

    def extend(self, handles, counts, tokens=None):
        raise self.error


def test_a_failure_is_folded_with_its_error_type():
    """Same call, same arguments, same counters: only the error raised differs."""
    digests = []
    for error in (kvpool.PoolExhaustedError("x"), kvpool.PoolExhaustedError("y"), kvpool.ContextTooLongError("x")):
        p = TPPool(FailingPool(error))
        with pytest.raises(type(error)):
            p.extend([7], 3)
        assert p.calls == 1
        digests.append(p.digest())
    assert digests[0] == digests[1] and digests[0] != digests[2]


def test_a_change_made_past_the_wrapper_shows_in_the_counters():
    def change(a, b):
        b.inner.admit([1])  # not recorded; the counters differ
    da, db = _diverge(change)
    assert da != db


def test_arguments_are_folded_with_their_boundaries():
    a, b = twin(), twin()
    a._fold("extend", (np.array([1, 2]), np.array([3])), {}, None)
    b._fold("extend", (np.array([1]), np.array([2, 3])), {}, None)
    assert a.digest() != b.digest()


class FakeGather:
    """all_gather over four ranks: rank 0 is this process; ``edit[r]`` changes rank r's words."""

    def __init__(self, edit):
        self.edit, self.sent = edit, None

    def __call__(self, out, mine, group=None):
        self.sent = mine.clone()
        for r, t in enumerate(out):
            t.copy_(mine)
            if r in self.edit:
                self.edit[r](t)


def test_verify_exchanges_the_digest_words_and_names_the_first_differing_rank(monkeypatch):
    p = twin()
    workload(p)
    monkeypatch.setattr(tp_module, "group_ranks", lambda group: [0, 1, 2, 3])

    def bump(i):
        def edit(t):
            t[i] += 1
        return edit

    gather = FakeGather({})
    monkeypatch.setattr(tp_module.dist, "all_gather", gather)
    p.verify()  # everyone agrees
    words = np.frombuffer(p.digest(), dtype=np.int64)
    assert gather.sent.tolist() == [int(words[0]), int(words[1]), p.calls]
    for edits, first, bad in (({2: bump(1), 3: bump(0)}, 2, (2, 3)),   # a digest word
                              ({1: bump(2)}, 1, (1,)),                 # only the call count
                              ({3: bump(0)}, 3, (3,))):
        monkeypatch.setattr(tp_module.dist, "all_gather", FakeGather(edits))
        with pytest.raises(RankDivergenceError) as e:
            p.verify()
        assert e.value.rank == first and e.value.ranks == bad
        assert f"rank {first}'s allocator digest differs from rank 0's" in str(e.value)
        assert f"differing ranks: {list(bad)}" in str(e.value)
    # The call counts named are the differing rank's and the first rank's.
    monkeypatch.setattr(tp_module.dist, "all_gather", FakeGather({1: bump(2)}))
    with pytest.raises(RankDivergenceError, match=f"after {p.calls + 1} vs {p.calls} recorded pool calls"):
        p.verify()


def test_verify_on_a_real_one_rank_group():
    p = twin()
    workload(p)
    p.verify()
    p.check_every = 1
    p.extend(p.admit([1])[0], 1)  # the automatic check runs here, through the real all_gather


def test_swapping_different_requests_out_changes_the_digest():
    """Ranks that swap out different requests of the same length diverge with every
    counter equal (the same number of pages leaves the device either way): only the
    recorded swap_out call tells them apart. swap_in too."""
    def tiered() -> TPPool:
        pool = kvpool.KVPool(1, 2, 4, dtype=torch.float32, page_size=4, num_pages=32, max_requests=8,
                             max_context_len=64, hash_seed=5, handle_seed=9, host_pages=16)
        return TPPool(pool)
    a, b = tiered(), tiered()
    for p in (a, b):
        hs = p.admit([6, 6])[0]
    a.swap_out([hs[0]])
    b.swap_out([hs[1]])
    assert (a.free_pages, a.used_pages, a.open_requests, a.used_slots) == \
        (b.free_pages, b.used_pages, b.open_requests, b.used_slots)
    assert a.digest() != b.digest()
    c, d = tiered(), tiered()
    for p in (c, d):
        hs = p.admit([6])[0]
        p.swap_out(hs)
    before = c.digest()
    c.swap_in(hs)
    d.inner.swap_in(hs)  # past the wrapper: counters agree, only the recorded call differs
    assert c.digest() != before and c.calls == d.calls + 1


@pytest.mark.parametrize("kw", [dict(tp_size=2), dict(tp_rank=1), dict(tp_size=2, tp_rank=1), dict(tp_rank=True),
                                dict(tp_size=1.0)])
def test_tp_pool_refuses_a_shard_other_than_the_groups(kw):
    """tp_pool takes tp_rank / tp_size from the group; given otherwise, this rank would hold
    heads its peers hold too (or none), found only as wrong attention or a shape error at the
    first write. One rank of a group of one: rank 0, size 1."""
    from kvpool.distributed import tp_pool

    key = next(iter(kw))
    with pytest.raises(kvpool.InvalidArgumentError, match=rf"tp_pool: {key}=.* rank 0 of a group of 1; leave {key} out"):
        tp_pool(1, 2, 4, dtype=torch.float32, page_size=4, num_pages=8, max_requests=2, max_context_len=16, **kw)
    same = tp_pool(1, 2, 4, dtype=torch.float32, page_size=4, num_pages=8, max_requests=2, max_context_len=16,
                   tp_rank=0, tp_size=1)
    assert same.inner.tp_rank == 0 and same.inner.tp_size == 1


def test_the_docs_name_every_call_tppool_records():
    """docs/distributed.md's list of the calls TPPool wraps omitted unpin, set_clock,
    swap_out and swap_in (and the private call KVPoolCache.crop makes), all recorded."""
    text = " ".join((Path(__file__).parent.parent / "docs" / "distributed.md").read_text().split())
    para = text[text.index("**Divergence check.**"):][:700]
    missing = [n for n in tp_module.MUTATING_CALLS + tp_module._PRIVATE_MUTATING_CALLS if f"`{n}`" not in para]
    assert not missing, f"docs/distributed.md's divergence check does not name {missing}"
