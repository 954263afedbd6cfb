"""Review: pools sized at the numeric limits (pages near 2**31, budgets, grouped anchors).

A size that cannot be allocated is an ``InvalidArgumentError`` that names the argument
and costs nothing: no resident memory written before the refusal.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import kvpool
from kvpool import GroupedAllocator, InvalidArgumentError

# Runs in a child whose address space is capped at 8 GiB above what it has mapped:
# 2**30 pages (2**29 host pages) would reserve a free stack of 4 (2) GiB and page records
# of 16 (8) GiB, which do not fit, so construction is refused. Filling the free stack
# (4 bytes a page) before that refusal wrote GiBs for nothing (8 GiB at MAX_PAGES): an
# OOM kill instead of the error on a smaller machine.
_CHILD = textwrap.dedent("""
    import importlib.util
    import resource

    # The extension alone (no torch import: seconds per child saved).
    spec = importlib.util.spec_from_file_location("_core", {core!r})
    core = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(core)

    def status(key):  # KiB; VmHWM is this process's own peak (ru_maxrss starts at the parent's)
        return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key + ":"))

    resource.setrlimit(resource.RLIMIT_AS, (status("VmSize") * 1024 + (8 << 30), resource.RLIM_INFINITY))
    before = status("VmHWM")
    try:
        core.SlotAllocator({args})
    except core.InvalidArgumentError as e:
        print("refused:", e)
    else:
        print("built")
    print("grew_kib", status("VmHWM") - before)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status and caps RLIMIT_AS")
@pytest.mark.parametrize("args", ["2**30", "16, host_pages=2**29, max_requests=4, max_context_len=64"],
                         ids=["device-pages", "host-pages"])
def test_a_pool_too_big_to_allocate_is_refused_before_its_free_stack_is_written(args):
    child = _CHILD.format(args=args, core=kvpool._core.__file__)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("refused: cannot allocate"), out.stdout
    grew_mib = int(lines[-1].split()[1]) // 1024
    assert grew_mib < 512, f"a refused construction wrote {grew_mib} MiB first"


@pytest.mark.parametrize("anchor_pages", [2**31, 2**32 + 1])
def test_anchor_pages_past_the_page_limit_is_named_as_anchor_pages(anchor_pages):
    # No full group's page size divides the other's, so a token-only anchor chain is built:
    # the refusal named "num_pages", which the caller never passed.
    groups = [dict(kind="full", num_pages=8, page_size=3), dict(kind="full", num_pages=8, page_size=7)]
    with pytest.raises(InvalidArgumentError, match=rf"^anchor_pages must be in \[2, 2147483647\].*got {anchor_pages}$"):
        GroupedAllocator(groups, 4, 64, anchor_pages=anchor_pages)


def test_admissible_tokens_past_max_context_len_is_not_one_request():
    # The docs said one new request of admissible_tokens tokens fits; it does up to
    # max_context_len only (admissible_tokens is the pool's free slots).
    from kvpool import ContextTooLongError, SlotAllocator

    a = SlotAllocator(100, 1, 4, 16)
    assert a.admissible_tokens == 99
    before = a.stats()
    with pytest.raises(ContextTooLongError, match="max_context_len=16"):
        a.admit([a.admissible_tokens])
    assert a.stats() == before
    h, slots = a.admit([min(a.admissible_tokens, a.max_context_len)])
    assert len(slots) == 16
    assert "max_context_len" in SlotAllocator.admissible_tokens.__doc__
    assert "max_context_len" in GroupedAllocator.admissible_tokens.__doc__


@pytest.mark.parametrize(("num_slots", "page_size", "fix"), [
    (1, 3, r"use 6 \(two pages"),  # was "use 0 or 3": a pool needs two pages
    (4, 3, "use 6$"),  # was "use 3 or 6"
    (7, 3, "use 6 or 9$"),
    (2**31 + 1, 2, "use 2147483648$"),  # was "or 2147483650", past the 2**31 slots
    (2**31 - 1, 2, "use 2147483646 or 2147483648$"),
])
def test_num_slots_off_the_page_size_suggests_sizes_a_pool_takes(num_slots, page_size, fix):
    from kvpool.capacity import resolve_num_pages

    with pytest.raises(InvalidArgumentError, match=f"not a multiple of page_size={page_size}; {fix}"):
        kvpool.KVPool(1, 1, 1, num_slots=num_slots, page_size=page_size)
    # Each size suggested is one that resolves.
    for word in fix.split():
        if word.strip("$").isdigit() and fix.startswith("use"):
            n = int(word.strip("$"))
            assert resolve_num_pages(page_size=page_size, slot_bytes=2, fixed_bytes=0, num_pages=None, num_slots=n,
                                     memory_bytes=None, memory_fraction=None, device=None) == n // page_size


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_lazy_metadata_still_writes_the_free_page_stack_as_documented():
    # The docs said lazy_metadata maps the per-page metadata on first use; the free page
    # stack (4 bytes a page) is written at construction either way, and now says so.
    child = textwrap.dedent(f"""
        import importlib.util
        spec = importlib.util.spec_from_file_location("_core", {kvpool._core.__file__!r})
        core = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(core)
        def hwm():  # KiB; this process's own peak (ru_maxrss starts at the parent's)
            return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
        before = hwm()
        a = core.SlotAllocator(2**24, lazy_metadata=True)
        print(hwm() - before)
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) >= 48 * 1024  # KiB: most of the 64 MiB stack is resident
    assert "free page stack (4 bytes a page) is written at construction" in \
        " ".join(kvpool.SlotAllocator.__doc__.split())


@pytest.mark.parametrize(("num_slots", "page_size", "message"), [
    (7, 3, "num_slots=7 is not a multiple of page_size=3; use 6 or 9$"),  # was "... >= 2 pages, got 7"
    (1, 3, r"num_slots=1 is not a multiple of page_size=3; use 6 \(two pages"),
    (2**31 + 1, 2, "use 2147483648$"),
    (3, 3, r"num_slots=3 is under two pages of page_size=3; use 6 \(two pages"),
])
def test_a_hybrid_pool_names_the_sizes_it_takes_as_the_plain_pool_does(num_slots, page_size, message):
    """98b26d0 made the plain pool's num_slots refusal name page_size and the nearest sizes a pool
    takes; the hybrid pool (layer_types) still said only "num_slots must be a multiple of
    page_size >= 2 pages, got 7". Both now share the check (capacity.pages_of_slots)."""
    hybrid = dict(layer_types=["full_attention", "sliding_attention"], sliding_window=8,
                  max_requests=4, max_context_len=64)
    with pytest.raises(InvalidArgumentError, match=message):
        kvpool.KVPool(2, 2, 8, num_slots=num_slots, page_size=page_size, **hybrid)
    pool = kvpool.KVPool(2, 2, 8, num_slots=6 * page_size, page_size=page_size, **hybrid)
    assert pool.groups[0].num_pages == 6
