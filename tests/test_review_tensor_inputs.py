"""Outside-style sweep of the tensors engines hand a pool: dtypes, layouts and strides of K/V,
slot tensors of every kind, and transformers models cast to float16 / bfloat16."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the 'hf' extra (transformers>=5.23)")
__import__("_hf_skip").require_hf()  # transformers may refuse this torch
from _hf_models import greedy, left_padded  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from kvpool.bench.hf_generate import HFSettings, build_model  # noqa: E402
from kvpool.errors import InvalidArgumentError, TensorDtypeError  # noqa: E402
from kvpool.integrations.transformers import KVPoolCache, pool_for_model  # noqa: E402

TINY = HFSettings(hidden=64, layers=2, heads=4, kv_heads=2, vocab=128)


@pytest.fixture(scope="module")
def llama():
    return build_model(TINY)


def cast(model, dtype):
    with torch.inference_mode(False), torch.no_grad():
        return copy.deepcopy(model).to(dtype)


@pytest.mark.parametrize("model_dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_pool_for_model_fp8_takes_the_model_dtype_rows(llama, model_dtype, fp8):
    """pool_for_model(model, dtype=fp8) built the pool with KVPool's default compute_dtype
    (bfloat16) whatever the model's dtype, so KVPoolCache refused every forward of a float16 or
    float32 model ("build the pool with the model's dtype", which it was). The pool now takes
    the model's dtype as its compute_dtype."""
    model = cast(llama, model_dtype)
    ids, mask = left_padded([5, 3], seed=1)
    ids = ids % TINY.vocab
    pool = pool_for_model(model, max_tokens=64, page_size=4, max_requests=4, dtype=fp8)
    assert (pool.dtype, pool.compute_dtype) == (fp8, model_dtype)
    free = pool.free_pages
    with torch.inference_mode():
        ref = greedy(model, ids, mask, 4, DynamicCache(config=model.config))
        with KVPoolCache(pool) as cache:
            out = greedy(model, ids, mask, 4, cache)
    assert out.sequences.shape == ref.sequences.shape
    assert torch.equal(out.sequences[:, : ids.shape[1]], ids)
    pool.check()
    assert pool.open_requests == 0 and pool.free_pages == free


def test_pool_for_model_fp8_keeps_a_given_compute_dtype(llama):
    model = cast(llama, torch.float16)
    pool = pool_for_model(model, max_tokens=64, dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    assert pool.compute_dtype == torch.float32
    # A bare config without a dtype: KVPool's own default.
    bare = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                                    num_key_value_heads=2, vocab_size=128)
    bare.dtype = None
    assert pool_for_model(bare, max_tokens=64, dtype=torch.float8_e4m3fn).compute_dtype == torch.bfloat16


def test_fp8_pool_of_another_compute_dtype_names_the_fix(llama):
    """A hand-built fp8 pool whose compute_dtype is not the model's is refused typed, with the
    pool unchanged, and the message names compute_dtype (the pool's dtype is fp8 already)."""
    model = cast(llama, torch.float16)
    pool = pool_for_model(model, max_tokens=64, dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    ids, mask = left_padded([5, 3], seed=1)
    free = pool.free_pages
    with torch.inference_mode(), KVPoolCache(pool) as cache:
        with pytest.raises(TensorDtypeError, match=r"compute_dtype=torch\.float16"):
            greedy(model, ids % TINY.vocab, mask, 2, cache)
    pool.check()
    assert pool.open_requests == 0 and pool.free_pages == free


@pytest.mark.parametrize("bad", [np.array([1, 2]), torch.tensor([1.0, 2.0])], ids=["ndarray", "tensor"])
def test_pool_for_model_dtype_not_a_dtype_is_refused_typed(llama, bad):
    """The fp8 compute_dtype check compared ``dtype in FP8_DTYPES`` before KVPool checked the
    dtype: an array's elementwise == made that raise numpy's untyped ValueError ("truth value of
    an array ... is ambiguous") instead of KVPool's InvalidArgumentError naming the dtypes."""
    with pytest.raises(InvalidArgumentError, match="dtype must be a floating torch.dtype"):
        pool_for_model(llama, max_tokens=64, dtype=bad)
