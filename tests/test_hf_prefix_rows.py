"""KVPoolCache(prefix_ids=) on a batch whose rows hit different cached prefixes.

Rows of a transformers cache share one length, so every row starts at the shortest hit
and the longer rows recompute the tokens past it. Those tokens are still their prompt's:
closing the cache must publish them (and the rest of the prompt) as it would for the
row alone, so that a later request hits them.
"""

from __future__ import annotations

import pytest
import torch
from _hf_models import greedy, tiny_model  # noqa: I001  (skips without transformers)

from kvpool.integrations.transformers import KVPoolCache, pool_for_model

PAGE = 4


@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tiny_model("llama")
    torch.set_num_threads(threads)


def _hit(pool, prompt: torch.Tensor) -> int:
    with KVPoolCache(pool, prefix_ids=prompt) as cache:
        return int(cache.cached_lens[0])


def test_rows_cut_back_to_the_shortest_hit_still_publish_their_prompts(model):
    """Row 0's first three pages are cached, row 1 shares only two: row 0 recomputes its
    third page and computes its fourth, and closing publishes both, as row 0 alone would."""
    g = torch.Generator().manual_seed(3)
    p0 = torch.randint(3, 90, (1, 16), generator=g)
    p1 = torch.cat([p0[:, :8], torch.randint(3, 90, (1, 8), generator=g)], 1)
    probe = torch.cat([p0, torch.randint(3, 90, (1, PAGE), generator=g)], 1)  # can hit all of p0
    pool = pool_for_model(model, max_tokens=1024, page_size=PAGE, max_context_len=64)
    with KVPoolCache(pool, prefix_ids=p0[:, :12]) as cache:
        greedy(model, p0[:, :12], None, 4, cache=cache)
    assert _hit(pool, probe) == 12

    batch = torch.cat([p0, p1])
    ref = greedy(model, batch, None, 4)
    with KVPoolCache(pool, prefix_ids=batch) as cache:
        # The rows hit differently, so row 0 starts at row 1's hit and recomputes a page.
        assert cache.cached_lens.tolist() == [12, 8]
        out = greedy(model, batch, None, 4, cache=cache)
    assert torch.equal(out.sequences, ref.sequences)
    # Row 0 ran its whole prompt, so its 16 tokens are cached as if it had run alone.
    assert _hit(pool, probe) == 16
    pool.allocator.check()
    assert pool.allocator.open_requests == 0
