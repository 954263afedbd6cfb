"""Retention priorities in the naive model (tests/allocator_model.py), the
obvious way: a dict from registered page to the priority a caller gave it
(absent: the default), the cached pages still one list in the order they
were last filed (so least recently used within a priority is their order in
it), the victim found by scanning for the lowest priority, pins counted by
scanning, durations ended by sorting the due ones."""

import kvpool

DEFAULT = kvpool.DEFAULT_PRIORITY
MAX = kvpool.MAX_PRIORITY
PINNED = MAX + 1  # the list of pinned pages


class PriorityModel:
    """Mixin of Model. Its state: ``prio`` (page -> [q, until ns or None,
    seq]), ``now`` (ns), ``max_pinned``, ``ends_given``, and ``victims`` (the
    pages evicted, in order, for a test to compare and clear)."""

    def plist(self, p):
        x = self.prio.get(p)
        if x is None:
            return DEFAULT
        return PINNED if x[0] == MAX and x[1] is None else x[0]

    def pinned(self):
        return sum(self.plist(p) == PINNED for p in self.prio)

    def evictable(self):
        return sum(self.plist(p) != PINNED for p in self.lru)

    def by_priority(self):
        out = [0] * (MAX + 1)
        for p in self.lru:
            if self.plist(p) != PINNED:
                out[self.plist(p)] += 1
        return out

    def pop_victim(self):
        """The first cached page of the lowest priority leaves the cache."""
        low = min(self.plist(p) for p in self.lru if self.plist(p) != PINNED)
        p = next(p for p in self.lru if self.plist(p) == low)
        self.lru.remove(p)
        self.prio.pop(p, None)
        self.victims.append(p)
        # With a host tier the entry may live on in a host copy.
        self.drop_device_copy(p, True)
        return p

    def cache_order(self):
        """Cached pages as clear_cache frees them: victims in order, then pins."""
        victims = sorted((p for p in self.lru if self.plist(p) != PINNED), key=self.plist)
        return victims + [p for p in self.lru if self.plist(p) == PINNED]

    def refile(self, p, old):
        if old != self.plist(p) and p in self.lru:
            self.lru.remove(p)
            self.lru.append(p)

    def raise_(self, p, q, until):
        old = self.plist(p)
        if q == MAX and until is None and old != PINNED and self.pinned() >= self.max_pinned:
            q = MAX - 1
        cur = self.prio.get(p)
        if cur is None or q > cur[0]:
            new = [q, until]
        elif q == cur[0]:
            new = [q, None if cur[1] is None or until is None else max(cur[1], until)]
        else:
            return
        if cur is not None and cur[:2] == new:
            return
        if new[1] is not None and (cur is None or cur[1] != new[1]):
            self.ends_given += 1
            seq = self.ends_given
        else:
            seq = cur[2] if cur is not None else 0
        self.prio[p] = new + [seq]
        self.refile(p, old)

    def cached_prefix(self, r):
        """Each page of row r's cached prefix: its own page where registered,
        else the registered copy of the same content under the same parent
        (on the device)."""
        q = self.reqs[r]
        known = q.known()
        out, prev = [], 0
        for k in range(q.hashed):
            p = q.pages[k]
            e = self.entry_at(p)
            if e is None:
                # A copy only on the host is gone from the device, where
                # priorities apply.
                e = self.find((q.salt, tuple(known[: (k + 1) * self.ps])))
                if e is None or e.parent_reg != prev or e.dev is None:
                    break
            p, reg = e.dev, e.reg
            out.append(p)
            prev = reg
        return out

    def _retention(self, hs, priority, retain_s):
        """The binding's and the core's checks, in their order; the end in ns."""
        if priority is None:
            if retain_s is not None:
                raise kvpool.InvalidArgumentError
            return None, None
        rows = self.resident_rows(hs)
        qs = [priority] * len(hs) if isinstance(priority, int) else list(priority)
        given = [priority] if isinstance(priority, int) else qs
        if len(qs) != len(hs) or any(not 0 <= q <= MAX for q in given):
            raise kvpool.InvalidArgumentError
        if retain_s is not None and not 0 < retain_s <= 1e9:
            raise kvpool.InvalidArgumentError
        return rows, qs

    def give(self, rows, qs, retain_s):
        until = None if retain_s is None else self.now + round(retain_s * 1e9)
        targets = [(p, q) for r, q in zip(rows, qs) for p in self.cached_prefix(r)]
        for p, q in targets:
            self.raise_(p, q, until)

    def cache_priority(self, hs, priority=None, retain_s=None):
        rows, qs = self._retention(hs, priority, retain_s)
        if rows is None:
            return self.cache(hs)
        self.register_rows(rows)
        self.give(rows, qs, retain_s)

    def close_priority(self, hs, cache, priority=None, retain_s=None):
        if priority is not None and not cache:
            raise kvpool.InvalidArgumentError
        rows, qs = self._retention(hs, priority, retain_s)
        if rows is None:
            return self.close(hs, cache)
        self.register_rows(rows)
        self.give(rows, qs, retain_s)
        self.close(hs, False)

    def resident_rows(self, hs):
        """batch_rows, then a swapped-out request refused: priorities are the
        device's."""
        rows = self.batch_rows(hs)
        if any(self.reqs[r].swapped for r in rows):
            raise kvpool.RequestSwappedOutError
        return rows

    def unpin(self, hs):
        rows = self.resident_rows(hs)
        n = 0
        for p in [p for r in rows for p in self.cached_prefix(r)]:
            if self.plist(p) == PINNED:
                del self.prio[p]
                self.refile(p, PINNED)
                n += 1
        return n

    def set_clock(self, now_ns):
        """Durations due by now end, soonest first, the latest given first
        among those ending together."""
        self.now = now_ns
        due = sorted((x[1], -x[2], p) for p, x in self.prio.items() if x[1] is not None and x[1] <= now_ns)
        for _, _, p in due:
            old = self.plist(p)
            del self.prio[p]
            self.refile(p, old)
