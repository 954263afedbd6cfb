"""The host copy of a pool's K/V (or MLA latent): page-major across layers.

One tensor ``[host_pages, C, num_layers, P, H, D]`` (C = 2 for K and V, 1 for
the MLA latent): host page ``h`` is one contiguous block holding every layer
of every cache for that page, so moving a page between device and host is one
block on this side, whatever the number of layers (``kvpool.kernels``
``offload_pages`` / ``load_pages``).

Bytes per host page: ``C * num_layers * P * H * D * itemsize``, exactly a
device page across all layers (``bytes_per_slot * P``); a Llama-8B-like
page (32 layers, 8 KV heads x 128, bf16, P = 16) is 2 MiB. Host page 0 is
reserved (the core never hands it out), as device page 0 is, so host page
ids index ``buffer`` directly; ``host_pages`` counts it.

fp8 pools keep the raw fp8 bytes: their scales are per layer and global (the
pool's ``k_scale`` / ``v_scale``), so a page needs nothing of its own to be
read back; a page moved to the host and back is bitwise what it was.

Memory: on a CUDA pool the buffer is page-locked (pinned), so the copies are
asynchronous DMA and the transfer kernel can reach it through its
device-mapped address; on a CPU pool it is plain memory. Large buffers are
pinned by registering an ordinary allocation with CUDA
(``cudaHostRegister``): torch's pinned allocator rounds every request up to a
power of two, which would cost up to twice the memory asked for; where CUDA
refuses (e.g. a memlock limit) it falls back to that allocator. Contents are
meaningless until an offload writes a page.

Dropping a pinned storage waits for the device before its memory goes, however
it was pinned (``_Release``); dropped while this thread captures a CUDA graph,
that wait is deferred to the next safe point rather than invalidate the capture.
"""

from __future__ import annotations

import ctypes
import math
import os
import weakref
from typing import Any

import torch

from kvpool._nopickle import NotPicklable
from kvpool.capacity import budget_bytes
from kvpool.errors import InvalidArgumentError
from kvpool.modes import persistent
from kvpool.out_of_memory import refuse_out_of_memory
from kvpool.torch_types import CACHE_DTYPES, as_device
from kvpool.validate import check_flag, is_int, require_plain_pool

__all__ = ["MAX_HOST_PAGES", "HostStorage", "host_page_bytes", "host_pages_for_bytes"]

#: Most host pages a tier may have, reserved page 0 included (the allocator's
#: host page ids are int32).
MAX_HOST_PAGES = 2**31 - 1


def _count(name: str, value: Any, minimum: int) -> int:
    if not is_int(value):
        raise InvalidArgumentError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    v = int(value)
    if v < minimum:
        raise InvalidArgumentError(f"{name} must be >= {minimum}, got {v}")
    return v


def host_page_bytes(num_layers: int, page_size: int, heads: int, head_dim: int, dtype: torch.dtype,
                    *, mla: bool) -> int:
    """Bytes of one host page: every layer of K and V (MLA: the latent) for ``page_size`` tokens.

    Raises:
        InvalidArgumentError: a size that is not an int >= 1, or a dtype a pool cannot hold.
    """
    sizes = [_count(name, v, 1) for name, v in (("num_layers", num_layers), ("page_size", page_size),
                                                 ("heads", heads), ("head_dim", head_dim))]
    _check_dtype(dtype)
    return (1 if check_flag("mla", mla) else 2) * math.prod(sizes) * dtype.itemsize


def _check_dtype(dtype: Any) -> None:
    if not isinstance(dtype, torch.dtype) or dtype not in CACHE_DTYPES:
        raise InvalidArgumentError(f"dtype must be one of {list(CACHE_DTYPES)}, got {dtype!r}")


def host_pages_for_bytes(memory_bytes: int, page_bytes: int) -> int:
    """How many host pages (reserved page 0 included) ``memory_bytes`` holds.

    Raises:
        InvalidArgumentError: fewer than two pages fit (page 0 is reserved, so a tier
            needs at least one more), or more than ``MAX_HOST_PAGES``.
    """
    memory_bytes = budget_bytes("host_memory_bytes", memory_bytes)  # the device budget's rule
    page_bytes = _count("page_bytes", page_bytes, 1)
    pages = memory_bytes // page_bytes
    if pages < 2:
        raise InvalidArgumentError(
            f"host_memory_bytes={memory_bytes} holds {pages} host page(s) of {page_bytes} bytes; a host tier "
            f"needs at least 2 (page 0 is reserved): give at least {2 * page_bytes} bytes"
        )
    if pages > MAX_HOST_PAGES:
        # Checked here, not left to the allocator, whose refusal would name host_pages.
        raise InvalidArgumentError(
            f"host_memory_bytes={memory_bytes} holds {pages} host pages of {page_bytes} bytes, more than the "
            f"{MAX_HOST_PAGES} a host tier addresses: give at most {MAX_HOST_PAGES * page_bytes} bytes"
        )
    return pages


def _cudart_lib() -> Any:
    """The libcudart torch itself loaded, or None. Only that copy shares torch's per-thread
    "last error" (a second copy would be a second runtime instance), so it is opened with
    RTLD_NOLOAD: found by soname (torch wheels link libcudart dynamically), else by the path
    /proc/self/maps gives it; never loaded anew."""
    major = (torch.version.cuda or "").split(".")[0]
    names = [f"libcudart.so.{major}"] if major else []
    try:
        with open("/proc/self/maps") as maps:
            names += sorted({line.split()[-1] for line in maps if "/libcudart.so" in line})
    except OSError:
        pass
    for name in names:
        try:
            return ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
    return None


def _register(t: torch.Tensor) -> bool:
    """Page-lock ``t``'s memory with cudaHostRegister (portable and mapped); False if refused.

    A refused registration leaves the runtime's last error set, and torch reads that error
    after its next kernel launch (``cudaGetLastError``): an unrelated launch would raise it.
    torch's cudart module has no ``cudaGetLastError``, so it is cleared through torch's own
    libcudart; where that library cannot be found, nothing is registered (pin_memory
    instead), so a refusal never outlives this call."""
    lib = _cudart_lib()
    if lib is None:
        return False
    flags = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), flags)
    ok = int(getattr(err, "value", err)) == 0
    if not ok:
        lib.cudaGetLastError()  # same thread, same runtime instance: resets what the refusal set
    return ok


def _capturing() -> bool:
    """Whether this thread's current stream is being captured into a CUDA graph (a device
    sync there would invalidate the capture)."""
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except Exception:  # noqa: BLE001 - no usable CUDA (or shutdown): nothing can be capturing
        return False


def _synchronize(device: torch.device) -> None:
    try:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        else:  # pinned for caches somewhere unknown: every device
            for i in range(torch.cuda.device_count()):
                torch.cuda.synchronize(i)
    except Exception:  # noqa: BLE001 - interpreter shutdown, or a device already failed
        pass


#: Releases that came due while a graph was being captured: run at the next safe point.
#: No lock: releases run from garbage collections, which may start inside ``_drain`` on the
#: same thread (a lock held there would deadlock); append and pop are atomic.
_deferred: list[_Release] = []


class _Release:
    """What dropping a pinned ``HostStorage`` does, once the device is done with its pages.

    Transfers may still be queued on them (a pool dropped right after a swap_out): unpinned
    under a page-copy kernel that reaches them through their mapped address, it faults; a
    DMA would land in memory freed right after. A buffer from torch's pinned allocator is
    no safer: that allocator knows nothing of a Triton kernel reading it, and would hand the
    block to the next pinned allocation. So the release holds the buffer, waits for the
    device, and only then unregisters it (cudaHostRegister) and lets it go.

    The wait is a device sync, which would invalidate a CUDA graph capture in progress on
    this thread (a garbage collection can drop a pool there): then the release is queued,
    holding the buffer, and runs at the next safe point (``_drain``: another pinned
    ``HostStorage`` made or released outside a capture).
    """

    __slots__ = ("buffer", "device", "registered")

    def __init__(self, buffer: torch.Tensor, device: torch.device, registered: bool) -> None:
        self.buffer: torch.Tensor | None = buffer
        self.device, self.registered = device, registered

    def __call__(self) -> None:
        if _capturing():
            _deferred.append(self)
            return
        _drain()
        self._run()

    def _run(self) -> None:
        buf, self.buffer = self.buffer, None
        if buf is None:
            return
        _synchronize(self.device)
        if self.registered:
            try:
                torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
            except Exception:  # noqa: BLE001 - interpreter shutdown: the process is going anyway
                pass
        del buf  # the last reference (pin_memory): back to torch's pinned allocator, now idle


def _drain() -> None:
    """Run the releases a capture deferred, unless this thread is capturing now."""
    if not _deferred or _capturing():
        return
    while True:
        try:  # one at a time: a release that comes due meanwhile (a collection) is run too
            release = _deferred.pop(0)
        except IndexError:
            return
        release._run()


def _pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True)


class HostStorage(NotPicklable):
    """Page-major host K/V of one pool (see the module doc).

    Args:
        host_pages: host pages, reserved page 0 included (>= 2).
        num_layers, page_size, heads, head_dim, dtype: the pool's geometry.
        mla: one latent cache instead of K and V.
        pin: page-lock the memory (what a CUDA pool needs); default: ``device`` is CUDA.
        device: the pool's device (only decides the default of ``pin``).

    Raises:
        InvalidArgumentError: a bad size or dtype (nothing is allocated).
    """

    # A copy duplicated the pool's (often pinned, gigabytes of) host memory for a second object no
    # pool uses; a pickle would send all of it.
    _pickle_refusal = "it is one pool's host K/V (often pinned memory)"
    _copy_refusal = "a copy would duplicate the pool's host memory for an object no pool uses; use pool.host itself"

    def __init__(self, host_pages: int, *, num_layers: int, page_size: int, heads: int, head_dim: int,
                 dtype: torch.dtype, mla: bool = False, pin: bool | None = None, device: Any = "cpu") -> None:
        self.host_pages = _count("host_pages", host_pages, 2)
        self.num_layers = _count("num_layers", num_layers, 1)
        self.page_size = _count("page_size", page_size, 1)
        self.heads = _count("heads", heads, 1)
        self.head_dim = _count("head_dim", head_dim, 1)
        _check_dtype(dtype)
        self.dtype, self.mla = dtype, check_flag("mla", mla)
        self.num_caches = 1 if self.mla else 2
        if pin is None:
            pin = as_device(device).type == "cuda"
        elif check_flag("pin", pin) and not torch.cuda.is_available():
            raise InvalidArgumentError("pin=True pins host pages for CUDA copies, but torch.cuda.is_available() "
                                       "is False; pass pin=False (or None: pin on a CUDA device only)")
        self.page_bytes = host_page_bytes(self.num_layers, self.page_size, self.heads, self.head_dim, dtype,
                                          mla=self.mla)
        shape = (self.host_pages, self.num_caches, self.num_layers, self.page_size, self.heads, self.head_dim)
        self.pin_method = "none"
        with persistent(), refuse_out_of_memory("the host tier's pages", math.prod(shape) * dtype.itemsize, "cpu",
                                                "use fewer host pages (host_pages or host_memory_bytes), layers, heads or a smaller head_dim"):
            # device= named: under torch.set_default_device / `with torch.device("cuda")` (model
            # loading) a bare empty would put the host tier in device memory.
            buf = torch.empty(shape, dtype=dtype, device="cpu")
            if pin:
                _drain()
                if _register(buf):
                    self.pin_method = "cudaHostRegister"
                else:  # e.g. a memlock limit: torch's pinned allocator (may round up)
                    del buf  # before the pinned one: both at once could exceed host memory
                    buf = _pinned_empty(shape, dtype)
                    self.pin_method = "pin_memory"
                weakref.finalize(self, _Release(buf, as_device(device), self.pin_method == "cudaHostRegister"))
        self.buffer: torch.Tensor = buf

    @classmethod
    def for_pool(cls, pool: Any, *, host_pages: int | None = None,
                 host_memory_bytes: int | None = None) -> HostStorage:
        """The host storage matching ``pool`` (a ``KVPool``), sized by exactly one of
        ``host_pages`` (reserved page 0 included) or ``host_memory_bytes`` (rounded down
        to whole pages of ``host_page_bytes``); pinned when the pool is on CUDA.

        Raises:
            InvalidArgumentError: ``pool`` is not a plain ``KVPool``, neither or both sizes,
                or fewer than 2 pages.
        """
        require_plain_pool(pool, "HostStorage.for_pool")
        if (host_pages is None) == (host_memory_bytes is None):
            raise InvalidArgumentError("give exactly one of host_pages or host_memory_bytes")
        page = host_page_bytes(pool.num_layers, pool.page_size, pool.num_kv_heads, pool.head_dim, pool.dtype,
                               mla=pool.mla)
        if host_pages is None:
            host_pages = host_pages_for_bytes(host_memory_bytes, page)  # type: ignore[arg-type]
        return cls(host_pages, num_layers=pool.num_layers, page_size=pool.page_size, heads=pool.num_kv_heads,
                   head_dim=pool.head_dim, dtype=pool.dtype, mla=pool.mla, device=pool.device)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole buffer (reserved page 0 included)."""
        return self.host_pages * self.page_bytes

    @property
    def pinned(self) -> bool:
        return self.pin_method != "none"

    def page(self, host_page: int) -> torch.Tensor:
        """Host page ``host_page`` as a ``[C, num_layers, P, H, D]`` view (no copy)."""
        # is_int, not int(): that would parse a str, truncate a float and take a 1-element array.
        if not is_int(host_page) or not 0 <= host_page < self.host_pages:
            raise InvalidArgumentError(f"host page {host_page!r} is out of range [0, {self.host_pages}): "
                                       f"pass an int in it")
        return self.buffer[int(host_page)]

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The persistent tensors (``audit`` walks these)."""
        return [("host_kv", self.buffer)]

    def __repr__(self) -> str:
        kind = "latent" if self.mla else "k+v"
        return (f"HostStorage({kind}, host_pages={self.host_pages}, layers={self.num_layers}, "
                f"page_size={self.page_size}, heads={self.heads}, head_dim={self.head_dim}, dtype={self.dtype}, "
                f"page_bytes={self.page_bytes}, pinned={self.pin_method})")

