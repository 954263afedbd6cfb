"""Outside-style sweep s82: a hybrid KVPoolCache whose rows another thread closes while the cache
writes its linear-attention states back.

A linear-attention layer whose rows' state slots are not consecutive works on a copy of their
states and writes it back to the pool's state rows (``flush``: before the next step's extend, at
``close``). The cache first checks that no pool call closed its rows (``check_edits``), then
writes. Another thread closing the rows between the two, and a new batch opened on the freed
state slots, had those slots overwritten by the closed cache's states: another request's state
silently corrupted. The check and the writes now hold the pool's lock, as the plain cache's
flush does; the other thread's close waits, and the cache's next step is refused with
``InvalidHandleError``.
"""

from __future__ import annotations

import threading

import pytest
import torch
from _hf_hybrid_models import P, tiny
from _hf_models import VOCAB, greedy  # noqa: I001  (skips without transformers)
from _thread_window import start_at_call

import kvpool
from kvpool.integrations.transformers import KVPoolCache, pool_for_model

JOIN_S = 60.0
STATE_LAYER = 0  # Qwen3-Next's first layer is linear attention
MARK = 7.0


@pytest.fixture(scope="module")
def model():
    return tiny("qwen3_next")


def test_rows_closed_by_another_thread_during_the_state_write_back_leave_new_rows_states_alone(model):
    g = torch.Generator().manual_seed(5)
    p = torch.randint(3, VOCAB, (2, 2 * P + 2), generator=g)
    pool = pool_for_model(model, max_tokens=256, page_size=P, max_requests=8)
    # Rows whose state slots are not consecutive: the layer works on a copy and writes it back.
    pre = pool.open(3)
    pool.extend(pre, 1)
    pool.close(pre[1:2])
    new: list = []
    threads: list[threading.Thread] = []

    def other(handles):
        # Another thread: the cache's rows closed (an abort) and a new batch admitted, which
        # takes their state slots and writes its own states there.
        pool.close(handles)
        kids = pool.open(2)
        pool.extend(kids, 1)
        slots = pool.state_slots(kids, STATE_LAYER)
        pool.state(STATE_LAYER, "recurrent")[torch.as_tensor(slots)] = MARK
        new.append((kids, slots))

    cache = KVPoolCache(pool)
    layer_cls = type(cache.requests.state_layers[0])
    real = layer_cls.flush
    mine: list = []

    def hooked(self):
        # After the cache's edit check, before its write-back: the window another thread's close
        # would fall in. With the fix the other thread waits for the pool's lock (the join times out).
        if self._work and not threads and self.layer_idx == STATE_LAYER:
            mine.append(self._slots.tolist())
            t = threading.Thread(target=other, args=(cache.requests.handles.copy(),), daemon=True)
            t.start()
            threads.append(t)
            t.join(0.5)  # (not an assertion: either order of the two threads is valid)
        return real(self)

    layer_cls.flush = hooked
    try:
        with pytest.raises(kvpool.errors.InvalidHandleError):
            greedy(model, p, None, 4, cache=cache)  # the write-back's step is refused
        cache.close()
    finally:
        layer_cls.flush = real
    for t in threads:
        t.join(JOIN_S)
        assert not t.is_alive()
    assert threads, "the state layer never wrote a working copy back"
    assert new, "the other thread's close found the rows closed"
    kids, slots = new[0]
    assert set(slots.tolist()) & set(mine[0]), "the new batch took other state slots: nothing was at risk"
    states = pool.state(STATE_LAYER, "recurrent")[torch.as_tensor(slots)]
    assert bool((states == MARK).all()), "the closed cache's write-back overwrote the new batch's states"
    pool.close(kids)
    pool.close(pre[[0, 2]])
    pool.check()
    assert pool.open_requests == 0


@pytest.mark.parametrize("arch", ["gemma3", "qwen3_next"])
@pytest.mark.parametrize("edit", ["truncate", "close"])
@pytest.mark.parametrize("at_call", [2, 5, 8])  # (8: the last step's extend)
def test_a_truncate_or_close_by_another_thread_before_the_step_extends_is_refused_or_lands_after(arch, edit, at_call):
    """As the plain cache's step (tests/test_review_threads_hf.py): a truncate or close of the rows
    by another thread between the hybrid step's edit check and its extend is refused typed at the
    next step, or waits for the step; the step never extends rows whose length it no longer knows."""
    model = tiny(arch)
    g = torch.Generator().manual_seed(9)
    p = torch.randint(3, VOCAB, (1, 2 * P + 3), generator=g)
    with torch.inference_mode():
        ref = greedy(model, p, None, 8).sequences
    pool = pool_for_model(model, max_tokens=256, page_size=P, max_requests=4)
    done: list = []

    def other():
        h = cache.requests.handles
        try:
            if edit == "truncate":  # (to a page start: a linear-attention model's checkpoints are there)
                pool.truncate(h, [max(P, (int(pool.lengths(h)[0]) - 1) // P * P)])
            else:
                pool.close(h)
        except kvpool.errors.KVPoolError as e:  # refused by the pool, nothing changed (no checkpoint there)
            done.append(e)
        else:
            done.append(edit)

    out = None
    with torch.inference_mode(), KVPoolCache(pool) as cache:
        started = start_at_call(pool, at_call, other)
        try:
            out = greedy(model, p, None, 8, cache=cache).sequences
        except kvpool.errors.KVPoolError:
            pass
        for t, _ in started:
            t.join(JOIN_S)
            assert not t.is_alive()
    assert done, "the hook never ran"
    # Before the fix the edit landed in the window and the step extended rows whose length it no
    # longer knew (its attention then read a context the pool no longer had: silently wrong logits).
    assert all(waited for _, waited in started), "another thread's edit landed between the step's check and extend"
    if out is not None:
        assert torch.equal(out, ref), (out, ref)
    del pool.extend
    pool.check()
    assert pool.open_requests == 0
