"""A ZmqEventPublisher dropped without close(): its finalizer stops the sender thread and
waits for it, so its addresses are free for a publisher made again at once, and gives up
waiting (rather than hang) when the thread needs a lock the collecting thread holds."""

import gc
import sys
import threading
import time
import weakref

import numpy as np
import pytest

zmq = pytest.importorskip("zmq", reason="the events extra (pyzmq) is not installed")
pytest.importorskip("msgspec", reason="the events extra (msgspec) is not installed")
from test_events_zmq import admit, pool, rebind_endpoints  # noqa: E402

from kvpool.events import ZmqEventPublisher, zmq_publisher  # noqa: E402


@pytest.mark.parametrize("kind", ["inproc", "ipc", "tcp"])
def test_a_dropped_publisher_frees_its_addresses_for_one_made_again_at_once(kind, tmp_path):
    """A publisher dropped without close() only queued its thread's stop marker, and the thread
    unbound later: an engine that rebuilt its publisher on the same addresses right after the
    drop failed every other time with 'Address already in use' (inproc and tcp)."""
    pub_ep, rep_ep = rebind_endpoints(kind, tmp_path, "drop")
    senders = sum(t.name == "kvpool-kv-events" for t in threading.enumerate())
    a = pool()
    for i in range(60):
        pub = ZmqEventPublisher(a, pub_ep, replay_endpoint=rep_ep)
        admit(a, np.arange(8) + 100 * i)
        assert pub.publish() > 0
        if i % 2:
            pub.cycle = pub  # collected by the cyclic collector rather than by refcount
            del pub
            gc.collect()
        else:
            del pub
        # The drop has stopped the sender thread before it returned.
        assert sum(t.name == "kvpool-kv-events" for t in threading.enumerate()) == senders


def test_a_dropped_publisher_collected_under_its_own_buffer_lock_does_not_wait_for_ever(monkeypatch):
    """The finalizer waits for the sender thread; a collection run by a thread that holds the
    publisher's buffer lock (a fork's hooks hold it) while the sender serves a replay, which
    needs that lock, must give up waiting rather than hang (the thread then ends by itself)."""
    monkeypatch.setattr(zmq_publisher, "_DROP_WAIT_S", 0.2)
    a = pool()
    pub = ZmqEventPublisher(a, "tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    admit(a, np.arange(8))
    pub.publish()
    assert pub.flush(30)
    lock, sender = pub._lock, pub._thread
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(pub.replay_endpoint)
    done = []

    def collect_holding_the_lock(held):
        pub = held.pop()  # (the thread's args must not keep it)
        with lock:
            dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            for _ in range(3000):  # until the sender waits for the lock in its replay
                frame = sys._current_frames().get(sender.ident)
                if frame is not None and frame.f_code.co_name == "kept_since":
                    break
                time.sleep(0.01)
            pub.cycle = pub
            gone = weakref.ref(pub)
            del pub
            gc.collect()
            done.append(gone() is None)

    was = gc.isenabled()
    gc.disable()
    try:
        t = threading.Thread(target=collect_holding_the_lock, args=([pub],), daemon=True)
        del pub
        t.start()
        t.join(60)
    finally:
        if was:
            gc.enable()
    try:
        assert done == [True], "the collection waited for a sender thread that waits for its lock"
        sender.join(30)
        assert not sender.is_alive()
    finally:
        dealer.close(linger=0)
