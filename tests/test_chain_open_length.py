"""``open_with_chain_hashes(..., length=)``: open on a chain's cached pages and extend to
``length`` in one atomic call, and kv_transfer's receiver using it.

The receiving pool below has 4 pages of room and no FREE page: prompt A's two cached
pages (the oldest) and prompt B's two. A request whose chain matches A's pages and
needs 3 more pages passes a ``free_pages`` check (3 <= 4), but once A's pages are held
only B's 2 are left. The call must be refused with nothing changed: the same counters,
and the next allocation evicts the same pages (an open that was closed again would
have moved A's pages to the newest end of the eviction order).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import kvpool
from kvpool.distributed import kv_receive

sys.path.insert(0, str(Path(__file__).parent))
import _dist  # noqa: E402
from _dist_chain_room import PROMPT_A, REST, assert_as_never_called, chain, make_pool, receiver, transfer  # noqa: E402


def test_refused_when_the_only_room_is_the_matched_pages_own():
    pool = receiver()
    hashes, tokens, salt = chain()
    with pytest.raises(kvpool.PoolExhaustedError, match="needs 3 free pages .* only 2"):
        pool.open_with_chain_hashes(hashes, tokens, salt, length=17)
    assert_as_never_called(pool)


def test_transfer_open_is_refused_and_keeps_eviction_order():
    """kv_transfer's receiver: a free_pages check passes, the atomic open refuses."""
    pool = receiver()
    ch = chain()
    cached = kv_receive._prefix_match(pool, ch, 5)
    assert cached == 2 and 5 - cached <= pool.free_pages
    with pytest.raises(kvpool.PoolExhaustedError):
        kv_receive._open(pool, ch, cached, 20)
    assert_as_never_called(pool)


def test_fits_exactly_in_what_is_left_after_the_hold():
    pool = receiver()
    hashes, tokens, salt = chain()
    a_slots = np.arange(4, 12)  # A's pages 1 and 2
    h = kv_receive._open(pool, (hashes, tokens, salt), 2, 16)
    assert pool.length(h) == 16 and pool.free_pages == 0
    slots = pool.slots(h)
    np.testing.assert_array_equal(slots[:8], a_slots)
    row = pool.rows([h])[0]
    np.testing.assert_array_equal(pool.req_to_token[row, :16].numpy(), slots)
    np.testing.assert_array_equal(pool.known_tokens(h)[:16], np.concatenate([PROMPT_A, REST[:8]]))
    pool.close([h], cache=True)  # the received pages can be registered
    assert pool.cached_pages == 4
    pool.check()


def test_without_length_the_call_is_as_before():
    pool = receiver()
    hashes, tokens, salt = chain()
    h = pool.open_with_chain_hashes(hashes, tokens, salt)
    assert pool.length(h) == 8 and pool.free_pages == 2
    pool.check()


@pytest.mark.parametrize("length, error, text", [
    (-1, kvpool.InvalidArgumentError, r"\[8, 64\]"),
    (7, kvpool.InvalidArgumentError, r"\[8, 64\]"),
    (65, kvpool.ContextTooLongError, "max_context_len=64"),
    ("8", kvpool.InvalidArgumentError, "length"),
])
def test_bad_lengths_are_typed_errors_and_change_nothing(length, error, text):
    pool = receiver()
    hashes, tokens, salt = chain()
    with pytest.raises(error, match=text):
        pool.open_with_chain_hashes(hashes, tokens, salt, length=length)
    assert_as_never_called(pool)


def test_max_pages_caps_the_match_and_the_range():
    pool = receiver()
    hashes, tokens, salt = chain()
    with pytest.raises(kvpool.InvalidArgumentError, match=r"\[4, 64\]"):
        pool.open_with_chain_hashes(hashes, tokens, salt, max_pages=1, length=3)
    h = pool.open_with_chain_hashes(hashes, tokens, salt, max_pages=1, length=5)
    assert pool.length(h) == 5 and pool.free_pages == 2  # 1 matched page held, 1 new
    pool.check()


def test_the_tp_proxy_shows_the_length_parameter():
    """recv_request through a TPPool takes the atomic path: the proxy's recorded call
    shows the wrapped method's signature."""
    from kvpool.distributed.tp import TPPool

    proxy = TPPool.__new__(TPPool)
    call = proxy._recorded("open_with_chain_hashes", make_pool().open_with_chain_hashes)
    assert kv_receive._takes_length(call)


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="torch.distributed with gloo is not available")
def test_recv_request_refuses_without_reordering_then_fits_exactly():
    """Two gloo ranks: the receiver refuses the 20-token request (its sender hears
    "exhausted") and is as if it never saw it; the 16-token one then fits exactly and
    only its 2 uncached pages move."""
    sender, got = _dist.run_ranks(transfer, world=2, timeout_s=120)
    assert sender[20] == "exhausted"
    assert "needs 3 free pages" in got[20] and "only 2" in got[20], got[20]
    assert sender[16] == (4, 2)
    assert got[16] == (16, 0)
    k, v = got[(16, "kv")]
    k0, v0 = sender[(16, "kv")]
    assert torch.equal(k, k0) and torch.equal(v, v0)
