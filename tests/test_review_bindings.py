"""Memory-safety and atomicity findings of a review of the bindings: each
case is a reproducer that failed (or crashed the interpreter) before its
fix. Cases that could crash run in a child process, so that a crash fails
the test instead of killing pytest."""

import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import kvpool
from kvpool import GroupedAllocator, InvalidArgumentError, SlotAllocator
from kvpool._core import encode_kv_events

# The folder of the kvpool this process imported (the checkout's python/ in a dev run, the
# installed package in CI, where python/ has no built extension), for the child to import too.
PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(kvpool.__file__)))


def kvpool_allocator() -> SlotAllocator:
    return SlotAllocator(64, 4, 8, 64, hash_seed=1)


def run_child(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = PYTHON_DIR + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


# `tables=` may be any iterable; the tables it yields were kept alive only
# while the list of them was being checked. A generator's fresh arrays (or
# those of an exhausted iterator over a temporary list) were freed before
# extend wrote into them: slots went into freed memory (a segfault here: a
# 2 MiB table is its own mapping, unmapped when freed).
GROUPED_TABLES_FREED = """
    import numpy as np
    from kvpool import GroupedAllocator
    R, L = 64, 8192
    g = GroupedAllocator([{"kind": "full", "num_pages": 4096, "page_size": 1}], R, L)
    h = int(g.open(1)[0])
    for tables in [
        (np.zeros((R, L), np.int32) for _ in range(1)),
        iter([np.zeros((R, L), np.int32)]),
    ]:
        out = g.extend([h], [1000], tables=tables)
        print("slots:", len(out[0]))
        g.check()
"""


def test_grouped_extend_keeps_tables_alive_while_it_writes_them():
    r = run_child(GROUPED_TABLES_FREED)
    assert r.returncode == 0, f"child died ({r.returncode}): {r.stderr[-2000:]}"
    assert r.stdout.count("slots: 1000") == 2


def test_grouped_extend_checks_tables_after_python_code_ran():
    # A table made read-only while `handles` is converted is refused, not
    # written (the check runs after every conversion that can run Python).
    g = GroupedAllocator([{"kind": "full", "num_pages": 64, "page_size": 1}], 4, 16)
    h = int(g.open(1)[0])
    table = np.zeros((4, 16), np.int32)

    class Handle:
        def __index__(self):
            table.flags.writeable = False
            return h

    with pytest.raises(InvalidArgumentError, match="not writable"):
        g.extend([Handle()], [3], tables=[table])
    assert not table.any()
    assert g.length(h) == 0
    g.check()


def test_grouped_take_copies_loses_nothing_to_a_memory_error():
    # GroupedAllocator.take_copies drained the queue, then built its arrays:
    # a MemoryError there lost every copy (their destination pages would
    # keep whatever they held), and a failed Vec in the drain aborted the
    # process. The arrays now exist before the drain.
    from test_result_memory_errors import run_cases

    got = run_cases(
        """
        case("grouped take_copies")
        ps = 1 << 10
        g = core.GroupedAllocator([{"kind": "full", "num_pages": 1100, "page_size": ps}], 1100, 2 * ps)
        parent = g.open(1)
        g.extend(parent, ps - 1)  # a partly filled page, shared by the forks
        kids = g.fork(parent[0], 1024)
        g.extend(kids, 1)  # each kid copies the shared page: 1024 * 1023 copies
        queued = g.pending_copies(0)
        r = outcome(lambda: g.take_copies(0), 4 * MiB)  # 8 MiB per array
        after = g.pending_copies(0)
        src, dst = g.take_copies(0)
        want_src = np.tile(g.slots(parent[0], 0), len(kids))
        want_dst = np.concatenate([g.slots(k, 0)[: ps - 1] for k in kids])
        g.check()
        result((r, queued, after, g.pending_copies(0), bool((src == want_src).all()), bool((dst == want_dst).all())))
        """
    )
    assert got == {"grouped take_copies": ("MemoryError", 1024 * 1023, 1024 * 1023, 0, True, True)}


def test_grouped_take_events_loses_nothing_to_a_memory_error():
    # GroupedAllocator.take_events drained the events, then built the dict:
    # a MemoryError there lost them (a router then never hears of 4096
    # cached pages). It now allocates the arrays first: a MemoryError leaves
    # them in the pool for the next call.
    from test_result_memory_errors import run_cases

    got = run_cases(
        """
        case("grouped take_events")
        ps, n = 1 << 10, 1 << 22
        g = core.GroupedAllocator([{"kind": "full", "num_pages": (n // ps) + 1, "page_size": ps}], 2, n)
        h = g.open(1)
        tokens = np.arange(n, dtype=np.int32) % 30000
        g.extend(h, n, tokens=tokens)
        pages = g.pages(h[0], 0)
        g.close(h, cache=True)  # 4096 Stored events, 16 MiB of token ids
        r = outcome(g.take_events, 8 * MiB)  # no room for the 16 MiB of token ids
        e = g.take_events()
        result((
            r,
            e["kind"].tolist() == [0] * (n // ps),
            np.array_equal(e["page"], pages),
            np.array_equal(e["token_ids"], tokens),
            g.take_events()["kind"].size,
        ))
        g.check()
        """
    )
    assert got == {"grouped take_events": ("MemoryError", True, True, True, 0)}


def _misaligned(a: np.ndarray) -> np.ndarray:
    buf = np.zeros(a.nbytes + 1, np.uint8)
    m = buf[1:].view(a.dtype)
    m[:] = a
    assert not m.flags.aligned
    return m


@pytest.mark.parametrize("form", [
    # match/open_with_chain_hashes read `hashes` through numpy's ndarray view, which forms a
    # reference per item: on a misaligned array (a view at an odd offset of a received
    # buffer) that is UB in Rust (release builds happened to read the right words). Such
    # an array is copied.
    lambda w: _misaligned(w),
    lambda w: _misaligned(w.view(np.int64)),
    # (refused as "must be a 1-D uint64 (or int64) numpy array", which it was; tokens of
    # '>i8' were taken)
    lambda w: w.astype(">u8"),
    lambda w: w.view(np.int64).astype(">i8"),
], ids=["misaligned-u64", "misaligned-i64", "big-endian-u64", "big-endian-i64"])
def test_chain_hashes_read_from_arrays_of_any_alignment_and_byte_order(form):
    a = kvpool_allocator()
    h, _ = a.open_with_prefix(list(range(1, 30)), [29])
    a.extend(h, 29)
    a.cache(h)
    hashes, tokens, salt = a.chain_hashes(int(h[0]))
    words = form(hashes)
    assert a.match_chain_hashes(words, tokens, salt) == len(hashes) // 2
    h2, n = a.open_with_chain_hashes(words, tokens.astype(">i8"), salt)
    assert n == 28
    a.close([h2])
    a.check()


def test_encode_kv_events_of_a_big_batch_reads_arrays_another_thread_rewrites_once():
    # A batch past 4096 events is encoded with the GIL released; it read the
    # caller's arrays in place meanwhile, so a thread rewriting them (here
    # whole-array swaps through a memoryview, each done with the GIL held)
    # produced payloads mixing old and new hashes. It now encodes a copy
    # taken with the GIL held: the payload is of one version or the other.
    n = 1 << 16
    old = np.arange(n, dtype=np.uint64)
    new = old[::-1].copy()
    zeros = np.zeros(n, np.uint64)
    events = {
        "kind": np.ones(n, np.uint8),  # Removed: one BlockRemoved of n hashes
        "hash_hi": zeros, "hash_lo": old.copy(), "parent_hi": zeros, "parent_lo": zeros,
        "num_tokens": np.zeros(n, np.int32), "salt": np.zeros(n, np.int64),
        "token_ids": np.zeros(0, np.int32),
    }
    versions = {encode_kv_events({**events, "hash_lo": v}, 1.0)[0] for v in (old, new)}
    view = memoryview(events["hash_lo"]).cast("B")
    old_bytes, new_bytes = old.tobytes(), new.tobytes()
    stop = threading.Event()

    def rewrite():
        while not stop.is_set():
            view[:] = new_bytes
            view[:] = old_bytes

    writer = threading.Thread(target=rewrite, daemon=True)
    writer.start()
    try:
        mixed = sum(encode_kv_events(events, 1.0)[0] not in versions for _ in range(200))
    finally:
        stop.set()
        writer.join(timeout=30)
    assert not writer.is_alive()
    assert mixed == 0


@pytest.mark.parametrize("key,size", [("kind", 1), ("kind", 5000), ("hash_hi", 1)])
def test_encode_kv_events_arrays_resized_by_a_medium_items_index(key, size):
    # encode_kv_events borrowed the event arrays, then converted "medium" (whose
    # items' __index__ runs Python code), then sliced the arrays: a callback that
    # resized one (numpy's unchecked resize, which reallocates) gave slices of other
    # lengths than the checks saw, an index past one panicked, and numpy's borrow
    # tracker, not finding the moved array, aborted the process. Now the arrays are
    # borrowed only after the conversion and re-measured: a typed error.
    code = f"""
        import numpy as np
        from kvpool import InvalidArgumentError
        from kvpool._core import SlotAllocator, encode_kv_events
        a = SlotAllocator(64, page_size=4, max_requests=4, max_context_len=16)
        h = a.open(1)
        a.extend(h, 8, tokens=list(range(8)))
        a.close(h, cache=True)
        e = {{k: v.copy() for k, v in a.take_events().items()}}
        assert len(e["kind"]) == 2
        ok = encode_kv_events(dict(e), 1.0)

        class Resizes:
            def __index__(self):
                e[{key!r}].resize({size}, refcheck=False)
                return 0

        e["medium"] = [Resizes(), 0]
        try:
            encode_kv_events(e, 1.0)
        except InvalidArgumentError as err:
            print("refused:", err)
        else:
            raise SystemExit("accepted")
    """
    r = run_child(code)
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    assert "refused: events[" in r.stdout


def test_encode_kv_events_names_a_misaligned_array_as_misaligned():
    # A contiguous array at an odd byte offset (np.frombuffer(buf, offset=1)) was
    # refused as "must be contiguous", which it was: the message now says what is wrong.
    a = SlotAllocator(64, page_size=4, max_requests=4, max_context_len=16)
    h = a.open(1)
    a.extend(h, 8, tokens=list(range(8)))
    a.close(h, cache=True)
    events = a.take_events()
    good = events["hash_hi"]
    odd = np.frombuffer(bytearray(good.nbytes + 1), np.uint64, count=len(good), offset=1)
    odd[:] = good
    assert odd.flags.c_contiguous and not odd.flags.aligned
    with pytest.raises(InvalidArgumentError, match=r'"hash_hi"\] .* not aligned'):
        encode_kv_events({**events, "hash_hi": odd}, 1.0)
    with pytest.raises(InvalidArgumentError, match=r'"hash_hi"\] .* not contiguous'):
        encode_kv_events({**events, "hash_hi": np.repeat(good, 2)[::2]}, 1.0)
    assert encode_kv_events({**events, "hash_hi": odd.copy()}, 1.0) == encode_kv_events(events, 1.0)
