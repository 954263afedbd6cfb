"""``KVPool.admit``: a scheduler step's new requests, opened and prefilled in one call."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvpool.staging import ToDevice
from kvpool.tables import ExtendResult, update_req_to_token


class AdmissionMixin:
    """Mixin: ``KVPool``'s one-call admission of new requests."""

    allocator: Any
    req_to_token: torch.Tensor
    _table_np: np.ndarray | None  # the CPU req_to_token as numpy; None on a device
    _to_device: ToDevice | None
    _lock: Any  # the pool's RLock (see KVPool: threads)
    _enter_device_call: Any
    _transfers: Any  # the host tier's TransferRunner (None without a tier)
    _run_transfers: Any

    def admit(self, counts: Any, tokens: Any = None) -> tuple[np.ndarray, ExtendResult]:
        """Open ``len(counts)`` requests and extend request ``i`` by ``counts[i]`` tokens,
        writing their slots into ``req_to_token``. See ``SlotAllocator.admit``;
        holds the pool's lock.

        The pool adds the table write (on CUDA one host -> device copy and one
        table-kernel launch, as ``extend``) and the device result.

        Returns:
            ``(handles, ExtendResult(slots, out_cache_loc))``.

        Raises:
            TensorDeviceError: called while a CUDA graph is being captured on
                the pool's device (its host -> device copy cannot be captured).
            Atomic as the allocator's call. If the device table update or a host
            tier's transfer fails after the allocator committed (a CUDA OOM or launch
            error), the new requests are emptied, last first, so their pages go back
            on the free stack in their old order, and closed.
        """
        with self._lock:
            if self._to_device is not None:  # CUDA (staged through the pinned ring)
                self._enter_device_call("admit")
            if self._table_np is not None:  # a CPU table: the core writes the rows
                handles, slots = self.allocator.admit(counts, table=self._table_np, tokens=tokens)
                try:
                    if self._transfers is not None:  # the evictions' offloads
                        self._run_transfers()
                    return handles, self._own_result(slots)
                except BaseException:
                    self._close_admitted(handles)
                    raise
            handles, packed, num_requests = self.allocator.admit_packed(counts, tokens=tokens)
            try:
                slots, dev = update_req_to_token(self.req_to_token, packed, num_requests, self._to_device)
                if self._transfers is not None:  # the evictions' offloads
                    self._run_transfers()
                return handles, self._own_result(slots, dev)
            except BaseException:
                self._close_admitted(handles)
                raise

    def _close_admitted(self, handles: np.ndarray) -> None:
        """Undo a committed admit whose table write, transfer or result failed: the caller
        never got the handles, so the requests are emptied, last first (their pages go back
        on the free stack in their old order), and closed. The evictions' offloads run
        first, whatever happened (best effort: one may just have failed, which clears the
        prefix cache), so no host page claims bytes it never got."""
        try:
            self._run_transfers()
        except BaseException:  # noqa: BLE001 - the original error is the one to raise
            pass
        back = np.asarray(handles, dtype=np.int64)[::-1].copy()
        self.allocator.truncate(back, 0)
        self.allocator.close(back)
