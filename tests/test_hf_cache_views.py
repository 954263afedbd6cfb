"""How KVPoolCache hands attention its K/V: views of the pool's pages when every row's
pages are consecutive (no copy), a page gather into a reused staging buffer otherwise;
the same values either way, and the rows' page table kept step by step. These run without
layer buffers: with them (the default), a CPU pool's rows are always read from the
buffers, whose views are kept (tests/test_hf_cache_buffers.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="needs the 'hf' extra (transformers>=5.23)")
__import__("_hf_skip").require_hf()  # transformers may refuse this torch

from kvpool import KVPool  # noqa: E402
from kvpool.integrations.transformers import KVPoolCache  # noqa: E402

H, D, LAYERS, PAGE = 2, 8, 3, 4


def make_pool(layout: str = "token") -> KVPool:
    return KVPool(LAYERS, H, D, dtype=torch.float32, page_size=PAGE, num_slots=512, max_requests=4,
                  max_context_len=64, layout=layout)


def shares_pool_memory(t: torch.Tensor, pool: KVPool) -> bool:
    return t.untyped_storage().data_ptr() == pool.k_buffer(0).untyped_storage().data_ptr()


def run_steps(pool: KVPool, batch: int, steps: list[int], *, layer_buffers: bool = False) -> list[tuple[bool, bool]]:
    """Feed ``steps`` tokens per forward to every layer; check every returned K/V against
    what was stored; return, per step, whether layer 0's K and V were views of the pool."""
    g = torch.Generator().manual_seed(batch)
    used = pool.allocator.used_pages
    stored: dict[int, list[torch.Tensor]] = {layer: [] for layer in range(LAYERS)}
    kinds = []
    with torch.inference_mode(), KVPoolCache(pool, layer_buffers=layer_buffers) as cache:
        for t in steps:
            for layer in range(LAYERS):
                k = torch.randn(batch, H, t, D, generator=g)
                stored[layer].append(k)
                got_k, got_v = cache.update(k, -k, layer)
                want = torch.cat(stored[layer], dim=2)
                assert torch.equal(got_k, want) and torch.equal(got_v, -want)
                if layer == 0:
                    kinds.append((shares_pool_memory(got_k, pool), shares_pool_memory(got_v, pool)))
    pool.allocator.check()
    assert pool.allocator.used_pages == used
    return kinds


@pytest.mark.parametrize("layout", ["token", "paged"])
def test_one_row_on_consecutive_pages_reads_the_pool_in_place(layout):
    pool = make_pool(layout)
    kinds = run_steps(pool, 1, [6] + [1] * 12)  # a prefill, then decode across three page boundaries
    assert kinds == [(True, True)] * 13


def test_with_layer_buffers_a_cpu_pool_reads_them_even_on_consecutive_pages():
    pool = make_pool()
    kinds = run_steps(pool, 1, [6] + [1] * 12, layer_buffers=True)
    assert kinds == [(False, False)] * 13


def test_rows_on_scattered_pages_are_gathered_with_the_same_values():
    pool = make_pool()
    # Three rows prefilled together get consecutive pages each, equally far apart (views);
    # their first decode page is taken by the rows in turn, so the rows' pages interleave
    # from then on (a gather).
    kinds = run_steps(pool, 3, [8] + [1] * 6)
    assert kinds[0] == (True, True)
    assert kinds[1:] == [(False, False)] * 6


def test_pages_taken_out_of_order_are_gathered():
    pool = make_pool()
    gap, hold = pool.open(1), pool.open(1)
    pool.extend(gap, 1)  # page 1
    pool.extend(hold, 1)  # page 2
    pool.close(gap)  # page 1 is free again, page 2 stays taken
    kinds = run_steps(pool, 1, [3] + [1] * 6)  # pages 1, then 3: not consecutive
    assert kinds == [(True, True)] * 2 + [(False, False)] * 5
    pool.close(hold)


def test_crop_then_continue_reads_the_table_again():
    pool = make_pool()
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode(), KVPoolCache(pool) as cache:
        ks = []
        for t in (9, 1, 1):
            ks.append(torch.randn(2, H, t, D, generator=g))
            for layer in range(LAYERS):
                cache.update(ks[-1], ks[-1], layer)
        cache.crop(-4)  # 11 -> 7 tokens: back into the second page
        kept = torch.cat(ks, dim=2)[:, :, :7]
        new = torch.randn(2, H, 2, D, generator=g)
        for layer in range(LAYERS):
            got_k, _ = cache.update(new, new, layer)
            assert torch.equal(got_k, torch.cat([kept, new], dim=2))
    pool.allocator.check()


def test_pool_for_a_bare_config_is_float32_on_cpu():
    """A config without a dtype (transformers 5 leaves ``config.dtype`` None) sizes a
    float32 CPU pool, as documented; a config naming its dtype gets that dtype."""
    from transformers import LlamaConfig

    from kvpool.integrations.transformers import pool_for_model

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    pool = pool_for_model(cfg, max_tokens=64)
    assert (pool.dtype, pool.device.type, pool.num_layers, pool.num_kv_heads) == (torch.float32, "cpu", 2, 2)
    cfg.dtype = "bfloat16"
    assert pool_for_model(cfg, max_tokens=64).dtype == torch.bfloat16


@pytest.mark.parametrize("cols", [3, 300], ids=["small-table", "large-table"])
def test_strided_run_finds_one_view_of_the_rows_pages(cols):
    """Whether a batch's page table is one strided view of a cache: each row's pages
    consecutive, the rows equally far apart (0 apart: every row on the same pages). Small
    tables are checked as lists, large ones in numpy: both must agree."""
    import numpy as np

    from kvpool.integrations._pool_views import strided_run

    def table(starts, n=cols):
        return np.array([[s + c for c in range(n)] for s in starts], dtype=np.int64)

    rows = 8
    assert strided_run(table([5])) == (5, 0)
    assert strided_run(table([5] * rows)) == (5, 0)
    assert strided_run(table([2 + 50 * r for r in range(rows)])) == (2, 50)
    assert strided_run(table([2, 52, 102, 153] + [200] * (rows - 4))) is None  # not equally apart
    assert strided_run(table([100 - 50 * r for r in range(2)])) is None  # rows going backwards
    gap = table([2 + 50 * r for r in range(rows)])
    gap[rows - 1, cols - 1] += 1  # one row's last page is not the next one
    assert strided_run(gap) is None
    one = table([7])
    one[0, 0] -= 2
    assert strided_run(one) is None
    assert strided_run(np.zeros((rows, 0), dtype=np.int64)) is None
