"""kvpool's KV events decoded with SGLang's schema, field by field, so that drift
on either side is caught in CI, where SGLang is not installed.

SGLang reads the int hash form only (``int_block_hashes=True``) and names
media and the salt its own way; docs/events-and-metrics.md lists the
differences, and these tests pin them."""

import enum
from typing import Any

import numpy as np
import pytest

import kvpool
from kvpool import _core

msgspec = pytest.importorskip("msgspec", reason="the events extra (msgspec) is not installed")


# Copied from SGLang 0.5.23, python/sglang/srt/disaggregation/kv_events.py (the
# event classes, unchanged but for the docstrings and `X | None` for Optional[X]).
class EventBatch(msgspec.Struct, array_like=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    pass


class StorageMedium(str, enum.Enum):
    GPU = "GPU"
    CPU = "CPU_PINNED"
    DISK = "DISK"
    EXTERNAL = "EXTERNAL"


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DEC = msgspec.msgpack.Decoder(KVEventBatch)
LOW64 = (1 << 64) - 1
MEDIA = ["GPU", "CPU", "STORAGE"]  # kvpool's (vLLM's) names, by medium code
SEED = 21


def admit(a, tokens, salt):
    h, c = a.open_with_prefix(tokens, [len(tokens)], salt=salt)
    a.extend(h, len(tokens) - int(c[0]))
    a.cache(h)
    return int(h[0])


def steps(P, host_pages):
    """Each step's drained event arrays over a short trace: salts, shared stems,
    evictions, swaps to the host, a clear."""
    a = kvpool.SlotAllocator(40 if P == 16 else 160, P, 8, 32 * P, hash_seed=SEED, host_pages=host_pages)
    rng = np.random.default_rng(P + host_pages)
    stems = [rng.integers(0, 50, size=3 * P + 1) for _ in range(3)]
    open_, out = [], []
    for step in range(120):
        try:
            if step % 40 == 39:
                a.clear_cache()
            elif open_ and step % 3 == 2:
                h = open_.pop(0)
                if host_pages and step % 2:  # a round trip to the host: Stored and Removed in "CPU"
                    a.swap_out(np.array([h]))
                    a.swap_in(np.array([h]))
                a.close(np.array([h]), cache=True)
            else:
                tail = rng.integers(0, 50, size=int(rng.integers(1, 2 * P)))
                open_.append(admit(a, np.concatenate([stems[step % 3], tail]), salt=step % 3 - 1))
            if step % 7 == 6:
                a.evict(int(rng.integers(1, 8)))
        except (kvpool.PoolExhaustedError, kvpool.TooManyRequestsError):
            pass
        ev = a.take_events()
        if len(ev["kind"]):
            out.append(ev)
    a.check()
    return out


def pages_of(ev):
    """One (kind, hash, parent, tokens, size, medium) per kvpool event."""
    tok, out = 0, []
    for i, kind in enumerate(ev["kind"]):
        n = int(ev["num_tokens"][i]) if kind == 0 else 0
        medium = MEDIA[int(ev["medium"][i])] if "medium" in ev else "GPU"
        out.append((int(kind), int(ev["hash_lo"][i]), int(ev["parent_hi"][i]) << 64 | int(ev["parent_lo"][i]),
                    [int(t) for t in ev["token_ids"][tok:tok + n]], n, medium))
        tok += n
    return out


@pytest.mark.parametrize("P,host_pages", [(1, 0), (16, 0), (1, 40), (16, 24)])
def test_sglangs_classes_decode_every_field_of_the_int_form(P, host_pages):
    seen = set()
    for k, ev in enumerate(steps(P, host_pages)):
        rank = None if k % 2 else k
        batch = DEC.decode(_core.encode_kv_events(ev, 3.5, rank, int_block_hashes=True)[0])
        assert (batch.ts, batch.attn_dp_rank) == (3.5, rank)
        want, q = pages_of(ev), 0
        for e in batch.events:
            seen.add((type(e).__name__, getattr(e, "medium", None)))
            if isinstance(e, AllBlocksCleared):
                assert want[q][0] == 2
                q += 1
                continue
            run, q = want[q:q + len(e.block_hashes)], q + len(e.block_hashes)
            assert e.block_hashes == [w[1] for w in run], "each hash: the low 64 bits, unsigned"
            assert all(0 <= h <= LOW64 for h in e.block_hashes)
            assert e.medium == run[0][5] and {w[5] for w in run} == {e.medium}
            if isinstance(e, BlockRemoved):
                assert {w[0] for w in run} == {1}
                continue
            assert {w[0] for w in run} == {0}
            parent = run[0][2]
            assert e.parent_block_hash == (None if parent == 0 else parent & LOW64)
            seen.add(("parent", e.parent_block_hash is not None))
            assert e.token_ids == [t for w in run for t in w[3]] and e.block_size == P == run[0][4]
            # The salt reaches SGLang only inside the hashes (it has no field for
            # an int salt; cache_salt is a request's str).
            assert (e.lora_id, e.lora_name, e.cache_salt, e.session_id) == (None, None, None, None)
        assert q == len(want)
    assert {("BlockStored", "GPU"), ("BlockRemoved", "GPU"), ("AllBlocksCleared", None), ("parent", True)} <= seen
    if host_pages:
        # kvpool sends vLLM's "CPU"; SGLang's own producer says "CPU_PINNED".
        assert ("BlockStored", "CPU") in seen and StorageMedium.CPU.value == "CPU_PINNED"


def test_the_batch_is_always_three_elements_as_sglang_and_vllm_send_it():
    """Both engines' publishers always send [ts, events, rank] (SGLang's EventBatch
    never omits the rank; vLLM's publisher always fills one in), and a consumer
    that reads the batch as a 3-tuple (a Rust router with serde) refuses a
    2-element array. kvpool sends nil for a rank of None."""
    ev = steps(4, 0)[0]
    for rank in (None, 0, 7):
        payload = _core.encode_kv_events(ev, 1.25, rank, int_block_hashes=True)[0]
        raw = msgspec.msgpack.decode(payload)
        assert len(raw) == 3 and raw[2] == rank
        theirs = msgspec.msgpack.encode(KVEventBatch(ts=1.25, events=DEC.decode(payload).events, attn_dp_rank=rank))
        assert msgspec.msgpack.decode(theirs)[::2] == raw[::2], "SGLang's encoder: [ts, events, rank] too"
    empty = kvpool.SlotAllocator(8, 4, 2, 64).take_events_msgpack(2.0)[0]
    assert msgspec.msgpack.decode(empty) == [2.0, [], None]


def test_the_bytes_form_is_refused_by_sglang_and_a_clear_alone_is_not():
    ev = steps(4, 0)[0]
    with pytest.raises(msgspec.ValidationError, match="Expected `int`, got `bytes`"):
        DEC.decode(_core.encode_kv_events(ev, 1.0)[0])
    a = kvpool.SlotAllocator(8, 4, 2, 64)
    a.clear_cache()
    assert DEC.decode(a.take_events_msgpack(1.0)[0]).events == [AllBlocksCleared()]


def test_zmq_frames_and_replay_as_sglangs_subscriber_reads_them():
    """Requests and answers as SGLang's ZmqEventPublisher._service_replay has them."""
    zmq = pytest.importorskip("zmq", reason="the events extra (pyzmq) is not installed")
    from kvpool.events import ZmqEventPublisher

    a = kvpool.SlotAllocator(64, 4, 8, 256, hash_seed=SEED)
    with ZmqEventPublisher(a, "inproc://kvpool-sglang-pub", replay_endpoint="inproc://kvpool-sglang-replay",
                           topic="kv", data_parallel_rank=1, int_block_hashes=True) as pub:
        for i in range(3):
            admit(a, np.arange(10 * i, 10 * i + 9), salt=0)
            pub.publish()
        pub.flush()
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        try:
            dealer.connect("inproc://kvpool-sglang-replay")
            dealer.send_multipart((b"", (1).to_bytes(8, "big")))
            got = []
            while True:
                assert dealer.poll(5000), "the replay service did not answer"
                frames = dealer.recv_multipart()
                assert len(frames) == 4 and frames[0] == b""
                if frames[2] == (-1).to_bytes(8, "big", signed=True):
                    assert frames[1] == frames[3] == b""
                    break
                assert frames[1] == b"kv"
                got.append((int.from_bytes(frames[2], "big"), DEC.decode(frames[3]).attn_dp_rank))
        finally:
            dealer.close(linger=0)
    assert got == [(1, 1), (2, 1)]
