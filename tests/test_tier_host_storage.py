"""HostStorage: page-major layout, sizing from pages or bytes, grad-mode safety, plain
memory on CPU pools (pinning is checked in tests/test_tier_cuda.py)."""

from __future__ import annotations

import gc

import pytest
import torch

import kvpool
from kvpool.errors import InvalidArgumentError
from kvpool.tiers import HostStorage, host_page_bytes, host_pages_for_bytes


def pool(**kw):
    args = dict(dtype=torch.bfloat16, page_size=4, num_pages=8, max_requests=4, max_context_len=64)
    args.update(kw)
    return kvpool.KVPool(3, 2, 8, **args)


def test_a_llama_8b_page_is_two_mib():
    assert host_page_bytes(32, 16, 8, 128, torch.bfloat16, mla=False) == 2 * 1024 * 1024
    # MLA (DeepSeek-like latent 512 + 64, 61 layers, fp8): one cache
    assert host_page_bytes(61, 64, 1, 576, torch.float8_e4m3fn, mla=True) == 61 * 64 * 576


def test_page_major_layout_matches_a_device_page_across_layers():
    p = pool()
    h = HostStorage.for_pool(p, host_pages=5)
    assert tuple(h.buffer.shape) == (5, 2, 3, 4, 2, 8)
    assert h.page_bytes == p.bytes_per_slot * p.page_size == h.page(1).numel() * 2
    assert h.nbytes == 5 * h.page_bytes
    assert h.page(4).is_contiguous() and h.page(4).data_ptr() == h.buffer.data_ptr() + 4 * h.page_bytes


def test_mla_and_fp8_pools():
    p = kvpool.KVPool(2, 1, 24, kv_lora_rank=16, qk_rope_head_dim=8, dtype=torch.float8_e4m3fn, page_size=16,
                      num_pages=4, max_requests=2, max_context_len=64)
    h = HostStorage.for_pool(p, host_pages=3)
    assert tuple(h.buffer.shape) == (3, 1, 2, 16, 1, 24) and h.buffer.dtype == torch.float8_e4m3fn
    assert h.page_bytes == 2 * 16 * 24


def test_sized_by_bytes_rounds_down_to_whole_pages():
    p = pool()
    page = HostStorage.for_pool(p, host_pages=2).page_bytes
    assert HostStorage.for_pool(p, host_memory_bytes=7 * page + page - 1).host_pages == 7
    assert host_pages_for_bytes(2 * page, page) == 2
    with pytest.raises(InvalidArgumentError, match="at least 2"):
        HostStorage.for_pool(p, host_memory_bytes=2 * page - 1)


@pytest.mark.parametrize("kw", [dict(), dict(host_pages=4, host_memory_bytes=1 << 20)])
def test_exactly_one_size(kw):
    with pytest.raises(InvalidArgumentError, match="exactly one"):
        HostStorage.for_pool(pool(), **kw)


@pytest.mark.parametrize("bad", [0, 1, -3, 2.0, True, "4"])
def test_bad_page_counts(bad):
    with pytest.raises(InvalidArgumentError):
        HostStorage(bad, num_layers=1, page_size=1, heads=1, head_dim=8, dtype=torch.float16)


def test_bad_geometry():
    with pytest.raises(InvalidArgumentError):
        HostStorage(4, num_layers=0, page_size=1, heads=1, head_dim=8, dtype=torch.float16)
    with pytest.raises(InvalidArgumentError, match="dtype"):
        HostStorage(4, num_layers=1, page_size=1, heads=1, head_dim=8, dtype=torch.int32)
    h = HostStorage(4, num_layers=1, page_size=1, heads=1, head_dim=8, dtype=torch.float16)
    with pytest.raises(InvalidArgumentError):
        h.page(4)


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad", "grad"])
def test_normal_tensor_whatever_the_mode_it_was_built_in(mode):
    ctx = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad, "grad": torch.enable_grad}[mode]
    with ctx():
        h = HostStorage.for_pool(pool(), host_pages=3)
    assert not h.buffer.is_inference() and not h.buffer.requires_grad
    assert kvpool.audit(host=h.buffer) == []
    h.buffer[1].zero_()  # an in-place write outside inference mode works


def test_plain_memory_on_a_cpu_pool():
    h = HostStorage.for_pool(pool(), host_pages=3)
    assert h.pin_method == "none" and not h.pinned
    assert h.buffer.device.type == "cpu"
    assert "host_pages=3" in repr(h) and h.tensors()[0][1] is h.buffer


def test_pinned_pages_are_unpinned_only_after_the_device_is_done_with_them(monkeypatch):
    # Freed with transfers still queued (a pool dropped right after a swap_out), the
    # buffer must not be unregistered under them: a page-copy kernel reading it through
    # its mapped address would fault, a DMA would land in memory about to be freed.
    import gc

    log = []

    class FakeCudart:
        def cudaHostRegister(self, ptr, nbytes, flags):
            log.append("register")
            return 0

        def cudaHostUnregister(self, ptr):
            log.append("unregister")
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append(f"synchronize({device})"))
    # A CUDA device as far as HostStorage's checks go: only the pinning and the sync are faked here.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    host = HostStorage(3, num_layers=2, page_size=4, heads=2, head_dim=8, dtype=torch.bfloat16,
                       device=torch.device("cuda", 1))
    assert host.pin_method == "cudaHostRegister" and log == ["register"]
    del host
    gc.collect()
    assert log == ["register", "synchronize(cuda:1)", "unregister"]


# ----- pinning and release on CUDA, with the CUDA calls faked (a GPU run confirms the real ones) -----


class _FakeCuda:
    """torch.cuda's pinning, sync and capture calls, logged; ``refuse`` makes cudaHostRegister fail."""

    def __init__(self, monkeypatch, *, refuse=False, lib=True):
        from kvpool.tiers import host_storage as hs

        self.log, self.refuse, self.capturing = [], refuse, False
        fake = self

        class Cudart:
            def cudaHostRegister(self, ptr, nbytes, flags):
                fake.log.append("register")
                return 2 if fake.refuse else 0  # 2: cudaErrorMemoryAllocation

            def cudaHostUnregister(self, ptr):
                fake.log.append("unregister")
                return 0

        class Lib:
            def cudaGetLastError(self):
                fake.log.append("clear_last_error")
                return 0

        def pinned(shape, dtype):
            fake.log.append("pin_memory")
            return torch.empty(shape, dtype=dtype)

        def sync(device=None):
            fake.log.append(f"synchronize({device})" + ("" if fake.watch is None or fake.watch() is not None
                                                       else " after the buffer was freed"))

        self.watch = None
        monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
        monkeypatch.setattr(torch.cuda, "synchronize", sync)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: fake.capturing)
        monkeypatch.setattr(hs, "_cudart_lib", lambda: Lib() if lib else None)
        monkeypatch.setattr(hs, "_pinned_empty", pinned)
        monkeypatch.setattr(hs, "_deferred", [])

    def storage(self):
        return HostStorage(3, num_layers=2, page_size=4, heads=2, head_dim=8, dtype=torch.bfloat16,
                           device=torch.device("cuda", 0))


def test_a_refused_registration_clears_the_runtime_error_before_falling_back(monkeypatch):
    # Left set, the refusal's error is what torch's next kernel-launch check reads: an
    # unrelated launch would raise "out of memory".
    cuda = _FakeCuda(monkeypatch, refuse=True)
    host = cuda.storage()
    assert host.pin_method == "pin_memory"
    assert cuda.log == ["register", "clear_last_error", "pin_memory"]


def test_a_successful_registration_clears_nothing(monkeypatch):
    cuda = _FakeCuda(monkeypatch)
    assert cuda.storage().pin_method == "cudaHostRegister" and cuda.log == ["register"]


def test_without_torch_s_libcudart_nothing_is_registered(monkeypatch):
    # A refusal could not be cleared: pin_memory straight away, so none is left behind.
    cuda = _FakeCuda(monkeypatch, lib=False)
    assert cuda.storage().pin_method == "pin_memory" and cuda.log == ["pin_memory"]


def test_a_pin_memory_buffer_outlives_the_device_work_on_it(monkeypatch):
    # torch's pinned allocator knows nothing of a Triton kernel reading the buffer through
    # its mapped address: freed at once, the block could go to the next pinned allocation.
    import weakref

    cuda = _FakeCuda(monkeypatch, refuse=True)
    host = cuda.storage()
    cuda.watch = weakref.ref(host.buffer)
    cuda.log.clear()
    del host
    gc.collect()
    assert cuda.log == ["synchronize(cuda:0)"]  # buffer still alive at the sync, no unregister
    assert cuda.watch() is None  # and let go right after it


def test_a_release_during_graph_capture_waits_for_the_next_safe_point(monkeypatch):
    # A device sync inside a capture invalidates it: the release is queued, holding the buffer.
    import weakref

    cuda = _FakeCuda(monkeypatch)
    host = cuda.storage()
    cuda.watch = weakref.ref(host.buffer)
    cuda.capturing = True
    del host
    gc.collect()
    assert cuda.log == ["register"] and cuda.watch() is not None
    other = cuda.storage()  # made during the capture: still no sync
    assert cuda.log == ["register", "register"] and cuda.watch() is not None
    cuda.capturing = False
    first, cuda.watch = cuda.watch, weakref.ref(other.buffer)
    del other  # outside the capture: the deferred release runs first, then this one
    gc.collect()
    assert cuda.log == ["register", "register", "synchronize(cuda:0)", "unregister",
                        "synchronize(cuda:0)", "unregister"]
    assert first() is None and cuda.watch() is None


def test_a_new_pinned_storage_runs_the_deferred_releases_first(monkeypatch):
    cuda = _FakeCuda(monkeypatch)
    host = cuda.storage()
    cuda.capturing = True
    del host
    gc.collect()
    cuda.capturing = False
    kept = cuda.storage()
    assert kept.pinned and cuda.log == ["register", "synchronize(cuda:0)", "unregister", "register"]


class _GcOnce(list):
    """The deferred releases, with a garbage collection at the drain's first look at them (where
    copying the list allocates, so a real collection can run): it collects a pinned storage
    caught in a reference cycle, whose release then runs inside the drain."""

    def __init__(self):
        super().__init__()
        self.fired = False

    def _gc(self):
        if not self.fired:
            self.fired = True
            gc.collect()

    def __getitem__(self, i):
        self._gc()
        return super().__getitem__(i)

    def pop(self, *args):
        self._gc()
        return super().pop(*args)


def test_a_release_that_comes_due_inside_the_drain_does_not_hang(monkeypatch):
    import threading

    from kvpool.tiers import host_storage as hs

    cuda = _FakeCuda(monkeypatch)
    monkeypatch.setattr(hs, "_deferred", _GcOnce())
    # (a fresh lock where there is one: a hung drain must not hold the module's for later tests)
    monkeypatch.setattr(hs, "_deferred_lock", threading.Lock(), raising=False)
    gc.disable()  # the cycle below goes only when the drain's collection runs
    try:
        cyc = cuda.storage()
        cyc.me = cyc
        del cyc
        host = cuda.storage()
        cuda.capturing = True
        del host  # (no cycle: released, so deferred, at once)
        cuda.capturing = False
        assert len(hs._deferred) == 1 and not hs._deferred.fired
        cuda.log.clear()
        done = threading.Event()

        def drain():
            hs._drain()
            done.set()

        threading.Thread(target=drain, daemon=True).start()
        assert done.wait(20), "the drain hung on its own lock (a release run by a collection inside it)"
    finally:
        gc.enable()
    assert hs._deferred.fired and list(hs._deferred) == []
    assert cuda.log == ["synchronize(cuda:0)", "unregister"] * 2  # both released, once each
