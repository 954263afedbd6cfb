"""The cases of docs/*.md's ```python blocks (see tests/_doc_cases.py)."""

from __future__ import annotations

from _doc_cases import (
    CUDA,
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

CASES["docs/allocator.md"] = [
    Case(
        "import numpy as np, kvpool",
        check="""
assert indptr.dtype == indices.dtype == last_page_len.dtype == np.int32
assert indptr.tolist() == [0, 1, 2, 5] and last_page_len.tolist() == [10, 2, 41 - 32]
assert indices[1:].tolist() == a.pages(reqs[1]).tolist() + a.pages(reqs[2]).tolist()
assert np.array_equal(a.lengths(reqs[1:]), [2, 41]) and len(slots) == 3
with pytest.raises(kvpool.InvalidHandleError):
    a.extend(reqs[:1], 1)
""",
    ),
]

CASES["docs/distributed.md"] = [
    Case(
        "import torch, torch.distributed as dist, kvpool",
        ranks=2,
        subs=CUDA + (('dist.init_process_group("nccl")', "dist.is_initialized()"), ("num_pages=...", "num_pages=64")),
        setup="num_layers, num_kv_heads, head_dim = 2, 4, 8\n",
        check="""
assert (pool.num_kv_heads, pool.kv_head_start, pool.tp_size) == (2, 2 * rank, 2)
assert pool.k_buffer(0).shape == (64 * 16, 2, 8) and pool.k_buffer(0).dtype == torch.bfloat16
""",
    ),
    Case(
        "import torch.distributed as dist",
        ranks=2,
        subs=(("...                                            # prefill forward",
               "fill(pool, h[0])                               # prefill forward"),),
        setup=TRANSFER_SETUP + """
import kvpool
pool = kvpool.KVPool(2, 2, 8, dtype=torch.float32, page_size=16, num_pages=16)
n = N_TOKENS
""",
        # (The decode branch names recv_request's handle `handle`; the README's example `h`.)
        check=TRANSFER_CHECK.replace("(h)", "(handle)") + """
if rank == 0:
    assert not pool.is_open(h[0]) and pool.open_requests == 0
    assert (stats.handle, stats.pages, stats.cached_pages) == (h[0], 3, 0) and stats.bytes > 0
    import inspect
    from kvpool.distributed.kv_transfer import TransferStats
    assert stats.messages == 4                     # header, reply, one chunk, ack
    fields = list(TransferStats._fields)
    assert fields == ["handle", "pages", "cached_pages", "bytes", "messages", "seconds"], fields
    assert inspect.signature(send_request).parameters["timeout_s"].default == 60
    assert inspect.signature(recv_request).parameters["timeout_s"].default == 60
    assert inspect.signature(send_request).parameters["chunk_bytes"].default == 16 << 20
""",
    ),
]

CASES["docs/events-and-metrics.md"] = [
    Case(
        "from kvpool.events import ZmqEventPublisher",
        subs=(('"tcp://*:5557"', '"tcp://127.0.0.1:0"'), ('"tcp://*:5558"', '"tcp://127.0.0.1:0"'),
              ("pub.publish()            #", "sent = pub.publish()     #")),
        setup="""
import torch, kvpool
pool = kvpool.KVPool(2, 2, 8, dtype=torch.float32, page_size=16, num_pages=16)
h = pool.admit([40], tokens=list(range(3, 43)))[0]
pool.close(h, cache=True)                       # registers 2 full pages: 2 Stored events
""",
        check="""
assert sent == 2                                   # one per page Stored
assert (pub.batches, pub.events, pub.stored_pages, pub.removed_pages, pub.cleared, pub.dropped_events) == (1, 2, 2, 0, 0, 0)
assert pool.take_events()["kind"].size == 0       # publish() drained them
""",
    ),
    Case(
        "events = pool.take_events()",
        setup="""
import tempfile, torch, kvpool
from kvpool.events import LocalEventPublisher
from kvpool.tiers import DiskCache, FileTier
directory = tempfile.mkdtemp(prefix="kvpool-doc-")
pool = kvpool.KVPool(2, 2, 8, dtype=torch.float32, page_size=16, num_pages=16)
pub = LocalEventPublisher(pool)
disk = DiskCache(pool, FileTier(directory, max_bytes=1 << 24), model="m")
h = pool.admit([40], tokens=list(range(3, 43)))[0]
pool.close(h, cache=True)                       # registers 2 full pages: 2 Stored events
""",
        check="""
assert disk.stats.pages_stored == 2 and pub.stored_pages == 2   # both got the same events
assert pool.take_events()["kind"].size == 0
with pytest.raises(kvpool.InvalidArgumentError, match="publishes"):
    disk.store_new()                               # refused while the publisher drains the pool
""",
        cleanup="import shutil; shutil.rmtree(directory, ignore_errors=True)",
    ),
    Case(
        "from kvpool.router import Router, ZmqFeed",
        subs=(("...\nfeed.poll()", "engine_step()\nfeed.poll()"),
              ("send(request, to=route.pool)     ", "sent.append(route.pool)          ")),
        setup="""
import torch, kvpool
from kvpool.events import ZmqEventPublisher
pools = [kvpool.KVPool(2, 2, 8, dtype=torch.float32, page_size=16, num_pages=32, hash_seed=7) for _ in range(4)]
pool = pools[0]
pubs = [ZmqEventPublisher(p, "tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0") for p in pools]
endpoints = [(p.endpoint, p.replay_endpoint) for p in pubs]
prompt_token_ids = list(range(3, 53))
has_room = [True, True, True, False]
sent = []

def engine_step():
    # Pool 2 serves the prompt; the others churn. A SUB socket misses what is sent
    # before it has connected (and a stream joined mid-way starts at its first
    # batch): churn until the feed has heard from pool 2, then store the prompt.
    for attempt in range(100):
        h = pools[2].admit([17], tokens=[100 + attempt] * 17)[0]
        pools[2].close(h, cache=True)
        pubs[2].publish()
        pubs[2].flush(5)
        if feed.poll(50) and router.pages(2) >= 1:
            break
    else:
        raise AssertionError("the router never heard from pool 2")
    h = pools[2].admit([50], tokens=prompt_token_ids)[0]
    pools[2].close(h, cache=True)
    pubs[2].publish()
    pubs[2].flush(5)
    for _ in range(100):
        feed.poll(50)
        if router.match(prompt_token_ids)[2] == 48:
            return
    raise AssertionError("the router never learned pool 2's prompt pages")
""",
        check="""
assert sent == [2] and route.cached_tokens == 48 == router.match(prompt_token_ids)[2]
assert router.load == [0, 0, 0, 0]
""",
        cleanup="feed.close()\nfor p in pubs:\n    p.close()",
    ),
    Case(
        "from prometheus_client import REGISTRY",
        subs=(("REGISTRY.register(KVPoolCollector(", "REGISTRY.register(collector := KVPoolCollector("),),
        setup="""
import torch, kvpool
from kvpool.events import LocalEventPublisher
pool0, pool1 = (kvpool.KVPool(2, 2, 8, dtype=torch.float32, page_size=16, num_pages=16) for _ in range(2))
pub0 = LocalEventPublisher(pool0)
pool1.admit([20])
""",
        check="""
from prometheus_client import generate_latest
text = generate_latest(REGISTRY).decode()
assert 'kvpool_pages{pool="gpu1",state="held"} 2.0' in text and 'pool="gpu0"' in text
""",
        cleanup="REGISTRY.unregister(collector)",
    ),
]

CASES["docs/grad-modes.md"] = [
    Case(
        "import torch, kvpool",
        subs=CUDA + (("num_layers=32", "num_layers=2"),
                     ("memory_fraction=0.8,      # or", "num_pages=64,             # or")),
        setup="""
import torch
layer = 1
k, v = torch.randn(61, 8, 128, dtype=torch.bfloat16), torch.randn(61, 8, 128, dtype=torch.bfloat16)
""",
        check="""
import numpy as np
assert step.slots.dtype == np.int64 and step.out_cache_loc.dtype == torch.int64
assert torch.equal(pool.k_buffer(layer)[step.out_cache_loc], k) and k_cache.data_ptr() == pool.k_buffer(layer).data_ptr()
assert table.kv_indptr.dtype == table.kv_indices.dtype == table.kv_last_page_len.dtype == torch.int32
assert table.kv_indptr.tolist() == [0, 2, 3, 6, 7]
assert pool.open_requests == 0
for name, t in pool.named_tensors():                 # built in inference mode, yet normal tensors
    assert not t.is_inference() and not t.requires_grad, name
with torch.no_grad():
    pool.k_buffer(0).add_(1)                          # an in-place write outside inference mode
""",
    ),
    Case(
        "for finding in kvpool.audit(model=model, pool=pool):",
        after=True,
        setup="""
import torch
printed = []
print = lambda *a: printed.append(" ".join(map(str, a)))   # noqa: E731

class Rotary(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cos_cache", torch.zeros(8192, 64))

with torch.inference_mode():
    model = torch.nn.Module()
    model.rotary = Rotary()
""",
        check="""
assert printed and printed[0].startswith("model.rotary.cos_cache [8192, 64] torch.float32: inference tensor; ")
assert not kvpool.audit(model=model, pool=pool) and not model.rotary.cos_cache.is_inference()
""",
    ),
]

CASES["docs/groups.md"] = [
    Case(
        "import kvpool",
        setup="""
import numpy as np
prompt = list(range(3, 3 + 3000))
full_table, sliding_table = np.zeros((257, 32_768), np.int32), np.zeros((257, 32_768), np.int32)
""",
        check="""
row = int(a.rows(h)[0])
assert cached[0] == 0 and [len(s) for s in new] == [3000, 3000]
assert np.array_equal(full_table[row, :3000], new[0])
in_window = sliding_table[row, 3000 - 1024 : 3000]
assert np.array_equal(in_window, new[1][-1024:])
h2, cached2 = a.open_with_prefix(prompt, [len(prompt)])
assert cached2[0] == (3000 - 1) // 16 * 16                # every group serves the prompt but its last token
assert a.hit_step == 16
a.extend(h, 1, tables=[full_table, sliding_table])         # a decode step releases what the window passed
released = sliding_table[row, : (3000 - 1024 + 1) // 16 * 16]
assert released.max() < 16 and released.size > 0          # read as the null page (page 0)
assert len(a.pages(h[0], 1)) == 188 and (a.pages(h[0], 1) == 0).sum() == (3000 - 1024 + 1) // 16
with pytest.raises(kvpool.PoolExhaustedError, match=r"group 1 \\(sliding\\)"):   # names the group that is short
    a.admit([30_000] * 5)
a.check()
""",
    ),
]

CASES["docs/hybrid.md"] = [
    Case(
        "pool = kvpool.KVPool(",
        subs=CUDA + (("num_pages=1 << 16,  ", "num_pages=1 << 8,   "),),
        setup="import torch, kvpool\n",
        modules=("torch", "kvpool"),
        check="""
from kvpool.hybrid import HybridKVPool
assert type(pool) is HybridKVPool and [pool.group(i).kind for i in range(6)] == ["sliding"] * 5 + ["full"]
plain = kvpool.KVPool(num_layers=1, num_kv_heads=1, head_dim=8, page_size=16, num_pages=4)
assert type(plain) is kvpool.KVPool                   # without layer_types: the plain pool
with pytest.raises(kvpool.InvalidArgumentError):      # the host tier is the plain pool's only
    kvpool.KVPool(num_layers=2, num_kv_heads=1, head_dim=8, layer_types=["sliding_attention", "full_attention"],
                  sliding_window=32, page_size=16, num_pages=8, host_pages=8)
""",
    ),
    Case(
        "step = pool.extend(running, 1)",
        after=True,
        setup="""
num_layers = 6
running = pool.admit([1500, 40])[0]
k, v = torch.randn(2, 8, 128, dtype=torch.bfloat16), torch.randn(2, 8, 128, dtype=torch.bfloat16)
""",
        check="""
assert table.shape == (pool.max_requests + 1, pool.max_context_len) and table.dtype == torch.int32
assert torch.equal(pool.k_buffer(5)[step.for_layer(5)], k) and torch.equal(pool.k_buffer(0)[step.for_layer(0)], k)
sliding = pool.page_table(running, 0)
pages = (sliding.kv_indptr[1:] - sliding.kv_indptr[:-1]).tolist()
assert pages[0] <= 1024 // 16 + 1 < len(pool.pages(running[0], 5))   # the window's pages, not all 94
assert pt.kv_indptr.tolist() == [0, 94, 97]          # the full group: every page of 1501 and 41 tokens
assert type(step).__name__ == "HybridExtendResult"
released = (1500 - 1024 + 1) // 16 * 16               # the pages wholly before start - W + 1
assert np.array_equal(pool.slots(running[0], 0)[:released], np.arange(released) % 16)   # the null page's slots
assert (pool.pages(running[0], 0)[: released // 16] == 0).all()
assert pool.held_tokens(running[0], 0) <= 1024 + 16 < pool.held_tokens(running[0], 5)
assert pool.used_pages(0) + pool.free_pages(0) <= pool.capacity_pages(0) and pool.cached_pages(5) == 0
assert pool.admissible_tokens() > 0 and pool.admissible_requests == pool.max_requests - 2
""",
    ),
]

CASES["docs/kernels-and-graphs.md"] = [
    Case(
        "import torch, kvpool",
        subs=CUDA + (("num_layers=32", "num_layers=2"), ("page_size=16, memory_fraction=0.8", "page_size=16, num_pages=64"),
                     ("runner = kvpool.DecodeGraphRunner(pool,", "handles = started(pool); runner = kvpool.DecodeGraphRunner(pool,")),
        setup=GRAPH_SETUP,
        check=GRAPH_CHECK,
    ),
    Case(
        "step = pool.extend(handles, 1)",
        skip="it orders CUDA streams (torch.cuda.current_stream, torch.cuda.stream): there is no CPU counterpart",
    ),
]

CASES["docs/tiers.md"] = [
    Case(
        "from kvpool.tiers import HostStorage",
        setup="""
import torch, kvpool
pool = kvpool.KVPool(2, 2, 8, dtype=torch.float32, page_size=16, num_pages=32)
""",
        check="""
assert host.buffer.shape == (4096, 2, 2, 16, 2, 8) and host.buffer.dtype == torch.float32
assert host.pin_method == "none" and not host.buffer.is_inference()   # a CPU pool: plain memory
from kvpool.tiers import host_page_bytes
assert host.page_bytes == pool.bytes_per_slot * 16                  # a device page across all layers
assert host_page_bytes(32, 16, 8, 128, torch.bfloat16, mla=False) == 2 << 20   # Llama-3-8B: 2 MiB
with pytest.raises(kvpool.InvalidArgumentError):                    # host_pages counts page 0: >= 2
    HostStorage.for_pool(pool, host_pages=1)
""",
    ),
    Case(
        "from kvpool.kernels import offload_pages, load_pages",
        after=True,
        setup="""
device_pages, host_pages = [3, 5], [7, 2]
for layer in range(2):
    pool.k_buffer(layer).normal_()
    pool.v_buffer(layer).normal_()
before = [t.clone() for t in pool.k_buffers]
""",
        check="""
for layer in range(2):
    assert torch.equal(host.buffer[7, 0, layer], pool.k_buffer(layer)[3 * 16 : 4 * 16])
    assert torch.equal(host.buffer[2, 1, layer], pool.v_buffer(layer)[5 * 16 : 6 * 16])
    assert torch.equal(pool.k_buffer(layer), before[layer])          # loaded back what it offloaded
host_before = host.buffer.clone()
for bad, error in ((([0], [1]), kvpool.ReservedSlotError), (([3], [4096]), kvpool.SlotRangeError),
                   (([3, 4], [2, 2]), kvpool.DuplicateSlotError), (([3, 4], [2, 0]), kvpool.ReservedSlotError)):
    with pytest.raises(error):
        offload_pages(pool.caches, host, *bad)
# (bitwise: pages no offload wrote hold whatever the memory held, NaN patterns included, and
# torch.equal finds a NaN unequal to itself: the block failed now and then on a loaded machine)
assert torch.equal(host.buffer.view(torch.int32), host_before.view(torch.int32))  # nothing written on a refusal
assert [c.shape for c in pool.caches] == [(2, 512, 2, 8)] * 2       # [layers, slots, H, D]: K, then V
assert pool.caches[1][1].data_ptr() == pool.v_buffer(1).data_ptr()  # the layers' buffers are views of them
""",
    ),
    Case(
        "from kvpool.tiers import TransferRunner",
        after=True,
        setup="""
allocator = pool.allocator                      # drive the core directly: a fork, then a write into the shared page
parent = allocator.open(1)
allocator.extend(parent, 20)
kid = allocator.fork(int(parent[0]), 1)
allocator.extend(kid, 1)                        # queues the copy of the shared, half-full page
src_page, dst_page = int(allocator.pages(parent[0])[-1]), int(allocator.pages(kid[0])[-1])
""",
        check="""
assert src_page != dst_page and batch.copies == 4 if hasattr(batch, "copies") else True
for layer in range(2):
    assert torch.equal(pool.k_buffer(layer)[dst_page * 16 : dst_page * 16 + 4],
                       pool.k_buffer(layer)[src_page * 16 : src_page * 16 + 4])
""",
    ),
    Case(
        "pool = kvpool.KVPool(32, 8, 128,",
        subs=CUDA + (("kvpool.KVPool(32, 8, 128,", "kvpool.KVPool(2, 8, 128, "),
                     ("num_pages=20_000, host_pages=100_000)", "num_pages=8, host_pages=64)           ")),
        setup="import torch, kvpool\n",
        modules=("torch", "kvpool"),
        check="""
assert pool.allocator.host_policy == "write_back"
prompt = list(range(3, 3 + 5 * 16 + 1))
h = pool.admit([len(prompt)], tokens=prompt)[0]
k = torch.randn(len(prompt), 8, 128).to(torch.bfloat16)
for layer in range(2):
    pool.write(layer, torch.as_tensor(pool.slots(h[0])), k, -k)
pool.close(h, cache=True)
other = pool.admit([6 * 16])[0]                  # pressure: the cached pages are evicted to the host
pool.close(other)
h, cached = pool.open_with_prefix(prompt, [len(prompt)])
assert cached[0] == 80 and pool.host_hit_tokens > 0   # a host hit, loaded back
assert torch.equal(pool.k_buffer(1)[torch.as_tensor(pool.slots(h[0]))], k[:80])
""",
    ),
    Case(
        "from kvpool.tiers import DiskCache, FileTier",
        subs=(('"/var/cache/kvpool"', "directory"),),
        setup='MODEL = "llama-3-8b@rev"\n' + DISK_SETUP + "prompt_tokens, salt = PROMPT, None\n",
        check="hs = handles\n" + DISK_CHECK,
        cleanup=DISK_CLEANUP,
    ),
]

CASES["docs/transformers.md"] = [
    Case(
        "from kvpool.integrations.transformers import KVPoolCache, pool_for_model",
        setup=HF_SETUP,
        check=HF_CHECK,
    ),
    Case(
        "import copy",
        setup=HF_SETUP + """
from kvpool.integrations.transformers import KVPoolCache, pool_for_model
pool = pool_for_model(model, max_tokens=1024, page_size=4)
INITIAL_PROMPT, prompts = [5, 17, 33, 8, 41, 12, 9], [[60, 3], [22, 70, 71, 4, 6]]
def tokenizer(token_ids, return_tensors):
    return {"input_ids": torch.tensor([token_ids])}
inputs = tokenizer(INITIAL_PROMPT, return_tensors="pt")
""",
        check="""
plain = model.generate(**new_inputs, max_new_tokens=20, do_sample=False)
assert torch.equal(out, plain)                      # the last prompt's tokens, token for token
assert pool.open_requests == 0                      # each copy and the prompt cache closed their rows
""",
    ),
]
