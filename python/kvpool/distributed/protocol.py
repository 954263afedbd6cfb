"""The wire format of ``kv_transfer`` and the receiver's checks of what a peer claims.

A header is 18 int64 words (``H_*`` below). The receiver trusts none of them: a
broken or hostile peer may send any value. ``meta_words`` says whether the
metadata the header announces is small enough to receive at all, and
``header_problem`` checks every field against the receiving pool's own
geometry, before anything is allocated or opened. Each refusal has a status
code that the receiver sends back, so the sender fails at once instead of
waiting out its timeout.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvpool.distributed.pages import page_bytes

# Version 3: the model's total KV heads in the header, a closing word on every K/V chunk
# (kvpool.distributed.stream), and the FAILED refusal. Version 4: the request's salt in the
# header (before, only a chain carried it, so a request with no full page of known tokens
# arrived with salt 0 and later registered its tenant's K/V where salt 0 hits it).
MAGIC, VERSION = 0x6B76706F6F6C, 4
TAG = 0x4B56
HEADER_LEN, REPLY_LEN = 18, 6
OK, EXHAUSTED, TOO_MANY, CONTEXT, INCOMPATIBLE, MALFORMED, FAILED = range(7)
REASONS = {EXHAUSTED: "exhausted", TOO_MANY: "too_many_requests", CONTEXT: "context_too_long",
           INCOMPATIBLE: "incompatible", MALFORMED: "malformed", FAILED: "failed"}
DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2")
# Header fields, by index.
(H_MAGIC, H_VERSION, H_LENGTH, H_PAGE, H_LAYERS, H_HEADS, H_DIM, H_DTYPE, H_CACHES, H_PAGES,
 H_HASHES, H_SCALES, H_PER_CHUNK, H_PAGE_BYTES, H_HEAD_START, H_ABORT, H_TOTAL_HEADS, H_SALT) = range(HEADER_LEN)

#: Metadata words a receiver accepts from a header that does not fit its pool (so
#: that a sender of another shape still gets its refusal): beyond this, and beyond
#: what its own pool could ever be sent, it refuses without reading them.
MAX_FOREIGN_META_WORDS = 1 << 16


def dtype_code(dtype: torch.dtype) -> int:
    name = str(dtype).replace("torch.", "")
    return DTYPE_NAMES.index(name) if name in DTYPE_NAMES else len(DTYPE_NAMES)


def shape_fields(pool: Any) -> dict[int, int]:
    """The header fields two pools must agree on, as this pool has them."""
    return {H_PAGE: pool.page_size, H_LAYERS: pool.num_layers, H_HEADS: pool.num_kv_heads,
            H_DIM: pool.head_dim, H_DTYPE: dtype_code(pool.dtype), H_CACHES: 1 if pool.mla else 2,
            H_PAGE_BYTES: page_bytes(pool), H_HEAD_START: int(getattr(pool, "kv_head_start", 0)),
            # The model's heads, not only this rank's shard: two models whose shards look
            # alike (heads 0-1 of 4 and of 2) hold other K/V.
            H_TOTAL_HEADS: int(getattr(pool, "total_kv_heads", pool.num_kv_heads))}


def scales(pool: Any) -> np.ndarray:
    """fp8 per-layer scales as float64 (k then v; MLA: one set); empty for other dtypes."""
    if not pool.fp8:
        return np.zeros(0, np.float64)
    sets = [pool.k_scale] if pool.mla else [pool.k_scale, pool.v_scale]
    return torch.cat([s.detach().float().cpu() for s in sets]).double().numpy()


def num_scales(pool: Any) -> int:
    return 0 if not pool.fp8 else pool.num_layers * (1 if pool.mla else 2)


def chain_words(n: int, page_size: int) -> int:
    """Words of a chain of ``n`` pages: 2n hash words, the salt, n * page_size token ids."""
    return 0 if n == 0 else 2 * n + 1 + n * page_size


def chain_of(pool: Any, handle: int) -> tuple[int, np.ndarray, int]:
    """Prefix hook: ``(n, words, salt)``, the request's n leading full pages of known tokens
    as int64 words ``[2n hash words (hi, lo) | salt | n * page_size token ids]``, and its
    salt (sent in the header too: a request with no such page still has one)."""
    fn = getattr(pool, "chain_hashes", None)
    if fn is None:
        return 0, np.zeros(0, np.int64), 0
    hashes, tokens, salt = fn(handle)
    n = len(hashes) // 2
    if not n:
        return 0, np.zeros(0, np.int64), int(salt)
    words = np.concatenate([np.asarray(hashes, np.uint64).view(np.int64), np.array([salt], np.int64),
                            np.asarray(tokens, np.int64)])
    return n, words, int(salt)


def split_chain(words: np.ndarray, n: int, salt: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
    """``(hash words uint64, tokens, salt)`` of a chain packed as ``chain_words`` says;
    with no pages, ``salt`` (the header's)."""
    if n == 0:
        return np.zeros(0, np.uint64), np.zeros(0, np.int64), int(salt)
    return words[: 2 * n].view(np.uint64), words[2 * n + 1 :], int(words[2 * n])


def incompatible(pool: Any, header: np.ndarray) -> str:
    """The shape fields where the sender's pool differs from this one ("" if none)."""
    names = {H_PAGE: "page_size", H_LAYERS: "num_layers", H_HEADS: "num_kv_heads (this rank's shard)",
             H_DIM: "head_dim", H_DTYPE: "dtype", H_CACHES: "cache kinds", H_PAGE_BYTES: "page bytes",
             H_HEAD_START: "first KV head of the shard", H_TOTAL_HEADS: "total_kv_heads"}
    diffs = [f"{names[k]} {_shown(k, int(header[k]))} vs {_shown(k, v)}"
             for k, v in shape_fields(pool).items() if int(header[k]) != v]
    return "; ".join(diffs)


def _shown(field: int, value: int) -> str:
    """A shape field as a reader knows it: a dtype by name, the cache kinds as what they hold."""
    if field == H_DTYPE:
        return DTYPE_NAMES[value] if 0 <= value < len(DTYPE_NAMES) else f"an unknown dtype (code {value})"
    if field == H_CACHES:
        return {1: "1 (an MLA latent cache)", 2: "2 (K and V caches)"}.get(value, str(value))
    return str(value)


def meta_words(pool: Any, header: np.ndarray) -> tuple[int, str]:
    """How many metadata words follow the header, or ``(-1, why)`` when the header's
    counts are impossible or larger than this pool would ever accept (then they
    are never read: a claim of 2**40 hashes must not allocate anything)."""
    n_hashes, n_scales, page = int(header[H_HASHES]), int(header[H_SCALES]), int(header[H_PAGE])
    if n_hashes < 0 or n_scales < 0:
        return -1, f"negative counts of chain hashes ({n_hashes}) or fp8 scales ({n_scales})"
    if page < 1:
        return -1, f"page size {page} (must be >= 1)"
    words = chain_words(n_hashes, page) + n_scales
    own = chain_words(pool.max_context_len // pool.page_size, pool.page_size) + num_scales(pool)
    if words > max(own, MAX_FOREIGN_META_WORDS):
        return -1, (f"{n_hashes} chain hashes and {n_scales} fp8 scales ({words} words of metadata), "
                    f"more than this pool could ever be sent ({own} words)")
    return words, ""


def header_problem(pool: Any, header: np.ndarray, src_scales: np.ndarray) -> tuple[int, str] | None:
    """The first thing wrong with a header whose pool shape matches this one, as
    ``(status, message)``, or None. Every count is checked against this pool's
    geometry: what a correct sender of this request would have written."""
    length, n_pages, page = int(header[H_LENGTH]), int(header[H_PAGES]), pool.page_size
    n_hashes, n_scales, per_chunk = int(header[H_HASHES]), int(header[H_SCALES]), int(header[H_PER_CHUNK])
    if length < 0:
        return MALFORMED, f"a request of {length} tokens (a length is >= 0)"
    if length > pool.max_context_len:
        return CONTEXT, f"a request of {length} tokens exceeds max_context_len {pool.max_context_len}"
    want_pages = -(-length // page)
    if n_pages != want_pages:
        return MALFORMED, f"{n_pages} pages for {length} tokens (page size {page}: {want_pages} pages)"
    if not 0 <= n_hashes <= length // page:
        return MALFORMED, f"{n_hashes} chain hashes for {length} tokens (at most {length // page} full pages)"
    if n_scales != num_scales(pool):
        return MALFORMED, f"{n_scales} fp8 scales; this pool has {num_scales(pool)}"
    if len(src_scales) and not (np.isfinite(src_scales).all() and (src_scales > 0).all()):
        return MALFORMED, "fp8 scales that are not finite and positive"
    if not 1 <= per_chunk <= max(1, n_pages):
        return MALFORMED, f"{per_chunk} pages per chunk (must be in [1, {max(1, n_pages)}] for {n_pages} pages)"
    return None


def reply_problem(status: int, cached: int, n_chain: int) -> str | None:
    """What is wrong with a receiver's reply to a header announcing ``n_chain`` chain pages,
    or None. A cached-page count outside the chain would make the sender send other pages
    than the receiver takes (``pages[-1:]`` for -1)."""
    if status != OK and status not in REASONS:
        return f"status {status}, none of kvpool's ({OK}: ok, {sorted(REASONS)}: refusals)"
    if status == OK and not 0 <= cached <= n_chain:
        return f"{cached} leading pages already cached, of a chain of {n_chain} (0 to {n_chain})"
    return None


def unsupported(pool: Any) -> str | None:
    """Why ``pool`` cannot send or receive a request (None when it can)."""
    inner = getattr(pool, "inner", pool)
    if getattr(inner, "layer_types", None) is not None and getattr(inner, "groups", None) is not None:
        # One page list per request is what the protocol describes; a hybrid request has
        # one per layer group, and sliding/state groups hold other tokens than its length.
        return ("hybrid pools (layer_types=...) cannot send or receive requests: each layer group has its "
                "own pages and the transfer moves one page list for every layer; move requests between "
                "KVPools built without layer_types")
    return None
