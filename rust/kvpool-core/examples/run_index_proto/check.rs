//! `Tree::check` (every invariant, by brute force) and the randomized
//! self-test against a model that knows nothing of runs: a map from each
//! cached whole-page prefix (salt, tokens) to its page.

use std::collections::HashMap;

use super::hash;
use super::tree::{Tree, EVENT_REMOVED, EVENT_STORED, NIL};

impl Tree {
    /// Checks every invariant; `holders` are the last nodes of the holds
    /// now taken. Returns the pages the tree holds.
    pub fn check(&self, holders: &[u32]) -> Vec<u32> {
        let ps = self.ps;
        let mut expect = vec![0u32; self.nodes.len()];
        for &h in holders {
            let mut x = h;
            while x != NIL {
                assert!(self.nodes[x as usize].live, "holder on a dead node");
                expect[x as usize] += 1;
                x = self.nodes[x as usize].parent;
            }
        }
        let (mut pages, mut regs) = (Vec::new(), Vec::new());
        for (i, n) in self.nodes.iter().enumerate() {
            if !n.live {
                continue;
            }
            let id = i as u32;
            assert_eq!(n.lock, expect[i], "node {i}: lock count");
            let root = n.parent == NIL;
            if root {
                assert!(n.tokens.is_empty() && n.pages.is_empty());
                assert_eq!(self.roots.get(&n.salt), Some(&id), "root {i}");
            } else {
                let p = &self.nodes[n.parent as usize];
                assert!(p.live, "node {i}: dead parent");
                assert_eq!(n.salt, p.salt, "node {i}: salt");
                assert_eq!(n.start as usize, p.start as usize + p.tokens.len());
                assert!(!n.pages.is_empty(), "node {i}: empty run");
                let key = n.tokens[0];
                let hits = p.children.iter().filter(|c| c.1 == id).count();
                assert_eq!(hits, 1, "node {i}: listed once by its parent");
                assert_eq!(
                    p.children[n.slot as usize],
                    (key, id),
                    "node {i}: key, slot"
                );
            }
            assert_eq!(n.tokens.len(), n.pages.len() * ps, "node {i}: lengths");
            assert_eq!(n.start as usize % ps, 0);
            let evictable = !root && n.children.is_empty() && n.lock == 0;
            assert_eq!(n.in_lru, evictable, "node {i}: LRU membership");
            for (a, &(_, x)) in n.children.iter().enumerate() {
                let fa = &self.nodes[x as usize].tokens[..ps];
                for &(_, y) in &n.children[a + 1..] {
                    assert_ne!(fa, &self.nodes[y as usize].tokens[..ps], "twin children");
                }
                assert_eq!(self.nodes[x as usize].parent, id);
            }
            if self.hashes_on && !root {
                assert_eq!(n.hashes.len(), n.pages.len(), "node {i}: hashes");
                let mut h = self.chain_before(id);
                for (j, pg) in n.tokens.chunks_exact(ps).enumerate() {
                    h = hash::reference(self.seed, h, pg);
                    assert_eq!(n.hashes[j], h, "node {i} page {j}: chain hash");
                }
            }
            pages.extend_from_slice(&n.pages);
            regs.push(n.reg);
        }
        regs.sort_unstable();
        regs.dedup();
        assert_eq!(
            regs.len(),
            self.nodes.iter().filter(|n| n.live).count(),
            "registration ids"
        );
        // The LRU list is linked both ways and holds exactly the leaves.
        let (mut x, mut prev, mut len) = (self.lru_head, NIL, 0);
        while x != NIL {
            let n = &self.nodes[x as usize];
            assert!(n.in_lru && n.prev == prev);
            prev = x;
            x = n.next;
            len += 1;
        }
        assert_eq!(prev, self.lru_tail);
        assert_eq!(
            len,
            self.nodes.iter().filter(|n| n.live && n.in_lru).count()
        );
        let mut sorted = pages.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), pages.len(), "a page in two places");
        pages
    }

    /// The chain value the first page of node `x` hashes from.
    fn chain_before(&self, x: u32) -> u128 {
        let p = &self.nodes[self.nodes[x as usize].parent as usize];
        if p.parent == NIL {
            hash::root(p.salt)
        } else {
            *p.hashes.last().unwrap()
        }
    }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// The model: (salt, whole-page prefix) -> page, and page -> its key.
#[derive(Default)]
struct Model {
    page_of: HashMap<(i64, Vec<i32>), u32>,
    key_of: HashMap<u32, (i64, Vec<i32>)>,
}

impl Model {
    fn matched(&self, ps: usize, salt: i64, t: &[i32], limit: usize) -> Vec<u32> {
        let mut out = Vec::new();
        for k in 1..=limit.min(t.len()) / ps {
            match self.page_of.get(&(salt, t[..k * ps].to_vec())) {
                Some(&p) => out.push(p),
                None => break,
            }
        }
        out
    }
}

struct Holder {
    salt: i64,
    tokens: Vec<i32>,
    pos: usize,
    last: u32,
    /// Pages taken for `tokens[pos..]`, not yet inserted.
    pending: Vec<u32>,
    /// The cached pages this holder holds (its prefix's, in order).
    held: Vec<u32>,
}

/// Applies the tree's new events to the model and checks each against it.
/// Evicts up to `n` pages; their pages go back to `free` and leave the
/// model, through the Removed events when the tree records them.
fn evict_into(
    t: &mut Tree,
    n: usize,
    events: bool,
    m: &mut Model,
    free: &mut Vec<u32>,
    seen: &mut usize,
) {
    let mut freed = Vec::new();
    let got = t.evict(n, &mut freed);
    assert_eq!(got, freed.len());
    if !events {
        free.extend(freed.iter().copied());
        for p in &freed {
            let key = m.key_of.remove(p).unwrap();
            m.page_of.remove(&key);
        }
    }
    drain_events(t, m, free, seen);
}

fn drain_events(t: &mut Tree, m: &mut Model, free: &mut Vec<u32>, from: &mut usize) {
    let ps = t.ps;
    let mut tok = 0;
    for e in &t.events[*from..] {
        if e.kind == EVENT_REMOVED {
            let key = m.key_of.remove(&e.page).expect("Removed: unknown page");
            m.page_of.remove(&key);
            let child = (key.1.len() + ps, key.0);
            assert!(
                !m.page_of
                    .keys()
                    .any(|k| k.0 == child.1 && k.1.len() == child.0 && k.1.starts_with(&key.1)),
                "evicted a page with a cached child"
            );
            free.push(e.page);
        } else {
            assert_eq!(e.kind, EVENT_STORED);
            let key = m.key_of.get(&e.page).expect("Stored: unregistered page");
            let n = key.1.len() / ps;
            let mut h = hash::root(key.0);
            let mut parent = 0;
            for k in 0..n {
                parent = if k == 0 { 0 } else { h };
                h = hash::reference(t.seed, h, &key.1[k * ps..(k + 1) * ps]);
            }
            assert_eq!(
                (e.hash, e.parent, e.salt),
                (h, parent, key.0),
                "Stored hash"
            );
            assert_eq!(&t.event_tokens[tok..tok + ps], &key.1[(n - 1) * ps..]);
            tok += ps;
        }
    }
    *from = t.events.len();
    t.event_tokens.clear();
}

/// Random traffic (prompts sharing prefixes, late inserts, evictions),
/// checked after every step against the model and `Tree::check`.
pub fn self_test(seed: u64, ps: usize, events: bool, steps: usize) {
    let total = 160usize;
    let mut t = Tree::new(ps, seed ^ 0x55, events, false);
    let mut m = Model::default();
    let mut rng = Rng(seed | 1);
    let mut free: Vec<u32> = (0..total as u32).collect();
    let docs: Vec<Vec<i32>> = (0..3)
        .map(|_| (0..64).map(|_| rng.below(3) as i32).collect())
        .collect();
    let mut holders: Vec<Holder> = Vec::new();
    let (mut seen, mut hits) = (0, 0);
    for _ in 0..steps {
        match rng.below(10) {
            0..=4 => {
                let salt = rng.below(2) as i64;
                let d = &docs[rng.below(docs.len())];
                let mut tokens = d[..rng.below(d.len())].to_vec();
                tokens.extend((0..rng.below(12)).map(|_| rng.below(3) as i32));
                let limit = tokens.len() - rng.below(2).min(tokens.len());
                let want = m.matched(ps, salt, &tokens, limit);
                let mut out = Vec::new();
                let (pos, last) = t.match_and_lock(salt, &tokens, limit, &mut out);
                assert_eq!(out, want, "matched pages");
                assert_eq!(pos, want.len() * ps);
                hits += pos;
                let need = tokens.len() / ps - pos / ps;
                if free.len() < need {
                    let n = need - free.len();
                    evict_into(&mut t, n, events, &mut m, &mut free, &mut seen);
                }
                if free.len() < need {
                    t.unlock(last);
                } else {
                    let pending = free.split_off(free.len() - need);
                    holders.push(Holder {
                        salt,
                        tokens,
                        pos,
                        last,
                        pending,
                        held: out,
                    });
                }
            }
            5..=6 if !holders.is_empty() => {
                let at = rng.below(holders.len());
                let h = &mut holders[at];
                if !h.pending.is_empty() {
                    let mut dup = Vec::new();
                    h.last = t.insert(h.last, &h.tokens, h.pos, &h.pending, &mut dup);
                    for (k, &p) in h.pending.iter().enumerate() {
                        let key = (h.salt, h.tokens[..h.pos + (k + 1) * ps].to_vec());
                        if m.page_of.contains_key(&key) {
                            assert!(dup.contains(&p), "a duplicate page kept");
                        } else {
                            m.page_of.insert(key.clone(), p);
                            m.key_of.insert(p, key);
                        }
                    }
                    free.extend_from_slice(&dup);
                    h.pending.clear();
                    h.held = m.matched(ps, h.salt, &h.tokens, h.tokens.len());
                    assert_eq!(h.held.len(), h.tokens.len() / ps);
                    drain_events(&mut t, &mut m, &mut free, &mut seen);
                }
            }
            7..=8 if !holders.is_empty() => {
                let h = holders.swap_remove(rng.below(holders.len()));
                free.extend_from_slice(&h.pending);
                t.unlock(h.last);
            }
            _ => {
                let n = rng.below(12);
                evict_into(&mut t, n, events, &mut m, &mut free, &mut seen);
            }
        }
        let last: Vec<u32> = holders.iter().map(|h| h.last).collect();
        let cached = t.check(&last);
        assert_eq!(cached.len(), m.page_of.len(), "tree vs model page count");
        for p in &cached {
            assert!(m.key_of.contains_key(p));
        }
        for h in &holders {
            let now = m.matched(ps, h.salt, &h.tokens, h.held.len() * ps);
            assert_eq!(now, h.held, "a held page was evicted");
        }
        let pending: usize = holders.iter().map(|h| h.pending.len()).sum();
        assert_eq!(
            free.len() + cached.len() + pending,
            total,
            "pages conserved"
        );
    }
    println!(
        "self-test seed {seed} page {ps} events {events}: {steps} steps ok, {hits} tokens hit, \
         {} nodes now",
        t.nodes.iter().filter(|n| n.live).count()
    );
}
