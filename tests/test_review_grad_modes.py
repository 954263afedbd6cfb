"""Outside review of the grad-mode contract: objects kvpool builds under one grad mode and
used under another. Every persistent tensor (made at construction or lazily) must be a
normal, grad-free tensor, so that in-place updates work whatever mode a later call runs in."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

import kvpool


@contextlib.contextmanager
def inference_inside_no_grad():
    with torch.no_grad(), torch.inference_mode():
        yield


BUILD_MODES = {"inference_mode": torch.inference_mode, "inference_inside_no_grad": inference_inside_no_grad}


@pytest.mark.parametrize("build", list(BUILD_MODES))
def test_a_linear_attention_cache_built_in_inference_mode_serves_generate_and_grad_mode(build):
    """transformers' ``LinearAttentionCacheLayerMixin.__init__`` makes a ``cumulative_length_linear``
    counter that the model bumps in place on every decode step (``increase_count``). Built
    under inference mode it was an inference tensor: ``generate`` (which runs under
    ``no_grad``) raised "Inplace update to inference tensor outside InferenceMode" on the
    first decode step of a Qwen3-Next cache made in a ``with torch.inference_mode():``."""
    from _hf_hybrid_models import P, tiny  # skips without transformers
    from _hf_models import CACHE_KW, greedy, left_padded

    from kvpool.integrations.transformers import KVPoolCache, pool_for_model

    model = tiny("qwen3_next")
    pool = pool_for_model(model, max_tokens=64, page_size=P, max_requests=2)
    with BUILD_MODES[build]():
        cache = KVPoolCache(pool)
    ids, mask = left_padded([5], seed=1)
    out = greedy(model, ids, mask, 3, cache)  # generate: no_grad
    assert out.sequences.shape == (1, 8)
    assert kvpool.audit(cache=cache, pool=pool) == []
    with torch.enable_grad():  # and one more step under grad mode
        nxt = out.sequences[:, -1:]
        logits = model(input_ids=nxt, attention_mask=torch.ones(1, 9, dtype=torch.long), **{CACHE_KW: cache}).logits
    assert logits.requires_grad
    # (the cache's working copies of the states carry this step's autograd history until the
    # next step writes them back detached; the pool's tensors never do)
    assert kvpool.audit(pool=pool) == []
    cache.close()
    pool.check()


def _pool(**kw):
    return kvpool.KVPool(2, 2, 8, dtype=torch.float32, page_size=4, num_pages=16, max_requests=4,
                         max_context_len=32, **kw)


def test_audit_of_a_pool_sees_the_transfer_staging_kept_for_it():
    """``kvpool.distributed`` keeps a pool's transfer staging between transfers (made lazily,
    under whatever mode the first transfer runs in), outside the pool object: audit(pool)
    must walk it too."""
    from kvpool.distributed import chunks

    pool = _pool()
    with torch.inference_mode():
        bufs = chunks.staging(torch.device("cpu"), pool, 2, 1)
    assert bufs and all(not t.is_inference() and not t.requires_grad for t in bufs)
    assert kvpool.audit(pool) == []
    with torch.inference_mode():
        chunks.STAGING[pool][0] = torch.empty_like(bufs[0])  # break one on purpose
    assert [f.name for f in kvpool.audit(pool=pool)] == ["pool.transfer_staging[0]"]


@pytest.mark.parametrize("layer_buffers", [True, False])
def test_audit_of_a_pool_sees_what_closed_caches_left_for_its_next_caches(layer_buffers):
    """A closed ``KVPoolCache`` leaves its staging or layer buffers to the pool's next caches
    (kept per pool, outside the pool object): made under one cache's grad mode, served to the
    next cache's under another, and walked by audit(pool)."""
    from _hf_models import CACHE_KW, left_padded, tiny_model  # skips without transformers

    from kvpool.integrations._pool_views import pool_views
    from kvpool.integrations.transformers import KVPoolCache, pool_for_model

    model = tiny_model("llama")
    pool = pool_for_model(model, max_tokens=64, page_size=4, max_requests=2)
    ids, _ = left_padded([6, 6], seed=2)
    for mode in (torch.inference_mode, torch.no_grad, torch.enable_grad):  # each takes the last one's spares
        with mode(), KVPoolCache(pool, layer_buffers=layer_buffers) as cache:
            logits = model(input_ids=ids, **{CACHE_KW: cache}).logits
            model(input_ids=logits[:, -1:].argmax(-1), **{CACHE_KW: cache})
    views = pool_views(pool)
    kept = [t for t, *_ in views.spare_stages] + [lb.buf for lb in views.spare_buffers._sets.values()]
    assert kept and all(not t.is_inference() and not t.requires_grad for t in kept)
    assert kvpool.audit(pool) == []
    with torch.inference_mode():  # break one on purpose: audit must name it
        if layer_buffers:
            (lb,) = views.spare_buffers._sets.values()
            lb.buf = torch.empty_like(lb.buf)
            want = "pool.cache_spares.layer_buffers[0]"
        else:
            views.spare_stages[0] = (torch.empty_like(views.spare_stages[0][0]), None, set())
            want = "pool.cache_spares.stage[0]"
    assert [f.name for f in kvpool.audit(pool=pool)] == [want]


class _Event:
    def record(self, stream=None):
        pass

    def query(self):
        return True


def test_audit_of_a_pool_sees_its_pinned_ring_buffers():
    """A CUDA pool stages host -> device copies through a ``PinnedRing`` that grows lazily; its
    buffers are the pool's long-lived tensors too. (CPU stand-in: a ring with injected
    buffers and events, as kvpool.staging allows, one of them broken on purpose.)"""
    from kvpool.staging import PinnedRing

    pool = _pool()
    made = []

    def alloc(nbytes):
        with torch.inference_mode():  # a wrong allocator: audit must name its buffer
            made.append(torch.empty(nbytes, dtype=torch.uint8))
        return made[-1]

    ring = PinnedRing(torch.device("cpu"), alloc=alloc, make_event=_Event)
    ring.to_device(np.arange(4, dtype=np.int64))
    pool._to_device = ring.to_device
    assert [f.name for f in kvpool.audit(pool=pool)] == ["pool.pinned_ring[0]"]


@pytest.mark.parametrize("arch,page_size,layer_buffers", [
    ("llama", 1, False), ("llama", 1, True), ("llama", 16, False), ("gemma3", 4, False),
    ("qwen3_next", 4, False),
])
def test_index_tensors_a_cache_keeps_across_steps_are_normal_after_inference_mode_generate(
        arch, page_size, layer_buffers):
    """A cache used under ``inference_mode`` keeps index tensors between steps (the gather
    index of the rows' pages, the rows of the pool's requests, a state layer's slots). Made
    in the caller's mode they were inference tensors: a page-1 cache without layer buffers
    kept its gather index as one, which autograd refuses to save if the next step runs
    under grad mode."""
    from _hf_hybrid_models import tiny  # skips without transformers
    from _hf_models import greedy, left_padded, tiny_model

    from kvpool.integrations.transformers import KVPoolCache, pool_for_model

    model = tiny_model(arch) if arch == "llama" else tiny(arch)
    pool = pool_for_model(model, max_tokens=256, page_size=page_size, max_requests=4)
    ids, mask = left_padded([5, 9], seed=2)
    with torch.inference_mode():
        cache = KVPoolCache(pool, layer_buffers=layer_buffers)
        greedy(model, ids, mask, 3, cache)
    assert kvpool.audit(cache=cache, pool=pool, max_depth=6) == []
    cache.close()
    pool.check()


@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference_mode"])
def test_an_fp8_scale_set_from_a_parameter_in_grad_mode_serves_every_mode(mode):
    """``pool.v_scale[layer] = s`` (the documented way) from a calibrated scale that requires
    grad, in grad mode, makes the scale tensor require grad: a write in grad mode then raised
    torch's error halfway (K stored, V not), and reads raised too."""
    pool = kvpool.KVPool(2, 2, 8, dtype=torch.float8_e4m3fn, page_size=4, num_pages=10)
    h = pool.open(1)
    step = pool.extend(h, [3])
    pool.v_scale[0] = torch.nn.Parameter(torch.tensor(0.5))  # grad mode: recorded by autograd
    k = torch.full((3, 2, 8), 1.5, dtype=torch.bfloat16)
    v = torch.full((3, 2, 8), 3.0, dtype=torch.bfloat16)
    ctx = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]
    with ctx():
        pool.write(0, step.out_cache_loc, k, v)
        got_k, got_v = pool.read(0, step.out_cache_loc)
    assert torch.equal(got_k.float(), k.float()) and torch.equal(got_v.float(), v.float())
    raw_v = pool.v_buffer(0).view(torch.uint8)[step.out_cache_loc].view(pool.dtype).float()  # bytes: torch 2.4
    assert torch.equal(raw_v, torch.full_like(raw_v, 6.0))  # stored as v / 0.5
