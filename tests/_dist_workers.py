"""Per-rank bodies of the multi-process tests (spawned by tests/_dist.py; importable by name)."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import kvpool
from kvpool.demo.engine import Engine
from kvpool.demo.model import ModelConfig, build_model
from kvpool.demo.requests import synthetic_requests
from kvpool.distributed import RankDivergenceError, TransferError, TransferRejectedError, chunks, kv_transfer, tp_pool

CFG = ModelConfig(vocab_size=96, hidden=32, layers=2, heads=4, kv_heads=2, max_positions=80, seed=3)
MAX_CTX = 80


def make_pool(page_size: int, pages: int, **kw: Any) -> kvpool.KVPool:
    kw.setdefault("dtype", torch.float32)
    return kvpool.KVPool(CFG.layers, kw.pop("kv_heads", CFG.kv_heads), kw.pop("head_dim", CFG.head_dim),
                         page_size=page_size, num_pages=pages, max_requests=4, max_context_len=MAX_CTX, **kw)


def snapshot(pool: Any) -> tuple[int, ...]:
    a = pool.allocator
    a.check()
    return (a.free_pages, a.used_pages, a.open_requests, a.used_slots)


# ----- tensor parallelism ---------------------------------------------------------------

def serve(model: Any, pool: Any, n: int = 6) -> list[dict[str, Any]]:
    reqs = synthetic_requests(n, vocab_size=CFG.vocab_size, prompt_len=(2, 20), output_len=(1, 10), seed=5)
    engine = Engine(model, pool, max_running=3, record=True)
    with torch.inference_mode():
        engine.run(reqs)
    return [{"rid": r.rid, "logits": torch.cat(r.logits), "output": list(r.output)} for r in reqs]


def tp_logits(rank: int, world: int, page_sizes: tuple[int, ...]) -> dict[int, Any]:
    return {P: _tp_logits(rank, world, P) for P in page_sizes}


def _tp_logits(rank: int, world: int, page_size: int) -> dict[str, Any]:
    from kvpool.demo.tp import shard_model

    model = shard_model(build_model(CFG), rank, world)
    # 48 tokens of pool: admission waits for room, so pages are reused across requests.
    pool = tp_pool(CFG.layers, CFG.kv_heads, CFG.head_dim, dtype=torch.float32, page_size=page_size,
                   num_pages=-(-48 // page_size) + 1, max_requests=4, max_context_len=MAX_CTX, check_every=2)
    out = serve(model, pool)
    pool.verify()
    digest = pool.digest()
    snap = snapshot(pool)
    shape = tuple(pool.k_buffer(0).shape)
    # Divergence: rank 1 makes one call the others do not.
    if rank == 1:
        pool.open(1)
    try:
        pool.verify()
        caught: Any = None
    except RankDivergenceError as e:
        caught = (e.rank, e.ranks, str(e))
    return {"requests": out, "digest": digest, "snapshot": snap, "caught": caught, "shape": shape,
            "calls": pool.calls, "head_start": pool.kv_head_start}


# ----- moving a request -----------------------------------------------------------------

def prefill(model: Any, pool: Any, prompt: np.ndarray) -> tuple[int, torch.Tensor]:
    h = int(pool.open(1)[0])
    ext = pool.extend([h], len(prompt))
    ids = torch.from_numpy(prompt)[None]
    pos = torch.arange(len(prompt))[None]
    rows = torch.tensor([pool.rows([h])[0]])
    logits = model.forward_pool(pool, ids, pos, rows, ext.out_cache_loc, len(prompt))[0]
    return h, logits


def decode(model: Any, pool: Any, h: int, first: int, steps: int) -> torch.Tensor:
    tok, out = first, []
    for _ in range(steps):
        ext = pool.extend([h], 1)
        n = int(pool.length(h))
        logits = model.forward_pool(pool, torch.tensor([[tok]]), torch.tensor([[n - 1]]),
                                    torch.tensor([pool.rows([h])[0]]), ext.out_cache_loc, n)[0, -1]
        out.append(logits)
        tok = int(logits.argmax())
    return torch.stack(out)


PROMPTS = [np.random.default_rng(i).integers(0, CFG.vocab_size, size=n) for i, n in enumerate((5, 17, 33, 48))]
STEPS = 6


def single_process(page_size: int) -> list[torch.Tensor]:
    """The reference: prefill and decode on one pool."""
    model, pool = build_model(CFG), make_pool(page_size, -(-200 // page_size) + 1)
    out = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            h, logits = prefill(model, pool, prompt)
            out.append(decode(model, pool, h, int(logits[-1].argmax()), STEPS))
            pool.close([h])
    return out


def transfer_decode(rank: int, world: int, page_sizes: tuple[int, ...]) -> dict[str, Any]:
    model = build_model(CFG)
    result: dict[str, Any] = {}
    with torch.inference_mode():
        for P in page_sizes:
            pool = make_pool(P, -(-200 // P) + 1)
            if rank == 1:
                # Occupy some pages first so the received request lands on other page ids.
                filler = pool.open(1)
                pool.extend(filler, 23)
            logits, stats, pages = [], [], []
            for prompt in PROMPTS:
                if rank == 0:
                    h, pre = prefill(model, pool, prompt)
                    st = kv_transfer.send_request(pool, h, 1)
                    dist.send(torch.tensor([int(pre[-1].argmax())]), 1)
                    stats.append((st.pages, st.cached_pages, st.bytes, st.messages))
                    pages.append(pool.pages(h).tolist())
                    pool.close([h])
                else:
                    h = kv_transfer.recv_request(pool, 0)
                    first = torch.zeros(1, dtype=torch.int64)
                    dist.recv(first, 0)
                    pages.append(pool.pages(h).tolist())
                    assert pool.length(h) == len(prompt)
                    logits.append(decode(model, pool, h, int(first), STEPS))
                    pool.close([h])
                pool.check()
            if rank == 1:
                pool.close(filler)
            result[P] = {"logits": logits, "stats": stats, "pages": pages, "snapshot": snapshot(pool)}
            result[("prefix", P)] = _prefix_transfer(model, rank, P)
        result["raw"] = _raw_cases(rank)
    result["failures"] = failures(rank, world)
    return result


SYSTEM = np.random.default_rng(99).integers(0, CFG.vocab_size, size=32)
PREFIX_PROMPT = np.concatenate([SYSTEM, np.random.default_rng(98).integers(0, CFG.vocab_size, size=14)])


def prefill_with_prefix(model: Any, pool: Any, prompt: np.ndarray) -> tuple[int, torch.Tensor]:
    """Prefill through the prefix cache: only the positions past the cached prefix run."""
    hs, cl = pool.open_with_prefix(prompt, [len(prompt)])
    h, c = int(hs[0]), int(cl[0])
    ext = pool.extend([h], len(prompt) - c)
    ids = torch.from_numpy(prompt[c:])[None]
    pos = torch.arange(c, len(prompt))[None]
    rows = torch.tensor([pool.rows([h])[0]])
    logits = model.forward_pool(pool, ids, pos, rows, ext.out_cache_loc, len(prompt))[0]
    return h, logits


def _prefix_transfer(model: Any, rank: int, P: int) -> dict[str, Any]:
    """dst caches SYSTEM; src prefills SYSTEM + more and sends: the cached pages stay put."""
    pool = make_pool(P, -(-200 // P) + 1, hash_seed=1234)
    out: dict[str, Any] = {}
    if rank == 1:
        h, _ = prefill_with_prefix(model, pool, SYSTEM)
        pool.close([h], cache=True)
        out["cached_before"] = int(pool.cached_pages)
    dist.barrier()
    if rank == 0:
        h, pre = prefill_with_prefix(model, pool, PREFIX_PROMPT)
        st = kv_transfer.send_request(pool, h, 1)
        dist.send(torch.tensor([int(pre[-1].argmax())]), 1)
        out["stats"] = (st.pages, st.cached_pages, st.bytes, st.messages)
        pool.close([h])
    else:
        st = kv_transfer.recv_request_stats(pool, 0)
        h = st.handle
        out["stats"] = (st.pages, st.cached_pages, st.bytes, st.messages)
        out["length"] = int(pool.length(h))
        out["known"] = pool.known_tokens(h).tolist()
        out["row_ok"] = bool((pool.req_to_token[pool.rows([h])[0], : len(PREFIX_PROMPT)]
                              == torch.from_numpy(pool.slots(h)).to(torch.int32)).all())
        first = torch.zeros(1, dtype=torch.int64)
        dist.recv(first, 0)
        out["logits"] = decode(model, pool, h, int(first), STEPS)
        pool.close([h])
    out["snapshot"] = snapshot(pool)  # check() inside
    return out


def _raw_cases(rank: int) -> dict[str, Any]:
    """fp8 with different scales on the two pools, and an MLA pool: K/V as each side reads it."""
    out = {}
    cases = {
        "fp8_same": dict(dtype=torch.float8_e4m3fn, compute_dtype=torch.float32),
        "fp8_rescaled": dict(dtype=torch.float8_e4m3fn, compute_dtype=torch.float32),
        "mla": dict(dtype=torch.bfloat16, kv_heads=1, head_dim=24, kv_lora_rank=16, qk_rope_head_dim=8),
    }
    for name, kw in cases.items():
        # The MLA case packs with index ops (as for fragmented requests), the others by page runs.
        chunks.MAX_RUNS = 0 if name == "mla" else 32
        pool = make_pool(4, 40, layout="paged", **kw)
        if pool.fp8:
            pool.k_scale.copy_(torch.tensor([2.0, 0.25]))
            pool.v_scale.copy_(torch.tensor([1.0, 3.0]))
            if name == "fp8_rescaled" and rank == 1:
                pool.k_scale.copy_(torch.tensor([0.5, 0.25]))
                pool.v_scale.copy_(torch.tensor([1.5, 3.0]))
        if rank == 0:
            h = int(pool.open(1)[0])
            slots = pool.extend([h], 13).slots
            gen = torch.Generator().manual_seed(7)
            for layer in range(pool.num_layers):
                rows = [torch.randn(13, pool.num_kv_heads, pool.head_dim, generator=gen).to(pool.compute_dtype)
                        for _ in range(1 if pool.mla else 2)]
                pool.write(layer, slots, *rows)
            kv_transfer.send_request(pool, h, 1, chunk_bytes=1)  # one page per chunk: many chunks
        else:
            h = kv_transfer.recv_request(pool, 0)
            slots = pool.slots(h)
        out[name] = {"read": [pool.read(layer, slots) for layer in range(pool.num_layers)],
                     # (bytes indexed: torch 2.4 has no CPU indexing of fp8)
                     "raw": [c.view(torch.uint8)[:, torch.from_numpy(slots).long()].contiguous()
                             for _, c in pool._storage.tensors()] if name != "fp8_rescaled" else None}
        pool.close([h])
        pool.check()
    return out


def failures(rank: int, world: int) -> dict[str, Any]:
    """Rejections leave both pools unchanged and the group usable."""
    model = build_model(CFG)
    res: dict[str, Any] = {}
    big = make_pool(4, 60)
    small = make_pool(4, 6)          # 5 usable pages: 20 tokens
    other = make_pool(4, 60, head_dim=CFG.head_dim * 2)
    if rank == 0:
        h, _ = prefill(model, big, PROMPTS[2])    # 33 tokens: 9 pages
        before = snapshot(big)
        for case in ("exhausted", "incompatible"):
            try:
                kv_transfer.send_request(big, h, 1)
                res[case] = None
            except TransferRejectedError as e:
                res[case] = (type(e).__name__, e.reason, str(e))
            assert snapshot(big) == before
        stale = int(big.open(1)[0])
        big.close([stale])
        try:
            kv_transfer.send_request(big, stale, 1)
        except kvpool.InvalidHandleError as e:
            res["stale"] = type(e).__name__
        try:
            kv_transfer.send_request(big, h, 1, chunk_bytes="16M")
        except kvpool.InvalidArgumentError as e:
            res["bad_args"] = (type(e).__name__, str(e))
        st = kv_transfer.send_request(big, h, 1)       # the group still works after clean refusals
        res["after"] = st.pages
        big.close([h])
        res["unchanged"] = snapshot(big)
    else:
        for case, pool in (("exhausted", small), ("incompatible", other)):
            before = snapshot(pool)
            try:
                kv_transfer.recv_request(pool, 0)
                res[case] = None
            except kvpool.KVPoolError as e:
                res[case] = (type(e).__name__, getattr(e, "reason", ""), str(e))
            res[case + "_unchanged"] = snapshot(pool) == before
        t0 = time.monotonic()
        try:
            kv_transfer.recv_request(big, 0, timeout_s=20)
        except TransferError as e:
            res["stale"] = (type(e).__name__, str(e), time.monotonic() - t0)
        t0 = time.monotonic()
        try:
            kv_transfer.recv_request(big, 0, timeout_s=20)
        except TransferError as e:
            res["bad_args"] = (type(e).__name__, str(e), time.monotonic() - t0)
        h = kv_transfer.recv_request(big, 0)
        res["after"] = len(big.pages(h))
        big.close([h])
        res["unchanged"] = snapshot(big)
    return res


def _die_on(what: str, nth: int) -> None:
    """Make this process exit abruptly on the nth point-to-point message described by ``what``."""
    seen = {"n": 0}
    orig_send, orig_recv = kv_transfer._Link.send, kv_transfer._Link.post_recv

    def check(w: str) -> None:
        if w == what:
            seen["n"] += 1
            if seen["n"] >= nth:
                os._exit(17)

    def send(self: Any, t: torch.Tensor, w: str) -> Any:
        check(w)
        return orig_send(self, t, w)

    def post_recv(self: Any, t: torch.Tensor, w: str) -> Any:
        check(w)
        return orig_recv(self, t, w)

    kv_transfer._Link.send = send  # type: ignore[method-assign]
    kv_transfer._Link.post_recv = post_recv  # type: ignore[method-assign]


def _error(fn: Any, pool: Any, before: tuple[int, ...]) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        fn()
        return {"error": None}
    except TransferError as e:
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - t0,
                "unchanged": snapshot(pool) == before}


def dead_peers(rank: int, world: int, peer_timeout_s: float) -> dict[str, Any]:
    """Three ranks: rank 2 dies while sending to rank 0, then rank 1 dies while receiving
    from rank 0, each after the handshake and part of the K/V chunks. Rank 0 reports both."""
    model = build_model(CFG)
    pool = make_pool(1, 200)
    with torch.inference_mode():
        h = prefill(model, pool, PROMPTS[3])[0] if rank != 1 else None
    before = snapshot(pool)
    if rank == 2:
        _die_on("K/V chunk", 3)
        kv_transfer.send_request(pool, h, 0, chunk_bytes=4096, timeout_s=peer_timeout_s)
    if rank == 1:
        _die_on("K/V chunk", 3)
        kv_transfer.recv_request(pool, 0, timeout_s=peer_timeout_s)
    out = {"sender_died": _error(lambda: kv_transfer.recv_request(pool, 2, timeout_s=peer_timeout_s), pool, before)}
    out["receiver_died"] = _error(
        lambda: kv_transfer.send_request(pool, h, 1, chunk_bytes=4096, timeout_s=peer_timeout_s), pool, before)
    return out


def silent_peer(rank: int, world: int, peer_timeout_s: float) -> Any:
    """Rank 1 stays alive but never answers; rank 0's receive must time out, not hang."""
    pool = make_pool(1, 50)
    if rank == 1:
        time.sleep(peer_timeout_s + 3)
        return None
    before = snapshot(pool)
    return _error(lambda: kv_transfer.recv_request(pool, 1, timeout_s=peer_timeout_s), pool, before)
