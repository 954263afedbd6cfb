"""Memory-safety and atomicity findings of a review of the bindings: each
case is a reproducer that failed (or crashed the interpreter) before its
fix. Cases that could crash run in a child process, so that a crash fails
the test instead of killing pytest."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvpool import GroupedAllocator, InvalidArgumentError

PYTHON_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python")


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
