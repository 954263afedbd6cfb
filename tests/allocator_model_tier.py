"""The host tier of the pure-Python allocator model (allocator_model.py), the
obvious way: host holders counted by scanning the swapped-out requests and the
transfer queues, the host free stack and eviction list plain lists, the queues
lists of page pairs. Same policies as the allocator (rust/kvpool-core/src/host/,
allocator/tier.rs, prefix_host.rs, swap.rs)."""

from allocator_model_priorities import PINNED

import kvpool

#: Marks a host page in a request's page list (and in a match).
HOST = 1 << 31


class Entry:
    def __init__(self, key, reg, parent_reg, dev, host=None):
        self.key, self.reg, self.parent_reg = key, reg, parent_reg
        self.dev, self.host = dev, host  # its device page, its host copy


class Tier:
    def __init__(self, host_pages, policy):
        self.policy = policy
        self.free = list(range(host_pages - 1, 0, -1))  # top = end: 1 first
        self.lru = []  # CACHED host pages, oldest first
        self.offloads = []  # (device, host)
        self.loads = []  # (host, device)
        self.hit = self.offloaded = self.loaded = 0


class TierMixin:
    def init_tier(self, host_pages, policy):
        self.tier = Tier(host_pages, policy) if host_pages else None

    def writes_through(self):
        return self.tier is not None and self.tier.policy == "write_through"

    def entry_on_host(self, h):
        for e in self.reg.values():
            if e.host == h:
                return e
        return None

    def host_holders(self, h):
        """Swapped-out requests naming host page h, plus the queued transfers pinning it."""
        named = sum(r.pages.count(h | HOST) for r in self.reqs.values())
        t = self.tier
        return named + sum(x[0] == h for x in t.loads) + sum(x[1] == h for x in t.offloads)

    def host_hold(self, h):
        if h in self.tier.lru:
            self.tier.lru.remove(h)

    def host_release(self, h):
        if self.host_holders(h):
            return
        (self.tier.lru if self.entry_on_host(h) else self.tier.free).append(h)

    def parent_live(self, e):
        return e.parent_reg == 0 or e.parent_reg in self.reg

    def drop_device_copy(self, p, offload):
        """Device page p leaves the index (evicted, or written in place)."""
        e = self.entry_at(p)
        if e is None:
            return
        if e.host is None and offload and self.tier and self.tier.policy == "write_back":
            self.new_host_copy(e, p)
        e.dev = None
        if e.host is None:
            self.forget(e.reg)

    def new_host_copy(self, e, p):
        if not self.parent_live(e):
            return None
        h = self.take_host_page()
        if h is None:
            return None
        if not self.parent_live(e):
            self.tier.free.append(h)
            return None
        e.host = h
        self.tier.offloads.append((p, h))
        return h

    def take_host_page(self):
        """FREE first, else the oldest CACHED host page (its copy goes)."""
        t = self.tier
        if t.free:
            return t.free.pop()
        if not t.lru:
            return None
        h = t.lru.pop(0)
        e = self.entry_on_host(h)
        e.host = None
        if e.dev is None:
            self.forget(e.reg)
        return h

    def write_through(self, r, start, end):
        for k in range(start, end):
            p = self.reqs[r].pages[k]
            e = self.entry_at(p)
            if e is not None and e.host is None:
                self.new_host_copy(e, p)

    def open_with_host_hits(self, prompts, salt, found):
        """Hold and pin every hit in batch order while a page is left for each
        load, then the loads, then the requests."""
        pending, kept = [], []
        for pages, _ in found:
            k = 0
            for loc in pages:
                spare = len(self.free) + self.evictable() > len(pending)
                if loc & HOST:
                    e = self.entry_on_host(loc & ~HOST)
                    if e not in pending:
                        if not spare:
                            break
                        self.host_hold(loc & ~HOST)
                        pending.append(e)
                else:
                    if loc in self.lru:
                        # A pinned page was never available: holding it uses up no page.
                        if not spare and self.plist(loc) != PINNED:
                            break
                        self.lru.remove(loc)
                k += 1
            kept.append(k)
        for e in pending:
            q = self.take_page()
            e.dev = q
            self.tier.loads.append((e.host, q))
        hs, cached = [], []
        for p, (pages, prev), k in zip(prompts, found, kept):
            mine = [loc if not loc & HOST else self.entry_on_host(loc & ~HOST).dev for loc in pages[:k]]
            loaded = sum(1 for loc in pages[:k] if loc & HOST)
            if k < len(pages):
                prev = self.entry_at(mine[-1]).reg if mine else 0
            h, n = self.open_on(p, salt, mine, prev)
            self.tier.hit += loaded * self.ps
            hs.append(h)
            cached.append(n)
        return hs, cached

    def plan(self, p):
        """What swap_out does with device page p: None (it stays), ("reuse", h), ("offload",)."""
        if (self.holders(p) != 1 or any(c[1] == p for c in self.queue)
                or any(x[1] == p for x in self.tier.loads)):
            return None
        e = self.entry_at(p)
        if e is not None and e.host is not None:
            return ("reuse", e.host)
        return ("offload",)

    def swap_out(self, hs):
        if self.tier is None:
            raise kvpool.InvalidArgumentError
        rows = self.batch_rows(hs)
        if any(self.reqs[r].swapped for r in rows):
            raise kvpool.RequestSwappedOutError
        fresh = cached = 0
        for r in rows:
            for p in self.reqs[r].pages:
                plan = self.plan(p)
                if plan and plan[0] == "reuse":
                    cached += plan[1] in self.tier.lru
                elif plan:
                    fresh += 1
        if fresh + cached > len(self.tier.free) + len(self.tier.lru):
            raise kvpool.PoolExhaustedError
        for r in rows:
            for p in list(self.reqs[r].pages):
                plan = self.plan(p)
                if plan and plan[0] == "reuse":
                    self.host_hold(plan[1])
        for r in rows:
            q = self.reqs[r]
            released = []
            for k, p in enumerate(list(q.pages)):
                plan = self.plan(p)
                if plan is None:
                    continue
                if plan[0] == "reuse":
                    h = plan[1]
                else:
                    h = self.take_host_page()
                    self.tier.offloads.append((p, h))
                    e = self.entry_at(p)
                    if e is not None and self.parent_live(e):
                        e.host = h
                q.pages[k] = h | HOST
                released.append(p)
            for p in reversed(released):
                self.release(p)
            q.swapped = True

    def device_copy(self, h):
        """The device page of the entry host page h is a copy of, if it still has one."""
        e = self.entry_on_host(h)
        return None if e is None else e.dev

    def swap_in(self, hs):
        if self.tier is None:
            raise kvpool.InvalidArgumentError
        rows = self.batch_rows(hs)
        if any(not self.reqs[r].swapped for r in rows):
            raise kvpool.InvalidArgumentError
        # Loads, plus each evictable device copy re-taken (once, however many of
        # the requests hold its host copy).
        need, copies = 0, set()
        for r in rows:
            for p in self.reqs[r].pages:
                if p & HOST:
                    d = self.device_copy(p & ~HOST)
                    if d is None:
                        need += 1
                    else:
                        copies.add(d)
        need += sum(1 for d in copies if d in self.lru and self.plist(d) != PINNED)
        if need > len(self.free) + self.evictable():
            raise kvpool.PoolExhaustedError
        # Device copies still there are re-taken first: no load, and no page
        # taken for a load evicts them.
        for r in rows:
            q = self.reqs[r]
            for k in reversed(range(len(q.pages))):  # last first: a chain's tail goes older on the host
                loc = q.pages[k]
                d = self.device_copy(loc & ~HOST) if loc & HOST else None
                if d is not None:
                    if d in self.lru:
                        self.lru.remove(d)
                    q.pages[k] = d
                    self.host_release(loc & ~HOST)
        for r in rows:
            q = self.reqs[r]
            for k, loc in enumerate(list(q.pages)):
                if not loc & HOST:
                    continue
                h = loc & ~HOST
                d = self.take_page()
                e = self.entry_on_host(h)
                if e is not None and e.dev is None and self.parent_live(e):
                    e.dev = d
                self.tier.loads.append((h, d))
                q.pages[k] = d
            q.swapped = False

    def close_swapped(self, r):
        """A swapped-out request's pages let go one by one, last first."""
        q = self.reqs[r]
        while q.pages:
            p = q.pages.pop()
            if self.release(p):
                self.drop_copy_into(p)
        del q.tokens[:]

    def take_offloads(self):
        if self.tier is None:
            return [], []
        q, self.tier.offloads = self.tier.offloads, []
        self.tier.offloaded += len(q)
        # A chain's tail goes older on the host than its parents: write_back queued device
        # victims tail first, write_through cache()'s pages head first.
        order = q[::-1] if self.writes_through() else q
        for i, (_d, h) in enumerate(order):
            self.tier.offloads = order[i + 1 :]
            self.host_release(h)
        self.tier.offloads = []
        return [d for d, _ in q], [h for _, h in q]

    def take_loads(self):
        if self.tier is None:
            return [], []
        q, self.tier.loads = self.tier.loads, []
        self.tier.loaded += len(q)
        for i in reversed(range(len(q))):  # last first: loads are queued in chain order
            self.tier.loads = q[:i]
            self.host_release(q[i][0])
        self.tier.loads = []
        return [h for h, _ in q], [d for _, d in q]

    def host_free_pages(self):
        return len(self.tier.free) + len(self.tier.lru) if self.tier else 0

    def host_registered(self):
        return sum(e.host is not None for e in self.reg.values())
