"""DecodeGraphRunner capture and replay on a GPU (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from kvpool.cuda_graph import DecodeGraphRunner  # noqa: E402

from kvpool.testing.toy_step import ToyDecode  # noqa: E402
from test_graph_runner import decode_inputs, make_pool, snapshot, start_requests  # noqa: E402


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
