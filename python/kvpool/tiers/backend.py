"""What a page tier below host memory stores, and the interface a backend implements.

A stored page is a ``PageRecord``: the page's chain hash, its parent's hash,
the request salt, its token ids, a fingerprint of the model shape that wrote
it, and its K/V bytes (one host page: every layer of K and V, or the MLA
latent). ``encode`` / ``decode`` give it a versioned, checksummed byte
format, so a backend only stores and returns opaque blobs by key.

Nothing read back is trusted. ``decode`` returns None for anything that is
not a whole, intact record of this format (wrong magic or version,
inconsistent sizes, truncated, any flipped byte: the checksum covers every
byte before it); the reader then checks the record's hash, fingerprint,
tokens, salt and parent against what it expects (``PageRecord.matches``), so
a renamed file, a file written for other tokens under a hash, a hash
collision or another model's file is a miss, never wrong K/V.

Names are the core's 128-bit chain hashes (``kvpool._core.page_hashes``)
under ``tier_seed(fingerprint)``: a seed derived from what the bytes mean
(model shape, dtype, page size, fp8 scales, model name), not the pool's
``hash_seed`` (random unless given). So any process with the same model
computes the same names, and pages of different models or shapes never
share a name (they cannot overwrite each other in one directory);
``page_key`` turns the core's (hi, lo) words into one int.
"""

from __future__ import annotations

import abc
import hashlib
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpool.errors import InvalidArgumentError
from kvpool.validate import is_int, require_plain_pool

__all__ = ["FORMAT_VERSION", "PageRecord", "TierBackend", "decode", "encode", "page_key", "record_bytes",
           "shape_fingerprint", "tier_seed"]

FORMAT_VERSION = 1
MAGIC = b"KVPOOLPG"
# magic, version, fingerprint, hash, parent, salt, num_tokens, reserved, payload bytes
_HEADER = struct.Struct("<8sI16s16s16sqIIQ")
_SUM = 16  # blake2b digest bytes at the end


def page_key(hi: int, lo: int) -> int:
    """One 128-bit int from the core's (hi, lo) uint64 words of a page hash."""
    for name, word in (("hi", hi), ("lo", lo)):
        if not is_int(word) or not 0 <= word < 1 << 64:
            raise InvalidArgumentError(f"{name} must be a uint64 word of a page hash, an int in [0, 2**64), "
                                       f"got {type(word).__name__} {word!r}")
    return (int(hi) << 64) | int(lo)


def check_model_name(model: Any) -> None:
    """``InvalidArgumentError`` unless ``model`` is a str the fingerprint can encode."""
    if not isinstance(model, str):
        # str(None) == "None": a non-str would share another model's fingerprint.
        raise InvalidArgumentError(f"model must be a str naming the model and revision, "
                                   f"got {type(model).__name__} {model!r:.60}")
    try:
        model.encode("utf-8")
    except UnicodeEncodeError as e:
        # A lone surrogate (os.fsdecode of a non-UTF-8 name, a JSON "\\ud800" escape): every
        # store_new and prefetch would fail on it, store_new after draining the events.
        raise InvalidArgumentError(f"model must be a str of UTF-8 text; {model!r:.60} has "
                                   f"{model[e.start:e.end]!r} at {e.start}, which UTF-8 cannot encode") from None


def shape_fingerprint(pool: Any, model: str = "") -> bytes:
    """16 bytes naming what a pool's page bytes mean: model shape, dtype, page size,
    this rank's KV heads, MLA ranks, fp8 scales and ``model`` (not the layout).
    Reads the fp8 scales (a device sync on a CUDA fp8 pool).

    Raises:
        InvalidArgumentError: ``pool`` is not a plain ``KVPool``, or ``model`` is not a str.
    """
    require_plain_pool(pool, "shape_fingerprint")
    check_model_name(model)
    parts = [
        "kvpool-page-v1", f"layers={pool.num_layers}", f"caches={1 if pool.mla else 2}",
        f"heads={pool.num_kv_heads}/{getattr(pool, 'total_kv_heads', pool.num_kv_heads)}"
        f"@{getattr(pool, 'kv_head_start', 0)}",
        f"head_dim={pool.head_dim}", f"dtype={pool.dtype}", f"page_size={pool.page_size}",
        f"mla={pool.kv_lora_rank},{pool.qk_rope_head_dim}", f"model={model}",
    ]
    for name in ("k_scale", "v_scale"):
        s = getattr(pool, name, None)
        if s is not None:
            parts.append(f"{name}=" + s.detach().float().cpu().numpy().tobytes().hex())
    return hashlib.blake2b(";".join(parts).encode(), digest_size=16).digest()


def tier_seed(fingerprint: bytes) -> int:
    """The hash seed that names the pages of one fingerprint (a 64-bit int, as
    ``page_hashes`` takes)."""
    if not isinstance(fingerprint, bytes) or len(fingerprint) != 16:
        raise InvalidArgumentError(f"fingerprint must be the 16 bytes shape_fingerprint(pool) returns, "
                                   f"got {type(fingerprint).__name__} {fingerprint!r:.60}")
    d = hashlib.blake2b(fingerprint, digest_size=8, person=b"kvpool-tier-v1").digest()
    return int.from_bytes(d, "little")


def _b16(h: int) -> bytes:
    return int(h).to_bytes(16, "little")


@dataclass(frozen=True)
class PageRecord:
    """One stored page. ``payload`` is the page's bytes in ``HostStorage`` layout
    (``[C, num_layers, P, H, D]``); ``tokens`` its ``page_size`` token ids (int32)."""

    page_hash: int
    parent_hash: int  # 0 for a chain's first page
    salt: int
    tokens: np.ndarray
    fingerprint: bytes
    payload: bytes

    def matches(self, fingerprint: bytes, tokens: np.ndarray, salt: int, parent_hash: int) -> bool:
        """Whether this record is the page a reader expects: same model shape, same
        token ids, same salt and same parent (so, by induction over a chain read from
        its first page, the same whole prefix)."""
        return (self.fingerprint == fingerprint and self.salt == int(salt) and self.parent_hash == int(parent_hash)
                and self.tokens.shape == np.shape(tokens) and bool(np.array_equal(self.tokens, tokens)))


def record_bytes(num_tokens: int, payload_bytes: int) -> int:
    """Encoded size of a record: header, token ids, payload, checksum."""
    return _HEADER.size + 4 * num_tokens + payload_bytes + _SUM


def _checked_tokens(tokens: object) -> np.ndarray:
    try:
        arr: np.ndarray | None = np.asarray(tokens)
    except (TypeError, ValueError):  # ragged
        arr = None
    if arr is None or arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        what = f"{type(tokens).__name__}" if arr is None else f"shape {arr.shape} dtype {arr.dtype}"
        raise InvalidArgumentError(f"a record's tokens must be its page's token ids, a 1-D int array, got {what}")
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
        raise InvalidArgumentError(f"a record's tokens must be token ids in [0, {np.iinfo(np.int32).max}], "
                                   f"got values in [{arr.min()}, {arr.max()}]")
    return np.ascontiguousarray(arr, dtype="<i4")


def _check_fields(rec: PageRecord) -> None:
    """Refuses a record whose fields the format cannot hold (before anything is written)."""
    for name in ("page_hash", "parent_hash"):
        h = getattr(rec, name)
        if not is_int(h) or not 0 <= h < 1 << 128:
            raise InvalidArgumentError(f"a record's {name} must be a 128-bit page hash, an int in [0, 2**128) "
                                       f"(page_key(hi, lo)), got {type(h).__name__} {h!r:.60}")
    if not is_int(rec.salt) or not -(1 << 63) <= rec.salt < 1 << 63:
        raise InvalidArgumentError(f"a record's salt must be an int64, got {type(rec.salt).__name__} "
                                   f"{rec.salt!r:.60}")
    if not isinstance(rec.fingerprint, bytes) or len(rec.fingerprint) != 16:
        raise InvalidArgumentError(f"a record's fingerprint must be the 16 bytes shape_fingerprint(pool) returns, "
                                   f"got {type(rec.fingerprint).__name__} {rec.fingerprint!r:.60}")
    if not isinstance(rec.payload, (bytes, bytearray, memoryview)):
        raise InvalidArgumentError(f"a record's payload must be its page's K/V bytes (bytes), "
                                   f"got {type(rec.payload).__name__}")


def encode(rec: PageRecord) -> bytes:
    """``rec`` in the stored format. Raises InvalidArgumentError for a field the format
    cannot hold (a hash past 128 bits, a salt past int64, tokens that are not int32 ids,
    a fingerprint that is not 16 bytes, a payload that is not bytes)."""
    if not isinstance(rec, PageRecord):
        raise InvalidArgumentError(f"record must be a kvpool.tiers.PageRecord, got {type(rec).__name__}")
    _check_fields(rec)
    tokens = _checked_tokens(rec.tokens)
    head = _HEADER.pack(MAGIC, FORMAT_VERSION, rec.fingerprint, _b16(rec.page_hash), _b16(rec.parent_hash),
                        int(rec.salt), tokens.size, 0, len(rec.payload))
    body = b"".join((head, tokens.tobytes(), bytes(rec.payload)))
    return body + hashlib.blake2b(body, digest_size=_SUM).digest()


HEADER_BYTES = _HEADER.size


def header_promises(head: bytes, size: int, page_hash: int | None = None) -> bool:
    """Whether ``head``, a file's first ``HEADER_BYTES``, starts a record of this format
    (magic, version, the reserved field 0) that is ``size`` bytes long in all, and, given
    ``page_hash``, is filed under it: what can be told without reading the rest (a torn or
    truncated file fails it; a flipped byte past the header needs ``decode``'s checksum).
    A later format that uses the reserved field changes the version."""
    try:
        magic, version, _fp, h, _parent, _salt, ntok, res, npay = _HEADER.unpack_from(head, 0)
    except struct.error:  # shorter than a header
        return False
    return (magic == MAGIC and version == FORMAT_VERSION and res == 0 and size == record_bytes(ntok, npay)
            and (page_hash is None or int.from_bytes(h, "little") == page_hash))


def decode(blob: bytes) -> PageRecord | None:
    """The record in ``blob``, or None if it is not an intact record of this format."""
    try:
        if len(blob) < _HEADER.size + _SUM:
            return None
        if not header_promises(blob[: _HEADER.size], len(blob)):
            return None
        _magic, _version, fp, h, parent, salt, ntok, _res, npay = _HEADER.unpack_from(blob, 0)
        view = memoryview(blob)
        if hashlib.blake2b(view[:-_SUM], digest_size=_SUM).digest() != bytes(view[-_SUM:]):
            return None
        start = _HEADER.size
        tokens = np.frombuffer(blob, dtype="<i4", count=ntok, offset=start).astype(np.int32)
        payload = bytes(view[start + 4 * ntok : start + 4 * ntok + npay])
        return PageRecord(int.from_bytes(h, "little"), int.from_bytes(parent, "little"), int(salt), tokens,
                          bytes(fp), payload)
    except (struct.error, ValueError, TypeError):
        return None


class TierBackend(abc.ABC):
    """A store of page records by chain hash, bounded in bytes.

    Implementations never raise on bad stored data: ``get`` returns None for a
    missing, unreadable or corrupted record, or one filed under another hash.
    Readers that find an intact record that is not the page they expect (other
    tokens, salt, parent or fingerprint under its hash) ``discard`` it.
    """

    @property
    @abc.abstractmethod
    def max_bytes(self) -> int:
        """Bound on the bytes stored (evicting least recently used records past it)."""

    @abc.abstractmethod
    def get(self, page_hash: int) -> PageRecord | None:
        """The intact record stored under ``page_hash`` whose own hash is ``page_hash``, or None."""

    @abc.abstractmethod
    def put(self, record: PageRecord) -> bool:
        """Store ``record`` under its hash (replacing any record there); False if it cannot
        be stored (larger than ``max_bytes``, or the store failed)."""

    @abc.abstractmethod
    def contains(self, page_hash: int) -> bool:
        """Whether a record is stored under ``page_hash`` (not fully verified: ``get`` may still
        miss). ``DiskCache.store_new`` skips a page this says is stored, so say False for what
        can be told damaged cheaply (``FileTier``: an empty or short file, a wrong header)."""

    @abc.abstractmethod
    def remove(self, page_hash: int) -> None:
        """Drop the record under ``page_hash``, if any."""

    def discard(self, record: PageRecord) -> None:
        """Drop ``record`` (one ``get`` returned and the reader rejected) if it is still what
        is stored under its hash; a record another writer stored there since stays.
        The default calls ``remove(record.page_hash)``, which may drop such a newer
        record: a backend shared by concurrent writers overrides it."""
        self.remove(record.page_hash)

    def touch(self, page_hashes: list[int]) -> None:  # noqa: B027 (optional: not abstract)
        """Mark the records under ``page_hashes`` as used, in that order (the last is the
        most recently used); absent ones are skipped. ``DiskCache`` passes a chain
        deepest page first, so that least-recently-used eviction takes a chain's tail
        before its first page: a record whose parent is gone can never be hit. A backend
        without recency (or one that orders by ``get`` alone) leaves this as is."""
