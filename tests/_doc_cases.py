"""What tests/test_doc_examples.py needs to run each ```python block of README.md and docs/*.md:
the ``Case`` record and the setups several cases share. The cases themselves, one per
block in the order of its file, are in _doc_cases_readme.py and _doc_cases_docs.py.

``setup`` supplies the names the doc leaves to the reader; module objects it binds are
removed before the block runs (a block must import what it uses), except those in
``modules``, for fragments whose surrounding doc imported them. ``subs`` makes a
GPU-sized block a CPU one by exact text replacement (same number of lines, so a
traceback's line is the doc's). ``check`` asserts what the block's comments and the
prose next to it claim.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Case:
    first: str                                # the block's first line: a reordered doc fails loudly
    setup: str = ""                           # the names the doc leaves to the reader
    subs: tuple[tuple[str, str], ...] = ()    # the CPU version: (doc text, CPU text)
    check: str = ""                           # what the block's comments and prose claim
    modules: tuple[str, ...] = ()             # modules of setup that the fragment's doc imported earlier
    skip: str = ""                            # why it cannot run here
    after: bool = False                       # continues the file's previous block, in its namespace
    ranks: int = 0                            # run on this many gloo ranks (tests/_dist.py)
    cleanup: str = ""                         # runs whatever happened


CUDA = (('device="cuda"', 'device="cpu"'),)

# A CPU decode step: embeds, writes this step's K/V through the pool, attends over
# req_to_token and returns logits; the eager result is the reference for the runner.
GRAPH_SETUP = """
import numpy as np, torch, kvpool
VOCAB = 32

def model(input_ids, positions, req_rows, out_cache_loc, seq_lens):
    emb = torch.randn(VOCAB, pool.num_kv_heads, pool.head_dim, generator=torch.Generator().manual_seed(0))
    emb = emb.to(pool.k_buffer(0).dtype)
    x = emb[input_ids] + positions[:, None, None].to(emb.dtype)
    for layer in range(pool.num_layers):
        pool.write(layer, out_cache_loc, x, -x)
    rows = pool.req_to_token[req_rows].long()
    keys = pool.k_buffer(0)[rows].float()                            # [n, ctx, H, D]
    mask = torch.arange(rows.shape[1])[None, :] < seq_lens[:, None]
    scores = (keys * x[:, None].float()).sum((-1, -2)).masked_fill(~mask, -1e9)
    ctx = (scores.softmax(-1)[..., None, None] * keys).sum(1)
    return ctx.flatten(1) @ emb.float().flatten(1).T

def started(pool):
    handles = pool.open(3)
    pool.extend(handles, [5, 17, 2])
    return handles

token_ids = torch.tensor([4, 9, 30])
"""
GRAPH_CHECK = """
assert logits.shape == (3, VOCAB)
assert kvpool.cuda_graph.default_buckets(256)[:6] == [1, 2, 4, 8, 16, 24] and runner.bucket_for(201) == 208
assert kvpool.cuda_graph.default_buckets(256)[-1] == 256
assert np.array_equal(lens, [6, 18, 3])
expect = model(token_ids, torch.as_tensor(lens - 1), torch.as_tensor(pool.rows(handles)), step.out_cache_loc,
               torch.as_tensor(lens))
# Same math, other batch shapes (the runner pads to its bucket): BLAS may sum in another
# order, so equal up to float32 rounding at the logits' scale, not bit for bit.
assert torch.allclose(logits, expect, rtol=1e-5, atol=1e-6 * float(expect.abs().max()))
# Host inputs are checked first: out_cache_loc below num_slots, every value within int64.
with pytest.raises(kvpool.SlotRangeError):
    runner.run(token_ids, lens - 1, pool.rows(handles), np.array([16, 17, pool.num_slots]), lens)
with pytest.raises(kvpool.InvalidArgumentError):
    runner.run(token_ids, lens - 1, pool.rows(handles), np.array([16, 17, 2**64 - 1], np.uint64), lens)
"""

HF_SETUP = """
import torch, sys
sys.path.insert(0, TESTS)
from _hf_models import tiny_model, left_padded
model = tiny_model("llama")
ids, mask = left_padded([7, 4])
inputs = {"input_ids": ids, "attention_mask": mask}
"""
HF_CHECK = """
plain = model.generate(**inputs, max_new_tokens=64, do_sample=False)
assert out.shape == (2, ids.shape[1] + 64) and torch.equal(out, plain)  # token for token
assert pool.open_requests == 0                                         # the with block closed its rows
"""

DISK_SETUP = """
import numpy as np, torch, kvpool, tempfile
from kvpool.tiers import DiskCache as _Disk, FileTier as _Tier
directory = tempfile.mkdtemp(prefix="kvpool-doc-")

def make_pool():
    return kvpool.KVPool(2, 2, 8, dtype=torch.float32, page_size=16, num_pages=32, max_context_len=256)

PROMPT = list(range(3, 3 + 70))
earlier = make_pool()                            # another process, before a restart
old_disk = _Disk(earlier, _Tier(directory, max_bytes=200 << 30), model=MODEL)
h = earlier.admit([len(PROMPT)], tokens=PROMPT)[0]
for layer in range(2):
    earlier.write(layer, torch.as_tensor(earlier.slots(h[0])), torch.randn(70, 2, 8), torch.randn(70, 2, 8))
earlier.close(h, cache=True)
assert old_disk.store_new() == 4
pool = make_pool()
"""
DISK_CHECK = """
assert cached[0] == 64                           # 4 pages from the disk: what the earlier pool wrote
assert disk.stats.pages_loaded == 4 and old_disk.stats.pages_stored == 4
theirs = earlier.read(0, earlier.slots(earlier.open_with_prefix(PROMPT, [70])[0][0])[:64])
mine = pool.read(0, pool.slots(hs[0])[:64])
assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1])
"""
# Two instances on two gloo ranks: rank 0 prefills, rank 1 decodes. Token i of layer l
# holds i + 1000 * l (v: its negative), so the decode side can check what arrived.
TRANSFER_SETUP = """
import torch, torch.distributed as dist
N_TOKENS = 37

def fill(pool, h):
    import torch   # (the setup's module bindings are dropped before the block runs)

    slots = torch.as_tensor(pool.slots(h))
    want = torch.arange(len(slots), dtype=torch.float32)[:, None, None].expand(-1, pool.num_kv_heads, pool.head_dim)
    for layer in range(pool.num_layers):
        k = (want + 1000 * layer).to(pool.k_buffer(0).dtype)
        pool.write(layer, slots, k, -k)

def prefilled(pool):
    h = int(pool.admit([N_TOKENS])[0][0])
    fill(pool, h)
    return h
"""
TRANSFER_CHECK = """
if rank == 1:
    assert pool.length(h) == N_TOKENS
    for layer in range(pool.num_layers):
        k, v = pool.read(layer, pool.slots(h))
        want = torch.arange(N_TOKENS, dtype=torch.float32) + 1000 * layer
        assert torch.equal(k[:, 0, 0].float(), want) and torch.equal(v[:, -1, -1].float(), -want)
"""

DISK_CLEANUP = "import shutil; shutil.rmtree(directory, ignore_errors=True)"
