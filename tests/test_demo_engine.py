"""The demo engine's decode through the pool gives the same logits as a cache-free forward.

Every request's logits from prefill + step-by-step decode (K/V stored with pool.write,
read back through req_to_token) must match the full forward pass over the same tokens,
while other requests are admitted and released around it, so slots get reused.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import kvpool
from kvpool.demo.engine import DecodeStep, Engine
from kvpool.demo.model import ModelConfig, build_model
from kvpool.demo.requests import synthetic_requests

CFG = ModelConfig(vocab_size=96, hidden=32, layers=2, heads=4, kv_heads=2, max_positions=64, seed=3)
ATOL, RTOL = 1e-5, 1e-4


@pytest.fixture(scope="module")
def model():
    return build_model(CFG)


def make_pool(page_size: int, pool_tokens: int, layout: str = "token", max_requests: int = 4):
    return kvpool.KVPool(CFG.layers, CFG.kv_heads, CFG.head_dim, dtype=torch.float32,
                         page_size=page_size, num_pages=-(-pool_tokens // page_size) + 1,
                         max_requests=max_requests, max_context_len=64, layout=layout)


def serve(model, pool, *, n=10, max_running=3, admission="reserve", use_cuda_graph=False, seed=1,
          prompt_len=(2, 20), output_len=(1, 14)):
    reqs = synthetic_requests(n, vocab_size=CFG.vocab_size, prompt_len=prompt_len,
                              output_len=output_len, seed=seed)
    engine = Engine(model, pool, max_running=max_running, admission=admission,
                    use_cuda_graph=use_cuda_graph, record=True)
    with torch.inference_mode():
        stats = engine.run(reqs)
    return reqs, stats


def assert_matches_reference(model, reqs):
    for r in reqs:
        tokens = r.all_tokens()
        assert len(r.output) == r.max_new_tokens
        got = torch.cat(r.logits)  # prefill rows then one row per decode step
        assert got.shape == (len(tokens), CFG.vocab_size), r.rid
        with torch.inference_mode():
            ref = model.forward_full(tokens)
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL, msg=lambda m: f"request {r.rid}: {m}")
        # Greedy decoding: each generated token is the argmax of the reference logits.
        assert r.output == ref[len(r.prompt) - 1 :].argmax(-1).tolist()


def assert_slots_reused(reqs):
    pairs = [(a.rid, b.rid) for a, b in itertools.combinations(reqs, 2) if a.slots_seen & b.slots_seen]
    assert pairs, "no slot was ever held by two requests: the test did not exercise reuse"


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", ["token", "paged"])
def test_pool_decode_matches_full_forward(model, page_size, layout):
    # A pool of 48 tokens holds at most two requests of up to 33 tokens (the longest
    # fits alone), so admission must wait for room and slots are handed out again.
    pool = make_pool(page_size, pool_tokens=48, layout=layout)
    reqs, stats = serve(model, pool, max_running=4)
    assert stats.requests_done == len(reqs)
    assert stats.preemptions == 0
    assert stats.steps_blocked_by_pool > 0, "pool was never full: admission control untested"
    assert_matches_reference(model, reqs)
    assert_slots_reused(reqs)
    assert pool.allocator.used_pages == 0 and pool.allocator.open_requests == 0
    pool.allocator.check()


def test_optimistic_admission_preempts_and_recomputes(model):
    # Admitting on prompt length alone overcommits a small pool; the engine must catch
    # PoolExhaustedError, preempt, and still produce exactly the reference logits.
    pool = make_pool(1, pool_tokens=48)
    reqs, stats = serve(model, pool, n=10, max_running=4, admission="optimistic", seed=5,
                        prompt_len=(2, 8), output_len=(10, 30))
    assert stats.preemptions > 0
    assert stats.requests_done == len(reqs)
    assert_matches_reference(model, reqs)
    assert pool.allocator.used_pages == 0
    pool.allocator.check()


def test_decode_graph_runner_path_matches(model):
    # On CPU DecodeGraphRunner runs the step eagerly, with padded batches and the
    # whole-table gather width a captured graph uses.
    pool = make_pool(16, pool_tokens=96)
    reqs, stats = serve(model, pool, use_cuda_graph=True)
    assert stats.requests_done == len(reqs)
    assert_matches_reference(model, reqs)


def test_padded_rows_do_not_disturb_real_ones(model):
    # A batch padded the way a graph runner pads it (null row, slot 0) gives the same
    # logits for the real rows and finite logits for the padding.
    pool = make_pool(16, pool_tokens=64)
    step = DecodeStep(model, pool)
    with torch.inference_mode():
        h = pool.open(1)
        prompt = torch.arange(5) % CFG.vocab_size
        ext = pool.extend(h, 5)
        model.forward_pool(pool, prompt[None], torch.arange(5)[None],
                           torch.tensor(pool.rows(h)), ext.out_cache_loc, 5)
        ext = pool.extend(h, 1)
        row = int(pool.rows(h)[0])
        alone = step(torch.tensor([7]), torch.tensor([5]), torch.tensor([row]),
                     ext.out_cache_loc, torch.tensor([6]))
        padded = step(torch.tensor([7, 0, 0]), torch.tensor([5, 0, 0]),
                      torch.tensor([row, pool.null_row, pool.null_row]),
                      torch.cat([ext.out_cache_loc, torch.zeros(2, dtype=torch.int64)]),
                      torch.tensor([6, 0, 0]))
    torch.testing.assert_close(padded[:1], alone, atol=ATOL, rtol=RTOL)
    assert torch.isfinite(padded).all()
    full = model.forward_full(torch.cat([prompt, torch.tensor([7])]))
    torch.testing.assert_close(alone[0], full[-1], atol=ATOL, rtol=RTOL)


def test_request_too_large_for_pool_is_rejected_before_running(model):
    pool = make_pool(16, pool_tokens=32)
    reqs = synthetic_requests(2, vocab_size=CFG.vocab_size, prompt_len=(40, 40),
                              output_len=(4, 4), seed=0)
    engine = Engine(model, pool, max_running=2)
    with pytest.raises(ValueError, match="enlarge the pool"):
        engine.run(reqs)
    assert pool.allocator.open_requests == 0


def test_model_weights_are_normal_tensors_under_inference_mode():
    with torch.inference_mode():
        m = build_model(CFG)
    for name, t in itertools.chain(m.named_parameters(), m.named_buffers()):
        assert not t.is_inference(), name
        assert not t.requires_grad, name
    # Same seed, same weights, whatever the mode.
    m2 = build_model(CFG)
    for (n1, a), (_, b) in zip(m.named_parameters(), m2.named_parameters()):
        assert torch.equal(a, b), n1


def test_synthetic_requests_are_seeded_and_in_range():
    a = synthetic_requests(20, vocab_size=50, prompt_len=(3, 9), output_len=(2, 5), seed=4)
    b = synthetic_requests(20, vocab_size=50, prompt_len=(3, 9), output_len=(2, 5), seed=4)
    assert [r.prompt.tolist() for r in a] == [r.prompt.tolist() for r in b]
    assert all(3 <= len(r.prompt) <= 9 and 2 <= r.max_new_tokens <= 5 for r in a)
    assert all(int(np.max(r.prompt)) < 50 for r in a)
    with pytest.raises(ValueError, match="prompt_len"):
        synthetic_requests(1, vocab_size=50, prompt_len=(5, 2), output_len=(1, 1), seed=0)


@pytest.mark.parametrize("budget", [1, 200, 4000])
def test_attention_in_query_blocks_matches_one_block(model, monkeypatch, budget):
    """A long prefill's scores ([B, Hq, T, T]) are built a block of queries at a time: a
    60K-token prompt asked for 115 GB at once. Blocks of 1, a few and many queries give
    the same logits as the whole step in one block, on the pool path and the oracle."""
    from kvpool.demo import attention

    pool = make_pool(1, pool_tokens=64)
    reqs, _ = serve(model, pool, n=4, max_running=2, prompt_len=(12, 30), output_len=(2, 4))
    monkeypatch.setattr(attention, "MAX_SCORE_ELEMENTS", budget)
    pool = make_pool(1, pool_tokens=64)
    blocked, _ = serve(model, pool, n=4, max_running=2, prompt_len=(12, 30), output_len=(2, 4))
    for a, b in zip(reqs, blocked):
        assert a.output == b.output
        torch.testing.assert_close(torch.cat(b.logits), torch.cat(a.logits), atol=ATOL, rtol=RTOL)
    assert_matches_reference(model, blocked)
    pos = torch.arange(30)[None]
    one_block = max(1, budget // (CFG.heads * 30)) >= 30
    assert (attention.step_mask(pos, CFG.heads, 30) is None) != one_block  # else blocks build their own
