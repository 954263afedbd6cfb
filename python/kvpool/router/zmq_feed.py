"""``ZmqFeed``: a ``Router`` subscribed to pools' ZMQ event streams.

One SUB socket per pool (all messages of the topic), and, where the pool's
publisher has one, a DEALER on its replay service. ``poll()`` runs on the
caller's thread: it applies every message that has arrived, then fills each
gap in the sequence numbers by asking for a replay, or, if the replay cannot
fill it, lets the router forget that pool (``Router.give_up_gap``).
"""

from __future__ import annotations

from typing import Any, Optional

from kvpool.extras import require
from kvpool.router.router import Router

zmq = require("zmq", "events", "kvpool.router.ZmqFeed")

_END = (-1).to_bytes(8, "big", signed=True)


class ZmqFeed:
    """Feeds ``router`` from ZMQ streams.

    Args:
        router: the Router to feed.
        replay_timeout_ms: longest wait for a replay's next message.
        context: the zmq.Context (default: the process-wide instance).
    """

    def __init__(self, router: Router, *, replay_timeout_ms: int = 1000, context: Any = None) -> None:
        self.router = router
        self.replay_timeout_ms = replay_timeout_ms
        self._ctx = context or zmq.Context.instance()
        self._poller = zmq.Poller()
        self._subs: dict[Any, int] = {}
        self._replay: dict[int, Any] = {}
        self.replays = 0  # replay requests sent

    def subscribe(self, pool: int, endpoint: str, *, replay_endpoint: Optional[str] = None, topic: str = "") -> None:
        """Receive ``pool``'s batches from the publisher at ``endpoint`` (connected)."""
        self.router._stream(pool)
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        sub.connect(endpoint)
        self._subs[sub] = pool
        self._poller.register(sub, zmq.POLLIN)
        if replay_endpoint is not None:
            d = self._ctx.socket(zmq.DEALER)
            d.connect(replay_endpoint)
            self._replay[pool] = d

    def poll(self, timeout_ms: int = 0) -> int:
        """Apply the messages that have arrived (waiting up to ``timeout_ms`` for
        the first), then fill or give up the gaps. Returns batches applied."""
        applied = 0
        events = dict(self._poller.poll(timeout_ms))
        while events:
            for sock in events:
                pool = self._subs[sock]
                while True:
                    try:
                        topic, seq, payload = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    applied += self.router.feed(pool, topic, seq, payload)
            events = dict(self._poller.poll(0))
        for pool in range(self.router.num_pools):
            start = self.router.needs_replay(pool)
            if start is not None:
                applied += self._fill(pool, start)
        return applied

    def _fill(self, pool: int, start: int) -> int:
        d, applied = self._replay.get(pool), 0
        if d is not None:
            self.replays += 1
            d.send_multipart((b"", start.to_bytes(8, "big")))
            while d.poll(self.replay_timeout_ms):
                frames = d.recv_multipart()
                if len(frames) != 4:
                    continue
                _, topic, seq, payload = frames
                if seq == _END:
                    break
                applied += self.router.feed(pool, topic, seq, payload)
        if self.router.needs_replay(pool) is not None:
            applied += self.router.give_up_gap(pool)
        return applied

    def close(self) -> None:
        for s in [*self._subs, *self._replay.values()]:
            s.close(linger=0)
        self._subs.clear()
        self._replay.clear()


__all__ = ["ZmqFeed"]
