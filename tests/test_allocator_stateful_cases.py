"""Shrunk cases the Hypothesis state machine (test_allocator_stateful.py) once found,
replayed step by step so CI never depends on Hypothesis finding them again. Each
step runs on the allocator and the model alike, and the machine's invariant (every
query and counter agrees, check() passes) runs after each step, as in the machine."""

import pytest
from allocator_machine_calls import BASES, run_both
from test_allocator_stateful import AllocatorMachine


def machine(drain_always, **setup):
    m = AllocatorMachine()
    m.setup(drain_always=drain_always, **setup)
    m.agrees_with_model()
    return m


def step(m, a_call, m_call):
    r = run_both(a_call, m_call)
    m.agrees_with_model()
    return r


@pytest.mark.parametrize("drain_always", [False, True])
def test_chain_through_evicted_duplicate_restarts_and_revives_ghost(drain_always):
    """A request whose chain has a duplicate inside it (not at its tip) restarts at its
    next cache() once the duplicated entry was evicted (docs/allocator.md, duplicates:
    "the same holds for a duplicate inside the chain"), and its recomputed page takes
    the entry's ghost back, so the page it had filed under the entry serves again.

    twice(3): the second request recomputes page 2 (a duplicate of the first's), then
    extends and files page 3 under the first's entry for page 2. twice(2): its extend
    evicts that entry, which has a child, so it leaves a ghost. cache() of the second
    request of twice(3): its tip (page 3's entry) is live, but the chain walked from page
    0 stops at its unregistered duplicate, so it restarts after page 1: page 2 is
    registered under the ghost's id and page 3's entry chains again (4 cached pages,
    all held). The model used to restart only on a gone tip and counted 3."""
    m = machine(drain_always, num_pages=6, ps=1, host_pages=0, policy="write_back", max_pinned=0)
    m.twice(base=0, length=3, evict=0, more=1)
    m.agrees_with_model()
    m.twice(base=0, length=2, evict=0, more=1)
    m.agrees_with_model()
    second = m.issued[4]  # after the setup's three: the first twice's first, then second
    assert m.a.length(second) == 4 and m.m.reqs[m.m.row(second)].known() == BASES[0][:3] + [0]
    assert m.a.stats().cached_pages == 3
    m.drain()
    step(m, lambda: m.a.cache([second]), lambda: m.m.cache([second]))
    s = m.a.stats()
    assert (s.evictable_pages, s.cached_pages) == (0, 4)
    # The whole chain serves: a prompt extending the second's four tokens hits all four.
    prompt = m.m.reqs[m.m.row(second)].known() + [1]
    r = step(m, lambda: m.a.open_with_prefix(prompt, [len(prompt)]), lambda: m.m.open_with_prefix([prompt], 0))
    assert r and int(r[0][1][0]) == 4
