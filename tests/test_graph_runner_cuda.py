"""DecodeGraphRunner capture and replay on a GPU (skipped without CUDA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from test_graph_runner import decode_inputs, make_pool, snapshot, start_requests  # noqa: E402

from kvpool.cuda_graph import DecodeGraphRunner  # noqa: E402
from kvpool.testing.toy_step import ToyDecode  # noqa: E402


@pytest.mark.parametrize("mode", [torch.inference_mode, torch.no_grad])
@pytest.mark.parametrize("layout,page_size", [("token", 1), ("paged", 4)])
def test_replay_equals_eager(mode, layout, page_size):
    pools = [make_pool(layout, page_size, device="cuda", dtype=torch.float16) for _ in range(2)]
    runners = [DecodeGraphRunner(pools[0], ToyDecode(pools[0]), 8, debug=True),
               DecodeGraphRunner(pools[1], ToyDecode(pools[1]), 8, enable_graphs=False)]
    with mode():
        runners[0].capture()
        assert len(runners[0].captured) == len(runners[0].buckets)
        handles = [start_requests(p, [2, 3, 4, 5, 6]) for p in pools]
        for step in range(3):  # 5 requests -> bucket 8: three padded entries each step
            outs = [r.run(*decode_inputs(p, h, seed=step)) for r, p, h in zip(runners, pools, handles)]
            # Same kernels on the same shapes; tolerance only in case cuBLAS picks
            # another algorithm under capture. Slot placement is checked exactly
            # in benchmarks/gpu_check.py and the CPU runner tests.
            torch.testing.assert_close(outs[0], outs[1], rtol=1e-3, atol=1e-3)
            for a, b in zip(snapshot(pools[0]), snapshot(pools[1])):
                torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


def test_debug_detects_moved_buffers():
    from kvpool import InvariantError
    pool = make_pool(device="cuda", dtype=torch.float16)
    runner = DecodeGraphRunner(pool, ToyDecode(pool), 4, debug=True)
    with torch.no_grad():
        runner.run([1], [0], [pool.null_row], [0], [1])
        runner._static = runner._static.clone()  # simulate a buffer that moved
        with pytest.raises(InvariantError, match="moved"):
            runner.run([1], [0], [pool.null_row], [0], [1])


@pytest.mark.parametrize("copy_outputs", [False, True])
def test_outputs_across_buckets(copy_outputs):
    """Buckets share one graph memory pool: an output is valid until the next run() of
    any bucket; with copy_outputs=True it stays valid for good."""
    pool = make_pool(device="cuda", dtype=torch.float16)
    twin = make_pool(device="cuda", dtype=torch.float16)
    runner = DecodeGraphRunner(pool, ToyDecode(pool), 8, buckets=[2, 8], copy_outputs=copy_outputs)
    eager = DecodeGraphRunner(twin, ToyDecode(twin), 8, buckets=[2, 8], enable_graphs=False, copy_outputs=True)
    with torch.inference_mode():
        runner.capture()
        h, th = start_requests(pool, [3]), start_requests(twin, [3])
        small = runner.run(*decode_inputs(pool, h))
        want = eager.run(*decode_inputs(twin, th))
        torch.testing.assert_close(small, want, rtol=1e-3, atol=1e-3)  # valid right after run()
        kept = small.clone()
        h8, th8 = start_requests(pool, [2] * 6), start_requests(twin, [2] * 6)
        runner.run(*decode_inputs(pool, h8))
        eager.run(*decode_inputs(twin, th8))
        torch.cuda.synchronize()
    if copy_outputs:
        assert torch.equal(small, kept)


def test_host_inputs_run_ahead_of_the_gpu():
    """Three steps with host inputs while ~100 ms of work is queued ahead of them: none
    may wait for an earlier step's copy (they go through the pool's pinned ring), and
    each step's K/V land in its own slots once the GPU gets to them."""
    pool, twin = (make_pool(device="cuda", dtype=torch.float16) for _ in range(2))
    runner = DecodeGraphRunner(pool, ToyDecode(pool), 8)
    eager = DecodeGraphRunner(twin, ToyDecode(twin), 8, enable_graphs=False)
    assert runner._to_device is pool._to_device
    with torch.inference_mode():
        runner.capture()
        hs, th = start_requests(pool, [2, 3, 4]), start_requests(twin, [2, 3, 4])
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)
        slept = torch.cuda.Event()
        slept.record()
        for step in range(3):
            runner.run(*decode_inputs(pool, hs, seed=step))
        ran_ahead = not slept.query()
        for step in range(3):
            eager.run(*decode_inputs(twin, th, seed=step))
        torch.cuda.synchronize()
    assert ran_ahead, "run() waited for work queued before it"
    sink = pool.page_size
    for a, b in zip(snapshot(pool), snapshot(twin)):
        torch.testing.assert_close(a.reshape(-1, 2, 8)[sink:], b.reshape(-1, 2, 8)[sink:], rtol=1e-3, atol=1e-3)


def test_uint64_device_inputs_are_refused():
    import kvpool
    pool = make_pool(device="cuda", dtype=torch.float16)
    runner = DecodeGraphRunner(pool, ToyDecode(pool), 4)
    loc = torch.tensor([2**64 - 1], dtype=torch.uint64, device="cuda")
    with pytest.raises(kvpool.TensorDtypeError, match="uint64"):
        runner.run([1], [0], [pool.null_row], loc, [1])


@pytest.mark.parametrize("lens", [[2, 3, 4, 5, 6], [2, 3, 4, 5, 6, 7, 8, 9]])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_device_inputs_replay_as_host_inputs_do(lens, dtype):
    """Device inputs are loaded by one stack and one pad copy (host inputs by one staged copy):
    the replays, and what they write into the pools, must agree, padded bucket or full."""
    pools = [make_pool(device="cuda", dtype=torch.float16) for _ in range(2)]
    runners = [DecodeGraphRunner(p, ToyDecode(p), 8) for p in pools]
    with torch.inference_mode():
        for r in runners:
            r.capture()
        handles = [start_requests(p, lens) for p in pools]
        for step in range(3):
            host = decode_inputs(pools[0], handles[0], seed=step)
            dev = tuple(torch.as_tensor(np.asarray(a, dtype=np.int64), device="cuda").to(dtype)
                        for a in decode_inputs(pools[1], handles[1], seed=step))
            outs = [runners[0].run(*host).clone(), runners[1].run(*dev).clone()]
            torch.testing.assert_close(outs[0], outs[1], rtol=1e-3, atol=1e-3)
            for a, b in zip(snapshot(pools[0]), snapshot(pools[1])):
                torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
