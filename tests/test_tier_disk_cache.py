"""DiskCache over FileTier: prefixes written by one pool come back bitwise into another (a
new process included), and nothing read from disk is trusted: a wrong fingerprint, a
truncated or corrupted file, swapped names, a record for other tokens, salt or parent
under a hash all end the hit at that page, with the K/V before it exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import kvpool
from kvpool.tiers import DiskCache, FileTier, PageRecord
from kvpool.tiers.backend import encode

P = 4
LAYERS = 2


def make_pool(dtype=torch.bfloat16, heads=2, mla=False, hash_seed=None, num_pages=32, **kw):
    if mla:
        return kvpool.KVPool(LAYERS, 1, 24, kv_lora_rank=16, qk_rope_head_dim=8, dtype=dtype, page_size=P,
                             num_pages=num_pages, hash_seed=hash_seed, max_requests=8, max_context_len=128, **kw)
    return kvpool.KVPool(LAYERS, heads, 8, dtype=dtype, page_size=P, num_pages=num_pages, hash_seed=hash_seed,
                         max_requests=8, max_context_len=128, **kw)


def prefill(pool, tokens, seed=0, salt=None):
    """Prefill one prompt past its cached prefix with random K/V and publish its pages;
    returns each layer's K/V bits over the whole prompt."""
    h, cached = pool.open_with_prefix(tokens, [len(tokens)], salt)
    slots = pool.extend(h, [len(tokens) - int(cached[0])]).slots
    gen = torch.Generator().manual_seed(seed)
    heads, dim = pool.num_kv_heads, pool.head_dim
    for layer in range(LAYERS):
        k = torch.randn(len(slots), heads, dim, generator=gen).to(pool.compute_dtype)
        if pool.mla:
            pool.write(layer, slots, k)
        else:
            pool.write(layer, slots, k, torch.randn(len(slots), heads, dim, generator=gen).to(pool.compute_dtype))
    want = kv_bits(pool, pool.slots(h[0]))
    pool.close(h, cache=True)
    return want


def kv_bits(pool, slots):
    out = []
    for layer in range(LAYERS):
        k, v = pool.read(layer, np.asarray(slots))
        n = len(slots)
        out.append(torch.cat([k.reshape(n, k.shape[1] * k.shape[2]), v.reshape(n, v.shape[1] * v.shape[2])], 1)
                   .view(torch.uint8))
    return torch.stack(out)


def hit(pool, tokens, salt=None):
    """open_with_prefix's cached length, and the K/V bits of those positions."""
    h, cached = pool.open_with_prefix(tokens, [len(tokens)], salt)
    n = int(cached[0])
    got = kv_bits(pool, pool.slots(h[0])[:n])
    pool.close(h)
    return n, got


TOKENS = np.arange(1000, 1018, dtype=np.int32)  # 18 tokens: 4 full pages usable by a hit


@pytest.fixture
def stored(tmp_path):
    """A 4-page prefix stored on disk by one pool."""
    src = make_pool(hash_seed=11)
    want = prefill(src, TOKENS, seed=1)
    tier = FileTier(tmp_path, 1 << 20)
    dc = DiskCache(src, tier, model="m")
    assert dc.store_new() == 4 and dc.stats.pages_stored == 4
    return tier, want


@pytest.mark.parametrize("layout", ["token", "paged"])
def test_another_pool_gets_bitwise_hits(stored, layout):
    tier, want = stored
    dst = make_pool(hash_seed=22, layout=layout)  # another hash seed: names do not use the pool's
    dc = DiskCache(dst, tier, model="m")
    assert hit(dst, TOKENS)[0] == 0
    assert dc.prefetch(TOKENS) == 4 and dc.stats.pages_loaded == 4
    n, got = hit(dst, TOKENS)
    assert n == 16 and torch.equal(got, want[:, :16])
    assert dc.prefetch(TOKENS) == 0  # already cached: nothing read
    dst.check()
    assert dst.open_requests == 0


def test_the_prompts_last_token_is_never_loaded(stored):
    tier, want = stored
    dst = make_pool()
    assert DiskCache(dst, tier, model="m").prefetch(TOKENS[:16]) == 3  # a 16-token prompt uses 3 pages
    assert hit(dst, TOKENS)[0] == 12


def test_only_the_missing_pages_are_loaded(stored):
    tier, want = stored
    dst = make_pool()
    prefill(dst, TOKENS[:9], seed=1)  # the same first 2 pages computed here (same seed, same values)
    assert hit(dst, TOKENS)[0] == 8
    dc = DiskCache(dst, tier, model="m")
    assert dc.prefetch(TOKENS) == 2
    n, got = hit(dst, TOKENS)
    assert n == 16 and torch.equal(got[:, 8:], want[:, 8:16])


def test_with_no_free_request_row_prefetch_loads_nothing(stored, monkeypatch):
    """As documented (it raised TooManyRequestsError, after reading the backend); also when
    another thread takes the last row between the check and the open."""
    tier, _ = stored
    dst = make_pool()
    busy = dst.open(8)  # every row, with free pages to spare
    dc = DiskCache(dst, tier, model="m")
    read = []
    monkeypatch.setattr(dc, "_read", lambda *a: read.append(a) or DiskCache._read(dc, *a))
    assert dc.prefetch(TOKENS) == 0 and not read  # the backend was not read
    dst.close(busy[:1])
    real = dst.open_with_chain_hashes

    def lose_the_row(*a, **k):
        dst.open(1)  # another thread takes it first
        return real(*a, **k)

    monkeypatch.setattr(dst, "open_with_chain_hashes", lose_the_row)
    assert dc.prefetch(TOKENS) == 0
    assert dst.open_requests == 8 and dst.cached_pages == 0
    dst.check()


@pytest.mark.parametrize("other", [dict(dtype=torch.float16), dict(heads=1), dict(mla=True)],
                         ids=["dtype", "heads", "mla"])
def test_a_pool_of_another_shape_misses(stored, other):
    tier, _ = stored
    dst = make_pool(**other)
    dc = DiskCache(dst, tier, model="m")
    assert dc.prefetch(TOKENS) == 0 and dc.stats.pages_missed == 1  # other names: not even read
    assert hit(dst, TOKENS)[0] == 0
    assert tier.stored == 4 and len(list(tier.path.glob("*/*.kvp"))) == 4  # nothing removed


def test_another_model_or_salt_misses(stored):
    tier, _ = stored
    dst = make_pool()
    assert DiskCache(dst, tier, model="other-model").prefetch(TOKENS) == 0
    dc = DiskCache(dst, tier, model="m")
    assert dc.prefetch(TOKENS, salt=5) == 0 and dc.stats.pages_missed == 1  # the salt is in the hash
    assert hit(dst, TOKENS, salt=5)[0] == 0 and hit(dst, TOKENS)[0] == 0


def _files(tier, tokens, salt=0):
    from kvpool._core import page_hashes
    from kvpool.tiers import shape_fingerprint
    from kvpool.tiers.backend import page_key, tier_seed

    w = page_hashes(tokens[:16], P, tier_seed(shape_fingerprint(make_pool(), "m")), salt)
    return [tier.file_for(page_key(w[2 * i], w[2 * i + 1])) for i in range(4)], [
        page_key(w[2 * i], w[2 * i + 1]) for i in range(4)]


def _rewrite(tier, f, **change):
    """Re-encode the record in ``f`` with some fields changed: an intact, checksummed file."""
    rec = tier.get(int(f.stem, 16))
    fields = dict(page_hash=rec.page_hash, parent_hash=rec.parent_hash, salt=rec.salt, tokens=rec.tokens,
                  fingerprint=rec.fingerprint, payload=rec.payload)
    fields.update(change)
    f.write_bytes(encode(PageRecord(**fields)))


def damage_cases():
    def truncate(tier, files, keys):
        files[2].write_bytes(files[2].read_bytes()[:-100])
        return 2

    def flip(tier, files, keys):
        b = bytearray(files[1].read_bytes())
        b[len(b) // 2] ^= 0x10
        files[1].write_bytes(bytes(b))
        return 1

    def swap(tier, files, keys):
        a, b = files[1].read_bytes(), files[2].read_bytes()
        files[1].write_bytes(b)
        files[2].write_bytes(a)
        return 1

    def delete(tier, files, keys):
        files[3].unlink()
        return 3

    def other_tokens(tier, files, keys):  # a collision: another page's record under this hash
        _rewrite(tier, files[2], tokens=np.arange(4, dtype=np.int32))
        return 2

    def other_salt(tier, files, keys):
        _rewrite(tier, files[0], salt=9)
        return 0

    def other_parent(tier, files, keys):
        _rewrite(tier, files[3], parent_hash=keys[1])
        return 3

    def other_fingerprint(tier, files, keys):
        _rewrite(tier, files[1], fingerprint=bytes(16))
        return 1

    def short_payload(tier, files, keys):
        rec = tier.get(keys[2])
        _rewrite(tier, files[2], payload=rec.payload[:-2])
        return 2

    def garbage(tier, files, keys):
        files[0].write_bytes(os.urandom(3000))
        return 0

    return [truncate, flip, swap, delete, other_tokens, other_salt, other_parent, other_fingerprint, short_payload,
            garbage]


@pytest.mark.parametrize("damage", damage_cases(), ids=lambda f: f.__name__)
def test_a_damaged_or_foreign_file_ends_the_hit_there(stored, damage):
    tier, want = stored
    files, keys = _files(tier, TOKENS)
    good = damage(tier, files, keys)
    dst = make_pool()
    dc = DiskCache(dst, tier, model="m")
    assert dc.prefetch(TOKENS) == good
    assert dc.stats.pages_missed + dc.stats.pages_rejected == 1
    assert not files[good].exists()  # damage is dropped, so a later store can write the page there
    n, got = hit(dst, TOKENS)
    assert n == good * P and torch.equal(got, want[:, : good * P])
    dst.check()


def test_fp8_scales_are_part_of_the_fingerprint(tmp_path):
    src = make_pool(dtype=torch.float8_e4m3fn)
    src.k_scale.fill_(0.5)
    want = prefill(src, TOKENS)
    tier = FileTier(tmp_path, 1 << 20)
    DiskCache(src, tier).store_new()
    other = make_pool(dtype=torch.float8_e4m3fn)  # scales 1: the same bytes would mean other values
    assert DiskCache(other, tier).prefetch(TOKENS) == 0
    same = make_pool(dtype=torch.float8_e4m3fn)
    same.k_scale.fill_(0.5)
    assert DiskCache(same, tier).prefetch(TOKENS) == 4
    n, got = hit(same, TOKENS)
    assert n == 16 and torch.equal(got, want[:, :16])


def test_mla_pool_round_trip(tmp_path):
    src = make_pool(mla=True)
    want = prefill(src, TOKENS, seed=4)
    tier = FileTier(tmp_path, 1 << 20)
    assert DiskCache(src, tier).store_new() == 4
    dst = make_pool(mla=True)
    assert DiskCache(dst, tier).prefetch(TOKENS) == 4
    n, got = hit(dst, TOKENS)
    assert n == 16 and torch.equal(got, want[:, :16])


def test_stale_events_never_store_reused_pages(tmp_path):
    pool = make_pool(num_pages=6)  # 5 usable pages
    prefill(pool, TOKENS)
    events = pool.take_events()
    pool.clear_cache()  # the pages go back to the free list...
    prefill(pool, TOKENS + 1, seed=2)  # ...and get other tokens' K/V
    tier = FileTier(tmp_path, 1 << 20)
    dc = DiskCache(pool, tier)
    assert dc.store_new(events) == 0  # the old chain is no longer registered
    assert dc.stats.chains_skipped == 1 and list(tmp_path.glob("*/*.kvp")) == []
    assert dc.store_new() == 4  # the new chain, from the pool's own events
    pool.check()
    assert pool.open_requests == 0


def test_stored_pages_are_written_once_and_max_pages_carries_over(tmp_path):
    pool = make_pool()
    prefill(pool, TOKENS)
    prefill(pool, TOKENS[:8].tolist() + list(range(50, 60)), seed=3)  # shares the first 2 pages
    tier = FileTier(tmp_path, 1 << 20)
    dc = DiskCache(pool, tier)
    assert dc.store_new(max_pages=3) == 3
    assert dc.store_new() == 3  # 4 + 2 new pages of the second prompt = 6 in all
    assert dc.store_new() == 0 and tier.stored == 6
    prefill(pool, TOKENS)  # a hit: no new registration, nothing to write
    assert dc.store_new() == 0


def test_removed_and_cleared_events_forget_chains(tmp_path):
    pool = make_pool()
    dc = DiskCache(pool, FileTier(tmp_path, 1 << 20))
    prefill(pool, TOKENS)
    dc._absorb(pool.take_events())
    assert len(dc._entries) == 4
    pool.evict(2)
    dc._absorb(pool.take_events())
    assert len(dc._entries) == 2 and len(dc._pending) == 2
    pool.clear_cache()
    dc._absorb(pool.take_events())
    assert dc._entries == {} and dc._pending == {}


def test_no_room_gives_up_and_leaves_the_pool_as_it_was(stored):
    tier, _ = stored
    dst = make_pool(num_pages=6)
    held, _ = dst.open_with_prefix(np.arange(17, dtype=np.int32), [17])
    dst.extend(held, [17])  # all 5 usable pages held
    before = (dst.free_pages, dst.open_requests, dst.cached_pages)
    assert DiskCache(dst, tier, model="m").prefetch(TOKENS) == 0
    assert (dst.free_pages, dst.open_requests, dst.cached_pages) == before
    dst.check()


def test_store_and_prefetch_bounded_by_the_tier(tmp_path):
    pool = make_pool()
    tier = FileTier(tmp_path, 2 * 1024)  # room for a few pages only (each ~ 600 bytes here)
    dc = DiskCache(pool, tier)
    for i in range(5):
        prefill(pool, TOKENS + 100 * i, seed=i)
        dc.store_new()
    assert sum(f.stat().st_size for f in tmp_path.glob("*/*.kvp")) <= tier.max_bytes
    assert tier.evicted > 0


SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np, torch
    sys.path.insert(0, sys.argv[3])
    from test_tier_disk_cache import TOKENS, hit, make_pool, prefill
    from kvpool.tiers import DiskCache, FileTier
    role, path = sys.argv[1], sys.argv[2]
    tier = FileTier(path, 64 * 1024)
    prompts = [TOKENS, np.concatenate([TOKENS[:8], np.arange(7, 17, dtype=np.int32)])]
    if role == "write":
        pool = make_pool()
        want = [prefill(pool, t, seed=i) for i, t in enumerate(prompts)]
        stored = DiskCache(pool, tier, model="llama").store_new()
        torch.save(want, path + ".want")
        print(json.dumps({"stored": stored}))
    else:
        want = torch.load(path + ".want")
        pool = make_pool()
        dc = DiskCache(pool, tier, model="llama")
        loaded = [dc.prefetch(t) for t in prompts]
        hits = [hit(pool, t) for t in prompts]
        other = make_pool(dtype=torch.float16)
        other_loaded = DiskCache(other, tier, model="llama").prefetch(TOKENS)
        print(json.dumps({"loaded": loaded, "cached": [n for n, _ in hits], "other_loaded": other_loaded,
                          "other_cached": hit(other, TOKENS)[0],
                          "bitwise": [bool(torch.equal(g, w[:, :n])) for (n, g), w in zip(hits, want)]}))
""")


def test_a_new_process_hits_what_an_earlier_one_wrote(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(kvpool.__file__).resolve().parent.parent), env.get("PYTHONPATH", "")])
    out = {}
    for role in ("write", "read"):
        proc = subprocess.run([sys.executable, "-c", SCRIPT, role, str(tmp_path / "tier"), str(Path(__file__).parent)],
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        out[role] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["write"]["stored"] == 4 + 2  # the second prompt shares 2 pages and adds 2
    r = out["read"]
    assert r["loaded"] == [4, 2] and r["cached"] == [16, 16] and all(r["bitwise"])
    assert r["other_loaded"] == 0 and r["other_cached"] == 0
    assert sum(f.stat().st_size for f in (tmp_path / "tier").glob("*/*.kvp")) <= 64 * 1024


def test_two_models_share_a_directory(tmp_path):
    """Same shape, same prompt, other model: each gets its own pages back (names differ,
    so neither store skips or overwrites the other's)."""
    tier = FileTier(tmp_path, 1 << 20)
    want = {}
    for i, model in enumerate(("model-a", "model-b")):
        src = make_pool()
        want[model] = prefill(src, TOKENS, seed=10 + i)
        assert DiskCache(src, tier, model=model).store_new() == 4
    for model in ("model-b", "model-a"):
        dst = make_pool()
        assert DiskCache(dst, tier, model=model).prefetch(TOKENS) == 4
        n, got = hit(dst, TOKENS)
        assert n == 16 and torch.equal(got, want[model][:, :16])


@pytest.mark.parametrize("tokens, match", [
    ([2**32 + 1000 + i for i in range(18)], "token id"),  # int32 would wrap these onto TOKENS
    ([-1] + list(range(17)), "token id"),
    ([float(t) + 0.5 for t in TOKENS], "int"),
    ([list(TOKENS[:9]), list(TOKENS[9:])], "1-D"),
    ("abc", "int"),
], ids=["past_int32", "negative", "floats", "2d", "str"])
def test_prompts_that_are_not_token_ids_are_typed_and_load_nothing(stored, tokens, match):
    tier, _ = stored
    dst = make_pool()
    dc = DiskCache(dst, tier, model="m")
    with pytest.raises(kvpool.InvalidArgumentError, match=match):
        dc.prefetch(tokens)
    assert (dst.cached_pages, dst.open_requests, dc.stats.pages_loaded) == (0, 0, 0)


def test_bad_backend_and_scan_interval_are_typed(tmp_path):
    with pytest.raises(kvpool.InvalidArgumentError, match="TierBackend"):
        DiskCache(make_pool(), str(tmp_path))
    for bad in ("1", float("nan"), -1.0, True):
        with pytest.raises(kvpool.InvalidArgumentError, match="scan_interval_s"):
            FileTier(tmp_path, 1 << 20, scan_interval_s=bad)


def test_a_pool_with_room_for_part_of_the_prefix_loads_that_part(stored):
    """Room is the pool's free pages, which count its evictable cached pages already: the
    prefetch loads the pages that fit (evicting those cached ones), not nothing."""
    tier, want = stored
    dst = make_pool(num_pages=6)  # 5 usable pages
    held, _ = dst.open_with_prefix(np.arange(8, dtype=np.int32), [8])
    dst.extend(held, [8])  # 2 pages held
    prefill(dst, np.arange(500, 512, dtype=np.int32), seed=3)  # 3 pages cached, evictable
    assert (dst.free_pages, dst.evictable_pages) == (3, 3)
    assert DiskCache(dst, tier, model="m").prefetch(TOKENS) == 3
    n, got = hit(dst, TOKENS)
    assert n == 3 * P and torch.equal(got, want[:, : 3 * P])
    dst.check()
