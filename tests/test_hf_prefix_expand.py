"""KVPoolCache(prefix_ids=[B, T]) under generate's batch expansion: beam search and
num_return_sequences repeat each input row k times (after the cache opened B rows on the
prefix), so the first forward has k x B rows. Before any forward the cache takes that as
batch_repeat_interleave(k): each row forks (sharing the hit's pages), and the tokens are
DynamicCache's. Any other batch is still refused, and the pool is as it was."""

from __future__ import annotations

import pytest
import torch
from _hf_hybrid_models import tiny
from _hf_models import PAD, VOCAB, tiny_model  # noqa: I001  (skips without transformers)

from kvpool.errors import TensorShapeError
from kvpool.integrations.transformers import KVPoolCache, pool_for_model

MODES = {"beams": dict(num_beams=2, do_sample=False), "samples": dict(do_sample=True, num_return_sequences=3)}


def _generate(model, ids, cache=None, **extra):
    kw = dict(max_new_tokens=5, min_new_tokens=5, pad_token_id=PAD, **extra)
    torch.manual_seed(1)
    return model.generate(ids, **kw) if cache is None else model.generate(ids, past_key_values=cache, **kw)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize(("arch", "page", "rows"), [("llama", 1, 1), ("llama", 16, 3), ("gemma3", 4, 2),
                                                    ("mistral", 4, 1)])
def test_a_prefix_cache_follows_generates_expansion(arch, page, rows, mode):
    model = tiny_model("llama") if arch == "llama" else tiny(arch)
    pool = pool_for_model(model, max_tokens=2048, page_size=page, max_context_len=64)
    ids = torch.randint(3, VOCAB, (rows, 21), generator=torch.Generator().manual_seed(5))
    ref = _generate(model, ids, **MODES[mode])
    hits = []
    for _ in range(2):  # a miss, then a hit on what the first run published
        with KVPoolCache(pool, prefix_ids=ids) as cache:
            hits.append(int(cache.cached_lens.min()))
            assert torch.equal(_generate(model, ids, cache, **MODES[mode]), ref)
        assert pool.open_requests == 0
    assert hits[0] == 0 and hits[1] > 0
    pool.check()


def test_a_batch_that_is_not_a_multiple_or_comes_later_is_still_refused():
    model = tiny_model("llama")
    pool = pool_for_model(model, max_tokens=1024, page_size=4, max_context_len=64)
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(6))
    with KVPoolCache(pool, prefix_ids=ids) as cache:
        before = (pool.free_pages, pool.open_requests)
        with pytest.raises(TensorShapeError, match="k times its rows"):
            _generate(model, torch.cat([ids, ids[:1]]), cache)  # 3 rows on 2
        assert (pool.free_pages, pool.open_requests) == before
    with KVPoolCache(pool, prefix_ids=ids) as cache:
        _generate(model, ids, cache)  # a forward ran: the rows are the batch's now
        with pytest.raises(TensorShapeError, match="this cache holds 2 pool requests"):
            _generate(model, ids.repeat_interleave(2, 0), cache)
    assert pool.open_requests == 0
    pool.check()
