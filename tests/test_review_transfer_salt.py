"""A request moved between pools keeps its salt (tenant, LoRA) even when it has no chain.

The handshake carried the salt only inside the chain (the request's leading full pages of
known tokens). A request with none (an empty one: `open_with_prefix` of a prompt nothing
was cached for; or one shorter than a page, or whose tokens the sender was never told)
arrived with salt 0. The destination engine then prefills it for its tenant, and `cache()`
registered that K/V under salt 0: a salt-0 prompt with the same tokens hit another
tenant's K/V, and the tenant's own prompt missed. The header now carries the salt.
"""

from __future__ import annotations

import _dist
import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="torch.distributed with gloo is not available")

SALT = 7


def _pool_class(old_receiver: bool):
    import kvpool

    if not old_receiver:
        return kvpool.KVPool

    class OldReceiver(kvpool.KVPool):
        """A receiver whose open_with_chain_hashes has no length= (opened, then extended)."""

        def open_with_chain_hashes(self, hashes, tokens, salt=None, max_pages=None):
            return super().open_with_chain_hashes(hashes, tokens, salt, max_pages)

    return OldReceiver


def _moved_then_cached(rank: int, world: int, page: int, sent: int, cut_to_zero: bool,
                       old_receiver: bool = False) -> dict:
    """Rank 0 sends a salted request of ``sent`` tokens (no chain: fewer than a page, or
    none); rank 1 fills it to a prompt for the same tenant, caches it, and says which salt
    the prompt hits under."""
    import numpy as np

    from kvpool.distributed import recv_request, send_request

    pool = _pool_class(old_receiver and rank == 1)(1, 1, 2, dtype=torch.float32, page_size=page, num_pages=16,
                                                   max_requests=4, max_context_len=64, hash_seed=1)
    prompt = list(range(1, 2 * page + 2))
    if rank == 0:
        hs, cached = pool.open_with_prefix(prompt, [len(prompt)], [SALT])  # nothing cached: length 0
        assert int(cached[0]) == 0
        if sent:
            pool.extend(hs, sent)  # tokens not told: no chain page
        send_request(pool, int(hs[0]), 1)
        return {}
    h = recv_request(pool, 0)
    assert pool.length(h) == sent
    if cut_to_zero:
        pool.truncate([h], [0])  # the engine recomputes it from the start, for the same tenant
    n = pool.length(h)
    pool.extend([h], [len(prompt) - n], tokens=prompt[n:])
    pool.close([h], cache=True)
    pool.check()
    hits = {}
    for salt in (0, SALT):
        hs, cached = pool.open_with_prefix(np.array(prompt + [0]), [len(prompt) + 1], [salt])
        hits[salt] = int(cached[0])
        pool.close(hs)
    pool.check()
    return hits


@pytest.mark.parametrize("page,sent,cut", [(1, 0, False), (16, 0, False), (16, 5, True), (2, 1, True)],
                         ids=["p1-empty", "p16-empty", "p16-short-recomputed", "p2-short-recomputed"])
def test_a_request_sent_without_a_chain_keeps_its_salt(page, sent, cut):
    _, hits = _dist.run_ranks(_moved_then_cached, world=2, timeout_s=120, page=page, sent=sent, cut_to_zero=cut)
    full = (2 * page + 1) // page * page  # the cached prompt's full pages
    assert hits[0] == 0, f"a salt-0 prompt hit {hits[0]} tokens of tenant {SALT}'s K/V"
    assert hits[SALT] == full, f"the tenant's own prompt hit {hits[SALT]} tokens, not {full}"


@pytest.mark.parametrize("sent", [0, 5], ids=["empty", "short"])
def test_a_receiver_without_the_atomic_open_keeps_the_salt_too(sent):
    """The receiver's other path: an open_with_chain_hashes with no
    length= opens the salted request with the empty chain, then extends it."""
    _, hits = _dist.run_ranks(_moved_then_cached, world=2, timeout_s=120, page=16, sent=sent, cut_to_zero=True,
                              old_receiver=True)
    assert hits == {0: 0, SALT: 32}, hits
