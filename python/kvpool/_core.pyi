"""Type stubs of kvpool._core, the Rust extension (kept true by tests/test_allocator_stubs.py)."""

from collections.abc import Sequence
from typing import Any, Literal, NoReturn, TypeAlias, final, overload

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
    "RequestSwappedOutError",
    "RollbackUnavailableError",
    "PoolStats",
    "_pool_stats",
    "_fork_prepare",
    "_fork_release",
    "SlotAllocator",
    "GroupedAllocator",
    "__version__",
    "DEFAULT_PRIORITY",
    "MAX_PRIORITY",
    "MAX_PAGES",
    "MAX_REQUESTS",
    "MAX_CONTEXT_LEN",
    "encode_kv_events",
    "page_hashes",
    "scatter_rows",
]
__version__: str
DEFAULT_PRIORITY: int
MAX_PRIORITY: int
# The bounds of a pool's shape: num_pages (reserved page 0 included), max_requests, max_context_len.
MAX_PAGES: int
MAX_REQUESTS: int
MAX_CONTEXT_LEN: int

# Batch arguments: a Python int (broadcast / single handle), a sequence of
# ints, a 1-D numpy integer array of any int dtype, or a CPU torch tensor.
_IntArray: TypeAlias = int | np.integer[Any] | Sequence[int] | npt.NDArray[np.integer[Any]] | Any
_Handle: TypeAlias = int | np.integer[Any]

class KVPoolError(Exception): ...
class PoolExhaustedError(KVPoolError): ...
class InvalidHandleError(KVPoolError): ...
class TooManyRequestsError(KVPoolError): ...
class ContextTooLongError(KVPoolError): ...
class InvalidArgumentError(KVPoolError, ValueError): ...
class InvariantError(KVPoolError): ...
class RequestSwappedOutError(KVPoolError): ...
class RollbackUnavailableError(KVPoolError): ...

@final
class PoolStats:
    """The pool's changing counters, read together under one lock (so they agree
    with each other, unlike separate property reads while other threads run).

    Pickles by field name. A snapshot pickled by an older kvpool loads with the
    fields it lacks at their defaults (that kvpool did not record them):
    dropped_events 0, evictable_pages_by_priority [] (empty, not 101 zeros,
    which would contradict evictable_pages). A snapshot pickled by a newer
    kvpool loads with the fields this one knows; the others are dropped."""

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
    @property
    def cached_pages(self) -> int: ...
    @property
    def evictable_pages(self) -> int: ...
    @property
    def hit_tokens(self) -> int: ...
    @property
    def miss_tokens(self) -> int: ...
    @property
    def pinned_pages(self) -> int: ...
    @property
    def host_free_pages(self) -> int: ...
    @property
    def host_cached_pages(self) -> int: ...
    @property
    def host_hit_tokens(self) -> int: ...
    @property
    def offloaded_pages(self) -> int: ...
    @property
    def loaded_pages(self) -> int: ...
    # 0 in a snapshot unpickled from a kvpool before it (17 counters).
    @property
    def dropped_events(self) -> int: ...
    # 101 counts, priority 0..100 (SlotAllocator.evictable_pages_by_priority); they add up
    # to evictable_pages, being read in the same snapshot. [] in a snapshot unpickled from
    # a kvpool before it (17 counters): that kvpool did not record them.
    @property
    def evictable_pages_by_priority(self) -> list[int]: ...
    # Compares every counter; pickles (a snapshot sent to a metrics or scheduler process).
    def __eq__(self, value: object, /) -> bool: ...
    __hash__: None  # type: ignore[assignment]
    # (_pool_stats, ({field: value, ...},)): by name, so that versions add fields.
    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]: ...

@final
class SlotAllocator:
    """SlotAllocator(num_pages, page_size=1, max_requests=256, max_context_len=4096, *, hash_seed=None, handle_seed=None, kv_events=True, max_pinned_pages=None, manual_clock=False, host_pages=0, host_policy="write_back", lazy_metadata=False)

    Owns which slots each request holds: free pages, per-request page lists,
    shared pages (refcounts, a prefix cache with LRU eviction and retention
    priorities, copy-on-write), and optionally a host tier below the device
    pages. Thread-safe (one internal lock; batch calls release the GIL).

    Args:
        num_pages: total pages, reserved page 0 included (>= 2).
        page_size: slots per page (>= 1).
        max_requests: most requests open at once (<= 2**20).
        max_context_len: most tokens per request (<= 2**28).
        hash_seed: seed of the prefix-cache page hash (random when None).
        handle_seed: seed of the handle generations (random when None): pools
            built with the same seed and making the same calls hand out the
            same handles (tensor-parallel ranks).
        kv_events: record KV events for take_events(). Without them the prefix
            index keys pages by a cheaper internal chain (chain_hashes() still
            gives the xxh3 chain hashes events and page_hashes() use).
        max_pinned_pages: most cached pages that may be pinned at once (<=
            capacity_pages; None: a quarter of it). A pin past it is given
            priority 99 instead.
        manual_clock: retention durations (cache(retain_s=)) run on a clock
            that only set_clock moves (tests; tensor-parallel ranks, which
            must agree on time), not the system's monotonic clock.
        host_pages: host pages of a host tier, the reserved host page 0
            included (0: no tier, and everything behaves as without one;
            otherwise >= 2). Cached pages then live on the device, the host
            or both; the core queues the transfers (take_offloads,
            take_loads) and swap_out / swap_in move whole requests.
        host_policy: "write_back" (a cached page goes to the host when device
            eviction would drop it) or "write_through" (when cache()
            registers it).
        lazy_metadata: map the per-page and per-slot metadata on first use
            instead of at construction (and let the prefix index grow with its
            registrations instead of reserving it for every page at the first
            cache()), and skip priming the heap for result arrays: for a pool
            sized far beyond what it will hold. Its first requests then pay the
            page faults that construction otherwise takes (docs/allocator.md).
            The free page stack (4 bytes a page) is written at construction
            either way: 4 GiB and seconds at 2**30 pages.

    Raises:
        InvalidArgumentError: a size is zero, negative or too large, a seed
            is not an int in [0, 2**64), host_pages is 1, or host_policy is
            neither policy.
    """

    def __copy__(self) -> NoReturn:
        """Raises CopyRefusedError: a copy would hand out the same pages (fork a request instead)."""
    def __deepcopy__(self, _memo: Any, /) -> NoReturn:
        """Raises CopyRefusedError, as ``__copy__``."""
    def __replace__(self, **_changes: Any) -> NoReturn:
        """Raises CopyRefusedError, as ``__copy__`` (Python 3.13's ``copy.replace``)."""

    def __new__(
        cls,
        num_pages: int,
        page_size: int = 1,
        max_requests: int = 256,
        max_context_len: int = 4096,
        *,
        hash_seed: int | None = None,
        handle_seed: int | None = None,
        kv_events: bool = True,
        max_pinned_pages: int | None = None,
        manual_clock: bool = False,
        host_pages: int = 0,
        host_policy: str = "write_back",
        lazy_metadata: bool = False,
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
    def host_pages(self) -> int:
        """Host pages of the host tier, the reserved host page 0 included (0: no tier)."""
    @property
    def host_policy(self) -> str | None:
        """The host tier's policy: "write_back" or "write_through" (None without a tier)."""
    @property
    def free_pages(self) -> int:
        """Pages an extend can take now: FREE + CACHED (evictable); pinned cached
        pages are not.
        """
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
        """free_slots: tokens that fit in whole free or evictable pages (pinned
        cached pages are not counted). One new request of this many tokens
        fits (of at most max_context_len: a longer one is refused as too
        long, whatever is free); a batch is a page count, not a token count: each request takes
        pages_for(length + n) - pages_for(length) (a new one starts a page),
        plus one copy when it writes into a partly filled last page that is
        shared (fork, a queued copy's source).
        """
    @property
    def metadata_bytes(self) -> int:
        """Heap bytes of the allocator's bookkeeping."""
    def stats(self) -> PoolStats:
        """The changing counters (free_pages, used_pages, free_slots, used_slots,
        open_requests, admissible_tokens, metadata_bytes, the cache's and the
        host tier's, dropped_events, and evictable_pages_by_priority as a list
        of 101) read under one lock, so they agree with each other even while
        other threads work: the priority counts add up to evictable_pages.
        """
    def open(self, n: int = 1) -> npt.NDArray[np.int64]:
        """Opens n empty requests (no pages until they grow).

        Returns:
            int64 array of n handles ((generation << 32) | row).

        Raises:
            TooManyRequestsError: more than max_requests would be open.
            InvalidArgumentError: n is negative.
        """
    # The return depends on cow=: the slots (a new array, or out itself), or with
    # cow=True the pair (slots, cow work or None).
    @overload
    def extend(
        self,
        handles: _IntArray,
        counts: _IntArray,
        table: npt.NDArray[np.int32] | None = None,
        tokens: _IntArray | None = None,
        cow: Literal[False] = False,
        out: npt.NDArray[np.int64] | None = None,
    ) -> npt.NDArray[np.int64]:
        """Grows each request by counts[i] tokens (or `counts` for all); a new page
        is taken only when a request's last page is full (FREE pages first,
        then the least recently used cached page). Atomic.

        Args:
            handles: int, sequence or 1-D integer array of open handles (no duplicates).
            counts: int (for all) or one int per handle, >= 0.
            table: optional int32 2-D numpy array [>= max_requests, >= max_context_len]
                (e.g. req_to_token.numpy()): table[row, start:start+count] gets each
                request's new slots in the same call (and the new slots of
                positions a copy-on-write moved).
            tokens: optional token ids of the new positions, flattened like the
                slots (one per new position, in [0, 2^31)). Positions covered by
                the prompt given to open_with_prefix take its ids (given ids must
                agree); positions without ids make their pages uncacheable.
            cow: also return the copy-on-write work of this call: None, or an
                int64 array [rows | positions | src_slots | dst_slots] (m each).
                Without cow=True the copies stay queued for take_copies().
            out: optional writeable, contiguous 1-D int64 numpy array with room for
                every new slot (sum(counts), or counts * len(handles) for one count),
                kept from call to call so that a step allocates nothing: the new
                slots go to out[:n] and the rest of out is left as it was. Written
                only if the call succeeds.
            table and out are written in place, possibly with the GIL released: no
            other thread may resize or free them (or their torch owner) during the
            call, as with any buffer handed to native code.

        Returns:
            the new slots, flattened in request order (int64), as a new array;
            with out=, out itself (the whole buffer: the slots are its first n
            entries). With cow=True, (slots, cow).

        Raises:
            InvalidHandleError: a handle is unknown, closed or stale.
            RequestSwappedOutError: a request is swapped out (swap_in first).
            PoolExhaustedError: not enough free or evictable pages (needed vs free).
            ContextTooLongError: a request would pass max_context_len.
            InvalidArgumentError: negative count, mismatched lengths, duplicate
                handle, bad table, tokens of the wrong length or range, or
                disagreeing with the prompt, or an out array that is too short,
                not contiguous int64, read-only or overlapping the table.
                Nothing changes on any error.
        """
    @overload
    def extend(
        self,
        handles: _IntArray,
        counts: _IntArray,
        table: npt.NDArray[np.int32] | None,
        tokens: _IntArray | None,
        cow: Literal[True],
        out: npt.NDArray[np.int64] | None = None,
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64] | None]: ...
    @overload
    def extend(
        self,
        handles: _IntArray,
        counts: _IntArray,
        table: npt.NDArray[np.int32] | None = None,
        tokens: _IntArray | None = None,
        *,
        cow: Literal[True],
        out: npt.NDArray[np.int64] | None = None,
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64] | None]: ...
    @overload
    def extend(
        self,
        handles: _IntArray,
        counts: _IntArray,
        table: npt.NDArray[np.int32] | None = None,
        tokens: _IntArray | None = None,
        cow: bool = False,
        out: npt.NDArray[np.int64] | None = None,
    ) -> npt.NDArray[np.int64] | tuple[npt.NDArray[np.int64], npt.NDArray[np.int64] | None]: ...
    def admit(
        self,
        counts: _IntArray,
        table: npt.NDArray[np.int32] | None = None,
        tokens: _IntArray | None = None,
        out: npt.NDArray[np.int64] | None = None,
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Opens len(counts) new requests and extends request i by counts[i]
        tokens: open(len(counts)) followed by extend(handles, counts, ...),
        in one call, as a scheduler step admits its new requests. Atomic: on
        any error no request is opened and nothing changes.

        Args:
            counts: one int >= 0 per new request (a sequence or 1-D integer
                array; a single int is refused: pass [n] for one request).
            table, tokens, out: as in extend (table rows of the new requests
                get their slots; tokens are the prompts' ids, flattened; out
                receives the slots, kept from step to step).

        Returns:
            (handles, slots): the int64 handles, and the new slots flattened in
            request order (with out=, out itself: the slots are its first
            sum(counts) entries).

        Raises:
            TooManyRequestsError: fewer than len(counts) rows are free.
            PoolExhaustedError: not enough free or evictable pages.
            ContextTooLongError: a count is past max_context_len.
            InvalidArgumentError: counts is not a sequence of ints >= 0, or a
                bad table, tokens or out (as in extend).
        """
    def admit_packed(
        self,
        counts: _IntArray,
        tokens: _IntArray | None = None,
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], int]:
        """admit, returning the new requests' table update in extend_packed's
        form (packed = [rows | starts | counts | offsets] then the slots), so
        that one host-to-device copy ships it. Atomic: on any error no
        request is opened and nothing changes.

        Raises:
            the same errors as admit; nothing changes on any error.
        """
    def extend_with_starts(
        self, handles: _IntArray, counts: _IntArray
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """extend, also returning each request's length before the call (int64).

        Raises:
            the same errors as extend; nothing changes on any error.
        """
    def extend_packed(
        self, handles: _IntArray, counts: _IntArray, tokens: _IntArray | None = None
    ) -> tuple[npt.NDArray[np.int64], int, npt.NDArray[np.int64] | None]:
        """`extend` plus everything a device copy of the request-to-token table
        needs, in one crossing and one int64 array, so that one host-to-device
        copy ships it: b = the number of requests and s = b rounded up to
        even, packed = [rows | starts | counts | offsets] (each s long, the
        padding zero) followed by the new slots. Every segment starts 16-byte
        aligned (Triton specializes pointers on it). `cow` is None, or the
        copy-on-write work as in extend(cow=True) (the table entries of the
        moved positions are not in `packed`: write them from `cow`).

        Raises:
            the same errors as extend; nothing changes on any error.
        """
    def truncate(self, handles: _IntArray, lengths: _IntArray) -> None:
        """Shortens requests to lengths[i] tokens (or `lengths` for all), freeing
        pages no longer needed. A request shortened to inside the prompt it was
        opened with (open_with_prefix) forgets the prompt from there: later
        positions take the token ids extend is given (or are unknown), and
        cache() registers what they hold. Atomic.

        Raises:
            InvalidHandleError: a handle is unknown, closed or stale.
            RequestSwappedOutError: a request is swapped out.
            InvalidArgumentError: a length is negative or past the request's
                length, mismatched lengths, duplicate handle.
        """
    def roll_back_extend(self, handles: _IntArray, lengths: _IntArray) -> None:
        """Shortens requests back to the lengths they had before an extend whose
        step never ran (a table update that failed after the extend
        committed), as truncate does, except that each request keeps the
        prompt it was opened with (open_with_prefix): a retried extend takes
        the prompt's token ids again and cache() can register them. Pages the
        extend evicted stay evicted, and a copy-on-write copy it made stays
        the request's page. Atomic.

        Raises:
            InvalidHandleError: a handle is unknown, closed or stale.
            RequestSwappedOutError: a request is swapped out.
            InvalidArgumentError: a length is negative or past the request's
                length, mismatched lengths, duplicate handle.
        """
    def close(self, handles: _IntArray, cache: bool = False, priority: _IntArray | None = None,
              retain_s: float | None = None) -> None:
        """Closes requests and releases their pages; their handles become stale.
        With cache=True, first registers each request's full pages of known
        tokens in the prefix cache (as cache()), so they stay reusable, with
        cache()'s priority and retain_s if given. A swapped-out request
        releases its host pages too. Atomic.

        Raises:
            InvalidHandleError: a handle is unknown, already closed or stale.
            RequestSwappedOutError: cache=True for a swapped-out request.
            InvalidArgumentError: a duplicate handle; a priority or retain_s
                as cache() refuses them, or given without cache=True.
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
            RequestSwappedOutError: the request is swapped out.
        """
    def pages(self, handle: _Handle) -> npt.NDArray[np.int32]:
        """The pages the request holds, in token order.

        Raises:
            InvalidHandleError: unknown, closed or stale handle.
            RequestSwappedOutError: the request is swapped out.
        """
    def page_table(
        self, handles: _IntArray
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32], npt.NDArray[np.int32]]:
        """FlashInfer's CSR page table of a batch (int32 arrays): request i's pages
        are indices[indptr[i]:indptr[i+1]]; last_page_len[i] in [1, page_size]
        (0 for an empty request).

        Raises:
            InvalidHandleError: a handle is unknown, closed or stale.
            RequestSwappedOutError: a request is swapped out.
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
        """Closes every request (a swapped-out one's host pages too) and releases
        the pages they hold; all handles become stale. The prefix cache stays:
        registered pages remain cached on both tiers, pinned ones pinned
        (clear_cache() drops them).
        """
    def open_with_prefix(
        self,
        tokens: _IntArray,
        lengths: _IntArray,
        salt: _IntArray | None = None,
        table: npt.NDArray[np.int32] | None = None,
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Opens one request per prompt, each starting on the longest cached
        prefix of full pages of its prompt, capped so that at least one token
        is left to compute (cached_len <= length - 1, rounded down to a page).
        Each request's length is its cached_len; its slots, pages and page
        table show the shared pages. The prompt's token ids are remembered:
        later extends take them. With a host tier, cached_lens count host
        hits too: a page whose only copy is on the host takes a device page
        (which may evict and, under "write_back", offload another) and
        queues its load (take_loads); a host hit that finds no device page
        ends that prompt's match (a miss, not an error). Atomic.

        Args:
            tokens: the prompts' token ids concatenated (ints in [0, 2^31)).
            lengths: each prompt's length.
            salt: None (0), an int for all, or one int per prompt (LoRA id,
                tenant, cache salt): different salts never share pages.
            table: optional int32 request-to-token table, as for extend: each
                new request's row gets the slots of its cached prefix
                (table[row, :cached_len]), so it need not read them back.

        Returns:
            (handles int64, cached_lens int64).

        Raises:
            InvalidArgumentError: tokens and lengths disagree, a negative length,
                a token id out of range, a salt of the wrong type or count, a
                bad table.
            ContextTooLongError: a prompt longer than max_context_len.
            TooManyRequestsError: not enough free rows.
        """
    def cache(
        self, handles: _IntArray, priority: _IntArray | None = None, retain_s: float | None = None
    ) -> None:
        """Registers every full page of each request whose token ids are all
        known and that is not registered yet, so later prompts can hit it.
        Call it once the step that wrote those pages has run. If the same
        content is registered already, the existing copy is kept. With a
        host tier under "write_through", each page registered also gets a
        host copy (an offload, take_offloads). Atomic.

        With a priority, every page of each request's cached prefix (its own
        registered pages, or the copy kept of one it duplicated) also gets that
        retention priority, for retain_s seconds on the pool's clock (None: no
        end). Eviction takes the lowest priority first, least recently used
        within one. Pages no caller gave a priority have DEFAULT_PRIORITY (35,
        as TensorRT-LLM); without a priority, pages keep theirs. A page keeps
        the highest priority callers gave it (at equal priority, the later
        end); when its retain_s is over it has the default again. Priority 100
        with no retain_s pins: the page is never evicted nor counted free
        until unpin() or clear_cache(); past max_pinned_pages pinned pages, a
        pin is given 99 instead (pinned_pages says how many hold).

        Args:
            priority: an int in [0, 100] for all, or one per request.
            retain_s: seconds (> 0) the priority lasts; needs a priority.

        Raises:
            InvalidHandleError: a handle is unknown, closed or stale.
            RequestSwappedOutError: a request is swapped out.
            InvalidArgumentError: a duplicate handle; a priority outside [0, 100]
                or not one per request; retain_s not a number in (0, 1e9], or
                given without a priority.
        """
    def fork(
        self, handle: _Handle, n: int | None = None, table: npt.NDArray[np.int32] | None = None
    ) -> npt.NDArray[np.int64]:
        """Opens n requests that share all of `handle`'s pages and known tokens
        (same length, prompt and salt). A shared, partly filled last page is
        copy-on-write: the first holder to extend into it gets a copy.
        With `table` (an int32 request-to-token table, as for extend), each
        new request's row gets its slots (the parent's, table[row, :length]).

        Raises:
            InvalidHandleError: `handle` is unknown, closed or stale.
            RequestSwappedOutError: `handle` is swapped out.
            TooManyRequestsError: not enough free rows.
            InvalidArgumentError: n is negative or not an int, a bad table.
        """
    def take_copies(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Drains the queued copy-on-write copies (int64 slot pairs). Copy every
        layer's K and V from src[i] to dst[i], in order, before the next write
        into the destination pages. Each source page stays held until its copy
        is taken here, so no later call frees or rewrites it meanwhile; a copy
        whose destination page its requests released (close, truncate, reset)
        is dropped, so the queue holds at most one page's copy (fewer than
        page_size slot pairs) per held page however long it is left. KVPool
        does this inside extend.
        """
    def evict(self, n_pages: int) -> int:
        """Evicts up to n_pages cached pages nobody holds, the lowest retention
        priority first and least recently used within one (a chain's tail
        before its parents), never a pinned page; they become free. Returns
        how many were evicted. With a host tier a page's entry keeps its host
        copy, and under "write_back" one without is offloaded.

        Raises:
            InvalidArgumentError: n_pages is negative or not an int.
        """
    def clear_cache(self) -> None:
        """Drops every prefix-index entry: cached pages become free (pinned ones
        too: nothing is pinned or has a priority after it), held pages stay
        with their requests (on both tiers). Records one Cleared event.
        Queued copies and transfers stay: they fill open requests' pages.
        """
    def take_events(self) -> dict[str, npt.NDArray[Any]]:
        """Drains the KV events (what vLLM's KVEventBatch carries), oldest
        first, one numpy array per field: kind (uint8: 0 Stored, 1 Removed,
        2 Cleared), hash_hi / hash_lo (uint64 halves of the 128-bit page
        hash), parent_hi / parent_lo (the parent page's hash, 0 for a chain's
        first page), page (int32), num_tokens (int32), salt (int64),
        token_ids (int32, the Stored events' tokens concatenated), and medium
        (uint8: the tier a Stored or Removed event is about and whose page id
        `page` is, 0 device, 1 host; 0 for Cleared; encode_kv_events sends
        them as "GPU" and "CPU"). Past max(num_pages, 65536) undrained events
        the backlog is replaced by one Cleared event (dropped_events counts
        what went). The arrays are allocated before anything is drained: a
        MemoryError leaves every event in the pool for the next drain.

        Raises:
            RuntimeError: called during a drain of the same pool on the same
                thread (a finalizer that a garbage collection ran inside it).
        """
    def take_events_msgpack(
        self, ts: float, data_parallel_rank: int | None = None, int_block_hashes: bool = False
    ) -> tuple[bytes, int, int, int]:
        """take_events() and encode_kv_events() in one call, without building
        the arrays: drains the KV events and returns them as one msgpack
        KVEventBatch in vLLM's schema (what ZmqEventPublisher.publish sends);
        int_block_hashes as encode_kv_events. A payload that cannot be
        allocated raises MemoryError and keeps the drained events, which the
        next drain (of either kind) returns first.

        Returns:
            (payload, stored, removed, cleared), as encode_kv_events; with no
            event, a batch of none and three zeros.

        Raises:
            InvalidArgumentError: ts not a finite number, a data_parallel_rank
                not an int >= 0 (nothing is drained).
            RuntimeError: called during a drain of the same pool on the same
                thread (a finalizer that a garbage collection ran inside it).
        """
    def known_tokens(self, handle: _Handle) -> npt.NDArray[np.int32]:
        """The request's token ids of its leading known positions.

        Raises:
            InvalidHandleError: unknown, closed or stale handle.
        """
    def chain_hashes(
        self, handle: _Handle
    ) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.int32], int]:
        """The request's leading full pages of known token ids, for a prefix-aware
        transfer to another pool: their chain hashes (this pool's hash_seed),
        their token ids and the request's salt. The receiver matches them with
        match_chain_hashes / open_with_chain_hashes.

        Returns:
            (hashes uint64 [2n]: (hi, lo) of each page's 128-bit hash,
             tokens int32 [n * page_size], salt int).

        Raises:
            InvalidHandleError: unknown, closed or stale handle.
            InvalidArgumentError: the chain's tokens or hashes cannot be
                allocated.
        """
    def match_chain_hashes(
        self, hashes: npt.NDArray[np.integer[Any]], tokens: _IntArray, salt: int | None = None
    ) -> int:
        """How many leading pages of a chain (from another pool's chain_hashes)
        this pool caches on the device. A page matches only if the entry under its hash holds
        exactly the given tokens, the same salt and the matched parent, so a
        different hash_seed or a collision is a miss, never wrong KV. Read-only.

        Raises:
            InvalidArgumentError: hashes not (hi, lo) uint64 words, tokens not
                page_size per hash or out of range, a bad salt.
        """
    def open_with_chain_hashes(
        self,
        hashes: npt.NDArray[np.integer[Any]],
        tokens: _IntArray,
        salt: int | None = None,
        max_pages: int | None = None,
        length: int | None = None,
    ) -> tuple[int, int]:
        """Opens one request holding the leading pages of the chain this pool
        caches (at most max_pages; refcount + 1 each). Its length is
        cached_len = pages * page_size; the chain's tokens become its known
        prompt, so extending it records their ids and cache() can register
        them later. Atomic.

        With length (an int in [cached_len, max_context_len]), the request
        is also extended to length tokens in the same call, or nothing
        happens: the room is what is free or evictable once the matched pages
        are held (a matched cached page stops being room when held), so a
        receiver that must also take the rest of a request's pages neither
        over-counts free_pages nor reorders eviction by closing a failed open.

        Raises:
            InvalidArgumentError: as match_chain_hashes; a negative max_pages;
                a length below cached_len.
            ContextTooLongError: more tokens than max_context_len.
            TooManyRequestsError: no free row.
            PoolExhaustedError: not enough room for length (counted as above).
        """
    @property
    def hash_seed(self) -> int:
        """The prefix hash seed (pass it as hash_seed= to agree on page hashes)."""
    @property
    def cached_pages(self) -> int:
        """Registered device pages (held or cached)."""
    @property
    def evictable_pages(self) -> int:
        """Cached pages nobody holds: evicted when pages run out (pinned ones
        are not counted).
        """
    @property
    def hit_tokens(self) -> int:
        """Prompt tokens served from the cache by open_with_prefix, host hits included (cumulative)."""
    @property
    def miss_tokens(self) -> int:
        """Prompt tokens open_with_prefix found no cached page for (cumulative)."""
    def _uncount_opens(self, hit: int, miss: int, host_hit: int) -> None:
        """Internal (kvpool.KVPool): takes back the hit_tokens, miss_tokens and
        host_hit_tokens that opens counted when the pool undid them (closed
        the requests unreturned after its table write or a host load failed)."""
    @property
    def dropped_events(self) -> int:
        """Events dropped because more than max(num_pages, 65536) were left
        undrained: each overflow replaces the backlog with one Cleared event
        (cumulative)."""
    @property
    def kv_events(self) -> bool:
        """Whether KV events are recorded (the kv_events argument, fixed at
        construction). Without them take_events() stays empty, and what
        learns the cache's pages from it (a router, DiskCache) learns nothing."""
    @property
    def pending_copies(self) -> int:
        """Copy-on-write slot copies queued and not yet taken (slot pairs, as
        take_copies hands them out: a page's copy counts its valid slots)."""
    def take_offloads(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Drains the queued offloads (int64 page ids, oldest first): copy every
        layer's K and V of device page device_pages[i] to host page
        host_pages[i]. Before a step's K/V writes, run the offloads, then
        take_loads(), then take_copies(), in that order. Each host page stays
        pinned (never reused or evicted) until its offload is taken here; a
        device page an offload reads may already be handed out again (as a
        load's or copy's destination, or to a new holder), which the order
        makes safe. Empty without a host tier.
        """
    def take_loads(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Drains the queued loads (int64 page ids, oldest first): copy host page
        host_pages[i] into device page device_pages[i], after the offloads and
        before the copies (see take_offloads). Each host page stays pinned
        until its load is taken here. Empty without a host tier.
        """
    def swap_out(self, handles: _IntArray) -> None:
        """Moves each request's pages that it holds alone to host pages (queued
        offloads, take_offloads) and frees their device pages (a registered
        page stays cached on the device, its entry on both tiers). Shared
        pages, and pages a queued load or copy has yet to fill, stay on the
        device, still held by the request. The request keeps its handle,
        length and known tokens; extend, truncate, fork, cache and its slots,
        pages and page table raise RequestSwappedOutError until swap_in.
        Atomic.

        Raises:
            InvalidHandleError: a handle is unknown, closed or stale.
            RequestSwappedOutError: a request is swapped out already.
            PoolExhaustedError: fewer free or evictable host pages than pages
                to move (nothing moved).
            InvalidArgumentError: a duplicate handle; no host tier.
        """
    def swap_in(self, handles: _IntArray) -> None:
        """Brings swapped-out requests back: for each of their host pages, the
        entry's device copy where it is still there (re-taken, no load), else a
        device page (evicting cached pages as extend does) and a queued load
        (take_loads); a host page is let go when re-taken or its load taken.
        After the loads, every position holds bitwise the K/V it held before
        swap_out, except a registered page whose entry's copy a duplicate
        registration of the same tokens replaced meanwhile: it comes back as
        that copy, the K/V a prefix hit would give. Atomic: all requests come
        back or none.

        Raises:
            InvalidHandleError: a handle is unknown, closed or stale.
            PoolExhaustedError: not enough free or evictable device pages
                (needed vs free; nothing changed).
            InvalidArgumentError: a duplicate handle; a request that is not
                swapped out; no host tier.
        """
    def is_swapped(self, handle: _Handle) -> bool:
        """Whether the request is swapped out (swap_out, and no swap_in since).

        Raises:
            InvalidHandleError: unknown, closed or stale handle.
        """
    @property
    def host_free_pages(self) -> int:
        """Host pages an offload or a swap_out can take now: free + cached (evictable)."""
    @property
    def host_cached_pages(self) -> int:
        """Host pages holding a registered page's copy (held or not)."""
    @property
    def host_hit_tokens(self) -> int:
        """Prompt tokens open_with_prefix served from host copies, part of hit_tokens (cumulative)."""
    @property
    def offloaded_pages(self) -> int:
        """Pages handed out by take_offloads (cumulative; times a page's bytes: bytes offloaded)."""
    @property
    def loaded_pages(self) -> int:
        """Pages handed out by take_loads (cumulative; times a page's bytes: bytes loaded)."""
    @property
    def pending_offloads(self) -> int:
        """Offloads queued and not yet taken."""
    @property
    def pending_loads(self) -> int:
        """Loads queued and not yet taken."""

    def unpin(self, handles: _IntArray) -> int:
        """Gives every pinned page of each request's cached prefix the default
        priority, so cached ones are evictable (and free) at once. Returns how
        many pages were unpinned. A pinned prefix no open request holds is
        reached by opening one on it: open_with_prefix(prompt + [any token]),
        unpin, close. clear_cache() unpins everything. Atomic.

        Raises:
            InvalidHandleError: a handle is unknown, closed or stale.
            RequestSwappedOutError: a request is swapped out.
            InvalidArgumentError: a duplicate handle.
        """
    def set_clock(self, now: float) -> None:
        """Sets a manual clock (manual_clock=True) to `now` seconds, and ends the
        priorities whose retain_s is over by then (soonest first). The clock
        starts at 0 and never goes back.

        Raises:
            InvalidArgumentError: the pool runs on the system clock; now is not
                a number in [0, 1e9] or is earlier than the clock.
        """
    @property
    def clock(self) -> float:
        """The pool's clock in seconds: since construction (the system's
        monotonic clock), or as last set (manual_clock=True).
        """
    @property
    def pinned_pages(self) -> int:
        """Registered pages pinned (priority 100 with no retain_s), held or
        cached; at most max_pinned_pages.
        """
    @property
    def max_pinned_pages(self) -> int:
        """Most registered pages that may be pinned at once."""
    def evictable_pages_by_priority(self) -> npt.NDArray[np.int64]:
        """Evictable pages (cached, not pinned) at each priority 0..100 (101
        entries), as last filed: a retain_s that is over moves its page when
        the clock is next read (an eviction, a priority given, set_clock).
        """

@final
class GroupedAllocator:
    """GroupedAllocator(groups, max_requests=256, max_context_len=4096, *, hash_seed=None, handle_seed=None, kv_events=True, anchor_pages=None)

    A pool of layer groups that share one request handle space: full
    attention, sliding-window attention and fixed-size state (linear
    attention, Mamba), each with its own pages, page size and prefix cache.
    Every call acts on all groups at once and changes nothing in any group
    when it refuses. A prefix hit of length L needs every full group's pages
    for [0, L), every sliding group's for [L - window + 1, L) and every state
    group's checkpoint at L; it is the longest such L (docs/allocator.md).
    Thread-safe (one internal lock).

    Args:
        groups: one dict per group: {"kind": "full", "num_pages": N,
            "page_size": P}, {"kind": "sliding", "num_pages": N, "page_size":
            P, "window": W} (a token attends to itself and W - 1 before it, as
            in Hugging Face configs), or {"kind": "state", "num_slots": S,
            "checkpoint_every": C} (C = 0: the pool's hit step). Page and slot
            counts include the reserved page (slot) 0.
        max_requests: most requests open at once (<= 2**20).
        max_context_len: most tokens per request (<= 2**28).
        hash_seed: seed of the prefix-cache page hash (random when None).
        handle_seed: seed of the handle generations (random when None).
        kv_events: record the anchor chain's KV events for take_events().
        anchor_pages: pages of the token-only anchor chain, used when no full
            group's page size divides every other (default: room for every
            request's longest context twice); 2 to 2**31 - 1, checked even
            where a full group holds the anchor and the value goes unused.

    Raises:
        InvalidArgumentError: no groups, a bad group dict, a size, page size,
            window, checkpoint_every or anchor_pages out of range, or a seed
            that is not an int in [0, 2**64).
    """

    def __copy__(self) -> NoReturn:
        """Raises CopyRefusedError: a copy would hand out the same pages (fork a request instead)."""
    def __deepcopy__(self, _memo: Any, /) -> NoReturn:
        """Raises CopyRefusedError, as ``__copy__``."""
    def __replace__(self, **_changes: Any) -> NoReturn:
        """Raises CopyRefusedError, as ``__copy__`` (Python 3.13's ``copy.replace``)."""

    def __new__(
        cls,
        groups: Sequence[dict[str, Any]],
        max_requests: int = 256,
        max_context_len: int = 4096,
        *,
        hash_seed: int | None = None,
        handle_seed: int | None = None,
        kv_events: bool = True,
        anchor_pages: int | None = None,
    ) -> GroupedAllocator: ...
    @property
    def groups(self) -> list[dict[str, Any]]:
        """Each group's spec, as the dicts the constructor takes (checkpoint_every resolved)."""
    @property
    def num_groups(self) -> int:
        """Number of layer groups."""
    @property
    def max_requests(self) -> int:
        """Most requests open at once (rows of every group's request-to-token table)."""
    @property
    def max_context_len(self) -> int:
        """Most tokens one request may hold."""
    @property
    def anchor_group(self) -> int | None:
        """The group carrying the anchor chain, or None for a token-only anchor."""
    @property
    def anchor_page_size(self) -> int:
        """Page size of the anchor chain (the gcd of the groups' page sizes)."""
    @property
    def hit_step(self) -> int:
        """Prefix hits are multiples of this (the lcm of every page size)."""
    @property
    def open_requests(self) -> int:
        """Requests opened and not yet closed."""
    @property
    def admissible_requests(self) -> int:
        """How many more requests can open now: free rows, and a free or
        evictable slot in every state group (the pool-wide figure for
        admission, with admissible_tokens()). A prefix hit's open may need
        one more: the checkpoint it restores from is not room for its own slot.
        """
    @property
    def hit_tokens(self) -> int:
        """Prompt tokens open_with_prefix served from the cache, cumulative."""
    @property
    def miss_tokens(self) -> int:
        """Prompt tokens open_with_prefix found no cached prefix for, cumulative."""
    def _uncount_opens(self, hit: int, miss: int) -> None:
        """Internal (kvpool.KVPool with layer_types): takes back the hit_tokens
        and miss_tokens that opens counted when the pool undid them (closed
        the requests unreturned after a state copy or table write failed)."""
    @property
    def metadata_bytes(self) -> int:
        """Heap bytes of the bookkeeping of every group and of the request table."""
    @property
    def hash_seed(self) -> int:
        """The hash seed (pass it as hash_seed to agree with this pool's hashes)."""
    @property
    def dropped_events(self) -> int:
        """Events dropped because too many were left undrained (cumulative)."""
    def stats(self) -> dict[str, Any]:
        """The changing counters read under one lock, so they agree with each
        other even while other threads work (a metrics scrape reads this):
        open_requests, hit_tokens, miss_tokens, dropped_events, and groups, a
        list with one dict per group of capacity_pages, free_pages,
        used_pages, cached_pages and evictable_pages (as the per-group
        queries).
        """
    @property
    def kv_events(self) -> bool:
        """Whether the anchor chain's KV events are recorded (the kv_events
        argument, fixed at construction)."""
    def open(self, n: int = 1) -> npt.NDArray[np.int64]:
        """Opens n empty requests in every group; a state group gives each a
        slot, queued to be zeroed (take_copies).

        Raises:
            TooManyRequestsError: more than max_requests would be open.
            PoolExhaustedError: a state group has fewer than n free or
                evictable slots (the message names the group).
            InvalidArgumentError: n is negative.
        """
    def admit(
        self, counts: _IntArray, tokens: _IntArray | None = None, tables: Sequence[npt.NDArray[np.int32] | None] | None = None
    ) -> tuple[npt.NDArray[np.int64], list[npt.NDArray[np.int64]]]:
        """Opens len(counts) requests and extends request i by counts[i] tokens
        in every group, as open then extend, in one call. Atomic. A single int
        is refused, as SlotAllocator.admit refuses it: pass [n] for one request.

        Returns:
            (handles int64, a list with each group's new slots (int64,
            flattened in request order; empty for a state group)).

        Raises:
            TooManyRequestsError: not enough free rows.
            PoolExhaustedError: a group is short of pages or state slots (the
                message names the first such group).
            ContextTooLongError: a count past max_context_len.
            InvalidArgumentError: a negative count, a single int, tokens of the
                wrong length or range, bad tables.
        """
    def extend(
        self,
        handles: _IntArray,
        counts: _IntArray,
        tokens: _IntArray | None = None,
        tables: Sequence[npt.NDArray[np.int32] | None] | None = None,
    ) -> list[npt.NDArray[np.int64]]:
        """Appends counts[i] tokens (or counts for all) to request handles[i] in
        every group. A sliding group first releases the pages wholly before
        start - window + 1 of each growing request (start: its length before
        the call), which the step no longer attends to; registered ones stay
        cached. With tables (one int32 request-to-token table or None per
        group), each group's new slots are written in the same call, and a
        sliding group's released positions get the null page's slots. Copies
        on write are queued per group (take_copies). Atomic.

        Returns:
            each group's new slots (int64, flattened in request order; empty
            for a state group).

        Raises:
            InvalidHandleError: a handle is unknown, closed or stale.
            PoolExhaustedError: a group is short of pages (the message names
                the first such group).
            ContextTooLongError: a request would pass max_context_len.
            InvalidArgumentError: negative count, mismatched lengths, duplicate
                handle, tokens of the wrong length or range or disagreeing with
                the prompt, bad or overlapping tables.
        """
    def truncate(self, handles: _IntArray, lengths: _IntArray) -> None:
        """Shortens requests to lengths[i] tokens (or lengths for all) in every
        group. A sliding group needs the new length's window still held, or
        the pages it released still cached (it takes them back); a state
        group restores the request's slot from a checkpoint at exactly the
        new length (a queued copy; at 0, a queued zeroing). The current
        length changes nothing. Atomic.

        Raises:
            InvalidHandleError: a handle is unknown, closed or stale.
            RollbackUnavailableError: a group cannot restore a request at its
                new length (the message names the group and why).
            PoolExhaustedError: a state group needs a fresh slot for a restore
                (a queued copy still reads the request's own) and has none.
            InvalidArgumentError: a length is negative or past the request's
                length, mismatched lengths, duplicate handle.
        """
    def roll_back_extend(self, handles: _IntArray, lengths: _IntArray) -> None:
        """Shortens requests to lengths[i] tokens (or lengths for all) in every
        group, as truncate does (the same window and checkpoint rules),
        except that each request keeps the prompt it was opened with
        (open_with_prefix): the next extend takes the prompt's token ids
        again and cache() registers them in every group. For an extend whose
        step never ran, or for prefix hits cut back to the batch's shortest.
        A state group's slot is the state at the new length, restored from
        the checkpoint there. Atomic.

        Raises:
            InvalidHandleError: a handle is unknown, closed or stale.
            RollbackUnavailableError: a group cannot restore a request at its
                new length (the message names the group and why).
            PoolExhaustedError: a state group needs a fresh slot for a restore
                (a queued copy still reads the request's own) and has none.
            InvalidArgumentError: a length is negative or past the request's
                length, mismatched lengths, duplicate handle.
        """
    def close(self, handles: _IntArray, cache: bool = False) -> None:
        """Closes requests in every group, releasing their pages and state
        slots; their handles become stale. With cache=True, first registers
        them as cache() does. Atomic.

        Raises:
            InvalidHandleError: a handle is unknown, already closed or stale.
            InvalidArgumentError: a duplicate handle.
        """
    def cache(self, handles: _IntArray) -> None:
        """Registers each request's full pages of known tokens in every group:
        the anchor chain, each group's pages under it, and a state group's
        checkpoint of the request's slot when its length is a multiple of
        the group's checkpoint_every (a queued copy). Call it once the step
        that wrote those pages and that state has run. Atomic.

        Raises:
            InvalidHandleError: a handle is unknown, closed or stale.
            InvalidArgumentError: a duplicate handle.
        """
    def fork(self, handle: _Handle, n: int = 1) -> npt.NDArray[np.int64]:
        """Creates n requests, each a copy of handle's in every group: the same
        pages (a shared partly filled page is copied on write), and in a
        state group a fresh slot queued to be filled from the parent's.
        Atomic.

        Raises:
            InvalidHandleError: the parent is unknown, closed or stale.
            TooManyRequestsError: not enough free rows.
            PoolExhaustedError: a state group has fewer than n free or
                evictable slots.
            InvalidArgumentError: n is negative.
        """
    def open_with_prefix(
        self, tokens: _IntArray, lengths: _IntArray, salt: _IntArray | None = None
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Opens one request per prompt on the longest prefix every group has
        cached (a multiple of hit_step, at most length - 1): full groups'
        pages for [0, L), sliding groups' window before L, state groups'
        checkpoint at L, each verified through the anchor chain so that a
        hash collision costs a miss, never another prompt's K/V or state. A
        state group's slot is queued to be filled from the checkpoint (zeroed
        when cached_len is 0). Atomic.

        Args:
            tokens: the prompts' token ids concatenated (ints in [0, 2^31)).
            lengths: each prompt's length.
            salt: None (0), an int for all, or one int per prompt.

        Raises:
            InvalidArgumentError: tokens and lengths disagree, a negative length,
                a token id out of range, a salt of the wrong type or count.
            ContextTooLongError: a prompt longer than max_context_len.
            TooManyRequestsError: not enough free rows.
            PoolExhaustedError: a state group has no slot for each request.
        """
    def evict(self, group: int, n: int) -> int:
        """Evicts up to n cached pages (checkpoints of a state group) of one
        group, least recently used first; returns how many.

        Raises:
            InvalidArgumentError: no such group, n negative.
        """
    def clear_cache(self) -> None:
        """Drops every cached page and checkpoint of every group (held ones stay
        with their requests).
        """
    def reset(self) -> None:
        """Closes every request in every group; all handles become stale."""
    def check(self) -> None:
        """Verifies every invariant of every group and of what ties them to the
        request table.

        Raises:
            InvariantError: an invariant is broken (a bug in kvpool).
        """
    def take_events(self) -> dict[str, npt.NDArray[Any]]:
        """Drains the anchor chain's KV events (as SlotAllocator.take_events).
        They name the prefixes the anchor group has cached: an upper bound on
        what this pool can serve, since a hit also needs every other group's
        pages (a sliding window's, a state checkpoint), which they do not
        report.
        """
    def free_pages(self, group: int) -> int:
        """Pages (state slots) of the group an extend can take now: FREE + evictable.

        Raises:
            InvalidArgumentError: no such group.
        """
    def used_pages(self, group: int) -> int:
        """Pages (state slots) of the group held by open requests or queued copies.

        Raises:
            InvalidArgumentError: no such group.
        """
    def cached_pages(self, group: int) -> int:
        """Registered pages (checkpoints) of the group, held or evictable.

        Raises:
            InvalidArgumentError: no such group.
        """
    def evictable_pages(self, group: int) -> int:
        """Cached pages (checkpoints) of the group no request holds.

        Raises:
            InvalidArgumentError: no such group.
        """
    def capacity_pages(self, group: int) -> int:
        """Pages (state slots) of the group requests can ever hold: num_pages - 1.

        Raises:
            InvalidArgumentError: no such group.
        """
    def admissible_tokens(self, group: int | None = None) -> int:
        """Tokens that fit in whole free or evictable pages: in one group
        (free_pages * page_size; state slots for a state group), or with
        group=None the least over every page group and the anchor chain, the
        pool-wide figure for admission with admissible_requests. One new
        request of this many tokens fits (of at most max_context_len); a batch is a page count, not a
        token count (each request starts a page in every page group), and a
        request writing into a partly filled page it shares (a fork's) takes
        one more page for the copy.

        Raises:
            InvalidArgumentError: no such group.
        """
    def length(self, handle: _Handle) -> int:
        """Tokens the request holds (the same in every group).

        Raises:
            InvalidHandleError: unknown, closed or stale handle.
        """
    def lengths(self, handles: _IntArray) -> npt.NDArray[np.int64]:
        """Tokens each request holds.

        Raises:
            InvalidHandleError: a handle is unknown, closed or stale.
        """
    def rows(self, handles: _IntArray) -> npt.NDArray[np.int64]:
        """Each request's row, the same in every group's request-to-token table.

        Raises:
            InvalidHandleError: a handle is unknown, closed or stale.
        """
    def is_open(self, handle: _Handle) -> bool:
        """Whether the handle is an open request.

        Raises:
            InvalidArgumentError: handle is not an int.
        """
    def known_tokens(self, handle: _Handle) -> npt.NDArray[np.int32]:
        """The request's token ids from position 0 as far as they are known.

        Raises:
            InvalidHandleError: unknown, closed or stale handle.
        """
    def slots(self, handle: _Handle, group: int) -> npt.NDArray[np.int64]:
        """Every slot of the request in a page group, in token order; positions
        a sliding window released read as the null page's slots
        (position % page_size, inside the reserved page 0).

        Raises:
            InvalidHandleError: unknown, closed or stale handle.
            InvalidArgumentError: no such group, or a state group.
        """
    def pages(self, handle: _Handle, group: int) -> npt.NDArray[np.int32]:
        """The request's page list in a page group, in token order (0 where a
        sliding window released the page).

        Raises:
            InvalidHandleError: unknown, closed or stale handle.
            InvalidArgumentError: no such group, or a state group.
        """
    def page_table(
        self, handles: _IntArray, group: int
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32], npt.NDArray[np.int32]]:
        """FlashInfer's CSR page table of a batch in a page group (int32): each
        request's held pages only (a sliding group's window: pass the
        window to the kernel, whose mask counts back from the last position),
        last_page_len in [1, page_size] (0 for an empty request).

        Raises:
            InvalidHandleError: a handle is unknown, closed or stale.
            InvalidArgumentError: no such group, or a state group.
        """
    def fill_table(self, handles: _IntArray, table: npt.NDArray[np.int32], group: int) -> None:
        """Writes each request's slots in a page group into its row of an int32
        request-to-token table (table[row, :length]; the null page's slots
        where a window released pages): for requests that got slots without
        an extend (open_with_prefix, fork). Checks everything first.

        Raises:
            InvalidHandleError: a handle is unknown, closed or stale.
            InvalidArgumentError: no such group, a state group, a bad table.
        """
    def state_slots(self, handles: _IntArray, group: int) -> npt.NDArray[np.int64]:
        """Each request's live state slot in a state group (fixed while it is
        open, except that a restore may move it: read it after truncate).

        Raises:
            InvalidHandleError: a handle is unknown, closed or stale.
            InvalidArgumentError: no such group, or a page group.
        """
    def take_copies(self, group: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Drains the group's queued copies (int64): slot pairs of a page group
        (copy-on-write, every layer's K and V, in order), state slot pairs
        of a state group, where src = -1 means "zero dst" (a new request's
        empty state). Run them before the group's next write. A state
        group's batch never reads a slot it writes (one parallel copy does).

        Raises:
            InvalidArgumentError: no such group.
        """
    def pending_copies(self, group: int) -> int:
        """Copies queued in the group and not taken (slot pairs; state copies).

        Raises:
            InvalidArgumentError: no such group.
        """

def page_hashes(
    tokens: _IntArray, page_size: int, hash_seed: int, salt: int | None = None
) -> npt.NDArray[np.uint64]:
    """The chain hashes of the full pages of a prompt, as a pool built with
    this hash_seed names them in its KV events and chain_hashes (the trailing
    partial page has none). Holds no pool.

    Args:
        tokens: the prompt's token ids (ints in [0, 2^31)).
        page_size: tokens per page (>= 1), the pool's page_size.
        hash_seed: the pool's hash_seed.
        salt: the request's salt as given to open_with_prefix (None: 0).

    Returns:
        uint64 [2n]: (hi, lo) of each full page's 128-bit hash, as
        SlotAllocator.chain_hashes gives them.

    Raises:
        InvalidArgumentError: a token id out of range, page_size < 1, a seed
            not in [0, 2**64), a salt that is not an int.
    """

def encode_kv_events(
    events: dict[str, npt.NDArray[Any]], ts: float, data_parallel_rank: int | None = None,
    int_block_hashes: bool = False,
) -> tuple[bytes, int, int, int]:
    """Encodes drained KV events (the dict take_events returns) as one msgpack
    KVEventBatch in vLLM's schema (vllm/distributed/kv_events.py): the
    payload a ZmqEventPublisher sends. Consecutive Stored events of one
    chain become one BlockStored, consecutive Removed events one
    BlockRemoved. Optional per-event arrays "medium" (0 GPU, 1 CPU,
    2 STORAGE; "GPU" without it) and "group_idx" (omitted without it or
    where negative) are used when present. With int_block_hashes, block
    hashes are sent as vLLM's int form (the low 64 bits of the 16-byte
    big-endian hash, unsigned), which vLLM sends by default, instead of
    the 16 bytes.

    Returns:
        (payload, stored, removed, cleared): the msgpack bytes, and how many
        pages the Stored and Removed events name and how many Cleared events
        there are.

    Raises:
        InvalidArgumentError: a missing or mistyped array, arrays of
            different lengths, an unknown kind or medium code, token_ids that
            do not match the Stored events' num_tokens or hold a negative id;
            ts not a finite number, a data_parallel_rank not an int >= 0.
    """

# Not public API: PoolStats.__reduce__'s rebuilder, and the os.register_at_fork hooks of
# kvpool._forksafe (hold every allocator's mutexes across a fork, then release them).
# _pool_stats also takes the flat lists older versions pickled (17, then 119 ints).
def _pool_stats(state: dict[str, Any] | list[int]) -> PoolStats: ...
def _fork_prepare() -> None: ...
def _fork_release() -> None: ...

def scatter_rows(dst: tuple[Any, ...], slots: Any, src: tuple[Any, ...]) -> int:
    """Stores row ``i`` of each ``src[j]`` at row ``slots[i]`` of ``dst[j]`` with one
    ``memcpy`` a row: a CPU ``KVPool.write``'s store (``kvpool.row_stores.scatter_into``).
    Negative slots are padding and skipped; every slot is checked against every cache
    before anything is written. A source that shares memory with a cache is stored as it
    was when the call was made. Does not bump the caches' version counters (the caller
    does).

    Args:
        dst: the caches, each exactly a ``torch.Tensor``: plain, C-contiguous (size-1
            dimensions aside), on the CPU, inside its storage (not shrunk below its
            shape), not overlapping one another.
        slots: a 1-D CPU integer ``torch.Tensor``, one slot per source row.
        src: one tensor per cache, of its dtype and row shape, ``len(slots)`` rows
            (of at least one byte).

    Returns:
        The rows stored per cache (slots that are not padding), or -1 when any
        argument is not of that kind: then nothing was read or written, and the caller
        stores with torch (``index_copy_``).

    Raises:
        IndexError: a slot ``>=`` the caches' rows (nothing written).
    """
