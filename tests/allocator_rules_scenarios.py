"""Rules of the allocator state machine (test_allocator_stateful.py) that play
a whole request across several calls: a request rolled back into its prompt
and continued with other tokens, parallel sampling from a partly filled page,
and a registered prompt asked for again. A mixin: AllocatorMachine holds the
allocator, the model, the store and the helpers these rules call."""

from allocator_machine_calls import run_both, serve_prompt
from allocator_model import MAX_CTX
from hypothesis import strategies as st
from hypothesis.stateful import rule


class ScenarioRules:
    @rule(data=st.data(), base=st.integers(0, 1), length=st.integers(2, MAX_CTX), n=st.integers(1, 6),
          seed=st.integers(0, 2), cache=st.booleans())
    def diverge(self, data, base, length, n, seed, cache):
        """A whole rolled-back request: open on a prompt, prefill it, truncate
        to inside the prompt, continue with other tokens, maybe cache."""
        h = serve_prompt(self, base, length)
        if h is None:
            return
        keep = [data.draw(st.integers(0, length - 1))]
        if run_both(lambda: self.a.truncate([h], keep), lambda: self.m.truncate([h], keep)):
            self.store.truncate(h, keep[0])
        toks = [(seed + 2 * j) % 3 for j in range(n)]
        if run_both(lambda: self.a.extend([h], [n], tokens=toks), lambda: self.m.extend([h], [n], toks)):
            self.write([h])
            if cache:
                self.drain()
                run_both(lambda: self.a.cache([h]), lambda: self.m.cache([h]))

    @rule(data=st.data(), n=st.integers(1, 2), close=st.sampled_from([None, "parent", "child"]))
    def sample(self, data, n, close):
        """Parallel sampling: fork, then the children and the parent write one
        token each (the first writers into a shared partly filled page copy
        it); then maybe the parent or a child finishes, its copies undrained."""
        if data.draw(st.booleans()):
            hs = self.pick_where(data, lambda q: len(q.tokens) % self.m.ps != 0)
        else:  # a new request, most often ending inside a page
            k = [data.draw(st.integers(1, MAX_CTX - 1))]
            r = run_both(lambda: self.a.admit(k), lambda: self.model_admit(k, None))
            hs = []
            if r:
                assert r[0][0].tolist() == r[1][0]
                hs = r[1][0]
                self.issued += hs
                self.write(hs)
        if not hs:
            return
        r = run_both(lambda: self.a.fork(hs[0], n), lambda: self.m.fork(hs[0], n))
        if r:
            assert r[0].tolist() == r[1]
            kids = r[1]
            self.issued += kids
            self.store.fork(hs[0], kids)
            batch = kids + hs
            r = run_both(lambda: self.a.extend(batch, 1), lambda: self.m.extend(batch, [1] * len(batch)))
            if r:
                assert r[0].tolist() == r[1]
                self.write(batch)
                if close:
                    gone = hs if close == "parent" else kids[:1]
                    run_both(lambda: self.a.close(gone), lambda: self.m.close(gone))

    def remember(self, hs):
        for h in hs:
            r = self.m.row(h)
            if r is not None and len(self.m.reqs[r].known()) > 1 and len(self.texts) < 8:
                self.texts.append((self.m.reqs[r].known(), self.m.reqs[r].salt))

    @rule(data=st.data(), evict_first=st.booleans())
    def revisit(self, data, evict_first):
        """A prompt whose pages were registered, asked for again (after its pages
        left the device, with a host tier often on the host): hits on either tier."""
        if not self.texts:
            return
        text, salt = data.draw(st.sampled_from(self.texts))
        if evict_first:
            self.evict(len(self.m.lru))
        r = run_both(lambda: self.a.open_with_prefix(text, [len(text)], salt),
                     lambda: self.m.open_with_prefix([text], salt))
        if r:
            (hs, cached), (mhs, mcached) = r
            assert hs.tolist() == mhs and cached.tolist() == mcached
            self.issued += mhs
            self.store.hit(self.m, mhs[0], mcached[0])

    @rule(base=st.integers(0, 1), length=st.integers(2, MAX_CTX - 2), evict=st.integers(0, 3),
          more=st.integers(1, 2))
    def twice(self, base, length, evict, more):
        """A prompt asked for again while its first request still holds it: the second
        recomputes the last page (a duplicate of the first's), so its chain ends on the
        first's entry. The first finishes, eviction may take that entry, and the second
        goes on and caches: its chain restarts where the entry is gone."""
        first = serve_prompt(self, base, length)
        if first is None:
            return
        self.drain()
        run_both(lambda: self.a.cache([first]), lambda: self.m.cache([first]))
        second = serve_prompt(self, base, length)
        if second is None:
            return
        self.drain()
        run_both(lambda: self.a.cache([second]), lambda: self.m.cache([second]))
        run_both(lambda: self.a.close([first]), lambda: self.m.close([first]))
        if evict:
            self.evict(evict)
        toks = [(base + 2 * j) % 3 for j in range(more)]
        if run_both(lambda: self.a.extend([second], [more], tokens=toks),
                    lambda: self.m.extend([second], [more], toks)):
            self.write([second])
            self.drain()
            run_both(lambda: self.a.cache([second]), lambda: self.m.cache([second]))
