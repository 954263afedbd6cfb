"""Publishers of a pool's KV events in vLLM's wire format.

A message is ``(topic, seq, payload)``: the topic bytes, the batch's sequence
number as 8 bytes big-endian (0, 1, 2, ... per publisher, one per non-empty
``publish()``) and a msgpack ``KVEventBatch`` (``kvpool._core.encode_kv_events``;
the mapping is in docs/events-and-metrics.md). The last ``buffer_steps`` messages
are kept for replay.

``publish()`` runs on the caller's thread (the scheduler's, once a step): it
drains the pool, encodes (native code) and hands the message over; calls from
several threads are numbered in the order they drained the pool.
``ZmqEventPublisher`` sends it from a thread of its own, which also serves
replays while the engine is idle.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from kvpool._core import InvalidArgumentError, SlotAllocator, encode_kv_events
from kvpool._forksafe import INNER, OUTER, OwnedLock
from kvpool._forksafe import track as track_for_fork
from kvpool._nopickle import NotPicklable
from kvpool._values import is_int
from kvpool.errors import PublisherClosedError
from kvpool.events.drained import checked_events
from kvpool.events.drainers import claim, release

# vLLM's end-of-replay marker: sequence number -1 as 8 signed big-endian bytes.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
DEFAULT_BUFFER_STEPS = 10_000


def _encoder(pool: Any, int_hashes: bool) -> Callable[[float, int | None], tuple[bytes, int, int, int]]:
    """``(ts, rank) -> (payload, stored, removed, cleared)`` draining ``pool``."""
    alloc = getattr(pool, "allocator", pool)
    if isinstance(alloc, SlotAllocator):
        take_msgpack = alloc.take_events_msgpack  # drains and encodes in one native call
        return lambda ts, rank: take_msgpack(ts, rank, int_hashes)
    take = getattr(pool, "take_events", None)
    if not callable(take):
        raise InvalidArgumentError(
            f"a KV event publisher needs a pool with take_events() (a KVPool or SlotAllocator), "
            f"got {type(pool).__name__}")
    return _DrainThenEncode(take, int_hashes)


class _DrainThenEncode:
    """Drain, then encode, in two calls (a hybrid pool's ``GroupedAllocator``): events
    whose encoding failed (a MemoryError) are kept and sent by the next call, as
    ``take_events_msgpack`` keeps them in its one call; else they would be lost with
    nothing in the stream to say so."""

    def __init__(self, take: Callable[[], Any], int_hashes: bool) -> None:
        self.take, self.int_hashes = take, int_hashes
        self.kept: Any = None  # (read and written under the publisher's _publishing lock)

    def __call__(self, ts: float, rank: int | None) -> tuple[bytes, int, int, int]:
        if self.kept is None:
            self.kept = self.take()
        out = encode_kv_events(self.kept, ts, rank, self.int_hashes)
        self.kept = None
        return out


def _rank(rank: Any) -> int | None:
    """``data_parallel_rank`` checked here, so that a bad one fails at construction and
    not at the first ``publish()``."""
    if rank is None:
        return None
    # is_int, not __index__: numpy arrays and tensors have __index__ too, and it raises for them.
    if not is_int(rank) or not 0 <= rank < 2**63:
        raise InvalidArgumentError(
            f"data_parallel_rank must be None or an int in [0, 2**63), got {type(rank).__name__} {rank!r}")
    return rank.__index__()


def kept_since(buffer: deque[tuple[int, bytes, bytes]], lock: Any, topic: bytes,
               start_seq: int) -> list[tuple[bytes, bytes, bytes]]:
    """``(topic, seq, payload)`` of the kept batches numbered ``start_seq`` on, oldest first;
    under ``lock``, which ``publish()`` holds to append."""
    with lock:
        return [(topic, b, p) for s, b, p in buffer if s >= start_seq]


class EventPublisher(NotPicklable):
    """Drains a pool's events into sequenced vLLM ``KVEventBatch`` messages.

    Block hashes go out as the 16-byte chain hashes, or with
    ``int_block_hashes=True`` as vLLM's int form (the low 64 bits, unsigned),
    which vLLM sends by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``) and
    consumers typed against it (SGLang's event classes, routers that key blocks
    by u64) need.

    ``data_parallel_rank`` is every batch's third element: 0 unless given, as vLLM's
    publisher sends its engine's rank (0 without data parallelism); None sends nil.

    Subclasses deliver each message (``_deliver``). Counters, all cumulative:
    ``batches`` (messages sent), ``events`` (kvpool events sent, one per page),
    ``stored_pages``, ``removed_pages`` (pages that left the prefix cache:
    evictions, a cached page rewritten in place, and a cached copy whose
    registration a request's recomputed copy took over, which also counts as
    stored) and ``cleared`` (Cleared events, an overflowed backlog's included).
    """

    _pickle_refusal = "it drains a pool of this process (build the publisher in the process that owns the pool)"

    def __init__(self, pool: Any, *, topic: str = "", buffer_steps: int = DEFAULT_BUFFER_STEPS,
                 data_parallel_rank: int | None = 0, int_block_hashes: bool = False) -> None:
        if not isinstance(int_block_hashes, (bool, np.bool_)):
            raise InvalidArgumentError(f"int_block_hashes takes True or False, got {type(int_block_hashes).__name__} "
                                       f"{int_block_hashes!r}")
        if not is_int(buffer_steps) or not 0 <= buffer_steps < 2**63:
            raise InvalidArgumentError(f"buffer_steps must be an int in [0, 2**63) (batches kept for replay), "
                                       f"got {buffer_steps!r}")
        buffer_steps = int(buffer_steps)
        if not isinstance(topic, str):
            raise InvalidArgumentError(f"topic must be a str (sent UTF-8 encoded), got {type(topic).__name__} {topic!r}")
        try:
            topic_bytes = topic.encode("utf-8")
        except UnicodeEncodeError as e:  # (a lone surrogate)
            raise InvalidArgumentError(f"topic {topic!r} cannot be sent UTF-8 encoded: {e.reason}") from None
        data_parallel_rank = _rank(data_parallel_rank)
        self._encode = _encoder(pool, bool(int_block_hashes))
        if getattr(getattr(pool, "allocator", pool), "kv_events", True) is False:
            # Every batch would be empty, for good: a router behind it would learn nothing.
            raise InvalidArgumentError("this pool records no KV events (built with kv_events=False): a publisher "
                                       "needs one built with kv_events=True, the default")
        self.pool = pool
        # The tokens of a page this pool's Stored events carry (a hybrid pool's anchor chain's):
        # publish(events=) refuses another pool's events by it, as DiskCache.store_new does.
        alloc = getattr(pool, "allocator", pool)
        self._page_size = getattr(alloc, "page_size", None) or getattr(alloc, "anchor_page_size", None)
        self.int_block_hashes = bool(int_block_hashes)
        self.topic = topic_bytes
        self.data_parallel_rank = data_parallel_rank
        self._seq = 0
        # (seq, seq bytes, payload), appended by publish() and read by replay;
        # the lock keeps a replay from iterating while publish() appends.
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        # Held from the drain to the hand-over: two threads publishing at once
        # must number (and send) their batches in the order they drained them,
        # or a consumer applies a Removed before the Stored it undoes.
        self._publishing = OwnedLock()  # (held around user code, which may fork: see _forksafe)
        track_for_fork(self, "_publishing", OUTER)
        track_for_fork(self, "_lock", INNER)
        self._closed = False
        self.batches = self.events = self.stored_pages = self.removed_pages = self.cleared = 0
        # Last, once every field is set: from here other threads may find it in the registry.
        other = claim(pool, self)
        if other is not None:
            raise InvalidArgumentError(
                f"this pool's events are published already (by a {type(other).__name__}, topic {other.topic!r}): a "
                f"pool records one event stream, and each drain takes its events from every other reader, so two "
                f"publishers would each miss what the other sent. Close that one first, or hand its messages on "
                f"(LocalEventPublisher.drain, replay)")

    def _drains_here(self) -> bool:
        """Whether this publisher still drains its pool in this process (one inherited
        through ``os.fork()`` may not: see ``ZmqEventPublisher``)."""
        return True

    @property
    def next_seq(self) -> int:
        """The sequence number the next non-empty ``publish()`` sends."""
        return self._seq

    @property
    def dropped_events(self) -> int:
        """Events the pool dropped because its backlog overflowed (each overflow
        shows in the stream as an AllBlocksCleared)."""
        # The allocator's: a hybrid pool (layer_types) forwards no such counter itself.
        return int(getattr(self.pool, "allocator", self.pool).dropped_events)

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called (``publish()`` then raises)."""
        return self._closed

    def publish(self, events: Any = None) -> int:
        """Drain the pool's events and send them as one ``KVEventBatch``.

        Args:
            events: events the engine drained itself (what ``pool.take_events()``
                returns), to send instead of draining: an engine that also hands
                them to ``DiskCache.store_new(events=)`` drains once and gives both
                the same events (each drain takes them from every other reader).

        Returns:
            the number of kvpool events sent (one per page Stored or Removed,
            one per Cleared); 0 sends nothing and uses no sequence number.

        Raises:
            PublisherClosedError: the publisher is closed (a ``RuntimeError`` too).
            InvalidArgumentError: ``events`` is not what ``take_events()`` returns,
                or holds Stored pages of another page size than this pool's (nothing sent).
        """
        if events is not None:
            events = checked_events(events, self._page_size)
        with self._publishing:
            # Under the lock: a close() from another thread waits for a publish in
            # flight, whose batch is then handed over before the sender stops.
            if self._closed:
                raise PublisherClosedError("this KV event publisher is closed; build a new one for the pool to "
                                           "publish again")
            ts, rank = time.time(), self.data_parallel_rank
            sent = 0
            if events is None or getattr(self._encode, "kept", None) is not None:
                # (with events: the ones a failed publish() drained and kept go first, in order)
                sent += self._send(*self._encode(ts, rank))
            if events is not None:
                sent += self._send(*encode_kv_events(events, ts, rank, self.int_block_hashes))
        return sent

    def _send(self, payload: bytes, stored: int, removed: int, cleared: int) -> int:
        """Number and hand over one encoded batch (nothing for an empty one); under _publishing."""
        n = stored + removed + cleared
        if not n:
            return 0
        seq = self._seq
        self._seq = seq + 1
        seq_b = seq.to_bytes(8, "big")
        self._deliver(seq_b, payload)
        with self._lock:
            self._buffer.append((seq, seq_b, payload))
        self.batches += 1
        self.events += n
        self.stored_pages += stored
        self.removed_pages += removed
        self.cleared += cleared
        return n

    def replay(self, start_seq: int) -> list[tuple[bytes, bytes, bytes]]:
        """The kept messages whose sequence number is >= ``start_seq``, oldest first
        (what the ROUTER replay service sends, before its end marker).

        Raises:
            InvalidArgumentError: ``start_seq`` is not an int.
        """
        if not is_int(start_seq):
            raise InvalidArgumentError(f"start_seq must be an int (a sequence number, as next_seq), "
                                       f"got {type(start_seq).__name__} {start_seq!r:.40}")
        return kept_since(self._buffer, self._lock, self.topic, start_seq)

    def _deliver(self, seq_b: bytes, payload: bytes) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Stop publishing; later ``publish()`` calls raise. A ``publish()`` running on
        another thread finishes (its batch is delivered) before this returns."""
        with self._publishing:
            self._closed = True
            release(self.pool, self)  # the pool may get another publisher now

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalEventPublisher(EventPublisher):
    """In-process delivery: messages wait in ``outbox`` until ``drain()`` hands
    them to a consumer (a router in the same process, a benchmark, a test)."""

    def __init__(self, pool: Any, *, topic: str = "", buffer_steps: int = DEFAULT_BUFFER_STEPS,
                 data_parallel_rank: int | None = 0, int_block_hashes: bool = False) -> None:
        super().__init__(pool, topic=topic, buffer_steps=buffer_steps, data_parallel_rank=data_parallel_rank,
                         int_block_hashes=int_block_hashes)
        self.outbox: deque[tuple[bytes, bytes, bytes]] = deque()

    def _deliver(self, seq_b: bytes, payload: bytes) -> None:
        self.outbox.append((self.topic, seq_b, payload))

    def drain(self) -> list[tuple[bytes, bytes, bytes]]:
        """The messages sent since the last drain, oldest first."""
        # One popleft at a time (each atomic): a message another thread
        # publishes meanwhile is taken now or by the next drain, never cleared unseen.
        out, box = [], self.outbox
        while True:
            try:
                out.append(box.popleft())
            except IndexError:  # empty (another drain may have taken the last one)
                return out


__all__ = ["DEFAULT_BUFFER_STEPS", "END_SEQ", "EventPublisher", "LocalEventPublisher"]
