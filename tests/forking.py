"""Forked children with a hard deadline, for the fork-safety tests: a child that hangs
(waits on a lock some parent thread held at the fork) fails the test and is killed, so a
regression never leaves the suite stuck."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import pytest

CHILD_DEADLINE_S = 10.0


def forked(fn: Callable[[], object]) -> tuple[int, str]:
    """Runs ``fn`` in a forked child: (exit code, its result or error as text).
    Fails the test if the child has not finished within CHILD_DEADLINE_S."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            msg = str(fn())
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            code, msg = 1, f"{type(e).__name__}: {e}"
        os.write(w, msg.encode()[:4000])
        os._exit(code)
    os.close(w)
    deadline = time.monotonic() + CHILD_DEADLINE_S
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status), os.read(r, 8192).decode()
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail(f"the forked child did not finish within {CHILD_DEADLINE_S} s (deadlocked)")
            time.sleep(0.005)
    finally:
        os.close(r)
