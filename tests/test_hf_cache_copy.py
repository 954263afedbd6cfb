"""``copy.deepcopy`` of a ``KVPoolCache``: transformers' prompt-reuse pattern (prefill one cache,
then ``generate`` on a deep copy of it per prompt) gives DynamicCache's tokens, with copies made
in any order, copies of copies, the original going on, and any of them closed first; every copy
is a new cache on the same pool whose rows are forks; a copy that cannot be made is refused typed
with the pool and the cache as they were. ``copy.copy`` is refused typed, ``pickle`` as before."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from _hf_hybrid_models import P, tiny
from _hf_models import CACHE_KW, VOCAB, greedy, tiny_model
from transformers import DynamicCache

import kvpool
from kvpool.errors import CopyRefusedError, IncompleteForwardError, KVPoolError, RowsChangedError, TooManyRequestsError
from kvpool.integrations.transformers import KVPoolCache, pool_for_model

NEW = 5


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", num_hidden_layers=3)


def ids(n: int, seed: int, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, n), generator=g)


def counts(pool) -> tuple:
    s = pool.stats()
    if isinstance(s, dict):  # (a hybrid pool's: per group)
        return s["open_requests"], [(g["used_pages"], g["free_pages"]) for g in s["groups"]]
    return s.open_requests, s.used_pages, s.free_pages


def reuse(model, make, prompt, suffixes, *, order="copies first", chain=True):
    """The documented pattern: prefill ``prompt``, then per suffix ``generate`` on a deep copy;
    ``chain`` also copies a copy after its generate and goes on with both; the original
    generates last (or first). Returns every generate's new tokens, and the caches."""
    cache = make()
    with torch.no_grad():
        cache = model(prompt, **{CACHE_KW: cache}).past_key_values
    copies = [copy.deepcopy(cache) for _ in suffixes]
    out, made = [], list(copies)

    def go(c, tail, n=NEW):
        full = torch.cat([prompt, tail], 1)
        out.append(greedy(model, full, None, n, cache=c).sequences[:, full.shape[1]:].tolist())
        return full

    if order == "original first":
        go(cache, suffixes[0])
    first = len(out)
    for c, tail in zip(copies, suffixes):
        go(c, tail)
    if chain:  # a copy of a copy holding generated (deferred decode) steps; then both go on
        held = torch.cat([suffixes[0], torch.tensor(out[first])], 1)
        twin = copy.deepcopy(copies[0])
        made.append(twin)
        go(twin, torch.cat([held, ids(2, 99, prompt.shape[0])], 1))
        go(copies[0], torch.cat([held, ids(3, 98, prompt.shape[0])], 1))
    if order != "original first":
        go(cache, suffixes[-1])
    return out, [cache] + made


@pytest.mark.parametrize("layer_buffers", [True, False])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("order", ["copies first", "original first"])
def test_prompt_reuse_gives_dynamic_caches_tokens_and_gives_every_row_back(model, layer_buffers, batch, order):
    pool = pool_for_model(model, max_tokens=1024, page_size=4, max_requests=16)
    start = counts(pool)
    prompt = ids(10, 1, batch)
    suffixes = [ids(k, 2 + k, batch) for k in (3, 6, 1)]
    want, _ = reuse(model, DynamicCache, prompt, suffixes, order=order)
    got, caches = reuse(model, lambda: KVPoolCache(pool, layer_buffers=layer_buffers), prompt, suffixes, order=order)
    assert got == want
    assert len({id(c.requests) for c in caches}) == len(caches) and all(c.pool is pool for c in caches)
    assert len({int(h) for c in caches for h in c.handles}) == batch * len(caches)
    for c in caches:
        c.close()
    assert counts(pool) == start
    pool.check()


def test_a_copy_is_an_independent_cache_of_the_same_kind_on_the_same_pool(model):
    pool = pool_for_model(model, max_tokens=512, page_size=4, max_requests=8)
    start = counts(pool)
    cache = KVPoolCache(pool, layer_buffers=False)
    with torch.no_grad():
        model(ids(7, 3), **{CACHE_KW: cache})
    held = {"cache": cache, "pool": pool}
    dup = copy.deepcopy(held)
    twin = dup["cache"]
    assert dup["pool"] is pool and twin.pool is pool and type(twin) is KVPoolCache
    assert twin.get_seq_length() == cache.get_seq_length() == 7
    assert not twin.requests.pages.layer_buffers
    assert not set(map(id, twin.layers)) & set(map(id, cache.layers))
    assert twin.requests is not cache.requests and int(twin.handles[0]) != int(cache.handles[0])
    # Dropping (closing) the original leaves the copy's rows; the copy closes its own once.
    prompt = torch.cat([ids(7, 3), ids(4, 5)], 1)
    want = greedy(model, prompt, None, NEW).sequences
    cache.close()
    assert greedy(model, prompt, None, NEW, cache=twin).sequences.tolist() == want.tolist()
    twin.close()
    twin.close()
    assert counts(pool) == start


def test_a_copy_of_an_empty_or_closed_cache_is_an_empty_cache(model):
    pool = pool_for_model(model, max_tokens=256, page_size=4, max_requests=4)
    start = counts(pool)
    prompt = ids(6, 7)
    want = greedy(model, prompt, None, NEW).sequences.tolist()
    empty = KVPoolCache(pool)
    twin = copy.deepcopy(empty)
    assert twin.handles is None and twin.get_seq_length() == 0 and counts(pool) == start
    greedy(model, prompt, None, NEW, cache=empty)
    empty.close()
    again = copy.deepcopy(empty)
    assert again.handles is None and counts(pool) == start
    assert greedy(model, prompt, None, NEW, cache=twin).sequences.tolist() == want
    assert greedy(model, prompt, None, NEW, cache=again).sequences.tolist() == want
    twin.close()
    again.close()
    assert counts(pool) == start


def _refused_unchanged(pool, cache, err, match):
    before = counts(pool), pool.lengths(cache.requests.handles).tolist(), [x.seen for x in cache._pool_layers]
    with pytest.raises(err, match=match):
        copy.deepcopy(cache)
    assert (counts(pool), pool.lengths(cache.requests.handles).tolist(), [x.seen for x in cache._pool_layers]) == before
    pool.check()


def test_a_copy_of_a_cache_mid_step_or_changed_through_the_pool_is_refused_unchanged(model):
    pool = pool_for_model(model, max_tokens=256, page_size=4, max_requests=4)
    cache = KVPoolCache(pool)
    with torch.no_grad():
        model(ids(6, 8), **{CACHE_KW: cache})
        k = torch.randn(1, 2, 1, 16)
        cache.update(k, -k, 0)  # one layer of the next step: a forward under way (or cut short)
    _refused_unchanged(pool, cache, IncompleteForwardError, "copy.deepcopy.*cut short.*crop\\(-1\\)")
    cache.crop(-1)
    pool.truncate(cache.handles, [3])  # through the pool, behind the cache's back
    _refused_unchanged(pool, cache, RowsChangedError, "truncated through the pool")
    cache.crop(-3)
    twin = copy.deepcopy(cache)
    assert twin.get_seq_length() == 3
    cache.close()
    twin.close()
    assert pool.open_requests == 0


def test_a_copy_of_a_broken_cache_is_refused(model, monkeypatch):
    pool = kvpool.KVPool(2, 2, 4, dtype=torch.float32, page_size=4, num_slots=256, max_requests=3, max_context_len=64)
    cache = KVPoolCache(pool)
    with torch.no_grad():
        k = torch.randn(3, 2, 5, 4)
        for layer in range(2):
            cache.update(k, -k, layer)
    with monkeypatch.context() as m:
        m.setattr(kvpool.KVPool, "fork", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("injected")))
        with pytest.raises(RuntimeError, match="injected"):
            cache.reorder_cache(torch.tensor([0, 0, 1]))  # closed a row, then lost the fork: broken
    open_before = pool.open_requests
    with pytest.raises(IncompleteForwardError, match="copy.deepcopy.*reset\\(\\)"):
        copy.deepcopy(cache)
    assert pool.open_requests == open_before
    cache.close()
    assert copy.deepcopy(cache).handles is None and pool.open_requests == 0


def test_a_copy_the_pool_has_no_rows_for_is_refused_and_a_failed_fork_undone(model, monkeypatch):
    pool = pool_for_model(model, max_tokens=256, page_size=4, max_requests=3)
    prompt = ids(6, 9, 2)
    cache = KVPoolCache(pool)
    seq = greedy(model, prompt, None, 2, cache=cache).sequences  # a decode step inside a page: deferred
    deferred = cache.requests.deferred
    assert deferred > 0
    _refused_unchanged(pool, cache, TooManyRequestsError, "max_requests=3")
    assert cache.requests.deferred == deferred
    # A fork refused part-way (one row forked): the fork made is closed, the flush undone.
    real = kvpool.KVPool.fork
    calls = []

    def second_fails(self, h, n=1):
        calls.append(h)
        if len(calls) == 2:
            raise kvpool.PoolExhaustedError("injected")
        return real(self, h, n)

    big = pool_for_model(model, max_tokens=256, page_size=4, max_requests=8)
    c2 = KVPoolCache(big)
    greedy(model, prompt, None, 2, cache=c2)
    n = c2.requests.deferred
    with monkeypatch.context() as m:
        m.setattr(kvpool.KVPool, "fork", second_fails)
        _refused_unchanged(big, c2, kvpool.PoolExhaustedError, "injected")
    assert c2.requests.deferred == n
    for c, p in ((cache, pool), (c2, big)):  # both go on as if nothing happened
        full = torch.cat([seq, ids(3, 10, 2)], 1)
        want = greedy(model, full, None, NEW).sequences.tolist()
        twin = copy.deepcopy(c) if p is big else None
        assert greedy(model, full, None, NEW, cache=c).sequences.tolist() == want
        if twin is not None:
            assert greedy(model, full, None, NEW, cache=twin).sequences.tolist() == want
            twin.close()
        c.close()
        assert p.open_requests == 0
        p.check()


def test_a_copy_of_a_cache_opened_on_a_prefix_goes_on_and_publishes(model):
    pool = pool_for_model(model, max_tokens=512, page_size=4, max_requests=6)
    prompt = ids(12, 11)
    with KVPoolCache(pool, prefix_ids=prompt) as warm:
        greedy(model, prompt, None, 1, cache=warm)
    cache = KVPoolCache(pool, prefix_ids=prompt)
    assert cache.get_seq_length() == 8
    twin = copy.deepcopy(cache)
    assert twin.get_seq_length() == 8 and twin.cached_lens.tolist() == cache.cached_lens.tolist()
    want = greedy(model, prompt, None, NEW).sequences.tolist()
    for c in (twin, cache):
        assert greedy(model, prompt, None, NEW, cache=c).sequences.tolist() == want
        c.close()
    assert pool.open_requests == 0
    pool.check()


def test_shallow_copy_and_pickle_are_refused_typed():
    pool = kvpool.KVPool(2, 2, 4, dtype=torch.float32, page_size=4, num_slots=64, max_requests=2, max_context_len=32)
    cache = KVPoolCache(pool)
    with torch.no_grad():
        k = torch.randn(1, 2, 3, 4)
        for layer in range(2):
            cache.update(k, -k, layer)
    with pytest.raises(CopyRefusedError, match="copy.deepcopy\\(cache\\)") as e:
        copy.copy(cache)
    assert isinstance(e.value, TypeError) and isinstance(e.value, KVPoolError)
    # Python 3.13's copy.replace() makes a shallow copy too (called directly on older Pythons).
    with pytest.raises(CopyRefusedError, match="copy.deepcopy\\(cache\\)"):
        type(cache).__replace__(cache)
    with pytest.raises(TypeError, match="cannot pickle a KVPoolCache"):
        pickle.dumps(cache)
    assert pool.open_requests == 1
    cache.close()


@pytest.mark.parametrize("arch", ["gemma3", "qwen3_next"])
def test_hybrid_prompt_reuse_copies_windows_and_state(arch):
    model = tiny(arch)
    pool = pool_for_model(model, max_tokens=512, page_size=P, max_requests=12)
    start = counts(pool)
    prompt = ids(11, 21)
    suffixes = [ids(k, 22 + k) for k in (2, 5)]
    want, _ = reuse(model, lambda: DynamicCache(config=model.config), prompt, suffixes)
    got, caches = reuse(model, lambda: KVPoolCache(pool), prompt, suffixes)
    assert got == want
    assert all(type(c) is type(caches[0]) and c.pool is pool for c in caches) and type(caches[0]) is not KVPoolCache
    for c in caches:
        c.close()
    assert counts(pool) == start
    pool.check()


def test_hybrid_copy_without_rows_for_it_is_refused_unchanged():
    model = tiny("qwen3_next")
    pool = pool_for_model(model, max_tokens=256, page_size=P, max_requests=1)
    cache = KVPoolCache(pool)
    seq = greedy(model, ids(6, 30), None, 2, cache=cache).sequences
    _refused_unchanged(pool, cache, TooManyRequestsError, "max_requests=1")
    full = torch.cat([seq, ids(2, 31)], 1)
    assert greedy(model, full, None, 3, cache=cache).sequences.tolist() == greedy(model, full, None, 3).sequences.tolist()
    cache.close()
    assert pool.open_requests == 0


def test_a_change_through_the_pool_just_before_the_forks_is_refused_not_hidden(model, monkeypatch):
    # Another thread's pool.truncate of the rows after deepcopy's first check but before it takes
    # the pool's lock (simulated by the lock itself): the copy is refused, and the original still
    # sees the change at its next step, instead of both caches taking the truncated rows as whole.
    import contextlib

    import kvpool.integrations._cache_copy as cache_copy

    pool = pool_for_model(model, max_tokens=256, page_size=4, max_requests=4)
    cache = KVPoolCache(pool)
    with torch.no_grad():
        model(ids(6, 12), **{CACHE_KW: cache})
    real = cache_copy.pool_lock

    @contextlib.contextmanager
    def truncated_first(p):
        pool.truncate(cache.handles, [3])
        with real(p):
            yield

    monkeypatch.setattr(cache_copy, "pool_lock", truncated_first)
    open_before = pool.open_requests
    with pytest.raises(RowsChangedError, match="truncated through the pool"):
        copy.deepcopy(cache)
    monkeypatch.setattr(cache_copy, "pool_lock", real)
    assert pool.open_requests == open_before
    with pytest.raises(RowsChangedError, match="truncated through the pool"):
        copy.deepcopy(cache)
    cache.close()
    assert pool.open_requests == 0
    pool.check()
