"""A naive pure-Python model of SlotAllocator, shared pages and a host tier
included, for the hypothesis state machine: one page list and one token list
per request, holders counted by scanning, the prefix index keyed by exact
content (salt, every token up to the end of the page) with registration ids,
each entry naming its device page and its host copy, the LRU lists plain lists
(in the order pages were last filed), retention priorities of device pages a
dict scanned for the lowest (allocator_model_priorities.py), the copy-on-write
queue a list of [source page, destination page, slots] searched front to back,
the offload and load queues lists of page pairs (tier part:
allocator_model_tier.py). Same policies as the allocator, written the obvious
way."""

from allocator_model_ghosts import GhostMixin
from allocator_model_priorities import PriorityModel
from allocator_model_tier import HOST, Entry, TierMixin

import kvpool

MAX_REQ, MAX_CTX = 5, 20
MAX_GEN = 0x7FFFFFFF


class Req:
    def __init__(self, salt=0):
        self.pages, self.tokens, self.prompt = [], [], []
        self.salt, self.hashed, self.chain_reg, self.broken = salt, 0, 0, False
        self.regs = []  # the registration each of its first `hashed` pages chains through
        self.swapped = False  # its pages list names host pages (| HOST)

    def copy(self):
        r = Req(self.salt)
        r.pages, r.tokens, r.prompt = list(self.pages), list(self.tokens), list(self.prompt)
        r.hashed, r.chain_reg, r.broken = self.hashed, self.chain_reg, self.broken
        r.regs = list(self.regs)
        return r

    def known(self):
        out = []
        for t in self.tokens:
            if t is None:
                break
            out.append(t)
        return out


class Model(PriorityModel, TierMixin, GhostMixin):
    def __init__(self, num_pages, ps, gen_base, host_pages=0, policy="write_back", max_pinned=None):
        self.ps = ps
        self.free = list(range(num_pages - 1, 0, -1))  # top = end: 1 first
        self.lru = []  # cached pages (pinned ones too), in the order last filed
        self.prio = {}  # registered device page -> [priority, until ns or None, seq]
        self.now = 0  # the manual clock, ns
        self.max_pinned = (num_pages - 1) // 4 if max_pinned is None else max_pinned
        self.ends_given = 0
        self.victims = []
        self.reg = {}  # registration id -> Entry
        self.next_reg = 1
        self.ghosts = {}  # removed ids with children -> (key, parent id): allocator_model_ghosts.py
        self.max_ghosts = num_pages - 1 + max(host_pages - 1, 0)
        self.init_tier(host_pages, policy)
        self.free_rows = list(range(MAX_REQ - 1, -1, -1))
        self.gen = [None] * MAX_REQ
        self.base = gen_base
        self.reqs = {}  # row -> Req
        # Queued copies [src page, dst page, slots], oldest first; the first
        # `holding` hold their source page (inside extend, its own do not yet).
        self.queue = []
        self.holding = 0
        self.dropped = 0  # copies dropped with their destination page
        self.hit = self.miss = 0

    # ----- helpers
    def row(self, h):
        r = h & 0xFFFFFFFF
        if h >= 0 and r < MAX_REQ and r in self.reqs and h >> 32 == self.gen[r]:
            return r
        return None

    def holders(self, p):
        """Requests naming p, plus the queued copies that read it."""
        held = sum(c[0] == p for c in self.queue[: self.holding])
        return sum(r.pages.count(p) for r in self.reqs.values()) + held

    def pending_copies(self):
        return sum(c[2] for c in self.queue)

    def slots(self, r):
        q = self.reqs[r]
        return [q.pages[t // self.ps] * self.ps + t % self.ps for t in range(len(q.tokens))]

    def find(self, key):
        for e in self.reg.values():
            if e.key == key:
                return e
        return None

    def entry_at(self, p):
        """The registration whose device copy is page p."""
        for e in self.reg.values():
            if e.dev == p:
                return e
        return None

    def device_registered(self):
        return sum(e.dev is not None for e in self.reg.values())

    def batch_rows(self, hs):
        rows = []
        for h in hs:
            r = self.row(h)
            if r is None:
                raise kvpool.InvalidHandleError
            if r in rows:
                raise kvpool.InvalidArgumentError
            rows.append(r)
        return rows

    def take_page(self):
        if self.free:
            return self.free.pop()
        return self.pop_victim()

    def release(self, p):
        """One holder of p gone: with none left, p is CACHED or FREE (True).
        A host page (| HOST) goes to the host tier's lists."""
        if p & HOST:
            self.host_release(p & ~HOST)
            return False
        if self.holders(p):
            return False
        (self.lru if self.entry_at(p) else self.free).append(p)
        return True

    def drop_copy_into(self, p):
        """Nobody holds p: the copy into it goes, its source is released, and
        so on down a chain of copies."""
        while True:
            i = next((i for i, c in enumerate(self.queue) if c[1] == p), None)
            if i is None:
                return
            src = self.queue.pop(i)[0]
            self.holding -= 1
            self.dropped += 1
            if not self.release(src):
                return
            p = src

    def take_copies(self):
        """Every queued copy as (src slots, dst slots); each lets its source go."""
        src = [c[0] * self.ps + j for c in self.queue for j in range(c[2])]
        dst = [c[1] * self.ps + j for c in self.queue for j in range(c[2])]
        while self.queue:
            s = self.queue.pop(0)[0]
            self.holding -= 1
            if self.release(s):
                self.drop_copy_into(s)
        return src, dst

    def new_row(self, salt=0):
        r = self.free_rows.pop()
        g = self.gen[r]
        self.gen[r] = self.base if g is None else (1 if g >= MAX_GEN else g + 1)
        self.reqs[r] = Req(salt)
        return r, (self.gen[r] << 32) | r

    # ----- operations
    def open(self, n):
        if n > len(self.free_rows):
            raise kvpool.TooManyRequestsError
        return [self.new_row()[1] for _ in range(n)]

    def open_with_prefix(self, prompts, salt):
        if any(len(p) > MAX_CTX for p in prompts):
            raise kvpool.ContextTooLongError
        if len(prompts) > len(self.free_rows):
            raise kvpool.TooManyRequestsError
        # Matches first (nothing changes): each page's location, its device
        # page or its host copy | HOST.
        found = []
        for p in prompts:
            pages, prev = [], 0
            for k in range(max(len(p) - 1, 0) // self.ps):
                e = self.find((salt, tuple(p[: (k + 1) * self.ps])))
                if e is None or e.parent_reg != prev:
                    break
                pages.append(e.dev if e.dev is not None else e.host | HOST)
                prev = e.reg
            found.append((pages, prev))
        if any(loc & HOST for pages, _ in found for loc in pages):
            return self.open_with_host_hits(prompts, salt, found)
        hs, cached = [], []
        for p, (pages, prev) in zip(prompts, found):
            h, n = self.open_on(p, salt, pages, prev)
            hs.append(h)
            cached.append(n)
        return hs, cached

    def open_on(self, p, salt, pages, prev):
        """A request of prompt p on the held device pages of a match ending at
        registration prev: (handle, cached_len)."""
        r, h = self.new_row(salt)
        for q in pages:
            if q in self.lru:
                self.lru.remove(q)
        n = len(pages) * self.ps
        req = self.reqs[r]
        req.pages, req.tokens, req.prompt = list(pages), list(p[:n]), list(p)
        req.hashed, req.chain_reg = len(pages), prev
        req.regs = [self.entry_at(q).reg for q in pages]
        self.hit += n
        self.miss += len(p) - n
        return h, n

    def extend(self, hs, cs, tokens=None):
        need = 0
        rows, shared = [], []
        for i in range(len(hs)):
            r = self.batch_rows(hs[: i + 1])[i]
            rows.append(r)
            q = self.reqs[r]
            n = len(q.tokens)
            if cs[i] < 0:
                raise kvpool.InvalidArgumentError
            if q.swapped:
                raise kvpool.RequestSwappedOutError
            if n + cs[i] > MAX_CTX:
                raise kvpool.ContextTooLongError
            need += -(-(n + cs[i]) // self.ps) - (-(-n // self.ps))
            if cs[i] > 0 and n % self.ps and self.holders(q.pages[-1]) > 1:
                shared.append(q.pages[-1])
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
        # A shared partly filled last page that m growing requests hold, of h holders, is
        # copied by all but the last holder to grow (which writes in place): min(m, h - 1).
        need += sum(min(shared.count(p), self.holders(p) - 1) for p in set(shared))
        if need > len(self.free) + self.evictable():
            raise kvpool.PoolExhaustedError
        out, k = [], 0
        for r, c in zip(rows, cs):
            q = self.reqs[r]
            n = len(q.tokens)
            if c > 0 and n % self.ps:
                last = q.pages[-1]
                if self.holders(last) > 1:
                    new = self.take_page()
                    self.queue.append([last, new, n % self.ps])
                    q.pages[-1] = new
                elif self.entry_at(last):
                    self.prio.pop(last, None)
                    self.drop_device_copy(last, False)
            for j in range(c):
                t = n + j
                if t % self.ps == 0:
                    q.pages.append(self.take_page())
                if tokens is not None:
                    q.tokens.append(tokens[k + j])
                else:
                    q.tokens.append(q.prompt[t] if t < len(q.prompt) else None)
                out.append(q.pages[-1] * self.ps + t % self.ps)
            k += c
        self.holding = len(self.queue)  # this call's copies hold from now on
        return out

    def shrink(self, r, n):
        q = self.reqs[r]
        keep = -(-n // self.ps)
        dropped = q.pages[keep:]
        del q.pages[keep:]
        del q.tokens[n:]
        unheld = [p for p in reversed(dropped) if self.release(p)]
        for p in unheld:  # then the copies into pages nobody holds now
            self.drop_copy_into(p)
        full = n // self.ps
        if q.hashed > full:
            # Where the last page kept duplicated another request's entry, the chain
            # resumes at that entry while every registration it stands for is live.
            intact = not q.broken and all(g in self.reg for g in q.regs)
            q.broken = False
            e = self.entry_at(q.pages[full - 1]) if full > 0 else None
            if e is not None:
                q.hashed, q.chain_reg = full, e.reg
            elif full > 0 and intact:
                q.hashed, q.chain_reg = full, q.regs[full - 1]
            else:
                q.hashed, q.chain_reg = 0, 0
            del q.regs[q.hashed :]

    def truncate(self, hs, ls, keep_prompt=False):
        """``keep_prompt``: ``roll_back_extend``, whose requests keep their prompts."""
        for i in range(len(hs)):
            r = self.batch_rows(hs[: i + 1])[i]
            if self.reqs[r].swapped:
                raise kvpool.RequestSwappedOutError
            if not 0 <= ls[i] <= len(self.reqs[r].tokens):
                raise kvpool.InvalidArgumentError
        for h, n in zip(hs, ls):
            q = self.reqs[self.row(h)]
            if n < len(q.tokens) and not keep_prompt:
                del q.prompt[n:]  # rolled back: what follows need not be the prompt
            self.shrink(self.row(h), n)

    def register_rows(self, rows):
        """``cache()`` of ``rows``: every dead chain restarts first (as the core does before it
        registers anything), then each row registers."""
        for r in rows:
            self.restart_dead_chain(r)
        for r in rows:
            self.register(r)

    def register(self, r):
        q = self.reqs[r]
        if q.broken:
            return
        known = q.known()
        k, chain = q.hashed, q.chain_reg
        while k < len(known) // self.ps:
            if chain and chain not in self.reg:
                # The chain's tip registration is gone: the chain stops.
                q.broken = True
                break
            p = q.pages[k]
            key = (q.salt, tuple(known[: (k + 1) * self.ps]))
            e = self.find(key)
            if e is not None and e.dev != p and self.entry_at(p) is None and not self.parent_live(e):
                # An orphan of this content gives way to this page.
                self.drop_orphan(e)
                e = None
            if e is None and self.entry_at(p) is None:
                self.prio.pop(p, None)
                reg = self.new_reg(key, chain)
                self.reg[reg] = Entry(key, reg, chain, p)
            elif e is not None and e.dev == p:
                e.parent_reg = chain
                self.prune_ghosts()  # its old parent may be a ghost it was the last child of
                reg = e.reg
            elif e is not None and e.parent_reg == chain:
                # A duplicate; one whose only copy is on the host, or on a
                # device page nobody holds, takes this page as its device copy
                # (the unheld page goes FREE, its priority moving along).
                if self.entry_at(p) is None:
                    if e.dev is None:
                        e.dev = p
                    elif self.holders(e.dev) == 0:
                        self.take_over(e, p)
                reg = e.reg
            else:
                q.broken = True
                break
            chain, k = reg, k + 1
            q.regs.append(reg)
        start = q.hashed
        q.hashed, q.chain_reg = k, chain
        if k > start and self.writes_through():
            self.write_through(r, start, k)

    def take_over(self, e, p):
        """Entry `e`'s device copy moves from its CACHED page to page `p`,
        which goes FREE; a priority's end counts as given now."""
        q = e.dev
        self.lru.remove(q)
        x = self.prio.pop(q, None)
        if x is not None:
            if x[1] is not None:
                self.ends_given += 1
                x = [x[0], x[1], self.ends_given]
            self.prio[p] = x
        e.dev = p
        self.free.append(q)

    def cache(self, hs):
        rows = self.batch_rows(hs)
        if any(self.reqs[r].swapped for r in rows):
            raise kvpool.RequestSwappedOutError
        self.register_rows(rows)

    def retired(self, r):
        g = self.gen[r]
        return g is not None and (1 if g >= MAX_GEN else g + 1) == self.base

    def close(self, hs, cache=False):
        rows = self.batch_rows(hs)
        if cache:
            if any(self.reqs[r].swapped for r in rows):
                raise kvpool.RequestSwappedOutError
            self.register_rows(rows)
        for r in rows:
            self.close_row(r)
            if not self.retired(r):
                self.free_rows.append(r)

    def close_row(self, r):
        if self.reqs[r].swapped:
            self.close_swapped(r)
        else:
            self.shrink(r, 0)
        del self.reqs[r]

    def reset(self):
        for r in sorted(self.reqs):
            self.close_row(r)
        self.free_rows = [r for r in range(MAX_REQ - 1, -1, -1) if not self.retired(r)]

    def fork(self, h, n):
        parent = self.row(h)
        if parent is None:
            raise kvpool.InvalidHandleError
        if self.reqs[parent].swapped:
            raise kvpool.RequestSwappedOutError
        if n > len(self.free_rows):
            raise kvpool.TooManyRequestsError
        out = []
        for _ in range(n):
            copy = self.reqs[parent].copy()
            r, child = self.new_row()
            self.reqs[r] = copy
            out.append(child)
        return out

    def evict(self, n):
        k = min(n, self.evictable())
        for _ in range(k):
            self.free.append(self.pop_victim())
        return k

    def clear_cache(self):
        self.free.extend(self.cache_order())
        self.lru = []
        if self.tier:
            self.tier.free.extend(self.tier.lru)
            self.tier.lru = []
        self.reg = {}
        self.ghosts = {}
        self.prio = {}
        for q in self.reqs.values():
            q.hashed, q.chain_reg, q.broken = 0, 0, False
            q.regs = []
