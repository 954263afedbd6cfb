"""The fork hooks (kvpool/_forksafe.py) in the three situations a sweep found them hanging:
a pool built on another thread while a fork waits for a busy lock, two threads forking at
once, and a fork from inside user code that a kvpool lock is held around (a TierBackend's
put, a publisher's _deliver). Each runs in a fresh interpreter under a deadline, so a hang
fails the test instead of stalling the suite, and so sys.setswitchinterval stays its own."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX-only")

DEADLINE_S = 90


def run(script: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    try:
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True,
                             text=True, timeout=DEADLINE_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the script did not finish within {DEADLINE_S} s (a fork hook hung):\n{e.stdout}\n{e.stderr}")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Exception ignored" not in out.stderr, out.stderr  # a hook that raised
    return out.stdout


CHILD = """
        def wait_child(pid, seconds=20.0):
            t0 = time.monotonic()
            while time.monotonic() - t0 < seconds:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    return os.waitstatus_to_exitcode(status)
                time.sleep(0.01)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "hung"
"""


def test_a_pool_built_while_a_fork_waits_is_held_across_it():
    out = run("""
        import os, signal, threading, time
        import numpy as np, torch
        from kvpool import KVPool
        from kvpool.events import LocalEventPublisher
    """ + CHILD + """
        mk = lambda: KVPool(1, 1, 8, page_size=1, num_pages=1 << 14, max_requests=2100, max_context_len=8,
                            dtype=torch.float32)
        pool1 = mk()

        class SlowDelivery(LocalEventPublisher):
            def _deliver(self, seq_b, payload):
                time.sleep(0.5)  # publish() holds its lock meanwhile: the fork waits for it
                super()._deliver(seq_b, payload)

        pub = SlowDelivery(pool1)
        h = pool1.open(1); pool1.extend(h, [8], np.arange(8)); pool1.close(h, cache=True)
        box, stop = {}, threading.Event()

        def builder():
            time.sleep(0.1)  # the fork is waiting by now; this pool comes after its first look
            pool2 = box["pool2"] = mk()
            while not stop.is_set():
                hh = pool2.open(2048); pool2.extend(hh, np.full(2048, 4)); pool2.close(hh)

        threading.Thread(target=pub.publish).start()
        time.sleep(0.05)
        tb = threading.Thread(target=builder); tb.start()
        pid = os.fork()
        if pid == 0:
            p2 = box.get("pool2")
            if p2 is not None:
                p2.close(p2.open(1))
            os._exit(0)
        print("child", wait_child(pid))
        stop.set(); tb.join()
        p2 = box["pool2"]; p2.close(p2.open(1)); p2.check()
        print("parent ok")
    """)
    assert "child 0" in out and "parent ok" in out, out


def test_an_allocator_built_while_a_fork_waits_is_held_across_it():
    """The same for a bare SlotAllocator (no Python lock of its own), built while the Rust hook
    waits for another allocator's mutex: its mutexes, taken by calls that run with the GIL
    released, are held by the hook's later snapshot. The wait is made with the test-only
    hook that holds an allocator's event lock around a callback (the test-hooks build)."""
    from kvpool import SlotAllocator

    if not hasattr(SlotAllocator(8, 1, 1, 8), "_while_draining_for_tests"):
        pytest.skip("needs the bindings' test-hooks feature (SlotAllocator._while_draining_for_tests)")
    out = run("""
        import os, signal, threading, time
        import numpy as np
        from kvpool import SlotAllocator
    """ + CHILD + """
        a1 = SlotAllocator(64, page_size=1, max_requests=4, max_context_len=8)

        def builder(box, stop):
            time.sleep(0.1)  # the fork's Rust hook is waiting for a1 by now
            a = box["a"] = SlotAllocator(1 << 16, page_size=1, max_requests=4200, max_context_len=8)
            while not stop.is_set():
                hh = a.open(4096); a.extend(hh, np.full(4096, 8)); a.close(hh)

        codes = []
        for _ in range(3):  # a fork finds the builder inside a call most times, not every time
            box, stop = {}, threading.Event()
            threading.Thread(target=a1._while_draining_for_tests, args=(lambda: time.sleep(0.4),)).start()
            time.sleep(0.05)
            tb = threading.Thread(target=builder, args=(box, stop)); tb.start()
            pid = os.fork()
            if pid == 0:
                a = box.get("a")
                if a is not None:
                    for _ in range(3):
                        a.close(a.open(1))
                os._exit(0)
            codes.append(wait_child(pid))
            stop.set(); tb.join()
            box["a"].check()
        print("child", max(codes, key=str))
        print("parent ok")
    """)
    assert "child 0" in out and "parent ok" in out, out


def test_two_threads_forking_at_once_leave_every_lock_free():
    out = run("""
        import os, sys, threading, time, torch
        from kvpool import KVPool
        sys.setswitchinterval(1e-6)  # widens the window the hooks' shared state raced in
        pool = KVPool(1, 1, 8, page_size=4, num_pages=64, max_requests=8, max_context_len=64,
                      dtype=torch.float32)

        def forker():
            for _ in range(150):
                pid = os.fork()
                if pid == 0:
                    os._exit(0)
                os.waitpid(pid, 0)

        ts = [threading.Thread(target=forker, daemon=True) for _ in range(2)]
        [t.start() for t in ts]
        for t in ts:
            t.join(60)
        print("stuck", [t.is_alive() for t in ts])
        free = pool._lock.acquire(timeout=5)
        print("lock free", free)
        if free:
            pool._lock.release()
            pool.close(pool.open(1))
            print("parent ok")
        sys.stdout.flush(); os._exit(0)
    """)
    assert "stuck [False, False]" in out and "lock free True" in out and "parent ok" in out, out


def test_a_fork_from_inside_user_code_a_kvpool_lock_is_held_around():
    out = run("""
        import multiprocessing as mp, os, signal, tempfile, threading, time
        import numpy as np, torch
        from kvpool import KVPool
        from kvpool.events import LocalEventPublisher
        from kvpool.tiers import DiskCache, FileTier
        from kvpool.tiers.backend import TierBackend

        def worker():
            p = mp.get_context("fork").Process(target=lambda: None)  # e.g. an upload worker
            p.start(); p.join(20)
            return p.exitcode

        class ForkingUpload(TierBackend):
            def __init__(self, inner): self.inner = inner
            @property
            def max_bytes(self): return self.inner.max_bytes
            def get(self, h): return self.inner.get(h)
            def contains(self, h): return self.inner.contains(h)
            def remove(self, h): return self.inner.remove(h)
            def put(self, record):
                assert worker() == 0
                return self.inner.put(record)

        class ForkingDelivery(LocalEventPublisher):
            def _deliver(self, seq_b, payload):
                assert worker() == 0
                super()._deliver(seq_b, payload)

        pool = KVPool(1, 1, 8, page_size=4, num_pages=32, dtype=torch.float32)
        disk = DiskCache(pool, ForkingUpload(FileTier(tempfile.mkdtemp(), max_bytes=1 << 20)), model="m")
        pub = ForkingDelivery(pool)
        h = pool.open(1); pool.extend(h, [8], np.arange(8)); pool.close(h, cache=True)
        box = {}
        # (the publisher drains the pool: the disk gets the events drained for it)
        t = threading.Thread(target=lambda: box.update(stored=disk.store_new(pool.take_events())), daemon=True)
        t.start(); t.join(30)
        print("stored", box.get("stored"), "hung", t.is_alive())
        h = pool.open(1); pool.extend(h, [8], np.arange(100, 108)); pool.close(h, cache=True)
        t = threading.Thread(target=lambda: box.update(batches=pub.publish()), daemon=True)
        t.start(); t.join(30)
        print("published", box.get("batches") is not None, "hung", t.is_alive())
        os._exit(0)
    """)
    assert "stored 2 hung False" in out and "published True hung False" in out, out
