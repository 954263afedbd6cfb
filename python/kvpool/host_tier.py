"""``KVPool``'s host tier: host storage below the device pages, and the
transfers the core queues, run inside the calls that queue them.

The core decides what moves (``take_offloads``, ``take_loads``); this layer
moves the bytes with a ``kvpool.tiers.TransferRunner`` over the pool's caches
and its ``HostStorage`` (page-major, pinned on CUDA), in the documented
order: offloads, loads, then copy-on-write copies. Every call that can queue
a transfer runs them before it returns, under the pool's lock, so no queue is
ever left for the engine to drain and no page a transfer reads can be handed
out by another thread first. On CPU the bytes have moved when the call
returns; on CUDA they are queued on the runner's copy stream and the caller's
current stream waits for them (an event, no host sync), so every kernel the
engine queues afterwards on that stream sees the pages (docs/tiers.md, "How
an engine waits").

A pool without a tier (``host_pages`` 0 or not given) has ``_transfers``
None: each call pays one attribute test and nothing else.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpool.errors import InvalidArgumentError
from kvpool.handle_args import frozen_handles
from kvpool.streams import refuse_capture
from kvpool.tiers.host_storage import HostStorage, host_page_bytes, host_pages_for_bytes
from kvpool.tiers.transfers import TransferBatch, TransferRunner

__all__ = ["HostTierMixin", "resolve_host_pages"]


def resolve_host_pages(pool: Any, host_pages: Any, host_memory_bytes: Any) -> int:
    """Host pages (reserved page 0 included) for ``KVPool(host_pages=, host_memory_bytes=)``; 0 = no tier.

    Raises:
        InvalidArgumentError: both given, a size that is not a non-negative
            int, or a byte budget below two pages.
    """
    if host_pages is not None and host_memory_bytes is not None:
        raise InvalidArgumentError("give at most one of host_pages or host_memory_bytes")
    if host_memory_bytes is not None:
        page = host_page_bytes(pool.num_layers, pool.page_size, pool.num_kv_heads, pool.head_dim, pool.dtype,
                               mla=pool.mla)
        return host_pages_for_bytes(host_memory_bytes, page)
    if host_pages is None:
        return 0
    if isinstance(host_pages, bool) or not isinstance(host_pages, (int, np.integer)) or host_pages < 0:
        raise InvalidArgumentError(f"host_pages must be a non-negative int (0: no host tier), got {host_pages!r}")
    return int(host_pages)


class HostTierMixin:
    """Mixin: ``KVPool``'s host tier (storage, transfers, swap, byte counters)."""

    allocator: Any
    device: Any
    _lock: Any
    _to_device: Any
    _enter_device_call: Any
    _write_prefixes: Any
    _sharing: bool  # read and set under _lock only (kvpool.sharing)
    _note_edit: Any  # (kvpool.row_edits)
    # Set by _init_host_tier: None without a tier.
    host: HostStorage | None = None
    _transfers: TransferRunner | None = None

    def _init_host_tier(self, host_pages: int) -> None:
        """Build the host storage and the transfer runner (after the caches exist)."""
        if host_pages == 0:
            return
        self.host = HostStorage.for_pool(self, host_pages=host_pages)
        self._transfers = TransferRunner.for_pool(self, self.host)

    def _refuse_transfers_in_capture(self, what: str, policy: str) -> None:
        """Refuse, before the core changes anything, a call that queues transfers under
        ``policy`` while the caller's stream is capturing (CUDA pools with a tier only):
        the copy stream would join the capture, the offloads would be recorded into the
        graph and the pinned ring's event recorded inside it."""
        if self._transfers is not None and self._to_device is not None and self.allocator.host_policy == policy:
            refuse_capture(self.device, what)

    def _run_transfers(self) -> TransferBatch | None:
        """Run what the last core call queued: offloads, then loads. The caller
        holds the lock and runs its own copy-on-write copies after this (on
        CUDA on its current stream, which already waits for these). If the
        transfer fails, the prefix cache is cleared (both tiers) before the
        error is raised."""
        runner = self._transfers
        if runner is None:
            return None
        alloc = self.allocator
        try:  # (the takes inside: an interrupt landing after one must not lose its transfers unseen)
            off = alloc.take_offloads()
            ld = alloc.take_loads()
            if not len(off[0]) and not len(ld[0]):
                return None
            return runner.run(offloads=off, loads=ld)
        except BaseException:
            # The core already counts these pages as holding the entries they were to
            # receive (an offload's host page, a load's device page): drop every entry,
            # on both tiers, so that a later prompt misses instead of hitting bytes that
            # never arrived. The requests' own pages are not the index's to drop.
            alloc.clear_cache()
            raise

    # ----- swap -----------------------------------------------------------------

    def swap_out(self, handles: Any) -> None:
        """Move requests' pages to host memory and free their device pages.
        See ``SlotAllocator.swap_out``; holds the pool's lock.

        The pool adds: the offloads run (CPU) or are queued on the copy stream
        (CUDA) before this returns, so the freed device pages can be written by
        the next step at once.

        Raises:
            TensorDeviceError: called while a CUDA graph is being captured on the
                pool's device (before anything changes).
        """
        handles = frozen_handles(handles)  # (read again after the core commits: convert once)
        with self._lock:
            if self._to_device is not None:
                self._enter_device_call("swap_out")
            self.allocator.swap_out(handles)
            self._note_edit(handles)
            self._run_transfers()

    def swap_in(self, handles: Any) -> None:
        """Bring swapped-out requests back onto device pages.
        See ``SlotAllocator.swap_in``; holds the pool's lock.

        The pool adds: the loads run (CPU) or are queued ahead of the caller's
        stream (CUDA), and each request's ``req_to_token`` row is rewritten
        (its pages changed), so after this every position reads bitwise the
        K/V it held before ``swap_out`` (a registered page whose entry's copy a
        duplicate registration of the same tokens replaced meanwhile comes back
        as that copy, as ``SlotAllocator.swap_in`` says).

        Raises:
            TensorDeviceError: called while a CUDA graph is being captured on the
                pool's device (before anything changes).
            If the loads or the table write fail after the allocator committed (a
            CUDA OOM or launch error, a KeyboardInterrupt), the requests are swapped
            out again, their K/V with them (what a failed load brought), and the error
            is raised (should the host have no room for that either, they stay on the
            device: close them).
        """
        handles = frozen_handles(handles)  # (read again after the core commits: convert once)
        with self._lock:
            if self._to_device is not None:
                self._enter_device_call("swap_in")
            self.allocator.swap_in(handles)
            try:  # (from the core's commit on: an interrupt there must not leave rows naming old pages)
                # A page whose entry another request's registration took over meanwhile comes
                # back as that request's page: both hold it, so extends must copy on write.
                self._sharing = True
                self._note_edit(handles)  # (their pages moved, whatever follows)
                self._run_transfers()
                hs = np.asarray(handles, dtype=np.int64).reshape(-1)  # valid: the core took them
                self._write_prefixes(hs, np.asarray(self.allocator.lengths(hs), dtype=np.int64))
            except BaseException:
                # Left on the device, the requests' rows would name the pages they had
                # before swap_out. Their offloads follow the loads just run (on CUDA on
                # the same copy stream), so the host gets back what was loaded.
                try:
                    self.allocator.swap_out(handles)  # (in the form swap_in just took)
                    self._run_transfers()
                except BaseException:  # noqa: BLE001 - the original error is the one to raise
                    pass
                raise

    def is_swapped(self, handle: Any) -> bool:
        """Whether the request is swapped out. See ``SlotAllocator.is_swapped``."""
        return self.allocator.is_swapped(handle)

    # ----- counters -------------------------------------------------------------

    @property
    def offload_bytes(self) -> int | None:
        """K/V bytes moved device -> host so far (every layer); None without a host tier."""
        if self.host is None:
            return None
        return int(self.allocator.offloaded_pages) * self.host.page_bytes

    @property
    def load_bytes(self) -> int | None:
        """K/V bytes moved host -> device so far (every layer); None without a host tier."""
        if self.host is None:
            return None
        return int(self.allocator.loaded_pages) * self.host.page_bytes
