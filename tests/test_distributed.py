"""Multi-process tests on CPU with gloo: tensor-parallel pools, moving requests, failures.

Each test spawns 2 processes on 127.0.0.1 with a hard timeout (tests/_dist.py);
models and pools are tiny so a test takes seconds, mostly process start-up.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import kvpool
from kvpool.distributed import contiguous_runs, page_descriptors, shard_kv_heads

sys.path.insert(0, str(Path(__file__).parent))
import _dist  # noqa: E402
import _dist_workers as W  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")
ATOL, RTOL = 1e-5, 1e-4


PAGE_SIZES = (1, 16)


# One spawn per scenario serves several tests: process start-up (importing torch) is
# most of a multi-process test's time.
@pytest.fixture(scope="module")
def tp_run():
    return _dist.run_ranks(W.tp_logits, world=2, timeout_s=240, page_sizes=PAGE_SIZES)


@pytest.fixture(scope="module")
def transfer_run():
    return _dist.run_ranks(W.transfer_decode, world=2, timeout_s=240, page_sizes=PAGE_SIZES)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_tensor_parallel_demo_matches_one_process(tp_run, page_size):
    ranks = [r[page_size] for r in tp_run]
    one = W.serve(W.build_model(W.CFG), W.make_pool(page_size, -(-48 // page_size) + 1))
    for res in ranks:
        assert res["shape"][-2] == W.CFG.kv_heads // 2  # each rank holds half the KV heads
        for got, ref in zip(res["requests"], one):
            torch.testing.assert_close(got["logits"], ref["logits"], atol=ATOL, rtol=RTOL)
            assert got["output"] == ref["output"]
    assert [r["head_start"] for r in ranks] == [0, 1]
    # Same decisions on both ranks: identical digests, counters and call counts.
    assert ranks[0]["digest"] == ranks[1]["digest"] and ranks[0]["snapshot"] == ranks[1]["snapshot"]
    # The extra call on rank 1 is caught on both ranks, naming rank 1.
    for res in ranks:
        assert res["caught"] is not None, "divergence went unnoticed"
        rank, bad, msg = res["caught"]
        assert rank == 1 and bad == (1,) and "rank 1" in msg


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_prefill_send_decode_matches_one_process(transfer_run, page_size):
    src, dst = transfer_run
    ref = W.single_process(page_size)
    got = dst[page_size]
    assert len(got["logits"]) == len(W.PROMPTS)
    for g, r in zip(got["logits"], ref):
        torch.testing.assert_close(g, r, atol=ATOL, rtol=RTOL)
    for (pages, cached, nbytes, messages), prompt, dpages, spages in zip(
            src[page_size]["stats"], W.PROMPTS, got["pages"], src[page_size]["pages"]):
        assert pages == -(-len(prompt) // page_size) and cached == 0
        assert nbytes == pages * page_size * 2 * W.CFG.layers * W.CFG.kv_heads * W.CFG.head_dim * 4
        assert messages <= 5, "a request must cost a bounded number of messages, not one per page or layer"
        assert len(dpages) == len(spages)
    assert any(d != s for d, s in zip(got["pages"], src[page_size]["pages"])), "pages never differed"
    for side in (src, dst):  # every request closed again: all pages back
        assert side[page_size]["snapshot"][1:3] == (0, 0)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_prefix_pages_cached_at_the_destination_are_not_sent(transfer_run, page_size):
    src, dst = (r[("prefix", page_size)] for r in transfer_run)
    n_sys = len(W.SYSTEM) // page_size
    assert dst["cached_before"] == n_sys
    pages = -(-len(W.PREFIX_PROMPT) // page_size)
    per_page = page_size * 2 * W.CFG.layers * W.CFG.kv_heads * W.CFG.head_dim * 4
    for pages_, cached, nbytes, _ in (src["stats"], dst["stats"]):
        assert (pages_, cached) == (pages, n_sys), "the system prompt's pages must not be sent"
        assert nbytes == (pages - n_sys) * per_page
    assert dst["length"] == len(W.PREFIX_PROMPT) and dst["row_ok"]
    full = len(W.PREFIX_PROMPT) // page_size * page_size  # the chain carries the full pages' token ids
    assert dst["known"][:full] == W.PREFIX_PROMPT[:full].tolist(), "received full pages are cacheable at dst"
    # Reference: one process, no prefix cache, plain prefill + decode.
    model, pool = W.build_model(W.CFG), W.make_pool(page_size, -(-200 // page_size) + 1)
    with torch.inference_mode():
        h, logits = W.prefill(model, pool, W.PREFIX_PROMPT)
        ref = W.decode(model, pool, h, int(logits[-1].argmax()), W.STEPS)
    torch.testing.assert_close(dst["logits"], ref, atol=ATOL, rtol=RTOL)
    assert src["snapshot"][1:3] == (0, 0) and dst["snapshot"][1:3] == (0, 0)


def test_fp8_and_mla_pages_arrive_intact(transfer_run):
    src, dst = transfer_run
    raw_src, raw_dst = src["raw"], dst["raw"]
    for name in ("fp8_same", "mla"):  # same storage, same scales: bit-identical pages
        for a, b in zip(raw_src[name]["raw"], raw_dst[name]["raw"]):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    for a, b in zip(raw_src["fp8_rescaled"]["read"], raw_dst["fp8_rescaled"]["read"]):
        # Requantized to the destination's scales: equal up to one fp8 rounding step.
        for x, y in zip(a, b):
            torch.testing.assert_close(y, x, atol=0.3, rtol=0.15)


def test_refusals_leave_both_pools_unchanged(transfer_run):
    src, dst = (r["failures"] for r in transfer_run)
    assert src["exhausted"][:2] == ("TransferRejectedError", "exhausted")
    assert "needs 9 free pages" in src["exhausted"][2] and "has 5" in src["exhausted"][2]
    assert dst["exhausted"][0] == "PoolExhaustedError" and dst["exhausted_unchanged"]
    assert src["incompatible"][:2] == ("TransferRejectedError", "incompatible")
    assert dst["incompatible"][:2] == ("TransferRejectedError", "incompatible") and dst["incompatible_unchanged"]
    assert "head_dim" in dst["incompatible"][2]
    assert src["stale"] == "InvalidHandleError"
    assert dst["stale"][0] == "TransferError" and dst["stale"][2] < 10, "abort must not wait for the timeout"
    assert src["bad_args"][0] == "InvalidArgumentError" and "chunk_bytes must be a positive int" in src["bad_args"][1]
    assert dst["bad_args"][0] == "TransferError" and dst["bad_args"][2] < 10, "the receiver is told to abort"
    assert src["after"] == dst["after"] == 9
    assert src["unchanged"][1:3] == dst["unchanged"][1:3] == (0, 0)


def test_dead_peer_is_an_error_not_a_hang():
    # Rank 2 dies while sending to rank 0, rank 1 while receiving from it (tests/_dist_workers.py).
    results = _dist.run_ranks(W.dead_peers, world=3, timeout_s=240, expect_dead=(1, 2), peer_timeout_s=15.0)
    for case in ("sender_died", "receiver_died"):
        res = results[0][case]
        assert res["error"] in ("TransferError", "TransferTimeoutError"), (case, res)
        assert res["seconds"] < 30, (case, res)
        assert res["unchanged"], f"{case}: the survivor's pool changed"


def test_silent_peer_times_out():
    res = _dist.run_ranks(W.silent_peer, world=2, timeout_s=120, peer_timeout_s=2.0)[0]
    assert res["error"] == "TransferTimeoutError", res
    assert 1.5 < res["seconds"] < 15, res
    assert res["unchanged"]


# ----- single-process pieces ------------------------------------------------------------

def test_shard_kv_heads():
    assert shard_kv_heads(8, 1, 4) == (2, 2, 8)
    assert shard_kv_heads(2, 3, 4) == (1, 1, 2)      # more ranks than heads: replicated
    assert shard_kv_heads(1, 1, 2, mla=True) == (0, 1, 1)
    with pytest.raises(kvpool.InvalidArgumentError, match="cannot be split"):
        shard_kv_heads(6, 0, 4)
    with pytest.raises(kvpool.InvalidArgumentError, match="tp_rank"):
        kvpool.KVPool(2, 4, 8, tp_rank=2, tp_size=2, num_pages=4)
    mla = kvpool.KVPool(2, 1, 24, kv_lora_rank=16, qk_rope_head_dim=8, tp_rank=1, tp_size=4, num_pages=4)
    assert mla.kv_buffer(0).shape == (4, 1, 24)  # the latent cache is replicated, not split
    gqa = kvpool.KVPool(2, 8, 16, tp_rank=3, tp_size=4, num_pages=4)
    assert (gqa.num_kv_heads, gqa.kv_head_start, gqa.total_kv_heads) == (2, 6, 8)
    assert gqa.k_buffer(0).shape == (4, 2, 16)


def test_the_whole_pool_recipe_gives_each_page_its_documented_index():
    """docs/distributed.md: prepare a whole pool once with pages = range(1, num_pages); the
    row of (kind c, layer l, page p) is then (c * num_layers + l) * (num_pages - 1) + p - 1."""
    import ctypes

    pool = kvpool.KVPool(3, 2, 8, dtype=torch.float16, page_size=4, num_pages=12, max_requests=4,
                         max_context_len=64, layout="paged")
    for layer in range(3):
        pool.k_buffer(layer).copy_(torch.randn(pool.k_buffer(layer).shape))
        pool.v_buffer(layer).copy_(torch.randn(pool.v_buffer(layer).shape))
    n, layers = pool.num_pages, pool.num_layers
    desc = page_descriptors(pool, range(1, n), merge=False)
    assert desc.shape == (2 * layers * (n - 1), 3)
    for c, buf in enumerate((pool.k_buffer, pool.v_buffer)):
        for layer in range(layers):
            for p in (1, 5, n - 1):
                addr, nbytes, _ = desc[(c * layers + layer) * (n - 1) + p - 1]
                assert ctypes.string_at(int(addr), int(nbytes)) == buf(layer)[p].contiguous().view(
                    torch.uint8).numpy().tobytes()


def test_page_descriptors_address_the_pages():
    import ctypes

    pool = kvpool.KVPool(3, 2, 8, dtype=torch.float16, page_size=4, num_pages=12, max_requests=4,
                         max_context_len=64, layout="paged")
    a, b = pool.open(2)
    pool.extend([a, b], [6, 9])
    pool.extend([a], 5)       # a's pages are now not contiguous
    for layer in range(3):
        pool.k_buffer(layer).copy_(torch.randn(pool.k_buffer(layer).shape))
        pool.v_buffer(layer).copy_(torch.randn(pool.v_buffer(layer).shape))
    pages = pool.allocator.pages(a)
    starts, lengths = contiguous_runs(pages)
    assert lengths.sum() == len(pages) and len(starts) == 2
    desc = page_descriptors(pool, pages)
    assert desc.shape == (2 * 3 * len(starts), 3)
    it = iter(desc)
    for buf in (pool.k_buffer, pool.v_buffer):
        for layer in range(3):
            for s, n in zip(starts, lengths):
                addr, nbytes, dev = next(it)
                want = buf(layer)[s : s + n].contiguous().view(torch.uint8).numpy().tobytes()
                assert dev == 0 and nbytes == len(want)
                assert ctypes.string_at(int(addr), int(nbytes)) == want
