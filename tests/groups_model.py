"""A naive pure-Python model of GroupedAllocator for the hypothesis state
machine (test_groups_stateful.py): the anchor is allocator_model's Model,
recording the registration id its chain reached at each page; each other
page group a page list per request (0 where a sliding window released the
page), a free stack, an LRU list and a registration dict; each state group
a dict of live slots and a list of queued copies searched front to back.
Holders are counted by scanning; the hit rule tries every length from the
longest down. Same policies as the allocator, written the obvious way.

Errors are raised as the allocator's classes; a group's refusal carries the
group index (``GroupError.group``) so the test can compare it with the
allocator's message."""

from math import gcd

import kvpool
from allocator_model import MAX_CTX, Entry, Model


def cdiv(a, b):
    return -(-a // b)


class GroupExhausted(kvpool.PoolExhaustedError):
    def __init__(self, group):
        super().__init__(f"group {group}")
        self.group = group


class Rollback(kvpool.RollbackUnavailableError):
    def __init__(self, group):
        super().__init__(f"group {group}")
        self.group = group


class AnchorModel(Model):
    """allocator_model's Model plus each row's registration ids."""

    def __init__(self, num_pages, ps, gen_base):
        super().__init__(num_pages, ps, gen_base)
        self.regs = {}

    def new_row(self, salt=0):
        r, h = super().new_row(salt)
        self.regs[r] = []
        return r, h

    def shrink(self, r, n):
        super().shrink(r, n)
        self.regs[r] = self.regs[r][: self.reqs[r].hashed]

    def fork(self, h, n):
        out = super().fork(h, n)
        for c in out:
            self.regs[c & 0xFFFFFFFF] = list(self.regs[self.row(h)])
        return out

    def clear_cache(self):
        super().clear_cache()
        for r in self.regs:
            self.regs[r] = []

    def register(self, r):
        q = self.reqs[r]
        if q.broken:
            return
        known = q.known()
        k, chain = q.hashed, q.chain_reg
        regs = self.regs[r]
        while k < len(known) // self.ps:
            if chain and chain not in self.reg:
                # The chain's tip registration is gone: the chain stops.
                q.broken = True
                break
            p = q.pages[k]
            key = (q.salt, tuple(known[: (k + 1) * self.ps]))
            e = self.find(key)
            if e is None and self.entry_at(p) is None:
                self.prio.pop(p, None)
                reg = self.next_reg
                self.next_reg += 1
                self.reg[reg] = Entry(key, reg, chain, p)
            elif e is not None and e.dev == p:
                e.parent_reg = chain
                reg = e.reg
            elif e is not None and e.parent_reg == chain:
                reg = e.reg
            else:
                q.broken = True
                break
            chain, k = reg, k + 1
            regs.append(reg)
        q.hashed, q.chain_reg = k, chain

    def match(self, p, salt):
        pages, regs, prev = [], [], 0
        for k in range(max(len(p) - 1, 0) // self.ps):
            e = self.find((salt, tuple(p[: (k + 1) * self.ps])))
            if e is None or e.parent_reg != prev or e.dev is None:
                break
            pages.append(e.dev)
            regs.append(e.reg)
            prev = e.reg
        return pages, regs

    def open_matched(self, p, salt, pages, regs):
        r, h = self.new_row(salt)
        for q in pages:
            if q in self.lru:
                self.lru.remove(q)
        n = len(pages) * self.ps
        req = self.reqs[r]
        req.pages, req.tokens, req.prompt = list(pages), list(p[:n]), list(p)
        req.hashed, req.chain_reg = len(pages), (regs[-1] if regs else 0)
        self.regs[r] = list(regs)
        self.hit += n
        self.miss += len(p) - n
        return h

    def extend_checks(self, hs, cs, tokens):
        """extend's checks but the room; returns the pages it needs."""
        need, rows = 0, []
        for i in range(len(hs)):
            r = self.batch_rows(hs[: i + 1])[i]
            rows.append(r)
            q = self.reqs[r]
            n = len(q.tokens)
            if cs[i] < 0:
                raise kvpool.InvalidArgumentError
            if n + cs[i] > MAX_CTX:
                raise kvpool.ContextTooLongError
            need += cdiv(n + cs[i], self.ps) - cdiv(n, self.ps)
            if cs[i] > 0 and n % self.ps and self.holders(q.pages[-1]) > 1:
                need += 1
        if tokens is not None:
            if len(tokens) != sum(cs) or any(not 0 <= t < 2**31 for t in tokens):
                raise kvpool.InvalidArgumentError
            k = 0
            for r, c in zip(rows, cs):
                q = self.reqs[r]
                for j in range(c):
                    pos = len(q.tokens) + j
                    if pos < len(q.prompt) and q.prompt[pos] != tokens[k + j]:
                        raise kvpool.InvalidArgumentError
                k += c
        return need


class Pages:
    """A page group that is not the anchor."""

    def __init__(self, pages, ps, window):
        self.ps, self.window = ps, window
        self.free = list(range(pages - 1, 0, -1))
        self.lru, self.reg = [], {}  # reg: page -> anchor id
        self.lists, self.first, self.progress = {}, {}, {}
        self.queue, self.holding = [], 0  # [src, dst, slots]

    def window_start(self, n):
        return 0 if self.window is None else max(n - (self.window - 1), 0)

    def find(self, reg):
        return next((p for p, r in self.reg.items() if r == reg), None)

    def holders(self, p):
        lists = sum(l.count(p) for l in self.lists.values())
        return lists + sum(c[0] == p for c in self.queue[: self.holding])

    def pending(self):
        return sum(c[2] for c in self.queue)

    def take_page(self):
        if self.free:
            return self.free.pop()
        p = self.lru.pop(0)
        del self.reg[p]
        return p

    def release(self, p):
        if self.holders(p):
            return False
        (self.lru if p in self.reg else self.free).append(p)
        return True

    def drop_copy_into(self, p):
        while True:
            i = next((i for i, c in enumerate(self.queue) if c[1] == p), None)
            if i is None:
                return
            src = self.queue.pop(i)[0]
            self.holding -= 1
            if not self.release(src):
                return
            p = src

    def release_all(self, dropped):
        unheld = [p for p in reversed(dropped) if self.release(p)]
        for p in unheld:
            self.drop_copy_into(p)

    def open_row(self, r):
        self.lists[r], self.first[r], self.progress[r] = [], 0, 0

    def has_room(self, batch):
        released, need = [], 0
        for r, n, c in batch:
            if c == 0:
                continue
            need += cdiv(n + c, self.ps) - cdiv(n, self.ps)
            if self.window is not None and n > 0:
                to = self.window_start(n) // self.ps
                released += self.lists[r][min(self.first[r], to) : to]
        credited = sum(self.holders(p) == released.count(p) for p in set(released))
        for r, n, c in batch:
            if c > 0 and n % self.ps:
                last = self.lists[r][-1]
                if self.holders(last) - released.count(last) > 1:
                    need += 1
        return need <= len(self.free) + len(self.lru) + credited

    def grow_batch(self, batch):
        if self.window is not None:
            for r, n, c in batch:
                to = self.window_start(n) // self.ps
                if c and to > self.first[r]:
                    dropped = self.lists[r][self.first[r] : to]
                    for k in range(self.first[r], to):
                        self.lists[r][k] = 0
                    self.first[r] = to
                    self.release_all(dropped)
        out = []
        for r, n, c in batch:
            if c > 0 and n % self.ps:
                last = self.lists[r][-1]
                if self.holders(last) > 1:
                    q = self.take_page()
                    self.queue.append([last, q, n % self.ps])
                    self.lists[r][-1] = q
                else:
                    self.reg.pop(last, None)
            for t in range(n, n + c):
                if t % self.ps == 0:
                    self.lists[r].append(self.take_page())
                out.append(self.lists[r][-1] * self.ps + t % self.ps)
        self.holding = len(self.queue)
        return out

    def rollback_ok(self, r, n):
        return n == 0 or self.first[r] <= self.window_start(n) // self.ps

    def shrink(self, r, n, new):
        keep, np_ = cdiv(new, self.ps), cdiv(n, self.ps)
        dropped = self.lists[r][max(keep, self.first[r]) : np_]
        del self.lists[r][keep:]
        self.release_all(dropped)
        self.first[r] = min(self.first[r], keep)
        self.progress[r] = min(self.progress[r], new // self.ps)

    def fork_row(self, parent, child):
        self.lists[child] = list(self.lists[parent])
        self.first[child], self.progress[child] = self.first[parent], self.progress[parent]

    def start_hit(self, r, n, regs, a):
        first = self.window_start(n) // self.ps
        lst = [0] * first
        for k in range(first, n // self.ps):
            p = self.find(regs[(k + 1) * self.ps // a - 1])
            lst.append(p)
            if p in self.lru:
                self.lru.remove(p)
        self.lists[r], self.first[r], self.progress[r] = lst, first, n // self.ps

    def register(self, r, n, regs, a):
        upto = min(n, len(regs) * a) // self.ps
        for k in range(self.progress[r], upto):
            p = self.lists[r][k]
            if p == 0:
                continue
            reg = regs[(k + 1) * self.ps // a - 1]
            if self.find(reg) is None:
                self.reg[p] = reg
        self.progress[r] = max(self.progress[r], upto)

    def evict(self, n):
        k = min(n, len(self.lru))
        for _ in range(k):
            p = self.lru.pop(0)
            del self.reg[p]
            self.free.append(p)
        return k

    def clear(self):
        self.free += self.lru
        self.lru, self.reg = [], {}
        for r in self.progress:
            self.progress[r] = 0

    def take_copies(self):
        src, dst = [], []
        while self.queue:
            s, d, n = self.queue.pop(0)
            self.holding -= 1
            src += [s * self.ps + j for j in range(n)]
            dst += [d * self.ps + j for j in range(n)]
            if self.release(s):
                self.drop_copy_into(s)
        return src, dst

    def slots(self, r, n):
        return [self.lists[r][t // self.ps] * self.ps + t % self.ps for t in range(n)]

    def close_row(self, r, n):
        self.shrink(r, n, 0)
        del self.lists[r], self.first[r], self.progress[r]


class State:
    """A state group."""

    def __init__(self, slots, every):
        self.every = every
        self.free = list(range(slots - 1, 0, -1))
        self.lru, self.reg, self.live = [], {}, {}  # reg: slot -> anchor id
        self.queue, self.pins = [], []  # (src, dst); src -1 zeroes

    def available(self):
        return len(self.free) + len(self.lru)

    def checkpoint(self, reg):
        return next((s for s, r in self.reg.items() if r == reg), None)

    def reading(self, s):
        return sum(c[0] == s for c in self.queue)

    def holders(self, s):
        return list(self.live.values()).count(s) + self.reading(s) + self.pins.count(s)

    def release(self, s):
        if self.holders(s) == 0:
            (self.lru if s in self.reg else self.free).append(s)

    def drop_into(self, d):
        i = next((i for i, c in enumerate(self.queue) if c[1] == d), None)
        if i is not None:
            src = self.queue.pop(i)[0]
            if src > 0:
                self.release(src)

    def take_slot(self):
        if self.free:
            return self.free.pop()
        s = self.lru.pop(0)
        del self.reg[s]
        self.drop_into(s)
        return s

    def push(self, src, dst):
        src = next((c[0] for c in self.queue if c[1] == src), src) if src > 0 else src
        if src > 0 and src in self.lru:
            self.lru.remove(src)
        self.queue.append((src, dst))

    def open_row(self, r):
        s = self.take_slot()
        self.live[r] = s
        self.push(-1, s)

    def close_row(self, r):
        s = self.live.pop(r)
        if self.holders(s) == 0:
            self.release(s)
            self.drop_into(s)

    def fork_row(self, parent, child):
        s = self.take_slot()
        self.live[child] = s
        self.push(self.live[parent], s)

    def pin(self, s):
        if s in self.lru:
            self.lru.remove(s)
        self.pins.append(s)

    def unpin(self, s):
        self.pins.remove(s)
        self.release(s)

    def restore(self, r, src):
        s = self.live[r]
        if self.reading(s):
            fresh = self.take_slot()
            self.push(src, fresh)
            self.live[r] = fresh
            self.release(s)
        else:
            self.drop_into(s)
            self.push(src, s)

    def start_hit(self, r, src):
        s = self.take_slot()
        self.live[r] = s
        self.push(src, s)

    def take_checkpoint(self, r, reg):
        if self.checkpoint(reg) is not None or self.available() == 0:
            return
        c = self.take_slot()
        self.reg[c] = reg
        self.push(self.live[r], c)
        self.release(c)

    def evict(self, n):
        k = 0
        while k < n and self.lru:
            k += 1
            s = self.lru.pop(0)
            del self.reg[s]
            self.free.append(s)
            self.drop_into(s)
        return k

    def clear(self):
        self.evict(len(self.free) + len(self.lru) + len(self.reg) + 1)
        self.reg = {}

    def take_copies(self):
        src, dst = [], []
        while self.queue:
            s, d = self.queue.pop(0)
            src.append(s)
            dst.append(d)
            if s > 0:
                self.release(s)
        return src, dst


class GroupsModel:
    """specs: dicts as GroupedAllocator takes them."""

    def __init__(self, specs, gen_base, anchor_pages):
        sizes = [s.get("page_size", 1) for s in specs if s["kind"] != "state"]
        a = 0
        for p in sizes:
            a = gcd(a, p)
        step = a
        for p in sizes:
            step = step * p // gcd(step, p)
        self.a, self.step = a, step
        self.anchor_group = next(
            (g for g, s in enumerate(specs) if s["kind"] == "full" and s.get("page_size", 1) == a), None)
        pages = specs[self.anchor_group]["num_pages"] if self.anchor_group is not None else anchor_pages
        self.anchor = AnchorModel(pages, a, gen_base)
        self.groups = []
        for g, s in enumerate(specs):
            if g == self.anchor_group:
                self.groups.append(None)
            elif s["kind"] == "state":
                self.groups.append(State(s["num_slots"], s.get("checkpoint_every", 0) or step))
            else:
                self.groups.append(Pages(s["num_pages"], s.get("page_size", 1), s.get("window")))

    def anchor_index(self):
        return len(self.groups) if self.anchor_group is None else self.anchor_group

    def anchor_room(self, need):
        if need > len(self.anchor.free) + len(self.anchor.lru):
            raise GroupExhausted(self.anchor_index())

    def length(self, r):
        return len(self.anchor.reqs[r].tokens)

    def state_room(self, n):
        for g, e in enumerate(self.groups):
            if isinstance(e, State) and n > e.available():
                raise GroupExhausted(g)

    def open_row(self, r):
        for e in self.groups:
            if e is not None:
                e.open_row(r)

    def open(self, n):
        if n > len(self.anchor.free_rows):
            raise kvpool.TooManyRequestsError
        self.state_room(n)
        hs = self.anchor.open(n)
        for h in hs:
            self.open_row(h & 0xFFFFFFFF)
        return hs

    def _grow(self, batch, anchor_out):
        return [anchor_out if e is None else (e.grow_batch(batch) if isinstance(e, Pages) else [])
                for e in self.groups]

    def extend(self, hs, cs, tokens=None):
        need = self.anchor.extend_checks(hs, cs, tokens)
        batch = [(h & 0xFFFFFFFF, self.length(h & 0xFFFFFFFF), c) for h, c in zip(hs, cs)]
        for g, e in enumerate(self.groups):
            if e is None:
                self.anchor_room(need)
            elif isinstance(e, Pages) and not e.has_room(batch):
                raise GroupExhausted(g)
        if self.anchor_group is None:
            self.anchor_room(need)
        out = self.anchor.extend(hs, cs, tokens)
        if self.anchor_group is None:
            self.anchor.take_copies()
        return self._grow(batch, out)

    def admit(self, cs):
        if len(cs) > len(self.anchor.free_rows):
            raise kvpool.TooManyRequestsError
        for c in cs:
            if c < 0:
                raise kvpool.InvalidArgumentError
            if c > MAX_CTX:
                raise kvpool.ContextTooLongError
        need = sum(cdiv(c, self.a) for c in cs)
        fresh = [(None, 0, c) for c in cs]
        for g, e in enumerate(self.groups):
            if e is None:
                self.anchor_room(need)
            elif isinstance(e, Pages) and not e.has_room(fresh):
                raise GroupExhausted(g)
            elif isinstance(e, State) and len(cs) > e.available():
                raise GroupExhausted(g)
        if self.anchor_group is None:
            self.anchor_room(need)
        hs = self.anchor.open(len(cs))
        out = self.anchor.extend(hs, cs)
        batch = [(h & 0xFFFFFFFF, 0, c) for h, c in zip(hs, cs)]
        for r, _, _ in batch:
            self.open_row(r)
        return hs, self._grow(batch, out)

    def checkpoint_at(self, e, r, n):
        if n == 0:
            return -1
        regs = self.anchor.regs[r]
        if n % self.a or len(regs) * self.a < n:
            return None
        return e.checkpoint(regs[n // self.a - 1])

    def truncate(self, hs, ls):
        for i in range(len(hs)):
            r = self.anchor.batch_rows(hs[: i + 1])[i]
            if not 0 <= ls[i] <= self.length(r):
                raise kvpool.InvalidArgumentError
        batch = [(h & 0xFFFFFFFF, self.length(h & 0xFFFFFFFF), l) for h, l in zip(hs, ls)]
        sources = {}
        for r, n, l in batch:
            if l >= n:
                continue
            for g, e in enumerate(self.groups):
                if isinstance(e, Pages) and not e.rollback_ok(r, l):
                    raise Rollback(g)
                if isinstance(e, State):
                    s = self.checkpoint_at(e, r, l)
                    if s is None:
                        raise Rollback(g)
                    sources.setdefault(g, []).append(s)
        for g, e in enumerate(self.groups):
            if isinstance(e, State):
                fresh = sum(1 for r, n, l in batch if l < n and e.reading(e.live[r]))
                cached = sum(1 for s in set(sources.get(g, [])) if s > 0 and s in e.lru)
                if fresh > e.available() - cached:
                    raise GroupExhausted(g)
        self.anchor.truncate(hs, ls)
        for g, e in enumerate(self.groups):
            if isinstance(e, Pages):
                for r, n, l in batch:
                    e.progress[r] = min(e.progress[r], len(self.anchor.regs[r]) * self.a // e.ps)
                    e.shrink(r, n, l)
            elif isinstance(e, State):
                src = sources.get(g, [])
                for s in src:
                    if s > 0:
                        e.pin(s)
                for (r, _, _), s in zip([b for b in batch if b[2] < b[1]], src):
                    e.restore(r, s)
                for s in src:
                    if s > 0:
                        e.unpin(s)

    def register(self, rows):
        for r in rows:
            self.anchor.register(r)
        for e in self.groups:
            for r in rows:
                regs, n = self.anchor.regs[r], self.length(r)
                if isinstance(e, Pages):
                    e.register(r, n, regs, self.a)
                elif isinstance(e, State) and n > 0 and n % e.every == 0 and len(regs) * self.a >= n:
                    e.take_checkpoint(r, regs[n // self.a - 1])

    def cache(self, hs):
        self.register(self.anchor.batch_rows(hs))

    def close(self, hs, cache=False):
        rows = self.anchor.batch_rows(hs)
        if cache:
            self.register(rows)
        lens = [self.length(r) for r in rows]
        self.anchor.close(hs)
        self.close_rows(rows, lens)

    def close_rows(self, rows, lens):
        for e in self.groups:
            for r, n in zip(rows, lens):
                if isinstance(e, Pages):
                    e.close_row(r, n)
                elif isinstance(e, State):
                    e.close_row(r)

    def reset(self):
        rows = sorted(self.anchor.reqs)
        lens = [self.length(r) for r in rows]
        self.anchor.reset()
        self.close_rows(rows, lens)

    def fork(self, h, n):
        parent = self.anchor.row(h)
        if parent is None:
            raise kvpool.InvalidHandleError
        if n > len(self.anchor.free_rows):
            raise kvpool.TooManyRequestsError
        self.state_room(n)
        kids = self.anchor.fork(h, n)
        for k in kids:
            for e in self.groups:
                if e is not None:
                    e.fork_row(parent, k & 0xFFFFFFFF)
        return kids

    def serves(self, e, regs, n):
        reg = lambda end: regs[end // self.a - 1]  # noqa: E731
        if isinstance(e, Pages):
            return all(e.find(reg((k + 1) * e.ps)) is not None
                       for k in range(e.window_start(n) // e.ps, n // e.ps))
        if isinstance(e, State):
            return n == 0 or e.checkpoint(reg(n)) is not None
        return True

    def open_with_prefix(self, prompts, salt):
        if any(len(p) > MAX_CTX for p in prompts):
            raise kvpool.ContextTooLongError
        if len(prompts) > len(self.anchor.free_rows):
            raise kvpool.TooManyRequestsError
        hits = []
        for p in prompts:
            pages, regs = self.anchor.match(p, salt)
            top = min(max(len(p) - 1, 0), len(regs) * self.a) // self.step * self.step
            n = next(l for l in range(top, -1, -self.step) if all(self.serves(e, regs, l) for e in self.groups))
            hits.append((n, pages[: n // self.a], regs[: n // self.a]))
        srcs = {}
        for g, e in enumerate(self.groups):
            if isinstance(e, State):
                srcs[g] = [-1 if n == 0 else e.checkpoint(regs[n // self.a - 1]) for n, _, regs in hits]
                cached = sum(1 for s in set(srcs[g]) if s > 0 and s in e.lru)
                if len(prompts) > e.available() - cached:
                    raise GroupExhausted(g)
        for g, src in srcs.items():
            for s in src:
                if s > 0:
                    self.groups[g].pin(s)
        hs, cached = [], []
        for i, (p, (n, pages, regs)) in enumerate(zip(prompts, hits)):
            h = self.anchor.open_matched(p, salt, pages, regs)
            r = h & 0xFFFFFFFF
            for g, e in enumerate(self.groups):
                if isinstance(e, Pages):
                    e.start_hit(r, n, regs, self.a)
                elif isinstance(e, State):
                    e.start_hit(r, srcs[g][i])
            hs.append(h)
            cached.append(n)
        for g, src in srcs.items():
            for s in src:
                if s > 0:
                    self.groups[g].unpin(s)
        return hs, cached

    def evict(self, g, n):
        e = self.groups[g]
        return self.anchor.evict(n) if e is None else e.evict(n)

    def clear_cache(self):
        self.anchor.clear_cache()
        for e in self.groups:
            if e is not None:
                e.clear()

    def take_copies(self, g):
        e = self.groups[g]
        return self.anchor.take_copies() if e is None else e.take_copies()

    def counters(self, g):
        """(free + evictable, registered, evictable, pending copies)."""
        e = self.groups[g]
        if e is None:
            m = self.anchor
            return len(m.free) + len(m.lru), len(m.reg), len(m.lru), m.pending_copies()
        if isinstance(e, Pages):
            return len(e.free) + len(e.lru), len(e.reg), len(e.lru), e.pending()
        return e.available(), len(e.reg), len(e.lru), len(e.queue)

    def slots(self, g, r):
        e = self.groups[g]
        return self.anchor.slots(r) if e is None else e.slots(r, self.length(r))
