"""Run a function on N gloo ranks in spawned processes, on 127.0.0.1, with a hard timeout.

``run_ranks(target, world, timeout_s, **kwargs)`` starts ``world`` processes
(spawn context), each calling ``target(rank, world, **kwargs)`` after joining a
gloo group on a free localhost port, and returns the list of their results. A
rank that raises, dies or outlives the timeout fails the calling test, and
every process is killed before this returns.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

GROUP_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _to_numpy(x: Any) -> Any:
    import torch

    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        if x.dtype in (torch.bfloat16, torch.float16) or x.dtype.itemsize == 1 and x.is_floating_point():
            x = x.float()
        return ("__tensor__", x.numpy().copy())
    if isinstance(x, dict):
        return {k: _to_numpy(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_numpy(v) for v in x)
    return x


def _to_torch(x: Any) -> Any:
    import torch

    if isinstance(x, tuple) and len(x) == 2 and x[0] == "__tensor__":
        return torch.from_numpy(x[1])
    if isinstance(x, dict):
        return {k: _to_torch(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_torch(v) for v in x)
    return x


def _main(target: Callable[..., Any], rank: int, world: int, port: int, q: Any, kwargs: dict) -> None:
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
        # Plain pickle of numpy arrays: torch's queue reducers would pass tensors as
        # shared-memory handles, which die with this process.
        q.put((rank, "ok", pickle.dumps(_to_numpy(target(rank, world, **kwargs)))))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        q.put((rank, "error", traceback.format_exc()))
    q.close()
    q.join_thread()  # flush the result to the parent before the hard exit below
    # Skip interpreter teardown (gloo's destructors can wait on a dead peer).
    os._exit(0)


def run_ranks(target: Callable[..., Any], world: int = 2, timeout_s: float = 120.0,
              expect_dead: tuple[int, ...] = (), **kwargs: Any) -> list[Any]:
    """Results of ``target`` per rank (None for ranks in ``expect_dead``, which must die)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_main, args=(target, r, world, port, q, kwargs), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(errors) < world - len(expect_dead):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"ranks did not finish within {timeout_s:g} s (got {sorted(results)})")
            try:
                rank, status, value = q.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if p.exitcode is not None and r not in results and r not in expect_dead]
                if dead and q.empty():
                    time.sleep(0.5)  # a result may still be in the pipe
                    if q.empty():
                        raise AssertionError(f"rank(s) {dead} exited (codes {[procs[r].exitcode for r in dead]}) "
                                             f"without a result; errors so far: {errors}") from None
                continue
            if status == "ok":
                results[rank] = _to_torch(pickle.loads(value))
            else:
                errors.append(f"rank {rank} raised:\n{value}")
        if errors:
            raise AssertionError("\n".join(errors))
        for r in expect_dead:
            procs[r].join(max(1.0, deadline - time.monotonic()))
            assert procs[r].exitcode not in (None, 0), f"rank {r} was expected to die, exit code {procs[r].exitcode}"
        return [results.get(r) for r in range(world)]
    finally:
        for p in procs:
            if p.is_alive():
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(5.0)
