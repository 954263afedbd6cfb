"""``ZmqFeed``: a ``Router`` subscribed to pools' ZMQ event streams.

One SUB socket per pool (all messages of the topic), and, where the pool's
publisher has one, a DEALER on its replay service. ``poll()`` runs on the
caller's thread: it applies every message that has arrived, then fills each
gap in the sequence numbers by asking for a replay, or, if the replay cannot
fill it, lets the router forget that pool (``Router.give_up_gap``).

Every replay starts at the last applied number (``Router.verify_from``): its
first batch shows whether the publisher still has the router's history. A SUB
socket's monitor tells when a publisher's connection dropped; a restarted
engine may resume at the very number the router expects next, so after a
disconnect the pool's next message is applied only once a replay overlap has
checked its history (with no replay endpoint, the pool is forgotten at once); a pool
that stays quiet for ``idle_probe_ms`` after the disconnect gets that check then.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from kvpool._core import InvalidArgumentError
from kvpool._values import is_int
from kvpool.extras import require
from kvpool.router.router import Router

zmq = require("zmq", "events", "kvpool.router.ZmqFeed")
from zmq.utils.monitor import parse_monitor_message  # noqa: E402

from kvpool.events.zmq_publisher import ZMQ_INT_MAX, bad_tcp_port, check_context  # noqa: E402
from kvpool.router.idle_probes import IdleProbes, ReplayAnswer  # noqa: E402  (imports zmq)


class ZmqFeed:
    """Feeds ``router`` from ZMQ streams.

    Args:
        router: the Router to feed.
        replay_timeout_ms: longest wait for a replay's next message.
        context: the zmq.Context (default: the process-wide instance).
        idle_probe_ms: a pool with a replay endpoint that sent nothing for this long
            is asked, without waiting, for what its publisher kept past the last
            batch applied (None: never). A gap shows only when a later batch
            arrives, so batches dropped at the end of a burst (a subscriber past its
            high-water mark) would otherwise stay missing while the engine is idle.

    Counters: ``replays`` (replay requests sent to fill a gap or check a
    reconnection), ``probes`` (idle probes sent) and ``disconnects`` (publisher
    connections seen dropping).
    """

    def __init__(self, router: Router, *, replay_timeout_ms: int = 1000, context: Any = None,
                 idle_probe_ms: int | None = 1000) -> None:
        if not isinstance(router, Router):
            raise InvalidArgumentError(f"router must be a kvpool.router.Router (what the feed applies the batches to), "
                                       f"got {type(router).__name__}")
        if not is_int(replay_timeout_ms) or not 0 <= replay_timeout_ms <= ZMQ_INT_MAX:
            raise InvalidArgumentError(f"replay_timeout_ms must be an int in [0, {ZMQ_INT_MAX}] (milliseconds), "
                                       f"got {replay_timeout_ms!r}")
        if idle_probe_ms is not None and (not is_int(idle_probe_ms) or not 0 < idle_probe_ms <= ZMQ_INT_MAX):
            raise InvalidArgumentError(f"idle_probe_ms must be None (no probes) or an int in [1, {ZMQ_INT_MAX}] "
                                       f"(milliseconds), got {idle_probe_ms!r}")
        check_context(context)
        self.router = router
        self.replay_timeout_ms = replay_timeout_ms
        self.idle_probe_ms = idle_probe_ms
        self._probes = IdleProbes(self)
        self._ctx = context or zmq.Context.instance()
        self._poller = zmq.Poller()
        self._subs: dict[Any, int] = {}
        self._monitors: dict[int, Any] = {}
        self._replay: dict[int, Any] = {}
        self._replay_endpoints: dict[int, str] = {}
        self._topics: dict[int, bytes] = {}  # pool -> its topic (b"": every message of its endpoint)
        self._suspect: set[int] = set()  # pools whose publisher disconnected since their last check
        self.replays = 0  # replay requests sent
        self.disconnects = 0  # publisher connections seen dropping
        # A feed dropped without close(): its sockets close once it is collected, monitors first.
        # pyzmq's own collection of a SUB socket leaves its monitor's inproc endpoint (named by the
        # socket's fd) bound, and a later subscribe() whose socket got that fd failed with
        # "Address already in use". (No atexit: the context may be gone by then.)
        self._finalizer = weakref.finalize(self, _close_sockets, self._subs, self._monitors, self._replay)
        self._finalizer.atexit = False

    def subscribe(self, pool: int, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "") -> None:
        """Receive ``pool``'s batches from the publisher at ``endpoint`` (connected).

        ``topic`` is the publisher's topic: messages under any other topic are not
        this pool's (a forwarder carries several pools' streams, and ZMQ's prefix
        match would also deliver "pool10"'s to "pool1"). The empty topic takes
        every message of the endpoint (one publisher per endpoint, any topic).

        Raises:
            InvalidArgumentError: a bad pool index, endpoint or topic, or a pool
                already subscribed (two streams into one pool would interleave
                their sequence numbers); the feed is left as it was.
        """
        self.router._stream(pool)
        if pool in self._monitors:
            raise InvalidArgumentError(f"pool {pool} is subscribed already; a pool has one event stream")
        for name, value in (("endpoint", endpoint), ("replay_endpoint", replay_endpoint)):
            if value is not None and not isinstance(value, str):
                raise InvalidArgumentError(f"{name} must be a str such as 'tcp://host:5557', got {value!r}")
            if (bad := bad_tcp_port(value)) is not None:
                # (ZMQ would connect to the port modulo 65536: another publisher's, or none)
                raise InvalidArgumentError(f"{name} {value!r} names port {bad!r}; a TCP port is in [0, 65535]")
        if not isinstance(topic, str):
            raise InvalidArgumentError(f"topic must be a str (matched UTF-8 encoded), got {topic!r}")
        try:
            topic.encode("utf-8")
        except UnicodeEncodeError as e:  # (a lone surrogate)
            raise InvalidArgumentError(f"topic {topic!r} cannot be matched UTF-8 encoded: {e.reason}") from None
        made: list[Any] = []
        try:
            sub = self._ctx.socket(zmq.SUB)
            made.append(sub)
            sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
            self._connect(sub, "endpoint", endpoint)
            monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            made.append(monitor)
            dealer = None
            if replay_endpoint is not None:
                dealer = self._replay_socket(replay_endpoint)
                made.append(dealer)
        except BaseException:
            for sock in reversed(made):
                sock.close(linger=0)
            raise
        self._subs[sub] = pool
        self._topics[pool] = topic.encode("utf-8")
        self._monitors[pool] = monitor
        self._poller.register(sub, zmq.POLLIN)
        if dealer is not None:
            self._replay[pool] = dealer
            self._replay_endpoints[pool] = replay_endpoint
            self._probes.heard(pool)

    def _replay_socket(self, endpoint: str) -> Any:
        """A DEALER on a replay service. IMMEDIATE: a request is queued only to a connected
        publisher, so idle probes to one that is not up (yet) are not piled up to send later."""
        dealer = self._ctx.socket(zmq.DEALER)
        try:
            dealer.setsockopt(zmq.IMMEDIATE, 1)
            self._connect(dealer, "replay_endpoint", endpoint)
        except BaseException:
            dealer.close(linger=0)
            raise
        return dealer

    def _renew_replay(self, pool: int) -> None:
        """A fresh DEALER for ``pool``'s replay service: an answer still on its way to the old
        one (a probe that timed out) is dropped by the publisher, never read as another's."""
        old = self._replay[pool]
        self._replay[pool] = self._replay_socket(self._replay_endpoints[pool])
        old.close(linger=0)

    @staticmethod
    def _connect(sock: Any, name: str, endpoint: str) -> None:
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as e:
            raise InvalidArgumentError(f"{name} {endpoint!r} cannot be connected: {e}") from None

    def poll(self, timeout_ms: int = 0) -> int:
        """Apply the messages that have arrived (waiting up to ``timeout_ms`` for
        the first), then fill or give up the gaps. Returns batches applied.

        Args:
            timeout_ms: milliseconds to wait, 0 to 2**31 - 1, or None to wait without
                limit (a negative number, which ZMQ too would wait on for ever, is refused).

        Raises:
            InvalidArgumentError: ``timeout_ms`` is not None or a number of
                milliseconds in [0, 2**31 - 1]; nothing is received.
                Or a message under a pool's topic that is not a KV event batch (not
                three frames, or as ``Router.feed`` refuses it): it is dropped, and
                the next ``poll()`` goes on with the messages behind it.
        """
        if timeout_ms is not None and (isinstance(timeout_ms, (bool, np.bool_))
                                       or not isinstance(timeout_ms, (int, float, np.integer, np.floating))
                                       or not 0 <= timeout_ms <= ZMQ_INT_MAX):
            # (NaN fails the range too; a negative one ZMQ would wait on for ever)
            raise InvalidArgumentError(f"timeout_ms must be None (no limit) or a number of milliseconds in "
                                       f"[0, {ZMQ_INT_MAX}], got {timeout_ms!r}")
        applied, want = 0, self._topics
        events = dict(self._poller.poll(timeout_ms))
        while events:
            for sock in events:
                pool = self._subs[sock]
                while True:
                    # A disconnect is noticed before the messages that follow the reconnection.
                    self._watch()
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if want[pool] and frames[0] != want[pool]:
                        # ZMQ matches subscriptions by prefix: through a forwarder, "pool1"
                        # also receives "pool10"'s batches, which are another stream.
                        continue
                    if len(frames) != 3:
                        raise InvalidArgumentError(
                            f"pool {pool}'s stream sent a message of {len(frames)} frames; a KV event batch is "
                            f"three (topic, 8-byte sequence number, payload)")
                    topic, seq, payload = frames
                    self._probes.heard(pool)
                    if pool in self._suspect:
                        applied += self._verify(pool)
                    applied += self.router.feed(pool, topic, seq, payload)
                    start = self.router.needs_replay(pool)
                    if start is not None and pool in self._replay:
                        # Filled at once: the messages queued behind a gap (a
                        # subscriber past its high-water mark has many) would
                        # otherwise pile up past max_pending and give it up.
                        applied += self._fill(pool, start)
            events = dict(self._poller.poll(0))
        self._watch()
        applied += self._probes.run()
        for pool in range(self.router.num_pools):
            start = self.router.needs_replay(pool)
            if start is not None:
                applied += self._fill(pool, start)
        return applied

    @property
    def probes(self) -> int:
        """Idle probes sent (see ``idle_probe_ms``)."""
        return self._probes.sent

    def _watch(self) -> None:
        """Mark the pools whose publisher connection dropped."""
        for pool, mon in self._monitors.items():
            while mon.poll(0):
                event = parse_monitor_message(mon.recv_multipart())
                if event["event"] != zmq.EVENT_DISCONNECTED:
                    continue
                self.disconnects += 1
                if pool in self._replay:
                    self._suspect.add(pool)
                else:
                    # Nothing can check what the publisher holds when it comes back.
                    self.router.resync(pool)

    def _verify(self, pool: int) -> int:
        """A replay from the last applied number, before a suspect pool's next
        message; a publisher that cannot show that batch cannot vouch for the
        router's history, so the pool is resynced."""
        self._suspect.discard(pool)
        start = self.router.verify_from(pool)
        if start is None:
            return 0
        return self._replay_from(pool, start, verify=True)

    def _fill(self, pool: int, start: int) -> int:
        applied = 0
        if pool in self._replay:
            self._suspect.discard(pool)
            # One batch of overlap: checked when the publisher still keeps it. A
            # connection that never dropped is the same publisher, so a fill
            # without it is trusted (a restart shows as a disconnect first).
            check = self.router.verify_from(pool)
            applied = self._replay_from(pool, start if check is None else check, verify=False)
        if self.router.needs_replay(pool) is not None:
            applied += self.router.give_up_gap(pool)
        return applied

    def _replay_from(self, pool: int, start: int, *, verify: bool) -> int:
        """Feed ``pool``'s kept batches from ``start`` on; returns the batches
        applied. The router tells a replayed batch ``start`` that it applied
        from another under that number by its payload. With ``verify``, a
        replay that does not begin with batch ``start`` cannot vouch for the
        router's history: the pool is resynced before the replay is fed."""
        applied = self._probes.finish(pool)  # its answer comes first on this socket
        d, first = self._replay[pool], True  # (after finish, which may have renewed it)
        while d.poll(0):
            d.recv_multipart()  # the rest of an earlier replay that timed out
        self.replays += 1
        try:
            # Without waiting: with no publisher connected (IMMEDIATE) the send would block.
            d.send_multipart((b"", start.to_bytes(8, "big")), flags=zmq.NOBLOCK)
        except zmq.Again:
            if verify:
                self.router.resync(pool)  # nobody to vouch for the router's history
            return applied
        for topic, seq, payload in ReplayAnswer(d, self.replay_timeout_ms):
            if first and verify and int.from_bytes(seq, "big", signed=True) != start:
                self.router.resync(pool)
            first = False
            applied += self.router.feed(pool, topic, seq, payload)
        if first and verify:
            self.router.resync(pool)  # nothing kept, or no answer
        return applied

    def close(self) -> None:
        """Close every socket; a later ``poll()`` receives nothing until a pool is
        subscribed again."""
        for sub in self._subs:
            # A closed socket left registered made every later poll() fail.
            self._poller.unregister(sub)
        _close_sockets(self._subs, self._monitors, self._replay)
        self._topics.clear()
        self._replay_endpoints.clear()
        self._suspect.clear()
        self._probes.clear()


def _close_sockets(subs: dict[Any, int], monitors: dict[int, Any], replay: dict[int, Any]) -> None:
    """Close a feed's sockets, each SUB's monitor disabled first, and forget them (``close``, or
    the finalizer of a feed collected without it: this holds no reference to the feed)."""
    for sub in subs:
        sub.disable_monitor()
    for s in [*monitors.values(), *subs, *replay.values()]:
        s.close(linger=0)
    subs.clear()
    monitors.clear()
    replay.clear()


__all__ = ["ZmqFeed"]
