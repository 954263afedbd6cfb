"""``ZmqEventPublisher``: a pool's KV events on a ZMQ PUB socket, with vLLM's
ROUTER replay service.

Wire protocol (vLLM 0.33, ``vllm/distributed/kv_events.py``):

- PUB: multipart ``(topic, seq, payload)``; ``seq`` is 8 bytes big-endian.
- ROUTER (``replay_endpoint``): a client (a DEALER: a REQ socket takes only the
  first answer, as vLLM's tests found) sends
  ``(b"", start_seq)`` with ``start_seq`` as 8 bytes big-endian; the service
  answers every kept message whose sequence number is >= ``start_seq`` as
  ``(b"", topic, seq, payload)``, then the end marker
  ``(b"", b"", seq -1 as 8 signed bytes, b"")``. With ``replay_topic_frame=False``
  it answers without the topic frame, ``(b"", seq, payload)`` and
  ``(b"", seq -1, b"")``, as SGLang's publisher (and vLLM's before its replay
  carried the topic) does, for subscribers that read that framing.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import weakref
from typing import Any

import numpy as np

from kvpool._core import InvalidArgumentError
from kvpool._values import is_int
from kvpool.errors import PublisherClosedError
from kvpool.events.drainers import release
from kvpool.events.publisher import DEFAULT_BUFFER_STEPS, END_SEQ, EventPublisher, kept_since
from kvpool.extras import require

zmq = require("zmq", "events", "kvpool.events.ZmqEventPublisher")
from zmq.utils.monitor import recv_monitor_message  # noqa: E402  (after the extra's check)

# Longest close() waits for ZMQ to close a TCP or IPC listener.
_UNBIND_WAIT_S = 1.0
# Longest a dropped publisher's finalizer waits for its sender thread (two unbinds and the
# queued sends, which never block, take far less).
_DROP_WAIT_S = 5.0

#: Largest value of a ZMQ int option or timeout (a C int).
ZMQ_INT_MAX = 2**31 - 1


def check_context(context: Any) -> None:
    """``context=``: None (the process-wide instance) or a zmq.Context, checked before
    any socket is made (anything else fails at its first ``socket()``)."""
    if context is not None and not isinstance(context, zmq.Context):
        raise InvalidArgumentError(f"context must be None or a zmq.Context, got {type(context).__name__}")
    if context is not None and context.closed:
        raise InvalidArgumentError("context is a terminated zmq.Context (term() was called): pass a live one, "
                                   "or None for the process-wide instance")

def _seconds(timeout: Any) -> float | None:
    """``flush(timeout=)`` checked: threading takes a str or a NaN until it must wait, and
    then raises TypeError or waits for ever, and an infinite one overflows its clock."""
    if timeout is None:
        return None
    if (isinstance(timeout, (bool, np.bool_)) or not isinstance(timeout, (int, float, np.integer, np.floating))
            or not timeout >= 0):
        raise InvalidArgumentError(f"timeout must be None (no limit) or a number of seconds >= 0, "
                                   f"got {type(timeout).__name__} {timeout!r:.40}")
    return None if timeout >= threading.TIMEOUT_MAX else float(timeout)


# How often an idle sender thread looks for replay requests.
_POLL_MS = 50


def bad_tcp_port(endpoint: str | None) -> str | None:
    """The port of a ``tcp://host:port`` endpoint when it is outside [0, 65535] (or a sign
    ZMQ would read), else None."""
    if endpoint is None or not endpoint.startswith("tcp://") or ":" not in endpoint[6:]:
        return None
    port = endpoint.rsplit(":", 1)[1]
    # ASCII digits only: str.isdigit() also takes '²' (int() then raised an untyped
    # ValueError) and '٣', which int() reads but ZMQ does not.
    if port == "*" or (port.isascii() and port.isdigit() and int(port) <= 65535):
        return None
    return port


def binds(endpoint: str) -> bool:
    """Whether the publisher binds ``endpoint`` (else it connects, to a forwarder):
    a wildcard host, ipc:// or inproc://, as vLLM decides, and port 0 (an
    ephemeral port; ``ZmqEventPublisher.endpoint`` says which)."""
    return ("*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
            or endpoint.endswith(":0"))


class ZmqEventPublisher(EventPublisher):
    """Publishes ``pool``'s KV events as vLLM's ``ZmqEventPublisher`` does.

    Args:
        pool: a ``KVPool`` or ``SlotAllocator`` (anything with ``take_events()``).
        endpoint: the PUB socket's address, e.g. ``tcp://*:5557`` (bound) or
            ``tcp://host:5557`` (connected to a forwarder); see ``binds``.
        replay_endpoint: address the ROUTER replay service binds (None: no replay).
        topic: topic frame of every message.
        buffer_steps: batches kept for replay.
        hwm: send high-water mark of the PUB socket (messages a slow subscriber
            may fall behind before ZMQ drops its messages; it then sees a gap
            in the sequence numbers and asks for a replay).
        data_parallel_rank: sent in every batch (0 unless given, as vLLM's publisher
            sends; None: nil). Unlike vLLM's publisher, the endpoints are bound as
            given: vLLM adds the rank to each endpoint's TCP port (``inproc``/``ipc``:
            a ``_dp{rank}`` suffix), so one engine per rank shares a base address;
            pass each rank its own endpoint.
        context: the zmq.Context (default: the process-wide instance).
        int_block_hashes: send block hashes as vLLM's int form (the low 64 bits
            of the 16-byte hash, unsigned), as vLLM does by default, instead of
            the 16 bytes; ``Router`` reads either.
        replay_topic_frame: replay answers carry the topic frame, as vLLM's do
            (True), or not, as SGLang's (False); ``ZmqFeed`` reads either.

    ``publish()`` drains and encodes on the calling thread and hands the
    message to a sender thread, which owns both sockets (as vLLM's publisher
    thread does): a ZMQ send wakes ZMQ's I/O thread, which costs the caller
    more than the encoding. Messages go out in sequence order; ``flush()``
    waits until they have; ``close()`` sends what is queued, then stops the
    thread and closes the sockets.

    One process's: a forked child inherits neither the sender thread nor usable
    sockets, so there ``publish()`` and ``flush()`` raise ``PublisherClosedError``
    (rather than queueing for a thread that does not exist, or waiting for it
    forever) and ``close()`` only marks the child's copy closed. Build a new
    publisher in the child.
    """

    def __init__(self, pool: Any, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = DEFAULT_BUFFER_STEPS, hwm: int = 100_000,
                 data_parallel_rank: int | None = 0, context: Any = None,
                 int_block_hashes: bool = False, replay_topic_frame: bool = True) -> None:
        if not isinstance(endpoint, str):
            raise InvalidArgumentError(f"endpoint must be a str such as 'tcp://*:5557', got {endpoint!r}")
        if replay_endpoint is not None and not isinstance(replay_endpoint, str):
            raise InvalidArgumentError(f"replay_endpoint must be None or a str such as 'tcp://*:5558', "
                                       f"got {replay_endpoint!r}")
        for name, e in (("endpoint", endpoint), ("replay_endpoint", replay_endpoint)):
            if (bad := bad_tcp_port(e)) is not None:
                raise InvalidArgumentError(f"{name} {e!r} names port {bad!r}; a TCP port is in [0, 65535] "
                                           "(ZMQ would take it modulo 65536 and bind another one)")
        if not is_int(hwm) or not 0 <= hwm <= ZMQ_INT_MAX:
            raise InvalidArgumentError(f"hwm must be an int in [0, {ZMQ_INT_MAX}] (0: no limit; ZMQ keeps it in a "
                                       f"C int), got {hwm!r}")
        if not isinstance(replay_topic_frame, (bool, np.bool_)):
            raise InvalidArgumentError(f"replay_topic_frame takes True (answers carry the topic, as vLLM's) or False "
                                       f"(no topic frame, as SGLang's), got {type(replay_topic_frame).__name__} "
                                       f"{replay_topic_frame!r}")
        check_context(context)
        self._pid = os.getpid()
        self.replay_topic_frame = bool(replay_topic_frame)
        super().__init__(pool, topic=topic, buffer_steps=buffer_steps, data_parallel_rank=data_parallel_rank,
                         int_block_hashes=int_block_hashes)
        try:
            self._start(context, endpoint, replay_endpoint, buffer_steps, hwm)
        except BaseException:
            # The pool was claimed: a traceback holding this half-made publisher (a logger,
            # sys.last_exc) must not keep the next one from publishing it.
            self._closed = True
            release(pool, self)
            raise

    def _start(self, context: Any, endpoint: str, replay_endpoint: str | None, buffer_steps: int, hwm: int) -> None:
        """Sockets and the sender thread (after the base class claimed the pool)."""
        ctx = context or zmq.Context.instance()
        self._queue: queue.SimpleQueue[tuple[bytes, bytes] | None] = queue.SimpleQueue()
        sender = _Sender(ctx.socket(zmq.PUB), self.topic, self._buffer, self._lock, self._queue,
                         self.replay_topic_frame)
        self._queued = 0
        # close() from two threads at once: one stops the sender thread, the other waits for it.
        self._closing = threading.Lock()
        try:
            sender.pub.set_hwm(int(hwm))
            try:
                if binds(endpoint):
                    sender.pub.bind(endpoint)
                    endpoint = sender.pub.getsockopt_string(zmq.LAST_ENDPOINT)
                    sender.binds.append((sender.pub, endpoint))
                else:
                    sender.pub.connect(endpoint)
            except zmq.ZMQError as e:
                raise InvalidArgumentError(f"endpoint {endpoint!r} cannot be {'bound' if binds(endpoint) else 'connected'}"
                                           f": {e}") from None
            self.endpoint = endpoint
            self.replay_endpoint = None
            if replay_endpoint is not None:
                sender.replay = ctx.socket(zmq.ROUTER)
                # Room for a whole replay and its end marker, as vLLM sizes it (ZMQ keeps
                # it in a C int: a larger buffer gets the largest mark ZMQ takes).
                sender.replay.setsockopt(zmq.SNDHWM, min(2 * (buffer_steps + 1), ZMQ_INT_MAX))
                try:
                    sender.replay.bind(replay_endpoint)
                except zmq.ZMQError as e:
                    raise InvalidArgumentError(f"replay_endpoint {replay_endpoint!r} cannot be bound: {e}") from None
                self.replay_endpoint = sender.replay.getsockopt_string(zmq.LAST_ENDPOINT)
                sender.binds.append((sender.replay, self.replay_endpoint))
        except BaseException:
            sender.close_sockets()
            raise
        self._sender = sender
        self._thread: threading.Thread | None = threading.Thread(
            target=sender.run, name="kvpool-kv-events", daemon=True)
        self._thread.start()
        # The thread holds the sender, not the publisher: a publisher dropped without close()
        # is collected, and then stops its thread (which closes the sockets, freeing the
        # addresses) and, being gone, no longer holds its pool against another publisher.
        # The finalizer waits for the thread, as close() does: had it only queued the stop
        # marker, a publisher made again on the same address right after the drop would find
        # it still bound (every other rebuild failed so, on inproc:// and tcp://).
        self._stop = weakref.finalize(self, _stop_sender, self._queue, self._thread, self._pid)
        self._stop.atexit = False  # (at exit the daemon thread just ends, as it did before)

    def _drains_here(self) -> bool:
        return os.getpid() == self._pid  # (a forked child's copy refuses to publish)

    def _check_process(self, what: str) -> None:
        if os.getpid() != self._pid:
            raise PublisherClosedError(
                f"cannot {what}: this ZmqEventPublisher was created in process {self._pid}, and this is a forked "
                f"child ({os.getpid()}), which has neither its sender thread nor usable sockets; build a new "
                f"ZmqEventPublisher in this process (on its own endpoint)")

    def publish(self, events: Any = None) -> int:
        """Drain the pool's events and hand them to the sender thread as one ``KVEventBatch``.
        ``events``: what the engine drained itself (see ``EventPublisher.publish``).

        Returns:
            the number of kvpool events sent (one per page Stored or Removed,
            one per Cleared); 0 sends nothing and uses no sequence number.

        Raises:
            PublisherClosedError: the publisher is closed, or was inherited through
                ``os.fork()`` (a ``RuntimeError`` too).
        """
        # Before draining: in a forked child the pool's events stay for a publisher that can send them.
        self._check_process("publish")
        return super().publish(events)

    def _deliver(self, seq_b: bytes, payload: bytes) -> None:
        self._queued += 1
        self._queue.put((seq_b, payload))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every message published before this call has been sent (not those
        other threads publish meanwhile, which could keep it waiting); False on timeout.

        Args:
            timeout: None (no limit) or seconds >= 0; ``inf``, or more than
                ``threading.TIMEOUT_MAX``, waits as None does.

        Raises:
            InvalidArgumentError: ``timeout`` is not None or a number >= 0 (nothing waited).
            PublisherClosedError: a copy inherited through ``os.fork()``.
        """
        timeout = _seconds(timeout)
        self._check_process("flush")
        sender, queued = self._sender, self._queued
        with sender.sent:
            return sender.sent.wait_for(lambda: sender.done >= queued, timeout)

    def close(self) -> None:
        """Send what is queued, stop the sender thread and close both sockets
        (idempotent). The addresses it bound are free when it returns: a publisher
        made again on them binds at once."""
        if os.getpid() != self._pid:
            # A forked child's copy: the locks may be held by parent threads that do not exist
            # here, and the sockets and the thread are the parent's.
            self._closed, self._thread = True, None
            return
        super().close()
        with self._closing:
            if self._thread is not None:
                self._queue.put(None)
                self._stop.detach()  # (the stop marker is queued)
                # Bounded: the queue ahead of the sentinel is finite, and sends
                # never block (PUB and ROUTER drop past their HWM). The thread closes
                # the sockets (it alone uses them) before it ends.
                self._thread.join()
                self._thread = None


def _stop_sender(items: Any, thread: threading.Thread, pid: int) -> None:
    """A dropped publisher's finalizer: queue the stop marker and wait until the sender thread
    has sent what was queued and closed the sockets, so the addresses are free when the
    collection that dropped the publisher returns. Not on the sender thread itself (a garbage
    collection that ran there): it cannot wait for itself, and ends once it returns to its loop.
    Bounded: a collection run by a thread holding the publisher's buffer lock (a fork's hooks
    hold it) while the thread serves a replay would otherwise wait for ever; past the bound the
    thread frees the addresses as it ends."""
    items.put(None)
    if os.getpid() == pid and threading.current_thread() is not thread:
        thread.join(_DROP_WAIT_S)


class _Sender:
    """What the sender thread uses: the sockets, the queue ``publish()`` fills, and the
    publisher's replay buffer and its lock, but not the publisher itself (see ``_stop``)."""

    def __init__(self, pub: Any, topic: bytes, buffer: Any, lock: Any, items: Any, topic_frame: bool) -> None:
        self.pub, self.replay, self.topic, self.topic_frame = pub, None, topic, topic_frame
        self.buffer, self.lock, self.items = buffer, lock, items
        # (socket, endpoint) of each bind, unbound before the socket closes: ZMQ closes a
        # socket in its I/O thread, and until then the address stays taken, so a publisher
        # made again on the same address right after close() could fail to bind it.
        self.binds: list[tuple[Any, str]] = []
        self.sent = threading.Condition()
        self.done = 0

    def run(self) -> None:
        # Both sockets are used by this thread only (ZMQ sockets are not
        # thread-safe).
        send, more, topic = self.pub.send, zmq.SNDMORE, self.topic
        replay = self.replay
        try:
            while True:
                if replay is not None and replay.poll(0):
                    self._serve_replay(replay)
                try:
                    item = self.items.get(timeout=_POLL_MS / 1000)
                except queue.Empty:
                    continue
                if item is None:
                    return
                # Three plain sends cost less than send_multipart's generic loop.
                send(topic, more)
                send(item[0], more)
                send(item[1])
                with self.sent:
                    self.done += 1
                    self.sent.notify_all()
        finally:
            self.close_sockets()

    def _serve_replay(self, sock: Any) -> None:
        frames = sock.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            return  # not a replay request (vLLM ignores these too)
        client, _, start = frames
        kept = kept_since(self.buffer, self.lock, self.topic, int.from_bytes(start, "big"))
        if self.topic_frame:
            for topic, seq_b, payload in kept:
                sock.send_multipart((client, b"", topic, seq_b, payload))
            sock.send_multipart((client, b"", b"", END_SEQ, b""))
        else:
            for _, seq_b, payload in kept:
                sock.send_multipart((client, b"", seq_b, payload))
            sock.send_multipart((client, b"", END_SEQ, b""))

    def close_sockets(self) -> None:
        for s, endpoint in self.binds:
            if not s.closed:
                _unbind(s, endpoint)
        for s in (self.pub, self.replay):
            if s is not None and not s.closed:
                s.close(linger=0)


def _unbind(sock: Any, endpoint: str, timeout: float = _UNBIND_WAIT_S) -> None:
    """Unbinds ``endpoint`` and waits (at most ``timeout``) until ZMQ's I/O thread has closed its
    listener, so that the address is free when ``close()`` returns. An inproc name is released at
    once; a TCP or IPC listener closes a moment later, reported on a monitor socket."""
    if endpoint.startswith("inproc://"):
        try:
            sock.unbind(endpoint)
        except zmq.ZMQError:
            pass  # already gone
        return
    try:
        monitor = sock.get_monitor_socket(zmq.EVENT_CLOSED | zmq.EVENT_CLOSE_FAILED)
    except zmq.ZMQError:
        monitor = None  # no monitor: unbind without waiting
    try:
        sock.unbind(endpoint)
        if monitor is None:
            return
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0 and monitor.poll(int(left * 1000) + 1):
            event = recv_monitor_message(monitor)
            if event.get("endpoint") in (endpoint, endpoint.encode()):
                return
    except zmq.ZMQError:
        pass  # already gone: the close that follows is all that is left
    finally:
        if monitor is not None:
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass  # the socket is closed next either way
            monitor.close(linger=0)


__all__ = ["ZmqEventPublisher", "binds"]
