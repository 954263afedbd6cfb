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

from allocator_model import MAX_CTX
from groups_model_anchor import AnchorModel, cdiv
from groups_model_pages import Pages
from groups_model_state import State

import kvpool


class GroupExhausted(kvpool.PoolExhaustedError):
    def __init__(self, group):
        super().__init__(f"group {group}")
        self.group = group


class Rollback(kvpool.RollbackUnavailableError):
    def __init__(self, group):
        super().__init__(f"group {group}")
        self.group = group


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

    def roll_back_extend(self, hs, ls):
        return self.truncate(hs, ls, keep_prompt=True)

    def truncate(self, hs, ls, keep_prompt=False):
        for i in range(len(hs)):
            r = self.anchor.batch_rows(hs[: i + 1])[i]
            if not 0 <= ls[i] <= self.length(r):
                raise kvpool.InvalidArgumentError
        batch = [(h & 0xFFFFFFFF, self.length(h & 0xFFFFFFFF), keep) for h, keep in zip(hs, ls)]
        sources, back = {}, {}
        for r, n, keep in batch:
            if keep >= n:
                continue
            for g, e in enumerate(self.groups):
                if isinstance(e, Pages) and not e.rollback_ok(r, keep):
                    got = e.cached_window(r, keep, self.anchor.regs[r], self.a)
                    if got is None:
                        raise Rollback(g)
                    back.setdefault(g, []).append((r, *got))
                if isinstance(e, State):
                    s = self.checkpoint_at(e, r, keep)
                    if s is None:
                        raise Rollback(g)
                    sources.setdefault(g, []).append(s)
        for g, e in enumerate(self.groups):
            if isinstance(e, State):
                fresh = sum(1 for r, n, keep in batch if keep < n and e.reading(e.live[r]))
                cached = sum(1 for s in set(sources.get(g, [])) if s > 0 and s in e.lru)
                if fresh > e.available() - cached:
                    raise GroupExhausted(g)
        self.anchor.truncate(hs, ls, keep_prompt)
        for g, e in enumerate(self.groups):
            if isinstance(e, Pages):
                for r, n, keep in batch:
                    e.progress[r] = min(e.progress[r], len(self.anchor.regs[r]) * self.a // e.ps)
                    e.shrink(r, n, keep)
                for r, first, pages in back.get(g, []):
                    e.take_back(r, first, pages)
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
        for r in rows:  # a restarted anchor chain: the groups file again from there
            if self.anchor.restart_dead_chain(r):
                for e in self.groups:
                    if isinstance(e, Pages):
                        e.clamp_progress(r, len(self.anchor.regs[r]) * self.a // e.ps)
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
            n = next(k for k in range(top, -1, -self.step) if all(self.serves(e, regs, k) for e in self.groups))
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
