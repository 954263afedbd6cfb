"""Outside check: the chunked-prefill engine of ``_chunked_engine.py`` on a hybrid pool
(``KVPool(layer_types=..., sliding_window=W)``) drives a real tiny Qwen2 model with sliding-window
layers (``use_sliding_window``; full-attention layers below ``max_window_layers``).

A prompt chunk of 3-7 tokens starts from a length whose window the sliding group must still
hold; each query attends to its own W tokens through that group's ``req_to_token[layer]`` row
(or its ``page_table``, which lists held pages only), and the engine asserts that none of them
reads the null page the group leaves where it released pages. Prefix hits, follow-up turns,
forks, a salted repeat and recompute preemption (a hybrid pool has no host tier) run as on
the plain pool, and the speculative variant truncates rejected drafts in every group. The
oracle: every token and its logits equal a cache-free forward of the model; check() and every
group's counters hold after every step, and every group is empty once the cache is cleared."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from _chunked_engine import ChunkedEngine, RewindingEngine, SpeculativeEngine, check_against_full_forward, one_thread, workload  # noqa: F401  (one_thread: an autouse fixture)
from _hf_models import VOCAB, transformers  # noqa: I001  (skips without transformers)

import kvpool

MAX_CHUNK = 7  # the engine's longest prompt chunk (a speculative step feeds at most 4 tokens)


def qwen_sliding(window: int, max_window_layers: int, layers: int = 3):
    """Qwen2 with ``use_sliding_window``: layers from ``max_window_layers`` on attend to the last
    ``window`` tokens (the token itself included). q/k/v biases are made to count."""
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, use_sliding_window=True, sliding_window=window, max_window_layers=max_window_layers,
        tie_word_embeddings=False, max_position_embeddings=256)
    with torch.inference_mode(False), torch.no_grad():
        torch.manual_seed(3)
        model = transformers.Qwen2ForCausalLM(cfg).eval()
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


class HybridMixin:
    """``ChunkedEngine`` on a ``HybridKVPool``: per-group tables, slots and page tables, the
    window in the mask, recompute instead of swap."""

    def pool_hit_step(self) -> int:
        self.types = self.model.config.layer_types
        self.window = self.model.config.sliding_window
        return math.lcm(*(self.pool.page_size_of(i) for i in range(len(self.types))))

    def group_key(self, layer: int) -> int:
        return self.pool.group_of_layer[layer]

    def new_slots(self, res, layer: int) -> torch.Tensor:
        return res.for_layer(layer)

    def mask(self, layer: int, pos: torch.Tensor, width: int) -> torch.Tensor:
        cols = torch.arange(width)[None]
        mask = cols <= pos[:, None]
        if self.types[layer] == "sliding_attention":
            mask &= cols > pos[:, None] - self.window
        return mask

    def kv_index(self, plan, layer: int) -> torch.Tensor:
        pool, ps, sliding = self.pool, self.pool.page_size_of(layer), self.types[layer] == "sliding_attention"
        lens = [start + len(ids) for _, start, ids in plan]
        handles = [r.handle for r, _, _ in plan]
        assert (pool.lengths(handles) == np.asarray(lens)).all()
        if self.read == "table":
            rows = torch.as_tensor(pool.rows(handles))
            idx = pool.req_to_token[layer][rows, :max(lens)].long()
            for b, n in enumerate(lens):  # released positions too: the null page's slots, as slots() says
                assert (idx[b, :n].numpy() == pool.slots(handles[b], layer)).all(), f"layer {layer}: row != slots"
        else:
            pt = pool.page_table(handles, layer)
            idx = torch.full((len(plan), max(lens)), -1, dtype=torch.long)
            for b, n in enumerate(lens):
                pages = pt.kv_indices[pt.kv_indptr[b]:pt.kv_indptr[b + 1]].long()
                first = -(-n // ps) - len(pages)  # held pages are the request's last ones
                assert first == 0 or sliding
                idx[b, first * ps:n] = (pages[:, None] * ps + torch.arange(ps)).flatten()[:n - first * ps]
                assert (idx[b, first * ps:n].numpy() == pool.slots(handles[b], layer)[first * ps:n]).all()
        # Every position a query of this step reads is held: never the null page (page 0).
        for b, (_, start, ids) in enumerate(plan):
            lo = max(0, start - self.window + 1) if sliding else 0
            assert (idx[b, lo:start + len(ids)] >= ps).all(), f"layer {layer}: a read position is not held"
        return idx

    def preempt(self, r) -> None:
        self.running.remove(r)
        self.pool.close([r.handle], cache=True)
        self.recompute(r)
        self.counts["recomputed"] += 1

    def check_invariants(self) -> None:
        pool = self.pool
        pool.check()
        assert pool.open_requests == len(self.running)
        if self.running:
            want = np.asarray([r.length for r in self.running])
            assert (pool.lengths([r.handle for r in self.running]) == want).all()
        for layer, kind in enumerate(self.types):
            assert pool.free_pages(layer) + pool.used_pages(layer) == pool.capacity_pages(layer), layer
            if kind == "sliding_attention":  # the window before a chunk's start, and the chunk
                ps = pool.page_size_of(layer)
                most = (-(-(self.window - 1 + MAX_CHUNK) // ps) + 1) * ps
                assert all(pool.held_tokens(r.handle, layer) <= most for r in self.running)


class HybridEngine(HybridMixin, ChunkedEngine):
    pass


class HybridSpeculativeEngine(HybridMixin, SpeculativeEngine):
    pass


class HybridRewindingEngine(HybridMixin, RewindingEngine):
    pass


def check_drained_hybrid(pool, layers: int) -> None:
    assert pool.open_requests == 0
    pool.clear_cache()
    pool.check()
    for layer in range(layers):
        assert pool.used_pages(layer) == 0 and pool.cached_pages(layer) == 0
        assert pool.free_pages(layer) == pool.capacity_pages(layer)


CONFIGS = [  # window, max_window_layers, page size, layout, read path, full group's pages, max running
    (6, 1, 4, "paged", "table", 22, 5),  # full, sliding, sliding; pages run out (recompute)
    (5, 0, 1, "token", "page_table", 60, 6),  # every layer sliding: a token-only anchor chain
    (8, 2, {"full_attention": 2, "sliding_attention": 4}, "token", "page_table", 40, 5),  # hits in steps of 4; recompute
]


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
@pytest.mark.parametrize("window,mwl,ps,layout,read,num_pages,max_running", CONFIGS,
                         ids=[f"w{c[0]}-mwl{c[1]}-p{c[2] if isinstance(c[2], int) else '2+4'}" for c in CONFIGS])
def test_hybrid_chunked_engine_matches_full_forward(window, mwl, ps, layout, read, num_pages, max_running,
                                                    speculative):
    model = qwen_sliding(window, mwl)
    types = model.config.layer_types
    with torch.inference_mode() if speculative else torch.no_grad():
        pool = kvpool.KVPool(len(types), 2, 16, dtype=torch.float32, page_size=ps, num_pages=num_pages, layout=layout,
                             max_requests=24, max_context_len=128, layer_types=types, sliding_window=window,
                             hash_seed=11)
        cls = HybridSpeculativeEngine if speculative else HybridEngine
        engine = cls(model, pool, read, seed=window, max_running=max_running)
        reqs = workload(seed=5)
        engine.run(reqs, max_steps=600)
        done = engine.finished
        assert {r.rid for r in reqs} <= {r.rid for r in done}
        for r in done:
            assert len(r.out) == r.max_new
            check_against_full_forward(model, r)
        c = engine.counts
        assert c["forks"] == 2 and c["mixed_steps"] > 0 and pool.hit_tokens > 0, c
        assert [r.cached for r in done if r.salt == 1] == [0]
        follow = [r for r in done if r.parent is not None]
        assert any(r.cached > len(r.parent.prompt) for r in follow), [(r.cached, len(r.parent.prompt)) for r in follow]
        assert (c["recomputed"] > 0) == (window != 5), c
        if speculative:
            assert c["truncated"] > 0 and c["probes"] > 0, c
        check_drained_hybrid(pool, len(types))


@pytest.mark.parametrize("window,mwl,ps", [(6, 1, 2), (4, 0, 1)], ids=["full+sliding", "all-sliding"])
def test_hybrid_rewinding_engine_matches_full_forward(window, mwl, ps):
    model = qwen_sliding(window, mwl)
    types = model.config.layer_types
    with torch.inference_mode():
        pool = kvpool.KVPool(len(types), 2, 16, dtype=torch.float32, page_size=ps, num_pages=90 // ps, layout="token",
                             max_requests=40, max_context_len=160, layer_types=types, sliding_window=window,
                             hash_seed=11)
        pool._tables_np = None  # the device path of the table updates (and of the nulls where windows released)
        engine = HybridRewindingEngine(model, pool, "table", seed=window, max_running=5)
        engine.run(workload(seed=7), max_steps=900)
        for r in engine.finished:
            assert len(r.out) == r.max_new
            check_against_full_forward(model, r)
        assert engine.counts["rewinds"] > 0 and engine.counts["forks"] == 2, engine.counts
        check_drained_hybrid(pool, len(types))
