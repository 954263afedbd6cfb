"""The grouped model's state group (groups_model.py): a dict of live slots,
checkpoints filed under anchor ids, and a list of queued copies searched
front to back."""


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
