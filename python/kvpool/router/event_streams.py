"""``EventStreams``: what the router knows of each pool's KV event stream, and the
stream's batches applied to its ``PageIndex``: taken in any order, applied in
sequence order, a gap waited on, replayed or given up. A mixin of ``Router``
(kept apart so router.py holds the routing decision).

Trust rules, per pool stream (sequence numbers as the publisher sends them):

- a batch is applied only in sequence order; a newer one waits while the gap
  is filled (``needs_replay``);
- an older one is ignored only if it is the very batch applied under that
  number (a replay overlap, a duplicate), or, past the last 1024 applied
  batches, if it is no newer than the last applied one (its ``ts``). Anything
  else under an old number means the publisher's numbering started again (an
  engine restart): the router forgets the pool and takes that batch as the
  stream's new start. A batch older (its ``ts``) than one the router took,
  applied or waiting under its number, is ignored as well, whatever its
  number (the publisher sent it before a restart the router already took),
  and the pool is forgotten (or the publisher's clock went back, and the
  batch's Removed events are lost);
  ``ZmqFeed`` asks every replay from the last applied number
  (``verify_from``), so a replay also checks that the publisher still has the
  router's history;
- a gap that cannot be filled (the publisher no longer keeps it, or more than
  ``max_pending`` batches wait) makes the router forget that pool's pages and
  go on from the waiting batches: the lost batches may have held Removed
  events, and the router must never believe in a page the pool no longer has;
- ``AllBlocksCleared`` (a ``clear_cache``, or a pool backlog that overflowed and
  dropped events) forgets the pool's pages as well; it relearns them from the
  Stored events that follow;
- a stream joined mid-way starts at its first batch: pages stored before are
  unknown (fewer predicted hits), never wrongly believed.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from kvpool._core import InvalidArgumentError, page_hashes
from kvpool._values import is_int

__all__ = ["EventStreams", "StreamState"]


@dataclasses.dataclass
class StreamState:
    """What the router knows of one pool's event stream."""

    next_seq: int | None = None  # None until the first batch
    # (decoded batch, payload digest) by sequence number
    pending: dict[int, Any] = dataclasses.field(default_factory=dict)
    batches: int = 0  # applied
    duplicates: int = 0  # ignored: a replay overlap, a stale copy, or older than a batch taken (late)
    resets: int = 0  # pool forgotten after an unfillable gap
    restarts: int = 0  # pool forgotten: the publisher's numbering started again (or resync())
    cleared: int = 0  # AllBlocksCleared applied
    checked_seed: bool = False
    # Payload digests of the last applied batches by sequence number: an old
    # number is a duplicate only if its payload is the one applied.
    applied: OrderedDict[int, int] = dataclasses.field(default_factory=OrderedDict)
    last_ts: float = float("-inf")  # ts of the last applied batch


# Applied batches remembered per stream for telling a duplicate from a restart
# by payload; older numbers are told apart by their timestamp.
_REMEMBERED = 1024


_DECIMAL = re.compile(r"-?[0-9]{1,19}")  # (an int64's digits; "--5" or "٣" are not kvpool's)


def _salt(key: Any) -> Any:
    """The salt of a root page's extra key: kvpool sends it as a decimal str (older
    kvpool versions as an int); anything else is returned as it is, to be refused."""
    if isinstance(key, str) and _DECIMAL.fullmatch(key):
        return int(key)
    return key


class EventStreams:
    """The event half of ``Router``: ``feed`` and the stream bookkeeping behind it (a mixin
    over the router's ``streams``, ``index`` and the settings its ``__init__`` checked)."""

    num_pools: int
    page_size: int
    hash_seed: int
    max_pending: int
    medium: str
    index: Any
    streams: list[StreamState]
    _int_keys: bool
    _bytes_keys: bool
    _decode: Any  # (payload) -> the decoded KVEventBatch
    _not_a_batch: Any  # what _decode raises for a payload that is not a batch
    _keys: Any  # (hash words) -> the 16-byte keys (PrefixMatching)
    _int_form: Any  # (hash words) -> vLLM's int keys (PrefixMatching)

    def feed(self, pool: int, topic: bytes, seq: bytes, payload: bytes) -> int:
        """Take one message of ``pool``'s stream, in any order. Returns the
        batches applied (0 while it waits behind a gap or was a duplicate).

        Raises:
            InvalidArgumentError: a malformed message, or a root page that this
                router would hash otherwise (another hash_seed or page_size);
                the stream is left as it was.
        """
        self._stream(pool)
        return self._feed(pool, *self._parse(pool, seq, payload))

    def _parse(self, pool: int, seq: Any, payload: Any) -> tuple[int, Any, int]:
        """(sequence number, decoded batch, payload digest); typed refusal, nothing changed."""
        if not isinstance(seq, (bytes, bytearray, memoryview)) or len(seq) != 8:
            raise InvalidArgumentError(
                f"seq must be the 8-byte big-endian sequence frame the publisher sends, got {seq!r:.40}")
        s = int.from_bytes(seq, "big", signed=True)
        if s < 0:
            # Publishers number batches from 0 up as int64 (vLLM's ZmqEventPublisher, and
            # -1 marks a replay's end): a negative number, or one past 2**63 - 1, is garbage,
            # and a gap up to it would ask the publisher for a replay no int64 can name.
            raise InvalidArgumentError(
                f"pool {pool}'s message has sequence number {int.from_bytes(seq, 'big')} (as unsigned); "
                f"publishers number their batches in [0, 2**63)")
        try:
            batch = self._decode(payload)
        except self._not_a_batch as e:
            raise InvalidArgumentError(f"pool {pool}'s message {s} is not a KV event batch: {e}") from None
        if not math.isfinite(batch.ts):
            # The stream's order checks compare ts: an infinite one would make every later batch stale.
            raise InvalidArgumentError(f"pool {pool}'s message {s} has ts {batch.ts}; a publisher sends its "
                                       f"time.time()")
        return s, batch, hash(bytes(payload))

    def _feed(self, pool: int, s: int, batch: Any, digest: int) -> int:
        st = self.streams[pool]
        if st.next_seq is None or s >= st.next_seq:
            waiting = st.pending.get(s)
            # One publisher's numbers and ts grow together: a batch older than one the
            # router took (applied, or waiting under this number) was sent before a
            # restart the router already saw, and came late.
            late = batch.ts < (st.last_ts if waiting is None else max(st.last_ts, waiting[0].ts))
            restart = not late and waiting is not None and waiting[1] != digest
        else:
            known = st.applied.get(s)
            # Past the remembered window, the batch's timestamp decides: a stale
            # copy (a SUB queue drained after a replay caught up) is no newer than
            # the last applied batch; a restarted publisher's batch is. Another
            # payload under a remembered number is a restart, unless it is older.
            late = known is not None and known != digest and batch.ts < st.last_ts
            restart = not late and (known != digest if known is not None else batch.ts > st.last_ts)
            if not late and not restart:
                st.duplicates += 1
                return 0
        if late:
            # Applying it would believe in pages the restarted pool lost. The pool is
            # forgotten too: were it the publisher's clock that went back, what the
            # ignored batch removed must not stay believed either.
            self.forget(pool)
            st.duplicates += 1
            return 0
        root = self._root(batch)
        if root is not None and (restart or not st.checked_seed):
            self._check_seed(pool, root)
        if restart:
            self.resync(pool)
        if st.next_seq is None:
            st.next_seq = s
        if root is not None:
            st.checked_seed = True
        if s > st.next_seq:
            st.pending[s] = (batch, digest)
            if len(st.pending) > self.max_pending:
                return self.give_up_gap(pool)
            return 0
        self._apply(pool, s, batch, digest)
        return 1 + self._apply_ready(pool)

    def feed_many(self, pool: int, messages: Iterable[tuple[bytes, bytes, bytes]]) -> int:
        """``feed`` each message in order, all or none: a refused one (malformed, or a root
        page hashed otherwise) leaves the router as it was before the first."""
        st = self._stream(pool)
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Iterable):
            raise InvalidArgumentError(f"messages must be an iterable of (topic, seq, payload) byte triples, "
                                       f"got {type(messages).__name__}")
        batch = list(messages)
        for i, m in enumerate(batch):
            if not isinstance(m, (tuple, list)) or len(m) != 3:
                raise InvalidArgumentError(f"messages[{i}] must be a (topic, seq, payload) triple, as a publisher "
                                           f"sends, got {type(m).__name__} {m!r:.80}")
        parsed = [self._parse(pool, m[1], m[2]) for m in batch]
        # A root's seed check depends on the stream's state, so it can refuse a message
        # after earlier ones applied: those are undone (the stream's state, the index's
        # changes to this pool, the hash forms seen).
        saved = (dataclasses.replace(st, pending=dict(st.pending), applied=OrderedDict(st.applied)),
                 self._int_keys, self._bytes_keys)
        self.index.journal = []
        try:
            return sum(self._feed(pool, *p) for p in parsed)
        except BaseException:
            self.index.undo(pool)
            for f in dataclasses.fields(st):
                setattr(st, f.name, getattr(saved[0], f.name))
            self._int_keys, self._bytes_keys = saved[1:]
            raise
        finally:
            self.index.journal = None

    def needs_replay(self, pool: int) -> int | None:
        """The first sequence number missing from ``pool``'s stream, or None."""
        st = self._stream(pool)
        return st.next_seq if st.pending else None

    def verify_from(self, pool: int) -> int | None:
        """Where a replay of ``pool``'s stream should start so that its first
        batch checks the publisher's history against the router's: the last
        applied sequence number (None before any). Replayed back unchanged it
        is a duplicate; changed, a restart (see the module's trust rules)."""
        st = self._stream(pool)
        if st.next_seq is None or st.next_seq - 1 not in st.applied:
            return None
        return st.next_seq - 1

    def give_up_gap(self, pool: int) -> int:
        """The missing batches will not come: forget the pool and go on from
        the oldest waiting batch. Returns the batches applied."""
        st = self._stream(pool)
        self.forget(pool)
        st.resets += 1
        if st.pending:
            st.next_seq = min(st.pending)
        return self._apply_ready(pool)

    def resync(self, pool: int) -> None:
        """``pool``'s stream cannot be trusted to continue (its publisher
        restarted, or went away and its history cannot be checked): forget the
        pool's pages and the waiting batches, and take the next batch that
        arrives as the stream's start (one no older than those applied: the
        last ``ts`` is kept, so a batch queued before is not taken)."""
        st = self._stream(pool)
        self.forget(pool)
        st.pending.clear()
        st.applied.clear()
        st.next_seq = None
        st.checked_seed = False
        st.restarts += 1

    def forget(self, pool: int) -> None:
        """Drop everything known of ``pool``'s pages."""
        self._stream(pool)
        self.index.forget(pool)

    def _apply_ready(self, pool: int) -> int:
        st, n = self.streams[pool], 0
        while st.next_seq in st.pending:
            s = st.next_seq
            batch, digest = st.pending.pop(s)
            self._apply(pool, s, batch, digest)  # type: ignore[arg-type]
            n += 1
        return n

    def _apply(self, pool: int, s: int, batch: Any, digest: int) -> None:
        st, ix = self.streams[pool], self.index
        for ev in batch.events:
            kind = type(ev).__name__
            if kind == "AllBlocksCleared":
                ix.forget(pool)
                st.cleared += 1
            elif ev.medium not in (self.medium, None):
                continue
            elif kind == "BlockStored":
                if ev.block_hashes:
                    if type(ev.block_hashes[0]) is int:
                        self._int_keys = True
                    else:
                        self._bytes_keys = True
                ix.add(pool, ev.block_hashes)
            else:
                ix.remove(pool, ev.block_hashes)
        st.batches += 1
        st.next_seq = s + 1
        st.last_ts = max(st.last_ts, batch.ts)
        st.applied[s] = digest
        if len(st.applied) > _REMEMBERED:
            st.applied.popitem(last=False)

    @staticmethod
    def _root(batch: Any) -> Any:
        """The batch's first BlockStored that starts a chain (None if none)."""
        for ev in batch.events:
            if type(ev).__name__ == "BlockStored" and ev.parent_block_hash is None:
                return ev
        return None

    def _check_seed(self, pool: int, ev: Any) -> None:
        """The pool hashes as this router does: its first root page, rehashed."""
        if ev.block_size != self.page_size:
            raise InvalidArgumentError(
                f"pool {pool} stores pages of {ev.block_size} tokens; this router was built for page_size "
                f"{self.page_size}")
        key = ev.extra_keys[0] if ev.extra_keys else (0,)
        salt: Any = _salt(key[0]) if isinstance(key, (tuple, list)) and key else None
        if (not ev.block_hashes or len(ev.token_ids) < self.page_size or not is_int(salt)
                or not -(1 << 63) <= salt < 1 << 63):
            raise InvalidArgumentError(
                f"pool {pool}'s root page is not one a kvpool pool sends (a hash, {self.page_size} token ids and "
                f"the salt in extra_keys, as a decimal str or an int, or none): got {len(ev.block_hashes)} hashes, "
                f"{len(ev.token_ids)} token ids and extra_keys {ev.extra_keys!r:.60}")
        try:
            words = page_hashes(ev.token_ids[: self.page_size], self.page_size, self.hash_seed, salt)
        except InvalidArgumentError as e:
            # Named as the message's: page_hashes alone says "tokens[0] = ...", no pool or event.
            raise InvalidArgumentError(f"pool {pool}'s root page has token ids no pool stores: {e}") from None
        theirs = ev.block_hashes[0]
        mine = self._int_form(words) if type(theirs) is int else self._keys(words)
        if mine[0] != theirs:
            if type(theirs) is int and theirs < 0 and theirs + (1 << 64) == mine[0]:
                raise InvalidArgumentError(
                    f"pool {pool} sends int block hashes as signed int64 (SGLang's hash_str_to_int64 form); this "
                    f"router takes vLLM's unsigned form (ZmqEventPublisher(int_block_hashes=True)): convert "
                    f"h + 2**64 if h < 0 before feeding")
            raise InvalidArgumentError(
                f"pool {pool}'s page hashes are not this router's: build the router with the pools' hash_seed "
                f"(pool.hash_seed) and page_size")

    def _stream(self, pool: int) -> StreamState:
        if not is_int(pool) or not 0 <= pool < self.num_pools:
            raise InvalidArgumentError(f"pool must be an int in [0, {self.num_pools}), got {pool!r}")
        return self.streams[pool]
