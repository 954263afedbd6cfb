"""Bad inputs to kvpool.distributed: no process group, a group without this rank, timeouts
no backend can wait, a receiver whose reply no recv_request writes, pools of other hash
seeds, the same request sent twice.

Each is a typed error that says what was wrong and what would be right, before anything
changes; the checks that need no peer run in a fresh spawned process (no process group),
the rest on 2 gloo ranks (tests/_dist.py, hard timeouts). Rank bodies live in this module
(spawned children import it by name).
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

import kvpool
from kvpool.distributed import TPPool, agree_seed, kv_transfer, protocol, tp_pool
from kvpool.distributed.comm import MAX_TIMEOUT_S

sys.path.insert(0, str(Path(__file__).parent))
import _dist  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

P, HEADS, DIM = 4, 2, 4
PROMPT = list(range(40, 40 + 3 * P + 1))  # 3 full pages and one token


def make_pool(**kw: Any) -> kvpool.KVPool:
    return kvpool.KVPool(2, HEADS, DIM, **{"dtype": torch.float32, "page_size": P, "num_pages": 32,
                                           "max_requests": 8, "max_context_len": 64, **kw})


def rows(uid: int, n: int, layer: int) -> torch.Tensor:
    pos = torch.arange(n, dtype=torch.float32)[:, None, None]
    return uid * 1000 + pos + torch.arange(HEADS)[None, :, None] / 4 + torch.arange(DIM)[None, None, :] / 64 \
        + layer * 100


def request(pool: Any, uid: int, tokens: list[int] | None = None, n: int = 10) -> int:
    if tokens is None:
        h = int(pool.open(1)[0])
        pool.extend([h], n)
    else:
        hs, cached = pool.open_with_prefix(tokens, [len(tokens)])
        h, n = int(hs[0]), len(tokens)
        pool.extend([h], n - int(cached[0]), tokens=tokens[int(cached[0]):])
    slots = np.asarray(pool.slots(h))
    for layer in range(pool.num_layers):
        pool.write(layer, slots, rows(uid, n, layer), -rows(uid, n, layer))
    return h


def holds(pool: Any, h: int, uid: int) -> bool:
    slots = np.asarray(pool.slots(h))
    return all(torch.equal(pool.read(layer, slots)[0], rows(uid, len(slots), layer))
               for layer in range(pool.num_layers))


def catch(fn: Any) -> tuple:
    try:
        r = fn()
        return ("ok", r)
    except Exception as e:  # noqa: BLE001 - an untyped error is a finding, reported by its class
        return (type(e).__name__, str(e))


# ----- no process group (a fresh spawned process) -------------------------------------------------

def _without_a_group() -> dict[str, tuple]:
    pool = make_pool()
    h = int(pool.open(1)[0])
    return {
        "send": catch(lambda: kv_transfer.send_request(pool, h, 1)),
        "recv": catch(lambda: kv_transfer.recv_request(pool, 1)),
        "TPPool": catch(lambda: TPPool(pool)),
        "tp_pool": catch(lambda: tp_pool(2, HEADS, DIM, num_pages=8)),
        "tp_pool_seeded": catch(lambda: tp_pool(2, HEADS, DIM, num_pages=8, seed=3)),
        "agree_seed": catch(agree_seed),
        "not_a_pool": catch(lambda: kv_transfer.send_request("pool", 0, 1)),
        "not_a_pool_recv": catch(lambda: kv_transfer.recv_request(None, 1)),
        **{f"timeout_{t!r}": catch(lambda t=t: kv_transfer.recv_request(pool, 1, timeout_s=t))
           for t in (float("inf"), float("nan"), 1e300, MAX_TIMEOUT_S * 2, 0, -1)},
        "unchanged": ("ok", pool.stats().open_requests == 1 and pool.stats().used_pages == 0),
    }


def test_without_a_process_group_every_entry_point_says_to_initialize_one():
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as ex:
        got = ex.submit(_without_a_group).result(timeout=120)
    for name in ("send", "recv", "TPPool", "tp_pool", "tp_pool_seeded", "agree_seed"):
        assert got[name][0] == "InvalidArgumentError", (name, got[name])
        assert "init_process_group" in got[name][1], (name, got[name])
    assert got["not_a_pool"][0] == got["not_a_pool_recv"][0] == "InvalidArgumentError"
    assert "send_request takes a KVPool" in got["not_a_pool"][1]
    assert "recv_request takes a KVPool" in got["not_a_pool_recv"][1]
    for key in [k for k in got if k.startswith("timeout_")]:
        assert got[key][0] == "InvalidArgumentError" and "timeout_s" in got[key][1], (key, got[key])
        assert f"at most {MAX_TIMEOUT_S:g}" in got[key][1]
    assert got["unchanged"] == ("ok", True)


@pytest.mark.parametrize("timeout_s, ms", [(0.0005, 1), (1e-9, 1), (0.0011, 2), (0.5, 500), (2, 2000)])
def test_a_wait_asks_for_at_least_one_whole_millisecond(timeout_s, ms):
    """torch truncates a wait's timeout to milliseconds and takes zero as "no timeout":
    timeout_s=0.0005 against a silent peer waited until the peer exited. The wait asks for
    the timeout rounded up to whole milliseconds, at least one."""
    from kvpool.distributed.comm import wait

    asked = []

    class Work:
        def wait(self, timeout):
            asked.append(timeout)
            return False  # (what a timed-out gloo wait gives back)

    with pytest.raises(kvpool.TransferTimeoutError, match="did not answer"):
        wait(Work(), timeout_s, "recv", 1)
    assert asked[0].total_seconds() * 1000 == pytest.approx(ms)


def test_page_descriptors_refuse_what_is_not_a_plain_pool_by_name():
    from kvpool.distributed import page_descriptors

    hybrid = kvpool.KVPool(2, 1, 8, dtype=torch.float32, page_size=4, num_pages=8, sliding_window=8,
                           layer_types=["full_attention", "sliding_attention"])
    for obj, name in ((None, "NoneType"), ("pool", "str"), (hybrid, type(hybrid).__name__)):
        with pytest.raises(kvpool.InvalidArgumentError, match=f"page_descriptors needs a plain kvpool.KVPool.*{name}"):
            page_descriptors(obj, [1])
    pool = make_pool()
    assert page_descriptors(pool, [1, 2]).shape == (2 * 2, 3)  # K and V of 2 layers, one run each


# ----- two ranks --------------------------------------------------------------------------------

def _hostile_reply(pool: Any, status: int, cached: int) -> None:
    """Take a header (and its metadata) as recv_request does, then reply what no
    recv_request writes; take nothing after."""
    link = kv_transfer._Link(0, None, torch.device("cpu"), 20.0)
    header = link.recv_ints(protocol.HEADER_LEN, "header")
    n_meta, _ = protocol.meta_words(pool, header)
    if n_meta:
        link.recv_ints(n_meta, "meta")
    link.send_ints([status, cached, int(pool.free_pages), 0, 0, 0], "reply")


def ranks(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    outside = dist.new_group([0])  # (a collective: every rank makes it)
    if rank == 0:
        pool = make_pool(hash_seed=2)
        out["own_group"] = catch(lambda: tp_pool(2, HEADS, DIM, num_pages=8, group=outside, seed=1).tp_size)
        h = request(pool, 1)
        before = repr(pool.stats())
        # 1. Timeouts: one no backend can wait is refused after an abort header (the receiver
        # fails at once); the longest accepted one works.
        out["inf"] = catch(lambda: kv_transfer.send_request(pool, h, 1, timeout_s=float("inf")))
        out["longest"] = catch(lambda: kv_transfer.send_request(pool, h, 1, timeout_s=MAX_TIMEOUT_S)[1:4])
        # 2. The same request twice, then to a receiver of another hash seed that caches its prompt.
        out["twice"] = [catch(lambda: kv_transfer.send_request(pool, h, 1)[1:4]) for _ in range(2)]
        hp = request(pool, 2, PROMPT)
        out["other_seed"] = catch(lambda: kv_transfer.send_request(pool, hp, 1)[1:4])
        # 3. Replies no recv_request writes: a typed error, nothing sent, this pool unchanged.
        mid = repr(pool.stats())
        out["reply_-1"] = catch(lambda: kv_transfer.send_request(pool, h, 1, timeout_s=30))
        out["reply_past_chain"] = catch(lambda: kv_transfer.send_request(pool, hp, 1, timeout_s=30))
        out["reply_status"] = catch(lambda: kv_transfer.send_request(pool, h, 1, timeout_s=30))
        # 4. A header cut short (a peer of another format): the receiver reads the missing
        # words as zeros and refuses it.
        link = kv_transfer._Link(1, None, torch.device("cpu"), 20.0)
        header = np.zeros(protocol.HEADER_LEN, np.int64)
        header[protocol.H_MAGIC], header[protocol.H_VERSION], header[protocol.H_LENGTH] = protocol.MAGIC, \
            protocol.VERSION, 10
        for k, v in protocol.shape_fields(pool).items():
            header[k] = v
        link.send_ints(header[:8], "a truncated header")
        out["truncated"] = catch(lambda: int(link.recv_ints(protocol.REPLY_LEN, "reply")[0]))
        out["after_replies"] = catch(lambda: kv_transfer.send_request(pool, h, 1, timeout_s=20)[1:4])
        out["unchanged"] = repr(pool.stats()) == mid and before != mid
        pool.check()
        return out
    pool = make_pool(hash_seed=1)
    out["outside_tp_pool"] = catch(lambda: tp_pool(2, HEADS, DIM, num_pages=8, group=outside, seed=1))
    out["outside_send"] = catch(lambda: kv_transfer.send_request(pool, 0, 0, group=outside))
    out["outside_TPPool"] = catch(lambda: TPPool(pool, group=outside))
    before = repr(pool.stats())
    out["inf"] = catch(lambda: kv_transfer.recv_request(pool, 0, timeout_s=30))
    out["inf_unchanged"] = repr(pool.stats()) == before
    got = catch(lambda: kv_transfer.recv_request(pool, 0, timeout_s=MAX_TIMEOUT_S))
    out["longest"] = got[0] == "ok" and holds(pool, got[1], 1)
    hs = [kv_transfer.recv_request(pool, 0) for _ in range(2)]
    out["twice"] = len(set(hs)) == 2 and all(holds(pool, x, 1) for x in hs)
    pool.close(hs)
    # The prompt cached here with other rows: under another seed it is a miss (every page sent,
    # the sender's rows arrive), never this pool's rows under the sender's hashes.
    mine = request(pool, 9, PROMPT)
    pool.close([mine], cache=True)
    st = kv_transfer.recv_request_stats(pool, 0)
    out["other_seed"] = (st.cached_pages, holds(pool, st.handle, 2))
    pool.close([st.handle], cache=True)
    hs, cached = pool.open_with_prefix(PROMPT, [len(PROMPT)])  # this seed's index still finds the prompt
    out["own_seed_hit"] = int(cached[0])
    pool.close(hs)
    pool.check()
    _hostile_reply(pool, protocol.OK, -1)
    _hostile_reply(pool, protocol.OK, 4)  # the chain sent has 3 pages
    _hostile_reply(pool, 77, 0)
    before = repr(pool.stats())
    # (What the buffer of the next 16-word receive is likely to reuse: without zeroing, the
    # header's missing words would read as these 7s, an abort among them.)
    junk = torch.full((protocol.HEADER_LEN,), 7, dtype=torch.int64)
    del junk
    out["truncated"] = catch(lambda: kv_transfer.recv_request(pool, 0, timeout_s=20))
    out["truncated_unchanged"] = repr(pool.stats()) == before
    got = catch(lambda: kv_transfer.recv_request(pool, 0, timeout_s=20))
    out["after_replies"] = got[0] == "ok" and holds(pool, got[1], 1)
    return out


@pytest.fixture(scope="module")
def run():
    return _dist.run_ranks(ranks, world=2, timeout_s=150)


def test_a_group_without_this_rank_is_refused_by_name(run):
    snd, rcv = run
    assert snd["own_group"] == ("ok", 1)  # a member of a 1-rank group
    for key in ("outside_tp_pool", "outside_send", "outside_TPPool"):
        assert rcv[key][0] == "InvalidArgumentError" and "not a member" in rcv[key][1], (key, rcv[key])


def test_an_unbounded_timeout_is_refused_and_the_longest_one_works(run):
    snd, rcv = run
    assert snd["inf"][0] == "InvalidArgumentError" and f"at most {MAX_TIMEOUT_S:g}" in snd["inf"][1]
    assert rcv["inf"][0] == "TransferError" and "aborted" in rcv["inf"][1]  # told, not timed out
    assert rcv["inf_unchanged"]
    assert snd["longest"] == ("ok", (3, 0, 3 * 2 * 2 * P * HEADS * DIM * 4)) and rcv["longest"]


def test_the_same_request_twice_gives_two_requests(run):
    snd, rcv = run
    assert [s[0] for s in snd["twice"]] == ["ok", "ok"] and rcv["twice"]


def test_a_receiver_of_another_hash_seed_misses_and_takes_the_senders_rows(run):
    snd, rcv = run
    assert snd["other_seed"] == ("ok", (4, 0, 4 * 2 * 2 * P * HEADS * DIM * 4))
    assert rcv["other_seed"] == (0, True)
    assert rcv["own_seed_hit"] == 3 * P


@pytest.mark.parametrize("key,text", [("reply_-1", "-1 leading pages already cached, of a chain of 0"),
                                      ("reply_past_chain", "4 leading pages already cached, of a chain of 3"),
                                      ("reply_status", "status 77")])
def test_a_reply_no_receiver_writes_is_a_typed_error_before_any_page_moves(run, key, text):
    snd, rcv = run
    assert snd[key][0] == "TransferError" and "malformed reply" in snd[key][1] and text in snd[key][1], snd[key]
    assert snd["unchanged"]
    assert snd["after_replies"][0] == "ok" and rcv["after_replies"]  # nothing was left on the channel


def test_a_truncated_header_reads_as_zeros_and_is_refused_with_the_sender_told(run):
    snd, rcv = run
    assert snd["truncated"] == ("ok", protocol.INCOMPATIBLE)
    assert rcv["truncated"][0] == "TransferRejectedError" and "page bytes 0 vs 128" in rcv["truncated"][1]
    assert rcv["truncated_unchanged"]
