"""Type stubs of kvpool._core, the Rust extension (kept true by tests/test_allocator_stubs.py)."""

from typing import Any, Optional, Sequence, Tuple, Union, final

import numpy as np
import numpy.typing as npt

__all__ = [
    "KVPoolError",
    "PoolExhaustedError",
    "InvalidHandleError",
    "TooManyRequestsError",
    "ContextTooLongError",
    "InvariantError",
    "InvalidArgumentError",
    "PoolStats",
    "SlotAllocator",
    "__version__",
]
__version__: str

# Batch arguments: a Python int (broadcast / single handle), a sequence of
# ints, a 1-D numpy integer array of any int dtype, or a CPU torch tensor.
_IntArray = Union[int, np.integer[Any], Sequence[int], npt.NDArray[np.integer[Any]], Any]
_Handle = Union[int, np.integer[Any]]

class KVPoolError(Exception): ...
class PoolExhaustedError(KVPoolError): ...
class InvalidHandleError(KVPoolError): ...
class TooManyRequestsError(KVPoolError): ...
class ContextTooLongError(KVPoolError): ...
class InvalidArgumentError(KVPoolError, ValueError): ...
class InvariantError(KVPoolError): ...

@final
class PoolStats:
    """The changing counters of a SlotAllocator, read together under one lock (``SlotAllocator.stats()``)."""

    @property
    def free_pages(self) -> int: ...
    @property
    def used_pages(self) -> int: ...
    @property
    def free_slots(self) -> int: ...
    @property
    def used_slots(self) -> int: ...
    @property
    def open_requests(self) -> int: ...
    @property
    def admissible_tokens(self) -> int: ...
    @property
    def metadata_bytes(self) -> int: ...

@final
class SlotAllocator:
    """SlotAllocator(num_pages, page_size=1, max_requests=256, max_context_len=4096)

    Owns which slots each request holds: free pages, per-request page lists,
    page owners. Thread-safe (one internal lock; batch calls release the GIL).

    Args:
        num_pages: total pages, reserved page 0 included (>= 2).
        page_size: slots per page (>= 1).
        max_requests: most requests open at once.
        max_context_len: most tokens per request.

    Raises:
        InvalidArgumentError: a size is zero, negative or too large.
    """

    def __new__(
        cls,
        num_pages: int,
        page_size: int = 1,
        max_requests: int = 256,
        max_context_len: int = 4096,
    ) -> SlotAllocator: ...
    @property
    def page_size(self) -> int:
        """Slots per page (P): slot = page * P + offset."""
    @property
    def num_pages(self) -> int:
        """Total pages, the reserved page 0 included."""
    @property
    def num_slots(self) -> int:
        """num_pages * page_size: slot ids are in [0, num_slots)."""
    @property
    def max_requests(self) -> int:
        """Most requests open at once (rows of a request-to-token table)."""
    @property
    def max_context_len(self) -> int:
        """Most tokens one request may hold."""
    @property
    def free_pages(self) -> int:
        """Pages on the free list."""
    @property
    def used_pages(self) -> int:
        """Pages held by open requests."""
    @property
    def capacity_pages(self) -> int:
        """Pages requests can ever hold: num_pages - 1 (page 0 is reserved)."""
    @property
    def free_slots(self) -> int:
        """free_pages * page_size."""
    @property
    def used_slots(self) -> int:
        """Slots in held pages (including the unfilled tail of each last page)."""
    @property
    def capacity_slots(self) -> int:
        """capacity_pages * page_size."""
    @property
    def open_requests(self) -> int:
        """Requests opened and not yet closed."""
    @property
    def admissible_tokens(self) -> int:
        """Tokens that can surely still be appended (a lower bound)."""
    @property
    def metadata_bytes(self) -> int:
        """Heap bytes of the allocator's bookkeeping."""
    def stats(self) -> PoolStats:
        """The changing counters (free_pages, used_pages, free_slots, used_slots,
        open_requests, admissible_tokens, metadata_bytes) read under one lock,
        so they agree with each other even while other threads work.
        """
    def open(self, n: int = 1) -> npt.NDArray[np.int64]:
        """Opens n empty requests (no pages until they grow).

        Returns:
            int64 array of n handles ((generation << 32) | row).

        Raises:
            TooManyRequestsError: more than max_requests would be open.
            InvalidArgumentError: n is negative.
        """
    def extend(
        self,
        handles: _IntArray,
        counts: _IntArray,
        table: Optional[npt.NDArray[np.int32]] = None,
    ) -> npt.NDArray[np.int64]:
        """Grows each request by counts[i] tokens (or `counts` for all); a new page
        is taken only when a request's last page is full. Atomic.

        Args:
            handles: int, sequence or 1-D integer array of open handles (no duplicates).
            counts: int (for all) or one int per handle, >= 0.
            table: optional int32 2-D numpy array [>= max_requests, >= max_context_len]
                (e.g. req_to_token.numpy()): table[row, start:start+count] gets each
                request's new slots in the same call.

        Returns:
            the new slots, flattened in request order (int64).

        Raises:
            InvalidHandleError: a handle is unknown, closed or stale.
            PoolExhaustedError: not enough free pages (needed vs free in the message).
            ContextTooLongError: a request would pass max_context_len.
            InvalidArgumentError: negative count, mismatched lengths, duplicate
                handle, bad table. Nothing changes on any error.
        """
    def extend_with_starts(
        self, handles: _IntArray, counts: _IntArray
    ) -> Tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """extend, also returning each request's length before the call (int64).

        Raises:
            the same errors as extend; nothing changes on any error.
        """
    def extend_packed(
        self, handles: _IntArray, counts: _IntArray
    ) -> Tuple[npt.NDArray[np.int64], int]:
        """`extend` plus everything a device copy of the request-to-token table
        needs, in one crossing and one int64 array, so that one host-to-device
        copy ships it: `(packed, b)` with b = the number of requests and
        s = b rounded up to even, packed = [rows | starts | counts | offsets]
        (each s long, the padding zero) followed by the new slots. Every
        segment starts 16-byte aligned (Triton specializes pointers on it).

        Raises:
            the same errors as extend; nothing changes on any error.
        """
    def truncate(self, handles: _IntArray, lengths: _IntArray) -> None:
        """Shortens requests to lengths[i] tokens (or `lengths` for all), freeing
        pages no longer needed. Atomic.

        Raises:
            InvalidHandleError: a handle is unknown, closed or stale.
            InvalidArgumentError: a length is negative or past the request's
                length, mismatched lengths, duplicate handle.
        """
    def close(self, handles: _IntArray) -> None:
        """Closes requests and frees their pages; their handles become stale. Atomic.

        Raises:
            InvalidHandleError: a handle is unknown, already closed or stale.
            InvalidArgumentError: a duplicate handle.
        """
    def length(self, handle: _Handle) -> int:
        """Tokens the request holds.

        Raises:
            InvalidHandleError: unknown, closed or stale handle.
        """
    def lengths(self, handles: _IntArray) -> npt.NDArray[np.int64]:
        """Tokens each request holds.

        Raises:
            InvalidHandleError: a handle is unknown, closed or stale.
        """
    def slots(self, handle: _Handle) -> npt.NDArray[np.int64]:
        """Every slot of the request, in token order.

        Raises:
            InvalidHandleError: unknown, closed or stale handle.
        """
    def pages(self, handle: _Handle) -> npt.NDArray[np.int32]:
        """The pages the request holds, in token order.

        Raises:
            InvalidHandleError: unknown, closed or stale handle.
        """
    def page_table(
        self, handles: _IntArray
    ) -> Tuple[npt.NDArray[np.int32], npt.NDArray[np.int32], npt.NDArray[np.int32]]:
        """FlashInfer's CSR page table of a batch (int32 arrays): request i's pages
        are indices[indptr[i]:indptr[i+1]]; last_page_len[i] in [1, page_size]
        (0 for an empty request).

        Raises:
            InvalidHandleError: a handle is unknown, closed or stale.
        """
    def rows(self, handles: _IntArray) -> npt.NDArray[np.int64]:
        """Each request's row of a request-to-token table (fixed while it is open).

        Raises:
            InvalidHandleError: a handle is unknown, closed or stale.
        """
    def is_open(self, handle: _Handle) -> bool:
        """Whether the handle is an open request (False for closed or stale ones).

        Raises:
            InvalidArgumentError: handle is not an int.
        """
    def check(self) -> None:
        """Verifies every invariant: free + held = capacity, no page in two places,
        owners match holders, page 0 never handed out.

        Raises:
            InvariantError: an invariant is broken (a bug in kvpool).
        """
    def reset(self) -> None:
        """Closes every request and frees every page; all handles become stale."""
