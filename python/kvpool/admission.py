"""``KVPool.admit``: a scheduler step's new requests, opened and prefilled in one call."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvpool.transfer import ExtendResult, ToDevice, update_req_to_token


class AdmissionMixin:
    """Mixin: ``KVPool``'s one-call admission of new requests."""

    allocator: Any
    req_to_token: torch.Tensor
    _table_np: np.ndarray | None  # the CPU req_to_token as numpy; None on a device
    _to_device: ToDevice | None

    def admit(self, counts: Any, tokens: Any = None) -> tuple[np.ndarray, ExtendResult]:
        """Open ``len(counts)`` requests and extend request ``i`` by ``counts[i]``
        tokens, writing their slots into ``req_to_token``: ``open`` then ``extend``
        in one crossing into the core (on CUDA, one H2D copy and one table-kernel
        launch, as ``extend``).

        Args:
            counts: one int >= 0 per new request (a sequence or 1-D integer array).
            tokens: optional token ids of the new positions (the prompts'),
                flattened like the slots; positions without ids make their pages
                uncacheable.

        Returns:
            ``(handles, ExtendResult(slots, out_cache_loc))``.

        Raises:
            TooManyRequestsError: fewer than ``len(counts)`` rows are free.
            PoolExhaustedError: not enough free or evictable pages.
            ContextTooLongError: a count is past ``max_context_len``.
            InvalidArgumentError: counts is not a sequence of ints >= 0 (a single
                int is refused), or token ids of the wrong length or range.
            Atomic: on any of these no request is opened and nothing changes. If
            the device table update itself fails after the allocator committed
            (a CUDA OOM or launch error), the new requests are emptied, last first,
            so their pages go back on the free stack in their old order, and closed.
        """
        if self._table_np is not None:  # a CPU table: the core writes the rows
            handles, slots = self.allocator.admit(counts, table=self._table_np, tokens=tokens)
            return handles, self._own_result(slots)
        handles, packed, num_requests = self.allocator.admit_packed(counts, tokens=tokens)
        try:
            slots, dev = update_req_to_token(self.req_to_token, packed, num_requests, self._to_device)
        except BaseException:
            back = handles[::-1].copy()
            self.allocator.truncate(back, 0)
            self.allocator.close(back)
            raise
        return handles, self._own_result(slots, dev)
