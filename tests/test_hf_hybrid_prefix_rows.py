"""KVPoolCache(prefix_ids=) on a hybrid pool, on a batch whose rows hit different cached
prefixes.

Rows of a transformers cache share one length, so every row starts at the batch's
shortest hit (a sliding window takes back the cached pages it released, a linear-attention
state is restored from the checkpoint there), or at 0 when a row cannot go back to it.
Either way the rows recompute their own prompts: closing the cache must publish them in
every group (pages, windows, state checkpoints), as it would for each row alone, so that
a later request on either prompt hits all of it.
"""

from __future__ import annotations

import pytest
import torch
from _hf_hybrid_models import P, tiny
from _hf_models import VOCAB, greedy  # noqa: I001  (skips without transformers)
from transformers import DynamicCache

from kvpool.integrations.transformers import KVPoolCache, pool_for_model


def _hit(pool, prompt: torch.Tensor) -> int:
    with KVPoolCache(pool, prefix_ids=prompt) as cache:
        return int(cache.cached_lens[0])


@pytest.mark.parametrize(("arch", "served", "shared", "hits"), [
    # Row 0's window at 8 attends to a page its hit at 12 released: taken back from the cache.
    ("gemma3", [("p0", 12)], True, [12, 8]),
    # Checkpoints at 12 only: row 1 hits nothing, and row 0 goes back to the empty state.
    ("qwen3_next", [("p0", 12)], True, [12, 0]),
    # Checkpoints at 8 and 12: row 0 goes back to 8, its state restored from there.
    ("qwen3_next", [("p0", 8), ("p0", 12)], True, [12, 8]),
    # Row 1 is another prompt with a checkpoint at 4, which row 0's prompt has not: every
    # row starts at 0.
    ("qwen3_next", [("p0", 12), ("p1", 4)], False, [12, 4]),
])
def test_rows_cut_back_to_a_common_start_still_publish_their_prompts(arch, served, shared, hits):
    model = tiny(arch)
    g = torch.Generator().manual_seed(3)
    p0 = torch.randint(3, VOCAB, (1, 16), generator=g)
    p1 = torch.cat([p0[:, :8] if shared else torch.randint(3, VOCAB, (1, 8), generator=g),
                    torch.randint(3, VOCAB, (1, 8), generator=g)], 1)
    prompts = {"p0": p0, "p1": p1}
    probes = [torch.cat([p, torch.randint(3, VOCAB, (1, P), generator=g)], 1) for p in (p0, p1)]
    pool = pool_for_model(model, max_tokens=512, page_size=P, max_requests=4)
    fed: list[int] = []
    for name, n in served:
        with KVPoolCache(pool, prefix_ids=prompts[name][:, :n]) as cache:
            greedy(model, prompts[name][:, :n], None, 4, cache)
    assert _hit(pool, probes[0]) == 12

    batch = torch.cat([p0, p1])
    ref = greedy(model, batch, None, 4, DynamicCache(config=model.config))
    hook = model.model.embed_tokens.register_forward_hook(lambda m, i, o: fed.append(i[0].shape[1]))
    try:
        with KVPoolCache(pool, prefix_ids=batch) as cache:
            assert cache.cached_lens.tolist() == hits
            out = greedy(model, batch, None, 4, cache)
    finally:
        hook.remove()
    # The batch starts at the shortest hit when every row can go back to it, else at 0.
    assert fed[0] == 16 - (min(hits) if shared else 0)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    # Each row ran its whole prompt, so its 16 tokens are cached as if it had run alone.
    assert [_hit(pool, p) for p in probes] == [16, 16]
    pool.check()
    assert pool.open_requests == 0
