"""The cases of README.md's ```python blocks (see tests/_doc_cases.py). Every block stands
alone: a fragment's context is its setup."""

from __future__ import annotations

from _doc_cases import (
    DISK_CHECK,
    DISK_CLEANUP,
    DISK_SETUP,
    GRAPH_CHECK,
    GRAPH_SETUP,
    HF_CHECK,
    HF_SETUP,
    TRANSFER_CHECK,
    TRANSFER_SETUP,
    Case,
)

CASES: dict[str, list[Case]] = {}

CASES["README.md"] = [
    Case(
        "pool.close(finished)",
        setup="""
import numpy as np, torch, kvpool
num_layers = 2
pool = kvpool.KVPool(num_layers, 2, 8, dtype=torch.float32, page_size=4, num_pages=32, max_context_len=512)
running = pool.open(3)
pool.extend(running, [5, 3, 9])
finished, running = running[:1], running[1:]
freed = set(pool.pages(finished[0]).tolist())
before = pool.lengths(running).copy()
prompt_lens = [6, 2]
k, v = torch.randn(num_layers, 2, 2, 8), torch.randn(num_layers, 2, 2, 8)
""",
        modules=("torch",),
        check="""
assert freed <= set(np.concatenate([pool.pages(h) for h in new]).tolist())  # LIFO: the freed pages first
assert len(pre.slots) == 8 and np.array_equal(pool.lengths(new), prompt_lens)
with pytest.raises(kvpool.InvalidHandleError):
    pool.lengths(finished)
assert np.array_equal(seq_lens, before + 1)
for layer in range(num_layers):
    assert torch.equal(pool.k_buffer(layer)[dec.out_cache_loc], k[layer])
    assert torch.equal(pool.v_buffer(layer)[dec.out_cache_loc], v[layer])
rows = pool.req_to_token[pool.rows(running)]
for i, h in enumerate(running):
    assert np.array_equal(rows[i, : seq_lens[i]].numpy(), pool.slots(h))
indptr, indices, last = pool.page_table(running)
assert indptr.dtype == torch.int32 and indptr.tolist() == [0, 1, 4]
free, admissible = pool.free_pages, pool.admissible_tokens
with pytest.raises(kvpool.PoolExhaustedError):      # all-or-nothing
    pool.admit([100, 100])
assert (pool.free_pages, pool.admissible_tokens, pool.open_requests) == (free, admissible, 4)
""",
    ),
    Case(
        "import numpy as np",
        check="""
assert reqs.dtype == np.int64 and len(slots) == 3 and len(pre) == 42 and len(new) == 2
b = kvpool.SlotAllocator(num_pages=1 << 16, page_size=16, max_requests=256, max_context_len=4096)
r = b.open(3)
assert len(b.extend(r, [17, 1, 40])) == 58
b.extend(r, 1)
b.admit([12, 30])
assert np.array_equal(b.extend(r, 1), step_slots[:3])
assert np.array_equal(a.lengths(reqs[1:]), [2, 41])
assert a.used_pages == 1 + 3 + 1 + 2                # truncate freed the pages past each new end
with pytest.raises(kvpool.InvalidHandleError):
    a.extend(reqs[:1], 1)
""",
    ),
    Case(
        "import torch, kvpool",
        subs=(("num_layers=32", "num_layers=2"),
              ('device="cuda", page_size=16, memory_fraction=0.8', 'device="cpu", page_size=16, num_pages=64')),
        setup="""
import torch
layer = 1
k, v = torch.randn(61, 8, 128, dtype=torch.bfloat16), torch.randn(61, 8, 128, dtype=torch.bfloat16)
model = torch.nn.Linear(4, 4)
""",
        check="""
assert torch.equal(pool.k_buffer(layer)[step.out_cache_loc], k)
assert torch.equal(pool.v_buffer(layer)[step.out_cache_loc], v)
assert k_cache.data_ptr() == pool.k_buffer(layer).data_ptr() and k_cache.shape == (64 * 16, 8, 128)
for i, h in enumerate(reqs):
    assert pool.req_to_token[pool.rows(reqs)[i], : [17, 1, 40, 3][i]].tolist() == pool.slots(h).tolist()
with pytest.raises(kvpool.TensorShapeError):        # validated first: nothing written
    pool.write(layer, step.out_cache_loc, torch.zeros(61, 8, 64, dtype=torch.bfloat16), v)
assert torch.equal(pool.k_buffer(layer)[step.out_cache_loc], k)
paged = kvpool.KVPool(num_layers=1, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, page_size=16,
                      num_pages=64, layout="paged")
assert paged.k_buffer(0).shape == (64, 16, 8, 128)
with torch.inference_mode():
    made_in_inference_mode = torch.nn.Linear(4, 4)
assert kvpool.audit(model=made_in_inference_mode, pool=pool)   # the block's assert can fail
""",
    ),
    Case(
        "system = tokenizer.encode(SYSTEM_PROMPT)",
        setup="""
import numpy as np, torch, kvpool
pool = kvpool.KVPool(2, 2, 8, dtype=torch.float32, page_size=16, num_pages=64, max_context_len=512)

class Tokenizer:
    def encode(self, text):
        return [3 + ord(c) % 90 for c in text]

tokenizer = Tokenizer()
SYSTEM_PROMPT, user_a, user_b = "You are a careful assistant. " * 2, [7] * 21, [9] * 13
sampled = [11, 12, 13, 14]
""",
        check="""
assert cached[0] == len(system) // 16 * 16 == 48
assert pool.req_to_token[int(pool.rows(h)[0]), :48].tolist() == pool.slots(h[0])[:48].tolist()  # already in the table
assert np.array_equal(pool.pages(h[0])[:3], pool.pages(kids[0])[:3])      # the shared full pages
assert len({int(pool.pages(r)[-1]) for r in [h[0], *kids]}) == 4           # the half page, copied
for kid in kids:
    assert np.array_equal(pool.slots(kid)[:48], pool.slots(h[0])[:48])
    assert pool.length(kid) == pool.length(h[0])
pool.check()
""",
    ),
    Case(
        "from kvpool.kernels import store_kv",
        setup="""
import torch
k_cache, v_cache = torch.zeros(64, 2, 8), torch.zeros(64, 2, 8)
slots = torch.tensor([5, -1, 9])
k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
src_slots, dst_slots = torch.arange(0, 16), torch.arange(16, 32)
""",
        modules=("torch",),
        check="""
assert k.dtype == torch.bfloat16 and k.shape == (3, 2, 8)
assert k[1].eq(0).all() and v[1].eq(0).all()                       # the negative slot read zeros
assert k[0].ne(0).all() and k_cache[:16].count_nonzero() == 2 * 2 * 8   # slot -1 was skipped
assert torch.equal(k_cache[21], k_cache[5]) and torch.equal(v_cache[25], v_cache[9])   # copied
""",
    ),
    Case(
        "runner = kvpool.DecodeGraphRunner(pool, decode_step, max_batch_size=256)",
        setup=GRAPH_SETUP + """
pool = kvpool.KVPool(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, page_size=16, num_pages=64)
handles = started(pool)
decode_step = model
step = pool.extend(handles, 1)
lens = pool.lengths(handles)
""",
        modules=("torch", "kvpool"),
        check=GRAPH_CHECK,
    ),
    Case(
        "from kvpool.integrations.transformers import KVPoolCache, pool_for_model",
        setup=HF_SETUP,
        check=HF_CHECK,
    ),
    Case(
        "from kvpool.distributed import recv_request, send_request, tp_pool",
        ranks=2,
        subs=(('device="cuda"', 'device="cpu"'), ("check_every=64)", "check_every=64, group=own)"),
              ("send_request(pool, h,", "send_request(pool, h := prefilled(pool),")),
        setup=TRANSFER_SETUP + """
layers, num_kv_heads, head_dim, N = 2, 4, 8, 32
own = [dist.new_group([r]) for r in range(world)][rank]   # each instance its own TP group here
prefill = rank == 0
""",
        check=TRANSFER_CHECK,
    ),
    Case(
        "from kvpool.tiers import DiskCache, FileTier",
        subs=(('"/var/cache/kvpool"', "directory"),),
        setup='MODEL = "llama-3-8b"\n' + DISK_SETUP + "tokens, salt = PROMPT, None\n",
        check="hs, cached = pool.open_with_prefix(tokens, [len(tokens)], salt)\n" + DISK_CHECK,
        cleanup=DISK_CLEANUP,
    ),
]
