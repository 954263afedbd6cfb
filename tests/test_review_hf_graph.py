"""Outside-style checks of three public surfaces with bad inputs: ``KVPoolCache`` (layer
indices, empty steps and batches, empty prefix batches), ``DecodeGraphRunner`` (outputs
that are not a tensor, tuple or list; buckets checked on every device; ``bucket_for``
agreeing with ``run``), and ``send_request`` / ``recv_request`` (peers that are not in
the group: a typed refusal, never a hang). Each refusal is typed and changes nothing."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="needs the 'hf' extra (transformers>=5.23)")
__import__("_hf_skip").require_hf()  # transformers may refuse this torch

import _dist  # noqa: E402
from test_graph_runner import make_pool  # noqa: E402

import kvpool  # noqa: E402
from kvpool import InvalidArgumentError, KVPool, LayerIndexError, TensorShapeError  # noqa: E402
from kvpool.cuda_graph import DecodeGraphRunner  # noqa: E402
from kvpool.distributed.tp import TPPool  # noqa: E402
from kvpool.integrations.transformers import KVPoolCache  # noqa: E402

H, D, LAYERS, B, T = 2, 8, 2, 2, 3


def _pool(**kw):
    return KVPool(LAYERS, H, D, dtype=torch.float32, page_size=4, num_slots=256, max_requests=8,
                  max_context_len=64, **kw)


def _state(pool, cache):
    a = pool.allocator
    a.check()
    h = cache.requests.handles
    return (a.open_requests, a.used_pages, None if h is None else h.tolist(), cache.requests.length,
            [layer.seen for layer in cache._pool_layers])


@pytest.fixture
def filled():
    pool = _pool()
    cache = KVPoolCache(pool)
    g = torch.Generator().manual_seed(0)
    for layer in range(LAYERS):
        k = torch.randn(B, H, T, D, generator=g)
        cache.update(k, -k, layer)
    yield pool, cache
    cache.close()
    assert pool.allocator.open_requests == 0


# ----- KVPoolCache ------------------------------------------------------------------------

@pytest.mark.parametrize("layer_idx", [-1, -LAYERS, np.int64(-1), torch.tensor(-1)])
def test_a_negative_layer_index_is_a_layer_index_error(filled, layer_idx):
    """``layer_idx=-1`` stored the step as the last layer's (a list index from the end): the
    real last layer then found its step taken. No model layer has a negative index."""
    pool, cache = filled
    before = _state(pool, cache)
    x = torch.ones(B, H, 1, D)
    with pytest.raises(LayerIndexError, match=r"the pool has layers \[0, 2\)"):
        cache.update(x, x, layer_idx)
    assert _state(pool, cache) == before
    for layer in range(LAYERS):  # the step the refused call would have started still runs whole
        k, _ = cache.update(x * layer, x, layer)
        assert k.shape == (B, H, T + 1, D) and torch.equal(k[:, :, -1], (x * layer)[:, :, 0])


@pytest.mark.parametrize("shape,layer_idx,error,match", [
    ((1, H, 2, D), -1, LayerIndexError, "the pool has layers"),
    ((1, H, 0, D), 0, TensorShapeError, "at least one token"),
    ((0, H, 2, D), 0, TensorShapeError, "at least one row"),
])
def test_a_hybrid_cache_refuses_what_a_plain_one_does(shape, layer_idx, error, match):
    pool = KVPool(LAYERS, H, D, dtype=torch.float32, page_size=4, num_pages=64, max_requests=4, max_context_len=64,
                  layer_types=["full_attention", "sliding_attention"], sliding_window=8)
    with KVPoolCache(pool) as cache:
        x = torch.ones(shape)
        with pytest.raises(error, match=match):
            cache.update(x, x, layer_idx)
        assert cache.get_seq_length() == 0 and pool.allocator.open_requests == 0
        with pytest.raises(TensorShapeError, match="at least one row"):
            KVPoolCache(pool, prefix_ids=torch.zeros(0, 4, dtype=torch.long))


def test_a_step_of_no_tokens_is_a_shape_error_that_changes_nothing(filled):
    """Zero new tokens raised numpy's IndexError from the page table."""
    pool, cache = filled
    before = _state(pool, cache)
    empty = torch.zeros(B, H, 0, D)
    with pytest.raises(TensorShapeError, match="at least one token"):
        cache.update(empty, empty, 0)
    assert _state(pool, cache) == before
    x = torch.ones(B, H, 1, D)
    for layer in range(LAYERS):
        assert cache.update(x, x, layer)[0].shape[2] == T + 1


def test_a_first_step_of_no_tokens_opens_nothing():
    pool = _pool()
    cache = KVPoolCache(pool)
    empty = torch.zeros(B, H, 0, D)
    with pytest.raises(TensorShapeError, match="at least one token"):
        cache.update(empty, empty, 0)
    assert pool.allocator.open_requests == 0 and cache.handles is None


def test_a_first_step_of_no_rows_is_a_shape_error_that_opens_nothing():
    """A batch of 0 rows raised IndexError and left the cache holding no rows but one token."""
    pool = _pool()
    cache = KVPoolCache(pool)
    empty = torch.zeros(0, H, 1, D)
    with pytest.raises(TensorShapeError, match="at least one row"):
        cache.update(empty, empty, 0)
    assert pool.allocator.open_requests == 0 and cache.handles is None and cache.requests.length == 0
    x = torch.ones(B, H, 1, D)
    for layer in range(LAYERS):  # and the cache still serves a batch
        assert cache.update(x, x, layer)[0].shape == (B, H, 1, D)
    cache.close()


def test_a_cache_of_no_rows_refuses_a_step_of_no_rows(filled):
    """After selecting no rows, a step of no rows took the short way and raised IndexError."""
    pool, cache = filled
    cache.batch_select_indices(torch.tensor([], dtype=torch.long))
    before = _state(pool, cache)
    for b, match in ((0, "at least one row"), (B, "holds 0 pool requests")):
        x = torch.ones(b, H, 1, D)
        with pytest.raises(TensorShapeError, match=match):
            cache.update(x, x, 0)
        assert _state(pool, cache) == before


def test_prefix_ids_of_no_rows_are_a_shape_error():
    """numpy's ValueError (``min`` of no hits) before."""
    pool = _pool()
    with pytest.raises(TensorShapeError, match="at least one row"):
        KVPoolCache(pool, prefix_ids=torch.zeros(0, 4, dtype=torch.long))
    assert pool.allocator.open_requests == 0


@pytest.mark.parametrize("make", [
    lambda pool: KVPoolCache(pool),
    lambda pool: DecodeGraphRunner(pool, lambda *a: None, 4),
    lambda pool: TPPool(pool),
], ids=["KVPoolCache", "DecodeGraphRunner", "TPPool"])
@pytest.mark.parametrize("pool", [None, object(), "cpu"], ids=["None", "object", "str"])
def test_something_that_is_not_a_pool_is_an_invalid_argument(make, pool):
    """Each raised AttributeError ('NoneType' object has no attribute 'device')."""
    with pytest.raises(InvalidArgumentError, match="takes a KVPool, got"):
        make(pool)


@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("flag", ["no", 0, None])
def test_layer_buffers_takes_true_or_false(hybrid, flag):
    """A truthy ``"no"`` built a cache with layer buffers (and a hybrid cache took anything)."""
    pool = _pool() if not hybrid else KVPool(
        LAYERS, H, D, dtype=torch.float32, page_size=4, num_pages=64, max_requests=4, max_context_len=64,
        layer_types=["full_attention", "sliding_attention"], sliding_window=8)
    with pytest.raises(InvalidArgumentError, match="layer_buffers takes True or False"):
        KVPoolCache(pool, layer_buffers=flag)
    KVPoolCache(pool, layer_buffers=np.bool_(False)).close()


# ----- DecodeGraphRunner ------------------------------------------------------------------

class Out(NamedTuple):
    logits: torch.Tensor
    lens: torch.Tensor


@pytest.mark.parametrize("copy_outputs", [False, True])
def test_a_named_tuple_output_is_sliced_to_the_real_batch(copy_outputs):
    """``type(out)(generator)`` raised TypeError for a namedtuple, after the step had run."""
    runner = DecodeGraphRunner(make_pool(), lambda *a: Out(a[0] * 2, a[4]), max_batch_size=4,
                               copy_outputs=copy_outputs)
    out = runner.run([1, 2, 3], [0, 0, 0], [0, 1, 2], [5, 6, 7], [1, 2, 3])
    assert isinstance(out, Out) and out.logits.tolist() == [2, 4, 6] and out.lens.tolist() == [1, 2, 3]


@pytest.mark.parametrize("copy_outputs", [False, True])
def test_a_dict_output_is_sliced_to_the_real_batch(copy_outputs):
    """A dict came back whole: the bucket's padded rows read as requests."""
    runner = DecodeGraphRunner(make_pool(), lambda *a: {"logits": a[0] * 2, "extra": [a[4]]}, max_batch_size=4,
                               copy_outputs=copy_outputs)
    out = runner.run([1, 2, 3], [0, 0, 0], [0, 1, 2], [5, 6, 7], [1, 2, 3])
    assert type(out) is dict and out["logits"].tolist() == [2, 4, 6] and out["extra"][0].tolist() == [1, 2, 3]


@pytest.mark.parametrize("rows", [[0, 1, -1], [0, 1, "past"], np.array([0, 1, -2], dtype=np.int32)])
def test_host_req_rows_outside_req_to_token_are_refused_before_the_step(rows):
    """A negative row counted from the end of req_to_token (another request's slots), and one
    past null_row read past the table: the step ran with them."""
    pool = make_pool()
    ran = []
    runner = DecodeGraphRunner(pool, lambda *a: ran.append(1) or a[0], max_batch_size=4)
    if isinstance(rows, list) and rows[-1] == "past":
        rows = [0, 1, pool.null_row + 1]
    with pytest.raises(InvalidArgumentError, match=r"req_rows\[2\] = .* is not a row of the pool's req_to_token"):
        runner.run([1, 2, 3], [0, 0, 0], rows, [5, 6, 7], [1, 2, 3])
    assert not ran
    # null_row itself is a row (padding), and the step runs with it
    runner.run([1, 2, 3], [0, 0, 0], [0, 1, pool.null_row], [5, 6, 7], [1, 2, 3])
    assert ran


@pytest.mark.parametrize("buckets,match", [([99], "99 is not one of the buckets"),
                                           (5, "buckets must be"),
                                           (["a"], "is not one of the buckets")])
def test_capture_checks_its_buckets_on_every_device(buckets, match):
    """On CPU (no graphs) capture() returned for any argument; on a GPU the same call raised
    (a plain TypeError for an int)."""
    runner = DecodeGraphRunner(make_pool(), lambda *a: a[0].clone(), max_batch_size=4)
    with pytest.raises(InvalidArgumentError, match=match):
        runner.capture(buckets)
    runner.capture([2, 4])
    runner.capture()
    assert runner.captured == []


def test_bucket_for_refuses_what_run_refuses():
    """With buckets past max_batch_size, bucket_for(n) gave a bucket for batches run refuses."""
    runner = DecodeGraphRunner(make_pool(), lambda *a: a[0].clone(), max_batch_size=10, buckets=[3, 16])
    assert runner.bucket_for(10) == 16
    with pytest.raises(InvalidArgumentError, match="batch of 12 exceeds max_batch_size 10"):
        runner.bucket_for(12)
    with pytest.raises(InvalidArgumentError, match="batch of 12 exceeds max_batch_size 10"):
        runner.run(*[[0] * 12] * 5)


# ----- send_request / recv_request --------------------------------------------------------

def _bad_peers(rank: int, world: int) -> dict:
    """On a world of one rank: every peer is refused at once (gloo's isend/irecv to a rank
    outside the group waited forever, whatever timeout_s said)."""
    import time

    from kvpool.distributed import recv_request, send_request

    pool = _pool()
    h = int(pool.open(1)[0])
    pool.extend(np.array([h], dtype=np.int64), 5)
    out: dict = {}
    for name, call in {
        "send-outside": lambda: send_request(pool, h, 5, timeout_s=1.0),
        "send-negative": lambda: send_request(pool, h, -1, timeout_s=1.0),
        "send-self": lambda: send_request(pool, h, 0, timeout_s=1.0),
        "send-str": lambda: send_request(pool, h, "1", timeout_s=1.0),
        "send-bad-timeout": lambda: send_request(pool, h, 5, timeout_s=-1),
        "recv-outside": lambda: recv_request(pool, 5, timeout_s=1.0),
        "recv-self": lambda: recv_request(pool, 0, timeout_s=1.0),
        "recv-float": lambda: recv_request(pool, 1.0, timeout_s=1.0),
        "recv-str-timeout": lambda: recv_request(pool, 5, timeout_s="1"),
        "recv-negative-timeout": lambda: recv_request(pool, 5, timeout_s=-1.0),
    }.items():
        t0 = time.monotonic()
        try:
            call()
            out[name] = ("returned", "", 0.0)
        except Exception as e:  # noqa: BLE001 - the parent checks the type
            out[name] = (type(e).__name__, str(e), time.monotonic() - t0)
    out["open"] = pool.allocator.open_requests
    return out


def test_a_peer_outside_the_group_is_refused_at_once():
    res = _dist.run_ranks(_bad_peers, world=1, timeout_s=120)[0]
    assert res.pop("open") == 1, "the sender's pool changed"
    for name, (err, msg, seconds) in res.items():
        assert err == "InvalidArgumentError", (name, err, msg)
        assert seconds < 5, (name, seconds)
        assert isinstance(getattr(kvpool, err), type)
    assert "rank 5 is not in the group (its ranks are [0])" in res["send-outside"][1]
    assert "this rank" in res["recv-self"][1]
    assert "timeout_s must be a positive number" in res["recv-str-timeout"][1]
