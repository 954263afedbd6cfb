"""Plain references for the page-1 outside checkers (tests/test_review_page1*.py):
a router fed only by KV events, a request's content keys, a snapshot of what a
refused call must leave alone, and a twin that runs every call on two pools."""

import itertools

import numpy as np
import pytest
from hypothesis import strategies as st

import kvpool

# Prompts share prefixes (one of a few texts, cut, then a short tail) so that hits are common.
TEXTS = [[1, 2, 3, 1, 2, 3, 1, 2], [1, 2, 2, 3, 3, 1, 1, 2], [3, 1, 2, 1, 3, 2, 2, 1]]
prompts = st.builds(lambda t, n, tail: (TEXTS[t][:n] + tail) or [1], st.integers(0, 2), st.integers(2, 8),
                    st.lists(st.integers(1, 3), max_size=2))
_uid = itertools.count()


class Router:
    """A KV-aware router's view of one tier (medium): hash -> (page, (salt, token
    prefix)). A hash names its content forever (one seed), so the prefix a
    hash spells is remembered across tiers and removals in `spelled`."""

    def __init__(self, ps, medium=0, spelled=None):
        self.ps, self.medium, self.entries = ps, medium, {}
        self.spelled = {} if spelled is None else spelled
        self.removed = set()  # keys a Removed event named, ever

    def feed(self, ev):
        off = 0
        for i, kind in enumerate(ev["kind"]):
            h = (int(ev["hash_hi"][i]), int(ev["hash_lo"][i]))
            n = int(ev["num_tokens"][i]) if kind == 0 else 0
            toks = tuple(int(t) for t in ev["token_ids"][off:off + n])
            off += n
            if kind == 2:
                self.entries.clear()
                continue
            if int(ev["medium"][i]) != self.medium:
                continue
            if kind == 1:
                assert h in self.entries, "Removed for a hash the router never saw stored"
                self.removed.add(self.entries.pop(h)[1])
                continue
            parent = (int(ev["parent_hi"][i]), int(ev["parent_lo"][i]))
            salt = int(ev["salt"][i])
            if parent == (0, 0):
                key = (salt, toks)
            else:
                assert parent in self.spelled, "Stored names a parent no event ever spelled"
                psalt, pprefix = self.spelled[parent]
                assert psalt == salt
                key = (salt, pprefix + toks)
            assert self.spelled.setdefault(h, key) == key, "one hash spells two prefixes"
            assert h not in self.entries, "Stored twice without a Removed between"
            assert n == self.ps
            self.entries[h] = (int(ev["page"][i]), key)

    def longest(self, salt, prompt, also=None):
        """Pages of the longest stored chain that prefixes the prompt (on this
        tier, or where absent here on the `also` router's)."""
        by_key = {v[1]: v[0] for v in self.entries.values()}
        if also is not None:
            by_key = {**{v[1]: v[0] for v in also.entries.values()}, **by_key}
        pages = []
        for end in range(self.ps, len(prompt) + 1, self.ps):
            p = by_key.get((salt, tuple(prompt[:end])))
            if p is None:
                break
            pages.append(p)
        return pages


class Req:
    def __init__(self, salt, prompt=()):
        self.salt, self.prompt, self.keys, self.toks = salt, list(prompt), [], []

    def key_at(self, i, tok):
        known = tok is not None and all(t is not None for t in self.toks[:i])
        return (self.salt, tuple(self.toks[:i]) + (tok,)) if known else ("u", next(_uid))

    @classmethod
    def hit(cls, salt, prompt, cached):
        """A request opened on ``prompt`` with its first ``cached`` tokens found cached."""
        r = cls(salt, prompt)
        for i in range(cached):
            r.toks.append(prompt[i])
            r.keys.append(r.key_at(i, prompt[i]))
        return r

    def copy(self):
        r = Req(self.salt, self.prompt)
        r.keys, r.toks = list(self.keys), list(self.toks)
        return r


def snapshot(a, handles):
    """Everything a refused call must leave as it was."""
    st_ = a.stats()
    counters = tuple(getattr(st_, f) for f in ("free_pages", "used_pages", "open_requests",
                                               "cached_pages", "evictable_pages", "pinned_pages"))
    per = []
    for h in handles:
        pt = a.page_table([h])
        per.append((a.length(h), a.slots(h).tolist(), a.known_tokens(h).tolist(),
                     [x.tolist() for x in pt]))
    return counters, per, a.pending_copies


def _same(x, y):
    if isinstance(x, tuple | list):
        return type(x) is type(y) and len(x) == len(y) and all(map(_same, x, y))
    if isinstance(x, np.ndarray):
        return isinstance(y, np.ndarray) and x.tolist() == y.tolist()
    if hasattr(x, "free_pages"):  # PoolStats: all but the bookkeeping's size
        return all(getattr(x, f) == getattr(y, f) for f in dir(x) if not f.startswith("_") and f != "metadata_bytes")
    return x == y


class Twin:
    """Runs every call on the pool under test and on a twin built with other
    bookkeeping options (no events: another internal chain keys the index; lazily
    mapped metadata), which must answer the same and refuse the same way."""

    def __init__(self, a, twin):
        self._a, self._t = a, twin

    def __getattr__(self, name):
        x = getattr(self._a, name)
        if not callable(x):
            assert _same(x, getattr(self._t, name)), name
            return x
        if name in ("take_events", "metadata_bytes"):
            getattr(self._t, name)()
            return x

        def both(*args, **kw):
            try:
                got = x(*args, **kw)
            except kvpool.KVPoolError as e:
                with pytest.raises(type(e)):
                    getattr(self._t, name)(*args, **kw)
                raise
            assert _same(got, getattr(self._t, name)(*args, **kw)), name
            return got
        return both
