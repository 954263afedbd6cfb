"""kvpool's KV events decoded as NVIDIA Dynamo's KV router reads vLLM's stream
(``lib/kv-router``'s ZMQ wire types, written here as msgspec structs): each
``extra_keys`` entry is a list of strings (MM digests, a LoRA name, a cache salt),
block hashes are 64-bit ints (signed or unsigned) and the batch is a 3-tuple.

Was: a salted page's key went out as an int (``extra_keys = [[7]]``), so such a
consumer refused every batch that held a salted page, and with it the Removed
events and the pages of every other request in that batch."""

import numpy as np
import pytest

import kvpool
from kvpool import _core
from kvpool.errors import InvalidArgumentError

msgspec = pytest.importorskip("msgspec", reason="the events extra (msgspec) is not installed")
from kvpool.events import LocalEventPublisher  # noqa: E402
from kvpool.router import Router  # noqa: E402

P, SEED = 4, 11


class Batch(msgspec.Struct, array_like=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list
    data_parallel_rank: int | None


class Event(msgspec.Struct, tag=True, gc=False):  # type: ignore[call-arg]
    pass


class BlockStored(Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[str] | None] | None = None


class BlockRemoved(Event):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(Event):
    pass


class DynamoBatch(Batch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DEC = msgspec.msgpack.Decoder(DynamoBatch)


def admit(a, tokens, salt):
    h, c = a.open_with_prefix(tokens, [len(tokens)], salt=salt)
    a.extend(h, len(tokens) - int(c[0]))
    a.close(h, cache=True)


@pytest.mark.parametrize("salt", [7, -3, 2**63 - 1, -(2**63)])
def test_a_salted_batch_decodes_with_dynamos_types(salt):
    a = kvpool.SlotAllocator(32, P, 4, 64, hash_seed=SEED)
    pub = LocalEventPublisher(a, int_block_hashes=True)
    admit(a, np.arange(100, 113), salt)
    admit(a, np.arange(200, 209), 0)
    a.evict(1)
    assert pub.publish() == 6
    ((_, _, payload),) = pub.drain()
    b = DEC.decode(payload)
    s0, s1, r = b.events
    assert isinstance(s0, BlockStored) and isinstance(s1, BlockStored) and isinstance(r, BlockRemoved)
    assert s0.extra_keys == [[str(salt)]] * 3 and s1.extra_keys is None
    assert s0.token_ids == list(range(100, 112)) and s0.block_size == P
    # The hashes are the pool's own (low 64 bits), under the salt.
    words = _core.page_hashes(np.arange(100, 113), P, SEED, salt)
    assert s0.block_hashes == [int(x) for x in words[1::2]]


def test_the_router_reads_the_str_salt_and_the_int_of_older_publishers():
    """Router rehashes a root page with its salt: from the str kvpool sends now, and
    from the int older kvpool versions sent; both route the salted prompt."""
    from kvpool.events import schema

    a = kvpool.SlotAllocator(32, P, 4, 64, hash_seed=SEED)
    pub = LocalEventPublisher(a)
    admit(a, np.arange(100, 113), 5)
    pub.publish()
    ((topic, seq, payload),) = pub.drain()
    r = Router(1, page_size=P, hash_seed=SEED)
    assert r.feed(0, topic, seq, payload) == 1
    assert r.route(np.arange(100, 113), salt=5).cached_tokens == 12
    assert r.route(np.arange(100, 113), salt=0).cached_tokens == 0

    old = schema.decoder().decode(payload)
    (ev,) = old.events
    assert ev.extra_keys == [("5",)] * 3
    ev = msgspec.structs.replace(ev, extra_keys=[(5,)] * 3)  # what kvpool sent before
    older = schema.msgspec.msgpack.encode(schema.KVEventBatch(ts=old.ts, events=[ev]))
    r2 = Router(1, page_size=P, hash_seed=SEED)
    assert r2.feed(0, topic, seq, older) == 1
    assert r2.route(np.arange(100, 113), salt=5).cached_tokens == 12
    for bad in ("--5", "5-", "٣", " 5", "99999999999999999999", "0x5"):
        # Not a decimal int64: a typed refusal, the router unchanged ("--5" raised int()'s ValueError).
        bent = schema.msgspec.msgpack.encode(schema.KVEventBatch(
            ts=old.ts, events=[msgspec.structs.replace(ev, extra_keys=[(bad,)] * 3)]))
        r3 = Router(1, page_size=P, hash_seed=SEED)
        with pytest.raises(InvalidArgumentError):
            r3.feed(0, topic, seq, bent)
        assert r3.route(np.arange(100, 113), salt=5).cached_tokens == 0
