"""What the interaction drivers (``pool_interactions``, ``allocator_interactions``) share:
the K/V code model (each position's code is a function of the request's salt and its
true tokens up to it, so content served for other tokens or another salt reads back
wrong), the request model, prompts that often repeat cached ones, a mirror of the KV
events with the content each page they name must hold, and injected device failures.
"""

from __future__ import annotations

import importlib
import random
from dataclasses import dataclass, field

import numpy as np

from kvpool._core import page_hashes

MASK = (1 << 64) - 1
CODE = (1 << 40) - 1  # 20 bits in K, 20 in V: exact in float32


def mix(a: int, b: int) -> int:
    """A 64-bit mixer (SplitMix64 finaliser of a ^ b * odd)."""
    z = (a ^ (b * 0x9E3779B97F4A7C15)) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def root(salt: int) -> int:
    return mix(0x5A17, salt + 1) & CODE


def next_code(prev: int, tok: int) -> int:
    """The K/V code of a position: its predecessor's code and its token."""
    return mix(prev, tok + 7) & CODE


def make_prompt(rng: random.Random, systems: list[list[int]], seen: list[tuple[list[int], int]],
                page_size: int) -> tuple[list[int], int]:
    """A prompt and salt: often one a request cached before (a hit, or under
    another salt a miss that must not share), else a system prompt, each
    perhaps cut and with a random tail."""
    if seen and rng.random() < 0.6:
        base, salt = rng.choice(seen)
        base = list(base)
        if rng.random() < 0.15:
            salt ^= 1
    else:
        base, salt = list(rng.choice(systems)), rng.choice([0, 0, 1])
    if base and rng.random() < 0.5:
        base = base[: rng.randrange(1, len(base) + 1)]
    base += [rng.randrange(4) for _ in range(rng.randrange(0, 2 * page_size + 2))]
    return (base or [rng.randrange(4)])[: 8 * page_size], salt


@dataclass
class Req:
    salt: int
    tokens: list[int] = field(default_factory=list)  # the true tokens (the engine always has them)
    told: list[int | None] = field(default_factory=list)  # what the pool was told (None: not told)
    codes: list[int] = field(default_factory=list)  # K/V code of each position
    prompt: list[int] = field(default_factory=list)  # the open_with_prefix prompt it still remembers
    swapped: bool = False

    def push(self, tok: int, told: bool) -> None:
        prev = self.codes[-1] if self.codes else root(self.salt)
        self.tokens.append(tok)
        self.told.append(tok if told else None)
        self.codes.append(next_code(prev, tok))

    def cut(self, n: int) -> None:
        shorter = n < len(self.tokens)  # the current length as the new one changes nothing
        del self.tokens[n:], self.told[n:], self.codes[n:]
        if shorter and n < len(self.prompt):
            self.prompt = self.prompt[:n]

    def known(self) -> list[int]:
        out = []
        for t in self.told:
            if t is None:
                break
            out.append(t)
        return out

    def clone(self) -> Req:
        return Req(self.salt, list(self.tokens), list(self.told), list(self.codes), list(self.prompt))


class Refused(Exception):
    pass


class Injected(RuntimeError):
    """A device failure the driver injects (a CUDA OOM or launch error)."""


class Faults:
    """Makes the ``at``-th device table write or copy-on-write copy of a call fail
    (armed per call; ``at`` None: nothing fails). Installed over the module
    attributes the pool calls through, and removed by ``remove``."""

    TARGETS = (("kvpool.tables", "write_packed_table"), ("kvpool.sharing", "write_req_to_token"),
               ("kvpool.sharing", "copy_slots"))

    def __init__(self) -> None:

        self.at: int | None = None
        self.seen = 0
        self.saved = []
        for mod_name, attr in self.TARGETS:
            mod = importlib.import_module(mod_name)
            orig = getattr(mod, attr)
            self.saved.append((mod, attr, orig))
            setattr(mod, attr, self.wrap(orig))

    def wrap(self, orig):
        def call(*args, **kwargs):
            if self.at is not None:
                if self.seen == self.at:
                    self.at = None
                    raise Injected("device failure (injected)")
                self.seen += 1
            return orig(*args, **kwargs)

        return call

    def arm(self, at: int | None) -> None:
        self.at, self.seen = at, 0

    def remove(self) -> None:
        for mod, attr, orig in self.saved:
            setattr(mod, attr, orig)


class EventMirror:
    """What a router learns from a pool's events: per tier (medium 0 device, 1 host)
    the hashes it holds and on which page; and, for every hash ever stored, its
    parent, tokens and salt, from which each page's content is known."""

    def __init__(self, page_size: int, hash_seed: int) -> None:
        self.P, self.seed = page_size, hash_seed
        self.on_tier: list[dict[tuple[int, int], int]] = [{}, {}]
        self.chain: dict[tuple[int, int], tuple[tuple[int, int], list[int], int]] = {}

    def apply_twins(self, a: object, b: object) -> None:
        """Drain two twin pools (or allocators), which must have recorded the same
        events, and apply them."""
        ea, eb = a.take_events(), b.take_events()  # type: ignore[attr-defined]
        for k in ea:
            assert np.array_equal(ea[k], eb[k]), f"twin events differ in {k}"
        self.apply(ea)

    def apply(self, ev: dict[str, np.ndarray]) -> None:
        off = 0
        for i in range(len(ev["kind"])):
            kind, med = int(ev["kind"][i]), int(ev["medium"][i])
            hsh = (int(ev["hash_hi"][i]), int(ev["hash_lo"][i]))
            n = int(ev["num_tokens"][i])
            toks = ev["token_ids"][off:off + n].tolist()
            off += n
            if kind == 2:
                self.on_tier[0].clear()
                self.on_tier[1].clear()
            elif kind == 0:
                assert hsh not in self.on_tier[med], f"Stored twice on medium {med} without a Removed"
                rec = ((int(ev["parent_hi"][i]), int(ev["parent_lo"][i])), toks, int(ev["salt"][i]))
                assert self.chain.setdefault(hsh, rec) == rec, "one hash, two contents"
                self.on_tier[med][hsh] = int(ev["page"][i])
            else:
                assert hsh in self.on_tier[med], f"Removed on medium {med} of a page not stored there"
                del self.on_tier[med][hsh]

    def pages(self):
        """(medium, page, tokens of the whole chain, the page's codes) of every page held."""
        for med in (0, 1):
            for hsh, page in self.on_tier[med].items():
                toks: list[int] = []
                salt, cur = self.chain[hsh][2], hsh
                while cur != (0, 0):
                    cur, t, _ = self.chain[cur]
                    toks = t + toks
                assert tuple(page_hashes(toks, self.P, self.seed, salt)[-2:].tolist()) == hsh, "event hash"
                c, codes = root(salt), []
                for t in toks:
                    c = next_code(c, t)
                    codes.append(c)
                yield med, page, toks, codes[-self.P:]
