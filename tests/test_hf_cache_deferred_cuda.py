"""KVPoolCache's deferred decode steps on a CUDA pool (``test_hf_cache_deferred.py`` runs them on
the CPU): inside a page the rows own, a step's token goes to the layer buffers alone, and the
core, the device page table and the pool's caches catch up at the next page (one extend, one
store of every layer's tokens, through a strided view or an index uploaded to the device).
On a GPU this is what keeps a decode step's host time near ``DynamicCache``'s: the extend
with its table launch is paid once a page instead of once a step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="needs the 'hf' extra (transformers>=5.23)")
__import__("_hf_skip").require_hf()  # transformers may refuse this torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from _hf_models import greedy, left_padded, tiny_model  # noqa: E402
from test_hf_cache_deferred import Reference, decode_three_pages, reorder_and_decode_past_a_page  # noqa: E402
from test_hf_cache_steps import LAYERS, PAGE, D, H, stored_in_pool  # noqa: E402

from kvpool import KVPool  # noqa: E402
from kvpool.integrations import _pages  # noqa: E402
from kvpool.integrations.transformers import KVPoolCache, pool_for_model  # noqa: E402

DEV = torch.device("cuda")


def make_cuda_pool(scrambled: bool) -> KVPool:
    pool = KVPool(LAYERS, H, D, dtype=torch.float32, device=DEV, page_size=PAGE, num_slots=1024,
                  max_requests=8, max_context_len=128)
    if scrambled:  # free pages out of order: the rows' slots are no strided run
        h = pool.open(3)
        for _ in range(3 * PAGE + 1):
            pool.extend(h, 1)
        pool.close(h)
    return pool


class CudaReference(Reference):
    """``Reference`` with the K/V on the GPU."""

    def __init__(self, batch: int, seed: int = 0) -> None:
        super().__init__(batch, seed)
        self.k = [k.to(DEV) for k in self.k]

    def step(self, cache: KVPoolCache, tokens: int) -> None:
        for layer in range(LAYERS):
            k = torch.randn(self.batch, H, tokens, D, generator=self.g).to(DEV)
            self.k[layer] = torch.cat([self.k[layer], k], dim=2)
            got_k, got_v = cache.update(k, 2 * k, layer)
            assert got_k.device.type == "cuda"
            assert torch.equal(got_k, self.k[layer]) and torch.equal(got_v, 2 * self.k[layer]), f"layer {layer}"

    def check_pool(self, pool: KVPool, handles: np.ndarray) -> None:
        torch.cuda.synchronize()
        for layer in range(LAYERS):
            k, v = stored_in_pool(pool, handles, layer)
            assert torch.equal(k, self.k[layer]) and torch.equal(v, 2 * self.k[layer]), f"layer {layer}"


@pytest.fixture
def store_paths(monkeypatch):
    """How each flush stored its tokens: 'run' (one strided view) or 'index' (uploaded index)."""
    seen: list[str] = []
    real = _pages.StepPages.store_tokens

    def spy(self, first, slots):
        b = self.table.shape[0]
        seen.append("index" if _pages.slot_run(slots, b, slots.shape[0] // b) is None else "run")
        return real(self, first, slots)

    monkeypatch.setattr(_pages.StepPages, "store_tokens", spy)
    return seen


@pytest.mark.parametrize("batch,scrambled,path", [(1, False, "run"), (3, True, "index")])
def test_steps_inside_a_page_are_deferred_and_land_at_the_next_page(batch, scrambled, path, store_paths):
    pool = make_cuda_pool(scrambled)
    ref = CudaReference(batch)
    with torch.inference_mode(), KVPoolCache(pool) as cache:
        raw = decode_three_pages(pool, cache, ref)
        ref.check_pool(pool, raw)
        # The device page table caught up too: it is what a kernel reading the pool uses.
        rows = torch.as_tensor(pool.allocator.rows(raw).astype(np.int64), device=DEV)
        table = pool.req_to_token[rows, : 5 + 3 * PAGE].cpu().numpy()
        for i, h in enumerate(raw):
            assert table[i].tolist() == pool.allocator.slots(int(h)).tolist()
    assert path in store_paths
    pool.allocator.check()
    assert pool.allocator.used_pages == 0


def test_crop_and_reorder_with_deferred_steps():
    pool = make_cuda_pool(scrambled=True)
    ref = CudaReference(2, seed=1)
    with torch.inference_mode(), KVPoolCache(pool) as cache:
        ref.step(cache, 5)
        for _ in range(PAGE + 2):
            ref.step(cache, 1)
        assert cache.requests.deferred == 2
        length = cache.get_seq_length()
        cache.crop(-1)
        ref.crop(length - 1)
        ref.check_pool(pool, cache.requests.handles)
        ref.step(cache, 1)
        reorder_and_decode_past_a_page(pool, cache, ref, [1, 1, 0], device=DEV)
    pool.allocator.check()
    assert pool.allocator.used_pages == 0


@pytest.mark.parametrize("lengths", [[9], [7, 12, 3]])
def test_generate_on_the_gpu_matches_dynamic_cache(lengths):
    """Token parity of greedy generate on the GPU, with steps deferred for most of it."""
    with torch.inference_mode(False), torch.no_grad():
        model = tiny_model().to(DEV)
    ids, mask = left_padded(lengths)
    ids, mask = ids.to(DEV), mask.to(DEV)
    ref = greedy(model, ids, mask, 24)
    pool = pool_for_model(model, max_tokens=2048, page_size=PAGE, device=DEV)
    with KVPoolCache(pool) as cache:
        out = greedy(model, ids, mask, 24, cache=cache)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert pool.allocator.used_pages == 0


def test_handles_read_from_another_stream_wait_for_the_steps():
    """A decode step on a side stream, held back by a long kernel, adds its token to the layer
    buffers there; ``cache.handles`` read on the default stream flushes, and its store from the
    buffers must wait for the side stream (or the pool gets the buffers' old contents)."""
    pool = make_cuda_pool(scrambled=False)
    ref = CudaReference(1)
    side = torch.cuda.Stream(DEV)
    with torch.inference_mode(), KVPoolCache(pool) as cache:
        ref.step(cache, 5)  # the next step is deferred: its token goes to the buffers alone
        ks = [torch.randn(1, H, 1, D, generator=ref.g).to(DEV) for _ in range(LAYERS)]
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the step's copies
            for layer, k in enumerate(ks):
                cache.update(k, 2 * k, layer)
        assert cache.requests.deferred == 1
        raw = cache.handles  # on the default stream
        torch.cuda.synchronize()
        ref.k = [torch.cat([old, k], dim=2) for old, k in zip(ref.k, ks)]
        ref.check_pool(pool, raw)


@pytest.mark.parametrize("steps", [1, PAGE - 1])  # the next step deferred / the next one starting a page
def test_a_step_under_capture_is_refused_and_decoding_goes_on(steps):
    from kvpool import TensorDeviceError

    pool = make_cuda_pool(scrambled=False)
    ref = CudaReference(1, seed=3)
    with torch.inference_mode(), KVPoolCache(pool) as cache:
        ref.step(cache, 5)
        for _ in range(steps):
            ref.step(cache, 1)
        req = cache.requests
        before = (req.length, req.deferred, len(req.unstored), pool.allocator.lengths(req.handles).tolist())
        k = torch.randn(1, H, 1, D, device=DEV)
        side = torch.cuda.Stream(DEV)
        with pytest.raises(TensorDeviceError, match="being captured"):
            # (a fresh graph: torch refuses a second capture into one, even after one that raised)
            with torch.cuda.stream(side), torch.cuda.graph(torch.cuda.CUDAGraph(), stream=side):
                cache.update(k, k, 0)
        assert (req.length, req.deferred, len(req.unstored), pool.allocator.lengths(req.handles).tolist()) == before
        for _ in range(PAGE + 1):
            ref.step(cache, 1)
        ref.check_pool(pool, cache.handles)
