"""The grouped model's page group that is not the anchor (groups_model.py):
a page list per request (0 where a sliding window released the page), a
free stack, an LRU list and a registration dict, holders counted by
scanning, queued copies searched front to back."""

from groups_model_anchor import cdiv


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
        lists = sum(held.count(p) for held in self.lists.values())
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
        # A shared partly filled last page that m growing rows hold, of h holders once the
        # windows released theirs, is copied by all but the last holder to grow: min(m, h - 1).
        shared = [self.lists[r][-1] for r, n, c in batch if c > 0 and n % self.ps]
        for p in set(shared):
            h = self.holders(p) - released.count(p)
            if h > 1:
                need += min(shared.count(p), h - 1)
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

    def cached_window(self, r, n, regs, a):
        """What a truncate to ``n`` takes back from the cache for the window it released: the
        first page index and the pages up to the first held one (or the new last page), each
        filed under ``regs`` at its end; None when one is not cached."""
        first = self.window_start(n) // self.ps
        pages = []
        for k in range(first, min(self.first[r], cdiv(n, self.ps))):
            at = (k + 1) * self.ps
            p = self.find(regs[at // a - 1]) if at <= len(regs) * a else None
            if p is None:
                return None
            pages.append(p)
        return first, pages

    def take_back(self, r, first, pages):
        self.lists[r][first : first + len(pages)] = pages
        for p in pages:
            if p in self.lru:
                self.lru.remove(p)
        self.first[r] = first

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

    def clamp_progress(self, r, pages):
        """``cache()``'s progress on row ``r`` goes back to ``pages`` at most."""
        self.progress[r] = min(self.progress[r], pages)

    def register(self, r, n, regs, a):
        upto = min(n, len(regs) * a) // self.ps
        for k in range(self.progress[r], upto):
            p = self.lists[r][k]
            if p == 0:
                continue
            reg = regs[(k + 1) * self.ps // a - 1]
            q = self.find(reg)
            if q is None:
                self.reg[p] = reg
            elif q != p and q in self.lru and p not in self.reg:
                # A copy nobody holds gives its key to this one, filed nowhere,
                # and goes FREE.
                self.lru.remove(q)
                del self.reg[q]
                self.free.append(q)
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
