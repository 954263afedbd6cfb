"""KVPool(layer_types=...): groups, window release, per-layer tables, state copies, typed refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpool import KVPool, audit
from kvpool._core import InvalidArgumentError, InvalidHandleError, PoolExhaustedError, RollbackUnavailableError
from kvpool.errors import LayerIndexError, SlotRangeError, TensorDtypeError
from kvpool.hybrid import HybridKVPool
from kvpool.hybrid_plan import STATE_DTYPES

W, P = 8, 4
TYPES = ["sliding_attention", "full_attention", "linear_attention", "sliding_attention"]
STATES = {"conv": (6, 4), "rec": ((2, 3), torch.float32)}


def make(**kw):
    args = dict(layer_types=TYPES, sliding_window=W, state_shapes=STATES, dtype=torch.float32, page_size=P,
                num_pages=64, max_requests=4, max_context_len=128)
    args.update(kw)
    return KVPool(4, 2, 8, **args)


def fill(pool, res, value_of_slot=None):
    """Write K = V = float(slot) into every attention layer's new slots (a value each slot keeps)."""
    for layer in (0, 1, 3):
        s = res.for_layer(layer)
        x = s.to(torch.float32).view(-1, 1, 1).expand(-1, 2, 8).contiguous() + 1000 * layer
        pool.write(layer, s, x, x)


def test_plain_pool_is_unchanged_and_layer_types_builds_the_hybrid_pool():
    plain = KVPool(2, 2, 8, dtype=torch.float32, num_pages=8)
    assert type(plain) is KVPool
    assert type(KVPool(2, 2, 8, dtype=torch.float32, num_pages=8, layer_types=None)) is KVPool
    pool = make()
    assert isinstance(pool, HybridKVPool)
    kinds = [(g.layer_type, g.kind, g.layers) for g in pool.groups]
    assert kinds == [("sliding_attention", "sliding", (0, 3)), ("full_attention", "full", (1,)),
                     ("linear_attention", "state", (2,))]
    # By need: every request's window plus a page, and one longest prompt.
    assert pool.groups[0].num_pages == 4 * (-(-(W - 1) // P) + 1) + 128 // P + 1
    assert pool.groups[2].num_pages == 2 * 4 + 1
    pool = make(group_pages={"sliding_attention": 20, "linear_attention": 5})
    assert [g.num_pages for g in pool.groups] == [20, 64, 5]
    assert pool.k_buffer(0).shape == (20 * P, 2, 8) and pool.k_buffer(1).shape == (64 * P, 2, 8)
    assert pool.state(2, "conv").shape == (5, 6, 4) and pool.state(2, "rec").dtype == torch.float32
    assert pool.page_size_of(3) == P


def test_a_memory_budget_gives_other_groups_their_need_and_the_full_group_the_rest():
    sized = make()
    token = 2 * 2 * 8 * 4  # K and V of one layer, float32
    tables = sized.overhead_bytes - int(sized.allocator.metadata_bytes)
    others = sized.nbytes - 64 * P * 1 * token  # sliding K/V + state rows at their need
    budget = others + tables + 100 * P * token + 17  # room for 100 full pages and change
    pool = make(num_pages=None, memory_bytes=budget)
    assert [g.num_pages for g in pool.groups] == [sized.groups[0].num_pages, 100, sized.groups[2].num_pages]
    assert pool.nbytes + pool.overhead_bytes - int(pool.allocator.metadata_bytes) <= budget
    assert make(num_pages=None, memory_bytes=budget - 18).groups[1].num_pages == 99


def test_hybrid_arguments_without_layer_types_are_a_typed_error():
    with pytest.raises(InvalidArgumentError, match="sliding_window applies to hybrid pools"):
        KVPool(2, 2, 8, dtype=torch.float32, num_pages=8, sliding_window=4)


def test_groups_with_their_own_page_sizes():
    pool = make(page_size={"sliding_attention": 2, "full_attention": 8})
    assert [g.page_size for g in pool.groups[:2]] == [2, 8] and pool.allocator.hit_step == 8
    h = pool.open(2)
    fill(pool, pool.extend(h, 11))
    for _ in range(13):
        fill(pool, pool.extend(h, 1))
    rows = pool.rows(h)
    for i, x in enumerate(h):
        assert pool.held_tokens(x, 0) <= W + 2 and pool.held_tokens(x, 1) == 24
        for layer, _p in ((0, 2), (1, 8)):
            slots = pool.slots(x, layer)
            np.testing.assert_array_equal(pool.req_to_token[layer][rows[i], :24].numpy(), slots)
            live = torch.from_numpy(slots[-W:])
            assert torch.equal(pool.read(layer, live)[0][:, 0, 0], live.float() + 1000 * layer)
    pool.check()


def test_a_default_sliding_group_with_larger_pages_holds_every_requests_window():
    """Capped at the full group's tokens counted in sliding pages, the default sliding group
    ignored that each request's window starts and ends inside a page: with full pages of 1
    token and sliding pages of 16, the fourth of five requests decoding well within
    max_context_len ran the sliding group dry while the full group had 55 pages free."""
    pool = KVPool(2, 1, 4, layer_types=["full_attention", "sliding_attention"], sliding_window=40,
                  page_size={"full_attention": 1, "sliding_attention": 16}, num_pages=251, max_requests=5,
                  max_context_len=50)
    # Five windows of 40 at a page each side of them, and one longest prompt (docs/hybrid.md).
    assert pool.groups[1].num_pages == 5 * (3 + 1) + 4 + 1
    for _ in range(5):
        h, _ = pool.admit([48])
        pool.extend(h, 1)
    pool.check()


def test_window_release_keeps_w_plus_one_page_and_tables_show_only_the_window():
    pool = make()
    h = pool.open(2)
    fill(pool, pool.extend(h, 10))
    for _ in range(40):
        fill(pool, pool.extend(h, 1))
        pool.check()
        for x in h:
            assert pool.held_tokens(x, 0) <= W + P  # at most W + one page per sliding layer
    n = 50
    assert list(pool.lengths(h)) == [n, n]
    rows = pool.rows(h)
    for i, x in enumerate(h):
        assert pool.held_tokens(x, 1) == -(-n // P) * P  # the full group keeps everything
        slots = pool.slots(x, 0)
        table = pool.req_to_token[0][rows[i], :n].numpy()
        np.testing.assert_array_equal(table, slots)
        # Released positions read as the null page; the window's as slots that kept their K/V.
        assert (slots[: n - W - P] < P).all()
        window = torch.from_numpy(slots[n - W:])
        for layer in (0, 3):
            k, v = pool.read(layer, window)
            assert torch.equal(k[:, 0, 0], window.float() + 1000 * layer) and torch.equal(v, k)
        full = torch.from_numpy(pool.slots(x, 1))
        assert torch.equal(pool.read(1, full)[0][:, 0, 0], full.float() + 1000)
    ind, idx, last = pool.page_table(h, 0)
    assert ind.tolist()[-1] == idx.shape[0] <= 2 * (-(-(W - 1) // P) + 1)
    for i, x in enumerate(h):
        held = pool.pages(x, 0)
        assert sorted(idx[ind[i]:ind[i + 1]].tolist()) == sorted(held[held > 0].tolist())
    ind1, idx1, _ = pool.page_table(h, 1)
    assert idx1.shape[0] == 2 * -(-n // P)
    assert torch.equal(pool.req_to_token[3], pool.req_to_token[0])  # layers of one group share a table


def test_writes_go_to_the_layers_group_and_state_layers_have_no_pages():
    pool = make()
    h = pool.open(1)
    res = pool.extend(h, 3)
    k = torch.randn(3, 2, 8)
    pool.write(3, res.for_layer(3), k, -k)
    assert torch.equal(pool.read(3, res.for_layer(3))[1], -k)
    assert pool.k_buffer(1).abs().sum() == 0 and pool.k_buffer(0).abs().sum() == 0  # layer 0 is a separate tensor
    with pytest.raises(InvalidArgumentError, match="linear_attention"):
        pool.write(2, res.for_layer(0), k, k)
    with pytest.raises(InvalidArgumentError, match="linear_attention"):
        pool.page_table(h, 2)
    with pytest.raises(InvalidArgumentError, match="K/V pages, not state"):
        pool.state(0, "conv")
    with pytest.raises(InvalidArgumentError, match="no state named"):
        pool.state(2, "ssm")
    with pytest.raises(LayerIndexError):
        pool.write(4, res.for_layer(0), k, k)
    with pytest.raises(SlotRangeError):
        pool.write(0, [pool.groups[0].num_pages * P], k[:1], k[:1])
    with pytest.raises(TensorDtypeError):
        pool.write(0, res.for_layer(0), k.half(), k.half())


def test_new_requests_start_from_zero_state_and_fork_copies_state_and_pages():
    pool = make()
    h = pool.open(1)
    fill(pool, pool.extend(h, 6))
    conv = pool.state(2, "conv")
    s = pool.state_slots(h, 2)
    conv[s] = 7.0
    pool.state(2, "rec")[s] = 3.0
    (f,) = pool.fork(int(h[0]), 1)
    fs = pool.state_slots([f], 2)
    assert fs[0] != s[0]
    assert (conv[fs] == 7.0).all() and (pool.state(2, "rec")[fs] == 3.0).all()
    for layer in (0, 1):
        np.testing.assert_array_equal(pool.slots(f, layer), pool.slots(int(h[0]), layer))
        row = pool.rows([f])[0]
        np.testing.assert_array_equal(pool.req_to_token[layer][row, :6].numpy(), pool.slots(f, layer))
    # The child writes into the shared partial page: copy-on-write keeps the parent's token 4 and 5.
    before = pool.read(1, torch.from_numpy(pool.slots(int(h[0]), 1)))[0].clone()
    res = pool.extend([f], 1)
    fill(pool, res)
    child = torch.from_numpy(pool.slots(f, 1))
    assert not np.array_equal(child[4:6].numpy(), pool.slots(int(h[0]), 1)[4:6])
    assert torch.equal(pool.read(1, child[:6])[0], before)
    assert torch.equal(pool.read(1, torch.from_numpy(pool.slots(int(h[0]), 1)))[0], before)
    # A slot closed with state in it is zeroed for the next request that gets it.
    pool.close([f])
    g = pool.open(3)
    assert fs[0] in pool.state_slots(g, 2)
    for slot in pool.state_slots(g, 2):
        assert conv[slot].abs().sum() == 0 and pool.state(2, "rec")[slot].abs().sum() == 0
    pool.check()


def test_state_checkpoint_serves_a_prefix_hit_and_restores_on_truncate():
    pool = make()
    tokens = np.arange(10, 30, dtype=np.int64)
    h = pool.open(1)
    fill(pool, pool.extend(h, 8, tokens=tokens[:8]))
    s = pool.state_slots(h, 2)
    pool.state(2, "conv")[s] = 5.0
    pool.cache(h)  # length 8: a checkpoint of the state at 8
    fill(pool, pool.extend(h, 4, tokens=tokens[8:12]))
    pool.state(2, "conv")[s] = 9.0
    # A prompt sharing the first 8 tokens hits 8 and starts from the checkpoint's state.
    prompt = np.concatenate([tokens[:8], [90, 91, 92]])
    (g,), (cached,) = pool.open_with_prefix(prompt, [len(prompt)])
    assert cached == 8
    gs = pool.state_slots([g], 2)
    assert (pool.state(2, "conv")[gs] == 5.0).all()
    for layer in (0, 1):
        np.testing.assert_array_equal(pool.req_to_token[layer][pool.rows([g])[0], :8].numpy(),
                                      pool.slots(g, layer))
    full = torch.from_numpy(pool.slots(g, 1))
    np.testing.assert_array_equal(full.numpy(), pool.slots(int(h[0]), 1)[:8])
    # Truncating h to 8 restores its state from the checkpoint.
    pool.truncate(h, [8])
    assert (pool.state(2, "conv")[pool.state_slots(h, 2)] == 5.0).all()
    pool.check()


def test_refusals_are_typed_and_change_nothing():
    pool = make(group_pages={"sliding_attention": 12})
    h = pool.open(2)
    fill(pool, pool.extend(h, 20))
    fill(pool, pool.extend(h, 1))  # the window moves: pages before 13 are released
    conv = pool.state(2, "conv")
    conv[pool.state_slots(h, 2)] = 4.0
    snap = ([t.clone() for _, t in pool.named_tensors()], pool.lengths(h).copy(),
            [pool.slots(int(x), layer).copy() for x in h for layer in (0, 1)])

    def unchanged():
        assert all(torch.equal(a, t) for a, (_, t) in zip(snap[0], pool.named_tensors()))
        np.testing.assert_array_equal(pool.lengths(h), snap[1])
        for a, b in zip(snap[2], [pool.slots(int(x), layer) for x in h for layer in (0, 1)]):
            np.testing.assert_array_equal(a, b)
        pool.check()

    with pytest.raises(RollbackUnavailableError, match="nothing was changed"):
        pool.truncate(h, [2, 2])  # the window before 2 was released, and no checkpoint is at 2
    unchanged()
    pool.cache(h[:1])  # no checkpoint at 21 either (not a multiple of the hit step)
    with pytest.raises(RollbackUnavailableError, match="sliding"):
        pool.truncate(h, [21, 4])
    unchanged()
    with pytest.raises(PoolExhaustedError):
        pool.extend(h, 40)  # the sliding group has 11 usable pages
    unchanged()
    with pytest.raises(InvalidArgumentError):
        pool.extend(h, [1, -1])
    unchanged()


@pytest.mark.parametrize("call", [
    lambda pool, h: pool.cache(h, priority=80),
    lambda pool, h: pool.cache(h, retain_s=5.0),
    lambda pool, h: pool.close(h, cache=True, priority=80, retain_s=600),
], ids=["cache-priority", "cache-retain_s", "close-priority"])
def test_retention_priorities_are_a_typed_error_that_changes_nothing(call):
    """A hybrid pool keeps no retention priorities (docs/hybrid.md): an engine written
    against the plain pool's cache / close gets InvalidArgumentError, not a TypeError,
    and its request stays open with nothing cached."""
    pool = make()
    h, _ = pool.open_with_prefix(np.arange(9), [9])
    fill(pool, pool.extend(h, 9))
    with pytest.raises(InvalidArgumentError, match="retention priorities"):
        call(pool, h)
    assert pool.open_requests == 1 and pool.lengths(h).tolist() == [9]
    assert [pool.cached_pages(layer) for layer in (0, 1)] == [0, 0]
    pool.check()


def test_req_to_token_iterates_over_the_layers_of_an_attention_only_pool():
    """It is a Sequence of len num_layers: list() gave a LayerIndexError at its end."""
    pool = make(layer_types=["sliding_attention", "full_attention"] * 2, state_shapes=None)
    tables = list(pool.req_to_token)
    assert len(tables) == 4 and all(t is pool.req_to_token[i] for i, t in enumerate(tables))
    with pytest.raises(InvalidArgumentError, match="linear_attention"):
        list(make().req_to_token)  # a state layer has no table: the typed error, as [layer] gives


def test_unpin_and_set_clock_answer_as_on_a_plain_pool_without_priorities():
    """Engine code shared with the plain pool calls unpin and set_clock: unpin checks the
    handles as the plain pool does and unpins nothing (nothing can be pinned here),
    set_clock is the typed refusal of a plain pool without manual_clock; nothing changes."""
    pool = make()
    h, _ = pool.open_with_prefix(np.arange(9), [9])
    fill(pool, pool.extend(h, 9))
    pool.cache(h)
    before = [pool.cached_pages(layer) for layer in (0, 1)]
    assert pool.unpin(h) == 0 and pool.unpin(torch.as_tensor(h.astype(np.int64))) == 0
    with pytest.raises(InvalidArgumentError, match="more than once"):
        pool.unpin([h[0], h[0]])
    with pytest.raises(InvalidHandleError):
        pool.unpin([h[0] ^ 1])
    with pytest.raises(InvalidArgumentError, match="set_clock"):
        pool.set_clock(5.0)
    assert pool.lengths(h).tolist() == [9] and [pool.cached_pages(layer) for layer in (0, 1)] == before
    pool.close(h)
    with pytest.raises(InvalidHandleError):
        pool.unpin(h)
    pool.check()


@pytest.mark.parametrize("kw, match", [
    (dict(layer_types=["full_attention"] * 3), "num_layers=4"),
    (dict(layer_types=["full_attention", "cross_attention", "full_attention", "full_attention"]), "cross_attention"),
    (dict(sliding_window=None), "sliding_window"),
    (dict(state_shapes=None), "state_shapes"),
    (dict(state_shapes={"conv": (0, 4)}), "positive ints"),
    (dict(layer_types=["linear_attention"] * 4), "attention layer"),
    (dict(group_pages={"mamba": 4}), "mamba"),
    (dict(memory_bytes=1 << 20), "one of num_pages"),
    (dict(num_pages=None, memory_bytes=4096), "budget of 4096 bytes"),
    (dict(num_pages=None, memory_fraction=1.5), "memory_fraction"),
    (dict(kv_lora_rank=4), "kv_lora_rank"),
    (dict(max_pinned_pages=4), "max_pinned_pages"),
    (dict(host_pages=8), "host_pages"),
    (dict(host_memory_bytes=1 << 20), "host_memory_bytes"),
    (dict(host_policy="write_through"), "host_policy"),
    (dict(dtype=torch.float8_e4m3fn), "fp8"),
    (dict(state_shapes={"conv": ((6, 4), torch.float8_e4m3fn)}), "cannot zero and copy"),
    (dict(state_shapes={"conv": ((6, 4), torch.uint16)}), "cannot zero and copy"),
    (dict(num_pages=None), "num_pages"),
    (dict(page_size={"full_attention": 0}), "page_size"),
])
def test_bad_configuration_is_a_typed_error(kw, match):
    with pytest.raises(InvalidArgumentError, match=match):
        make(**kw)


@pytest.mark.parametrize("dtype", STATE_DTYPES, ids=str)
def test_every_state_dtype_a_pool_accepts_is_zeroed_and_copied(dtype):
    """A state dtype refused at construction (fp8, uint16) failed at the first open, after the
    core had opened the request; each one accepted runs open's zeroing and fork's copy."""
    pool = make(state_shapes={"s": ((3,), dtype)})
    h = pool.open(1)
    st, s = pool.state(2, "s"), pool.state_slots(h, 2)
    st[s] = torch.ones((), dtype=dtype)
    (f,) = pool.fork(int(h[0]), 1)
    assert (st[pool.state_slots([f], 2)] == 1).all()
    pool.close([f])
    g = pool.open(3)
    assert pool.open_requests == 4 and not st[pool.state_slots(g, 2)].to(torch.bool).any()
    pool.check()


def test_no_host_tier_spelled_out_is_the_default():
    for kw in (dict(host_pages=0), dict(host_pages=None), dict(host_memory_bytes=None),
               dict(host_policy="write_back")):
        make(**kw).check()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_every_dtype_a_pool_accepts_runs_its_copies_on_write(dtype):
    """A dtype the copy kernels cannot take must be refused when the pool is built: once
    the core has queued a copy, failing to run it leaves the pool changed and the copy lost."""
    try:
        pool = make(dtype=dtype)
    except InvalidArgumentError as e:
        assert dtype == torch.float64 and "float64" in str(e) and "float32" in str(e), str(e)
        return
    assert dtype != torch.float64, "a float64 pool was built"

    def put(res):
        s = res.for_layer(1)
        x = (s % 64).to(dtype).view(-1, 1, 1).expand(-1, 2, 8).contiguous()  # exact in every dtype
        pool.write(1, s, x, x)

    h = pool.open(1)
    put(pool.extend(h, P + 1))
    kid = pool.fork(int(h[0]), 1)
    put(pool.extend(kid, 1))  # the shared partial page is copied first
    parent, child = pool.slots(int(h[0]), 1), pool.slots(int(kid[0]), 1)
    assert child[P] != parent[P]
    got = pool.read(1, torch.from_numpy(child[: P + 1]))[0][:, 0, 0]
    assert torch.equal(got, torch.from_numpy(parent % 64).to(dtype))
    pool.check()


def test_grad_modes_every_tensor_is_normal_and_writes_work_in_every_mode():
    with torch.inference_mode():
        pool = make(max_requests=8)
    assert not audit(pool)
    for name, t in pool.named_tensors():
        assert not t.is_inference() and not t.requires_grad, name
    modes = [torch.inference_mode, torch.no_grad, torch.enable_grad]
    h = pool.open(3)
    for i, mode in enumerate(modes):
        with mode():
            res = pool.extend(h, 2)
            x = torch.randn(6, 2, 8, requires_grad=mode is torch.enable_grad)
            pool.write(1, res.for_layer(1), x, x)
            pool.write(0, res.for_layer(0), x, x)
            pool.fork(int(h[i]), 1)  # state copies run in the caller's mode
            assert torch.equal(pool.read(1, res.for_layer(1))[0], x.detach())
    for name, t in pool.named_tensors():
        assert not t.is_inference() and not t.requires_grad, name


def test_device_table_path_writes_what_the_core_writes():
    """Pools off the CPU scatter the core's slots into the tables; run that path on CPU."""
    a, b = make(handle_seed=1), make(handle_seed=1)
    b._tables_np = None
    tokens = np.arange(100, 140, dtype=np.int64)
    opened = []
    for pool in (a, b):
        h = pool.open(2)
        pool.extend(h, 8, tokens=np.concatenate([tokens[:8], tokens[:8]]))
        pool.cache(h)  # pages and a state checkpoint at 8, before the window moves on
        for _ in range(13):
            pool.extend(h, 1)
        f = pool.fork(int(h[0]), 1)
        pool.extend(f, 3)  # copy-on-write of the shared partial page
        g, cached = pool.open_with_prefix(tokens[:10], [10])
        assert cached[0] == 8
        opened.append(np.concatenate([h, f, g]))
    np.testing.assert_array_equal(opened[0], opened[1])
    for x in opened[0]:
        n = a.length(int(x))
        for layer in (0, 1):
            ra, rb = a.req_to_token[layer][a.rows([x])[0], :n].numpy(), b.req_to_token[layer][b.rows([x])[0], :n].numpy()
            # Positions the window released hold the null page's slots on both paths.
            np.testing.assert_array_equal(ra, a.slots(int(x), layer))
            np.testing.assert_array_equal(rb, ra)


def test_device_table_path_nulls_released_positions_of_reused_rows():
    """A row closed and reopened (admit, open) starts its nulls from position 0 again, and
    a long step releases many pages at once: the scattered tables still equal the core's."""
    a, b = make(handle_seed=2), make(handle_seed=2)
    b._tables_np = None
    for pool in (a, b):
        h = pool.open(1)
        pool.extend(h, 9)
        for _ in range(7):
            pool.extend(h, 1)
        pool.close(h)
        h2, _ = pool.admit([3])  # the same row, fresh
        pool.extend(h2, 20)  # one step past several pages of the window
        pool.extend(h2, 1)
        h3 = pool.open(1)
        pool.extend(h3, 2 * W + P)
        pool.extend(h3, 1)  # releases what the long step left behind the window
    for x in h2.tolist() + h3.tolist():
        n = a.length(x)
        for layer in (0, 3):  # the sliding layers
            rb = b.req_to_token[layer][b.rows([x])[0], :n].numpy()
            np.testing.assert_array_equal(rb, a.slots(x, layer))
            assert (a.slots(x, layer) < P).any()  # the window did release pages


def test_threads_share_one_hybrid_pool():
    """Request calls hold the pool's lock for the core call and the copies it queued."""
    import threading

    pool = make(max_requests=16, num_pages=256)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            rng = np.random.default_rng(seed)
            h = pool.open(2)
            for _ in range(30):
                fill(pool, pool.extend(h, int(rng.integers(1, 3))))
                pool.state(2, "conv")[pool.state_slots(h, 2)] = float(seed)
            kid = pool.fork(int(h[0]), 1)
            assert (pool.state(2, "conv")[pool.state_slots(kid, 2)] == float(seed)).all()
            for x in h:
                assert pool.held_tokens(int(x), 0) <= W + P
            pool.close(np.concatenate([h, kid]))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert pool.open_requests == 0
    pool.check()


@pytest.mark.parametrize("call", ["extend", "admit"])
def test_results_made_under_inference_mode_are_normal_tensors(call):
    """As the plain pool's ExtendResult: an engine may edit out_cache_loc in place (padding)
    outside inference mode after extending inside it."""
    pool = make()
    with torch.inference_mode():
        res = pool.extend(pool.open(1), 3) if call == "extend" else pool.admit([3])[1]
    for layer in (0, 1, 3):
        loc = res.for_layer(layer)
        assert not loc.is_inference()
        loc[0] = -1  # raises on an inference tensor outside inference mode
