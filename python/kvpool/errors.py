"""Every exception kvpool raises, in one place (also importable from ``kvpool``).

All derive from ``KVPoolError``, so an engine can catch one base class.

- The allocator's (``kvpool._core``, raised by the Rust core): ``PoolExhaustedError``,
  ``InvalidHandleError``, ``TooManyRequestsError``, ``ContextTooLongError``,
  ``InvalidArgumentError`` (also a ``ValueError``), ``InvariantError``,
  ``RequestSwappedOutError`` (a call that needs the request on the device, made
  on one ``swap_out`` moved to the host tier; a ``KVPoolError`` and not an
  ``InvalidHandleError``: the handle stays valid and owns its pages, so code that
  forgets requests on an invalid handle must not catch it), and
  ``RollbackUnavailableError`` (a grouped pool's truncate that a sliding window or a
  state group cannot restore).
- The torch layer's and the kernels' argument errors derive from
  ``InvalidArgumentError``; ``TritonUnavailableError`` (an install problem, not
  a bad argument) is a ``KVPoolError`` and a ``RuntimeError``. All are raised
  before anything is written, so a failed call leaves the pool exactly as it was.
- ``CopyRefusedError`` (also a ``TypeError``): ``copy.copy`` / ``copy.deepcopy`` (and Python
  3.13's ``copy.replace``) of an object whose copy would share (and double-close) its pool
  state; the message says what to do instead.
- ``PublisherClosedError`` (also a ``RuntimeError``): a ``kvpool.events`` publisher used after ``close()``.
- ``IncompleteForwardError`` (also a ``RuntimeError``): the transformers cache's layers
  are out of step after a forward that stopped part-way.
- ``RowsChangedError`` (also a ``RuntimeError``): the transformers cache's rows were
  truncated through the pool since its last step.
- ``kvpool.distributed``'s (``TransferError`` and its subclasses,
  ``RankDivergenceError``) are defined here too, so catching them never needs
  ``torch.distributed``; ``kvpool.distributed.errors`` re-exports them.
"""

from __future__ import annotations

from kvpool._core import (
    ContextTooLongError,
    InvalidArgumentError,
    InvalidHandleError,
    InvariantError,
    KVPoolError,
    PoolExhaustedError,
    RequestSwappedOutError,
    RollbackUnavailableError,
    TooManyRequestsError,
)

__all__ = [
    "ContextTooLongError",
    "CopyRefusedError",
    "DuplicateSlotError",
    "IncompleteForwardError",
    "InvalidArgumentError",
    "InvalidHandleError",
    "InvariantError",
    "KVPoolError",
    "KernelArgumentError",
    "LayerIndexError",
    "PoolExhaustedError",
    "PublisherClosedError",
    "RankDivergenceError",
    "RequestSwappedOutError",
    "ReservedSlotError",
    "RollbackUnavailableError",
    "RowsChangedError",
    "SlotRangeError",
    "TensorDeviceError",
    "TensorDtypeError",
    "TensorShapeError",
    "TooManyRequestsError",
    "TransferError",
    "TransferRejectedError",
    "TransferTimeoutError",
    "TritonUnavailableError",
]


class TensorShapeError(InvalidArgumentError):
    """A tensor argument has the wrong shape (or the wrong number of rows)."""


class TensorDtypeError(InvalidArgumentError):
    """A tensor argument has the wrong dtype."""


class TensorDeviceError(InvalidArgumentError):
    """A tensor argument lives on a different device than the pool."""


class SlotRangeError(InvalidArgumentError):
    """A slot id is >= num_slots (negative ids are padding and are skipped)."""


class ReservedSlotError(SlotRangeError):
    """A slot in the reserved page 0 was given to a strict write (no padding expected)."""


class DuplicateSlotError(InvalidArgumentError):
    """One call names the same slot twice where the rows would race on a GPU: a
    strict write of one slot twice, or a copy whose destinations repeat or are
    also its sources (which row wins would depend on scheduling)."""


class LayerIndexError(InvalidArgumentError):
    """A layer index is outside ``[0, num_layers)``."""


class KernelArgumentError(InvalidArgumentError):
    """A kernel wrapper argument is wrong in a way not covered by the tensor
    shape / dtype / device errors above (all share the base class)."""


class IncompleteForwardError(KVPoolError, RuntimeError):
    """A ``KVPoolCache``'s layers are out of step: a forward stopped part-way (an exception
    in a layer), a layer was called twice in one forward, or layers got different numbers
    of tokens. Raised before anything changes; ``crop`` the unfinished step away (the
    message says by how much) or ``reset()`` the cache."""


class RowsChangedError(KVPoolError, RuntimeError):
    """A ``KVPoolCache``'s rows were truncated through the pool (``pool.truncate`` of its
    handles) since its last step, so they no longer hold the tokens the cache counts. Raised
    before anything changes; ``crop`` the cache to the rows' length (the message says by how
    much) or close it."""


class CopyRefusedError(KVPoolError, TypeError):
    """``copy.copy`` or ``copy.deepcopy`` of an object whose copy would share its pool state (a
    ``KVPoolCache``'s shallow copy would close its rows twice; a ``DecodeGraphRunner``'s graphs and
    static buffers, a ``KVPoolCollector``'s pools). Raised before anything changes; the message says
    what to do instead (``copy.deepcopy`` of the cache, or build another object)."""


class PublisherClosedError(KVPoolError, RuntimeError):
    """``publish()`` on a ``kvpool.events`` publisher after its ``close()``."""


class TritonUnavailableError(KVPoolError, RuntimeError):
    """K/V must move on a CUDA device but Triton cannot be imported; the message says what to install."""


class RankDivergenceError(KVPoolError):
    """Tensor-parallel ranks no longer agree on the allocator's decisions.

    ``rank`` is the first rank (in group order) whose digest differs from the
    group's first rank; ``ranks`` lists every differing rank.
    """

    def __init__(self, message: str, rank: int = -1, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.rank, self.ranks = rank, ranks


class TransferError(KVPoolError):
    """Moving a request between pools failed: a peer died, timed out or broke the protocol.

    The pool on the side that raises is left as it was (a half-received
    request is closed again). After this error the process group's
    point-to-point channel to that peer is in an unknown state: rebuild the
    group before the next transfer.
    """


class TransferTimeoutError(TransferError):
    """The peer did not answer within the transfer's timeout."""


class TransferRejectedError(TransferError):
    """The destination refused the request before any K/V moved (no room, an
    incompatible pool, a malformed header); both pools are unchanged (after a
    ``"failed"`` refusal, the destination's matched cached pages count as just used). ``reason`` is
    the destination's status code name (``"exhausted"``, ``"too_many_requests"``,
    ``"context_too_long"``, ``"incompatible"``, ``"malformed"``, or ``"failed"``
    when opening the request or allocating its staging failed there, a device out of
    memory)."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason
