"""Every refusal of the torch pool leaves it exactly as it was: a hypothesis state
machine over ``kvpool.KVPool`` on the CPU (token and paged layouts, page size 1
and 16, float32 and float8_e4m3fn, two of them with a host tier, prefix caching on,
pools small enough to evict), against a twin.

Two pools built alike (same seeds, a manual clock) take every valid call (open,
admit, extend with K/V written for every new slot, open_with_prefix, fork,
truncate, cache, close with and without caching, evict, reads, gather_kv, page
tables) and their answers must agree. K/V values are derived from (request,
position, layer), so a row stored in the wrong slot shows. Between valid calls
the subject alone takes a bad call from tests/pool_refusal_catalogue.py, under a
drawn grad mode; it must raise a kvpool error (never a PanicException or a bare
TypeError / RuntimeError / IndexError), and afterwards subject and twin must
agree on: stats(), check(), every live request's length, slots, pages, known
tokens and row, the CSR page table, the queued copies, every tensor the pool owns
byte for byte (K/V caches, req_to_token, fp8 scales; compared as uint8 with
torch.equal), and the pending KV events.

Two more kinds of call give the subject an unusual but possibly valid form, and the
twin the plain one: rows that are non-contiguous, overlapping, require grad or are
inference tensors; a handle, count or slot whose ``__index__`` answers once or twice
and then raises (read once, it is the plain call). The subject must either refuse
as above, changing nothing, or end up exactly as the twin.
"""

from __future__ import annotations

import pytest
from _pool_refusal_machine import CONFIGS, PoolRefusalMachine
from _pool_refusal_runs import prepared, run_machine, sweep


def test_pool_refusals_leave_the_pool_as_it_was():
    run_machine(PoolRefusalMachine)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.layout}-p{c.ps}-{str(c.dtype).split('.')[-1]}"
                                                 + ("-host" if c.host_pages else ""))
def test_every_pool_catalogue_entry_is_refused_and_changes_nothing(cfg):
    """Each entry once, from a state where it applies, against the first and then the
    last live handle, each time under another grad mode."""
    sweep(lambda: prepared(cfg))
