"""The grouped model's anchor (groups_model.py): allocator_model's Model,
recording the registration id its chain reached at each page, the ids a
grouped pool files its other groups' pages under."""

from allocator_model import MAX_CTX, Entry, Model

import kvpool


def cdiv(a, b):
    return -(-a // b)


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

    def restart_dead_chain(self, r):
        """``Model.restart_dead_chain``; the row's ids follow the restarted chain."""
        if not super().restart_dead_chain(r):
            return False
        self.regs[r] = self.regs[r][: self.reqs[r].hashed]
        return True

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
                self.prune_ghosts()
                reg = e.reg
            elif e is not None and e.parent_reg == chain:
                # A duplicate; a copy nobody holds gives this page its entry.
                if e.dev is not None and self.entry_at(p) is None and self.holders(e.dev) == 0:
                    self.take_over(e, p)
                reg = e.reg
            else:
                q.broken = True
                break
            chain, k = reg, k + 1
            regs.append(reg)
        q.hashed, q.chain_reg = k, chain
        q.regs = list(regs)  # what Model.restart_dead_chain checks

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
        self.regs[r], req.regs = list(regs), list(regs)
        self.hit += n
        self.miss += len(p) - n
        return h

    def extend_checks(self, hs, cs, tokens):
        """extend's checks but the room; returns the pages it needs."""
        need, rows, shared = 0, [], []
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
        return need
