"""A result array that does not fit in memory raises MemoryError (never a
PanicException, which is no Exception, and never an abort), and the pool
keeps working: a call that changes the pool allocates its result first, so
a MemoryError leaves the pool as it was, and drained queues lose nothing.

The address space is capped with RLIMIT_AS at what is mapped plus enough
room for the call's argument and the core's own answer, so that the result
array is what fails. Each case runs in a child process (without torch,
whose libraries map a lot) that prints the case's name first, so a crash
names it."""

import os
import subprocess
import sys
import textwrap

import kvpool._core

PRELUDE = textwrap.dedent(
    """
    import importlib.util, resource
    import numpy as np

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash dumps no core

    spec = importlib.util.spec_from_file_location("_core", {path!r})
    core = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(core)
    SlotAllocator = core.SlotAllocator
    MiB = 1 << 20

    def mapped():
        for line in open("/proc/self/status"):
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024

    def outcome(call, room):
        # The call's result under an address space of what is mapped now
        # plus `room` bytes; the limit is lifted again before returning.
        old = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (mapped() + room, old[1]))
        try:
            call()
            return "ok"
        except MemoryError:
            return "MemoryError"
        except Exception as e:
            return f"{{type(e).__name__}}: {{e}}"
        finally:
            resource.setrlimit(resource.RLIMIT_AS, old)

    def case(name):
        print("CASE", name, flush=True)

    def result(value):
        print("RESULT", repr(value), flush=True)
    """
).format(path=kvpool._core.__file__)


def run_cases(body: str) -> dict:
    try:
        # A fixed mmap threshold: glibc's moving one would let a result array land in heap
        # room an earlier case freed, so the address-space cap would not make it fail.
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
        r = subprocess.run(
            [sys.executable, "-c", PRELUDE + textwrap.dedent(body)], capture_output=True, text=True, timeout=180,
            env=env,
        )
        out, err, rc = r.stdout, r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        # A panic that cannot allocate its own message can hang the process.
        decode = lambda b: b.decode() if isinstance(b, bytes) else (b or "")  # noqa: E731
        out, err, rc = decode(e.stdout), decode(e.stderr), "timeout"
    results, current = {}, None
    for line in out.splitlines():
        if line.startswith("CASE "):
            current = line[5:]
        elif line.startswith("RESULT "):
            results[current] = eval(line[7:])
    assert rc == 0, f"case {current!r} ended the process (rc {rc}): {err[-3000:]}"
    return results


def test_per_handle_results_too_big_for_memory_are_memory_errors():
    # 2**24 copies of one handle (a broadcast view). The argument's
    # copy fits; the result (128 MiB) does not.
    got = run_cases(
        """
        a = SlotAllocator(64, page_size=4, max_requests=4, max_context_len=64)
        h = a.open(2)
        a.extend(h, [5, 1])
        many = np.broadcast_to(h[:1], (1 << 24,))
        for name in ["lengths", "rows"]:
            case(name)
            r = outcome(lambda: getattr(a, name)(many), 128 * MiB + 48 * MiB)
            a.check()
            result((r, a.lengths(h).tolist(), getattr(a, name)(many[:3]).tolist()))

        case("page_table")
        few = many[: 1 << 23]
        # Room for the argument (64 MiB) and the core's table (32 MiB of
        # indptr and of last_page_len, 64 MiB of indices: two pages each).
        r = outcome(lambda: a.page_table(few), 64 * MiB + 128 * MiB + 16 * MiB)
        a.check()
        result((r, [x.tolist() for x in a.page_table(few[:2])]))
        """
    )
    assert got == {
        "lengths": ("MemoryError", [5, 1], [5, 5, 5]),
        "rows": ("MemoryError", [5, 1], [0, 0, 0]),
        "page_table": ("MemoryError", [[0, 2, 4], [1, 2, 1, 2], [1, 1]]),
    }


def test_results_of_one_request_too_big_for_memory_are_memory_errors():
    got = run_cases(
        """
        n = 1 << 22  # tokens: 4 MiB of pages of 4096 slots
        a = SlotAllocator((n >> 12) + 1, page_size=1 << 12, max_requests=2, max_context_len=n)
        h = a.open(1)
        tokens = np.arange(n, dtype=np.int32) % 30000
        a.extend(h, n, tokens=tokens)
        a.cache(h)

        case("slots")
        # Room for the core's answer (32 MiB), not for a second copy.
        r = outcome(lambda: a.slots(h[0]), 32 * MiB + 8 * MiB)
        s = a.slots(h[0])
        result((r, s.size, bool((s[1:] - s[:-1] == 1).all())))

        case("known_tokens")
        r = outcome(lambda: a.known_tokens(h[0]), 16 * MiB + 8 * MiB)
        result((r, bool((a.known_tokens(h[0]) == tokens).all())))

        case("chain_hashes")
        r = outcome(lambda: a.chain_hashes(h[0]), 16 * MiB + 8 * MiB)
        hashes, toks, salt = a.chain_hashes(h[0])
        result((r, hashes.size, bool((toks == tokens).all()), salt))
        a.check()
        """
    )
    assert got == {
        "slots": ("MemoryError", 1 << 22, True),
        "known_tokens": ("MemoryError", True),
        "chain_hashes": ("MemoryError", 2 * 1024, True, 0),
    }


def test_calls_that_change_the_pool_allocate_their_result_first():
    got = run_cases(
        """
        case("open")
        a = SlotAllocator(64, max_requests=1 << 18, max_context_len=64)
        r = outcome(lambda: a.open(1 << 18), 1 * MiB)  # 2 MiB of handles
        a.check()
        result((r, a.open_requests, a.open(2).size))
        del a

        case("extend")
        n = 1 << 24  # one request taking the whole pool: a 128 MiB result
        a = SlotAllocator((n >> 12) + 1, page_size=1 << 12, max_requests=2, max_context_len=n)
        h = a.open(1)
        r = outcome(lambda: a.extend(h, n), 64 * MiB)
        a.check()
        result((r, a.lengths(h).tolist(), a.free_pages, a.extend(h, 5).tolist()))
        del a

        # The copy-on-write result: 63 of the 64 holders of a shared page each
        # move its 16383 filled slots to a copy (the last finds the page its own
        # and writes in place): 33 MB of [rows | positions | src | dst], taken off
        # the queue by the call, so it must be allocated before the change. Far
        # more than the room, so that address space the process gives back in the
        # meantime cannot make it fit (an 8 MiB result once did, on a loaded CI run).
        ps = 1 << 14
        for name in ["extend_cow", "extend_packed"]:
            case(name)
            a = SlotAllocator(200, page_size=ps, max_requests=64, max_context_len=2 * ps)
            parent = a.open(1)
            a.extend(parent, ps - 1)
            kids = a.fork(parent[0], 63)
            h = np.concatenate([parent, kids])
            if name == "extend_cow":
                call = lambda: a.extend(h, 1, cow=True)
            else:
                call = lambda: a.extend_packed(h, 1)
            r = outcome(call, 4 * MiB)
            state = (a.lengths(h).tolist() == [ps - 1] * 64, a.pending_copies, a.free_pages)
            a.check()
            if r != "MemoryError":  # the call had room: report it rather than fail below
                result((r, state))
                continue
            cow = call()[-1]
            m = cow.size // 4
            rows, positions, src, dst = cow.reshape(4, m)
            result((r, state, m, bool((positions == np.tile(np.arange(ps - 1), 63)).all()),
                    bool((src == np.tile(a.slots(kids[-1])[: ps - 1], 63)).all()), a.pending_copies))
            del a
        """
    )
    assert got == {
        "extend": ("MemoryError", [0], 1 << 12, [4096, 4097, 4098, 4099, 4100]),
        "open": ("MemoryError", 0, 2),
        "extend_cow": ("MemoryError", (True, 0, 198), 63 * 16383, True, True, 0),
        "extend_packed": ("MemoryError", (True, 0, 198), 63 * 16383, True, True, 0),
    }


def test_grouped_calls_that_change_the_pool_allocate_their_results_first():
    # The core builds each group's slots in a Vec of its own (a failure there is its
    # typed "cannot allocate" refusal); the result arrays the bindings copy them into
    # must exist before the call, or a MemoryError after it leaves the requests
    # opened or grown. 64 MiB fits neither 128 MiB array, 160 MiB fits one.
    got = run_cases(
        """
        GroupedAllocator = core.GroupedAllocator
        n = 1 << 24  # one request taking the whole full group: a 128 MiB result
        groups = [{"kind": "full", "num_pages": (n >> 12) + 1, "page_size": 1 << 12},
                  {"kind": "state", "num_slots": 4}]
        for name in ["admit", "extend"]:
            for room in [64, 160]:
                case(f"{name} {room}")
                a = GroupedAllocator(groups, 2, n)
                if name == "admit":
                    call = lambda: a.admit([n])
                else:
                    h = a.open(1)
                    call = lambda: a.extend(h, n)
                r = outcome(call, room * MiB)
                refused = r == "MemoryError" or r.startswith("InvalidArgumentError: cannot allocate")
                a.check()
                state = (a.open_requests, a.free_pages(0))
                h = a.open(1) if name == "admit" else h
                result((refused, state, [s.size for s in a.extend(h, 5)]))
                del a
        """
    )
    assert got == {
        "admit 64": (True, (0, 1 << 12), [5, 0]),
        "admit 160": (True, (0, 1 << 12), [5, 0]),
        "extend 64": (True, (1, 1 << 12), [5, 0]),
        "extend 160": (True, (1, 1 << 12), [5, 0]),
    }


def test_drained_queues_lose_nothing_to_a_memory_error():
    got = run_cases(
        """
        case("take_copies")
        ps = 1 << 10
        a = SlotAllocator(1100, page_size=ps, max_requests=1100, max_context_len=2 * ps)
        parent = a.open(1)
        a.extend(parent, ps - 1)  # a partly filled page, shared by the forks
        kids = a.fork(parent[0], 1024)
        a.extend(kids, 1)  # each kid copies the shared page: 1024 * 1023 copies
        queued = a.pending_copies
        r = outcome(a.take_copies, 4 * MiB)  # 8 MiB per array
        after = a.pending_copies
        src, dst = a.take_copies()
        want_src = np.tile(a.slots(parent[0]), len(kids))
        want_dst = np.concatenate([a.slots(k)[: ps - 1] for k in kids])
        a.check()
        result((r, queued, after, a.pending_copies, bool((src == want_src).all()), bool((dst == want_dst).all())))
        del a

        case("take_events")
        ps, n = 1 << 10, 1 << 22
        a = SlotAllocator((n // ps) + 1, page_size=ps, max_requests=2, max_context_len=n)
        h = a.open(1)
        tokens = np.arange(n, dtype=np.int32) % 30000
        a.extend(h, n, tokens=tokens)
        pages = a.pages(h[0])
        a.close(h, cache=True)  # 4096 Stored events, 16 MiB of token ids
        # Room for the small arrays, not for the 16 MiB of token ids.
        r = outcome(a.take_events, 8 * MiB)
        e = a.take_events()
        chained = bool((e["parent_hi"][1:] == e["hash_hi"][:-1]).all() and (e["parent_lo"][1:] == e["hash_lo"][:-1]).all())
        result((
            r,
            e["kind"].tolist() == [0] * (n // ps),
            bool((e["page"] == pages).all()),
            bool((e["token_ids"] == tokens).all()),
            set(e["num_tokens"].tolist()),
            chained,
            (int(e["parent_hi"][0]), int(e["parent_lo"][0])),
            a.take_events()["kind"].size,
        ))
        a.check()
        """
    )
    assert got == {
        "take_copies": ("MemoryError", 1024 * 1023, 1024 * 1023, 0, True, True),
        "take_events": ("MemoryError", True, True, True, {1024}, True, (0, 0), 0),
    }


def test_events_a_failed_drain_loses_none_and_newer_events_come_after():
    # take_events and take_events_msgpack drain the same events, into arrays
    # or vectors allocated first: a MemoryError there leaves every event in
    # the pool. take_events_msgpack keeps what it drained but could not
    # encode, for the next drain of either kind to return first.
    # Either way a newer event (Cleared) comes after them, and nothing twice.
    got = run_cases(
        """
        ps, n = 1 << 10, 1 << 22
        tokens = np.arange(n, dtype=np.int32) % 30000

        def pool():
            a = SlotAllocator((n // ps) + 2, page_size=ps, max_requests=2, max_context_len=n)
            h = a.open(1)
            a.extend(h, n, tokens=tokens)
            a.close(h, cache=True)  # 4096 Stored events, 16 MiB of token ids
            return a

        case("take_events, then take_events_msgpack")
        a = pool()
        r = outcome(a.take_events, 8 * MiB)  # no room for the token ids' array
        a.clear_cache()
        first = a.take_events_msgpack(1.0)[1:]
        second = a.take_events_msgpack(2.0)[1:]
        result((r, first, second, a.take_events()["kind"].size))
        a.check()
        del a

        case("take_events_msgpack without room to drain")
        a = pool()
        # No room for the 16 MiB of token ids it drains into: nothing is drained.
        r = outcome(lambda: a.take_events_msgpack(1.0), 8 * MiB)
        e = a.take_events()
        result((r, e["kind"].tolist() == [0] * (n // ps), bool((e["token_ids"] == tokens).all())))
        a.check()
        del a

        case("take_events_msgpack, then take_events")
        a = pool()
        # Room for the drained events (16 MiB of ids), not for a 20 MiB payload.
        r = outcome(lambda: a.take_events_msgpack(1.0), 16 * MiB + 4 * MiB)
        a.clear_cache()
        e = a.take_events()
        kept = (e["kind"].tolist() == [0] * (n // ps), bool((e["token_ids"] == tokens).all()))
        result((r, kept, a.take_events()["kind"].tolist(), a.take_events()["kind"].size))
        a.check()
        """
    )
    assert got == {
        "take_events, then take_events_msgpack": ("MemoryError", (1 << 12, 0, 1), (0, 0, 0), 0),
        "take_events_msgpack without room to drain": ("MemoryError", True, True),
        "take_events_msgpack, then take_events": ("MemoryError", (True, True), [2], 0),
    }
