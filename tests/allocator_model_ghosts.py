"""The reference model's ghost registrations (the core's ``prefix/ghosts.rs``): a registration
removed while it has children (live entries or ghosts) keeps its id and key; a new registration of
the same key under the same parent takes that id back, so the chain below it is served again. And
the orphans (live entries whose parent registration went) that give way where no ghost was kept,
and the requests' chains that restart where a registration they chain through went."""


class GhostMixin:
    def new_reg(self, key, chain):
        """The id of a new registration of `key` under `chain`: a ghost's of the same key and
        parent comes back (its children chain on it again), else a fresh one."""
        for g, (gkey, parent) in self.ghosts.items():
            if gkey == key and parent == chain:
                del self.ghosts[g]
                return g
        self.next_reg += 1
        return self.next_reg - 1

    def forget(self, reg):
        """Registration `reg` leaves the index: it stays a ghost while it has children (room
        allowing), and ghosts left without any go."""
        e = self.reg.pop(reg)
        if self.has_kids(reg) and len(self.ghosts) < self.max_ghosts:
            self.ghosts[reg] = (e.key, e.parent_reg)
        self.prune_ghosts()

    def has_kids(self, reg):
        return any(e.parent_reg == reg for e in self.reg.values()) or any(g[1] == reg for g in self.ghosts.values())

    def prune_ghosts(self):
        while True:
            gone = [g for g in self.ghosts if not self.has_kids(g)]
            if not gone:
                return
            del self.ghosts[gone[0]]

    def drop_orphan(self, e):
        """Orphan `e` leaves the index with its copies: an unheld device copy
        goes FREE (a held one stays with its holders, unregistered), its
        priority ends, and its host copy goes FREE once nobody holds it."""
        self.forget(e.reg)
        if e.dev is not None:
            self.prio.pop(e.dev, None)
            if not self.holders(e.dev):
                self.lru.remove(e.dev)
                self.free.append(e.dev)
        if e.host is not None and not self.host_holders(e.host):
            self.tier.lru.remove(e.host)
            self.tier.free.append(e.host)

    def restart_dead_chain(self, r):
        """A chain any of whose registrations is gone resumes after the longest run of the
        request's own registered pages from page 0 that still chains. Returns whether it
        restarted. Not only the tip (another request's entry, evicted): a page inside the chain
        that duplicated another request's entry stands for that entry, and the pages after it
        are filed under it; once it goes they could never be hit (docs/allocator.md,
        duplicates: "the same holds for a duplicate inside the chain")."""
        q = self.reqs[r]
        if q.broken:
            return False
        gone = any(g not in self.reg for g in q.regs)
        # Also where such a duplicate's entry kept only its host copy: the restart makes the
        # request's own page its device copy (the core's ``walk_chain``).
        host_only = any(g in self.reg and self.reg[g].dev is None and self.entry_at(p) is None
                        for p, g in zip(q.pages, q.regs))
        if not gone and not host_only:
            return False
        chain, walked = 0, []
        for p in q.pages[: q.hashed]:
            e = self.entry_at(p)
            if e is None or e.parent_reg != chain or e.key[0] != q.salt:
                break
            chain = e.reg
            walked.append(chain)
        q.hashed, q.chain_reg = len(walked), chain
        # The chain now stands on the ids the walk reached: a page that duplicated an entry
        # gone since is filed under its own page's entry. Keeping the old ids would restart
        # the chain again at the next cache() where the core's chain, walked and live, goes on.
        q.regs = walked
        return True
