"""``ZmqFeed``'s idle probes: ask a quiet pool's publisher what it kept past the last
batch applied, without waiting for the answer.

A gap in a stream shows only when a later batch arrives. Batches dropped at the end
of a burst (ZMQ drops them for a subscriber past its high-water mark) would stay
missing for as long as the engine is idle, and the router would keep predicting pages
the pool has since evicted. So once a pool with a replay endpoint has sent nothing for
``idle_probe_ms``, ``poll()`` sends one replay request from the last applied number
(an overlap the router takes as a duplicate) and later polls feed whatever comes back,
up to the end marker; a publisher that does not answer within ``replay_timeout_ms``
is left until the next probe. A live pool whose stream is complete costs one request
and its end marker a second. A quiet pool whose publisher disconnected since its last
check gets that check (``ZmqFeed._verify``, a replay overlap that waits for its answer)
instead of a probe.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator
from typing import Any

from zmq import NOBLOCK, Again

from kvpool.events.publisher import END_SEQ

__all__ = ["IdleProbes", "ReplayAnswer"]


class ReplayAnswer:
    """The batches of one replay answer on a DEALER socket, as ``(topic, seq, payload)``,
    each waited for up to ``wait_ms``; iteration stops at the end marker (``ended``
    then says so) or at the first wait that times out.

    Both framings publishers use are read: ``(b"", topic, seq, payload)`` (vLLM since its
    replay answers carry the topic, and kvpool by default) and ``(b"", seq, payload)``
    (SGLang, and vLLM before that; the topic is then ``b""``). Other messages are skipped."""

    def __init__(self, sock: Any, wait_ms: int) -> None:
        self.sock, self.wait_ms, self.ended = sock, wait_ms, False

    def __iter__(self) -> Iterator[tuple[bytes, bytes, bytes]]:
        while self.sock.poll(self.wait_ms):
            frames = self.sock.recv_multipart()
            if len(frames) == 4:
                _, topic, seq, payload = frames
            elif len(frames) == 3:
                (_, seq, payload), topic = frames, b""
            else:
                continue
            if seq == END_SEQ:
                self.ended = True
                return
            yield topic, seq, payload


class IdleProbes:
    """The probes of one ``ZmqFeed`` (its replay sockets, router and settings)."""

    def __init__(self, feed: Any) -> None:
        # A proxy: the feed holds these probes, and a strong reference back made a cycle that
        # kept a feed dropped without close(), and its sockets, until the cyclic collector ran.
        self.feed = weakref.proxy(feed)
        self.last_heard: dict[int, float] = {}  # pool -> when its stream last spoke (or was probed)
        self.asked: dict[int, float] = {}  # pool -> when its unanswered probe went out
        self.sent = 0

    def heard(self, pool: int) -> None:
        self.last_heard[pool] = time.monotonic()

    def run(self) -> int:
        """Feed what probes brought back, send the probes now due; the batches applied."""
        feed, applied = self.feed, 0
        if feed.idle_probe_ms is None:
            return 0
        now = time.monotonic()
        for pool in list(feed._replay):
            if pool in self.asked:
                applied += self._take(pool, now)
            elif feed.router.needs_replay(pool) is not None \
                    or (now - self.last_heard.get(pool, now)) * 1000 < feed.idle_probe_ms:
                continue
            elif pool in feed._suspect:
                # Its publisher disconnected and nothing came since (a restarted engine's first
                # batch lost to the reconnecting SUB, or none sent yet): check its history now,
                # as its next message would be; the router otherwise kept the old pages.
                applied += feed._verify(pool)
                self.last_heard[pool] = time.monotonic()
            else:
                start = feed.router.verify_from(pool)
                try:
                    feed._replay[pool].send_multipart((b"", (0 if start is None else start).to_bytes(8, "big")),
                                                      flags=NOBLOCK)
                except Again:  # no publisher connected (IMMEDIATE): ask after the next quiet spell
                    self.last_heard[pool] = now
                    continue
                self.asked[pool] = now
                self.sent += 1
        return applied

    def _take(self, pool: int, now: float) -> int:
        feed = self.feed
        answer = ReplayAnswer(feed._replay[pool], 0)
        applied = sum(feed.router.feed(pool, *batch) for batch in answer)
        if answer.ended:
            self._done(pool, now)
        elif (now - self.asked[pool]) * 1000 > feed.replay_timeout_ms:
            # No answer: ask again after the next quiet spell, on a fresh socket, so that a
            # late answer cannot end a later replay early with its end marker.
            feed._renew_replay(pool)
            self._done(pool, now)
        return applied

    def finish(self, pool: int) -> int:
        """Take the rest of ``pool``'s unanswered probe before another replay is asked on
        its socket (answers come in order, so the probe's end marker would end it)."""
        if pool not in self.asked:
            return 0
        feed = self.feed
        answer = ReplayAnswer(feed._replay[pool], feed.replay_timeout_ms)
        applied = sum(feed.router.feed(pool, *batch) for batch in answer)
        if not answer.ended:
            feed._renew_replay(pool)  # (as in _take: no late answer on the socket the replay uses)
        self._done(pool, time.monotonic())
        return applied

    def _done(self, pool: int, now: float) -> None:
        self.asked.pop(pool, None)
        self.last_heard[pool] = now

    def clear(self) -> None:
        self.last_heard.clear()
        self.asked.clear()
