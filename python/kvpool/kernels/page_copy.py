"""Triton kernel of ``kvpool.kernels.offload_pages`` / ``load_pages`` (imported on the
first launch only): whole pages between the device caches and a page-major host
buffer, every layer and cache of every page pair in one launch.

On CUDA the host buffer is pinned, so it has a device-mapped (UVA) address:
the kernel's loads (``load_pages``) and stores (``offload_pages``) on it go
over PCIe / NVLink-C2C directly, with no staging buffer and no copy engine.
Triton translates the pinned tensor's address itself (cuPointerGetAttribute).

Everything is addressed in integer words (``pages._word``): a page of one
layer is one contiguous run of ``chunk`` words on both sides, so each program
moves one contiguous block with the widest accesses its alignment allows.
Program (i, l, b) moves block b of page pair i's layer ``layer0 + l`` for
every cache.
"""

# No `from __future__ import annotations` here: Triton 3.0's interpreter (TRITON_INTERPRET=1)
# treats a parameter as constexpr only if its annotation is the tl.constexpr class, not a string
# (tests/test_review_dependency_floors.py).

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from kvpool.kernels.launch import OPTIONS

# Bytes one program moves per cache: with 8 warps, 64 bytes (four 16-byte
# accesses) a thread, enough in flight to cover host-memory latency.
BLOCK_BYTES = 16384


@triton.jit
def _page_copy_kernel(
    dev0, dev1, host, ids_ptr, n, chunk, layer_stride, host_page, host_cache, layer0,
    TO_HOST: tl.constexpr, TWO: tl.constexpr, BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    layer = (layer0 + tl.program_id(1)).to(tl.int64)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < chunk
    dp = tl.load(ids_ptr + i).to(tl.int64)  # ids: [2, n] = device pages, host pages
    hp = tl.load(ids_ptr + n + i).to(tl.int64)
    d_off = layer * layer_stride + dp * chunk + offs
    h_off = hp * host_page + layer * chunk + offs
    if TO_HOST:
        tl.store(host + h_off, tl.load(dev0 + d_off, mask=mask), mask=mask)
        if TWO:
            tl.store(host + host_cache + h_off, tl.load(dev1 + d_off, mask=mask), mask=mask)
    else:
        tl.store(dev0 + d_off, tl.load(host + h_off, mask=mask), mask=mask)
        if TWO:
            tl.store(dev1 + d_off, tl.load(host + host_cache + h_off, mask=mask), mask=mask)


def _pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def launch_page_copy(dev_words: list[torch.Tensor], host_words: torch.Tensor, ids: torch.Tensor, to_host: bool,
                     layer0: int, num_layers: int) -> None:
    """One launch; arguments validated by ``kvpool.kernels.pages.PageTransfer``.

    ``dev_words``: per cache ``[L, num_pages, chunk]`` word views; ``host_words``:
    ``[host_pages, C, L, chunk]``; ``ids``: int64 ``[2, n]`` on the device."""
    layers_total, num_pages, chunk = dev_words[0].shape
    n = ids.shape[1]
    word = dev_words[0].element_size()
    block = min(_pow2(chunk), max(1, BLOCK_BYTES // word))
    warps = max(1, min(8, block * word // 512))  # 16 bytes a thread per access
    grid = (n, num_layers, triton.cdiv(chunk, block))
    two = len(dev_words) == 2
    _page_copy_kernel[grid](
        dev_words[0], dev_words[1] if two else dev_words[0], host_words, ids, n, chunk,
        num_pages * chunk, host_words.shape[1] * layers_total * chunk, layers_total * chunk, layer0,
        TO_HOST=to_host, TWO=two, BLOCK=block, num_warps=warps, **OPTIONS,
    )
