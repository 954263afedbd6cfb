//! A per-run (radix) prefix index: one node per run of pages, SGLang style.
//! Holding a hit costs one count per node on its path, not one per page.

use std::collections::HashMap;

use super::hash;

pub const NIL: u32 = u32::MAX;
pub const EVENT_STORED: u8 = 0;
pub const EVENT_REMOVED: u8 = 1;

/// One recorded event, the same record as the core's `events::Raw` (the
/// bindings would read every field; this prototype reads some).
#[allow(dead_code)]
#[derive(Debug, Clone, Copy)]
pub struct Raw {
    pub hash: u128,
    pub parent: u128,
    pub salt: i64,
    pub page: u32,
    pub num_tokens: u32,
    pub kind: u8,
    pub medium: u8,
}

/// A run: `pages.len()` pages whose tokens follow the parent's last one.
#[derive(Debug, Default)]
pub struct Node {
    pub parent: u32,
    /// Tokens before this run (the parent's `start` plus its length).
    pub start: u32,
    pub tokens: Vec<i32>,
    pub pages: Vec<u32>,
    /// Chain hash of each page (empty when the tree keeps none).
    pub hashes: Vec<u128>,
    /// (first token, child); at page size > 1 several children may share
    /// a first token, and the first page tells them apart.
    pub children: Vec<(i32, u32)>,
    /// Holders whose last node is in this subtree.
    pub lock: u32,
    /// Where the parent lists this node (O(1) unlinking under a wide parent).
    pub slot: u32,
    pub salt: i64,
    pub reg: u64,
    pub prev: u32,
    pub next: u32,
    pub in_lru: bool,
    pub live: bool,
}

pub struct Tree {
    pub ps: usize,
    pub seed: u64,
    pub events_on: bool,
    /// Keep per-page chain hashes (forced on with events: they name pages).
    pub hashes_on: bool,
    pub nodes: Vec<Node>,
    free_nodes: Vec<u32>,
    pub roots: HashMap<i64, u32>,
    /// Evictable leaves (unlocked, childless, not a root); head = least recent.
    pub lru_head: u32,
    pub lru_tail: u32,
    next_reg: u64,
    pub events: Vec<Raw>,
    pub event_tokens: Vec<i32>,
}

/// Length of the common prefix of `a` and `b`: 16 tokens per branch, each
/// block an OR of XORs the compiler turns into vector ops.
#[inline]
fn common_prefix(a: &[i32], b: &[i32]) -> usize {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut i = 0;
    for (x, y) in a.chunks_exact(16).zip(b.chunks_exact(16)) {
        if x.iter().zip(y).fold(0, |acc, (p, q)| acc | (p ^ q)) != 0 {
            break;
        }
        i += 16;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

impl Tree {
    pub fn new(ps: usize, seed: u64, events_on: bool, hashes_on: bool) -> Self {
        Tree {
            ps,
            seed,
            events_on,
            hashes_on: hashes_on || events_on,
            nodes: Vec::new(),
            free_nodes: Vec::new(),
            roots: HashMap::new(),
            lru_head: NIL,
            lru_tail: NIL,
            next_reg: 1,
            events: Vec::new(),
            event_tokens: Vec::new(),
        }
    }

    /// A fresh node; a recycled slot keeps its vectors' capacity.
    fn alloc(&mut self, parent: u32, start: u32, salt: i64) -> u32 {
        let reg = self.next_reg;
        self.next_reg += 1;
        let id = match self.free_nodes.pop() {
            Some(id) => id,
            None => {
                self.nodes.push(Node::default());
                (self.nodes.len() - 1) as u32
            }
        };
        let n = &mut self.nodes[id as usize];
        n.parent = parent;
        n.start = start;
        n.lock = 0;
        n.salt = salt;
        n.reg = reg;
        n.prev = NIL;
        n.next = NIL;
        n.in_lru = false;
        n.live = true;
        id
    }

    fn root(&mut self, salt: i64) -> u32 {
        if let Some(&r) = self.roots.get(&salt) {
            return r;
        }
        let r = self.alloc(NIL, 0, salt);
        self.roots.insert(salt, r);
        r
    }

    fn lru_remove(&mut self, x: u32) {
        let (p, n) = {
            let node = &mut self.nodes[x as usize];
            node.in_lru = false;
            (node.prev, node.next)
        };
        if p == NIL {
            self.lru_head = n;
        } else {
            self.nodes[p as usize].next = n;
        }
        if n == NIL {
            self.lru_tail = p;
        } else {
            self.nodes[n as usize].prev = p;
        }
    }

    fn lru_push_back(&mut self, x: u32) {
        let t = self.lru_tail;
        let node = &mut self.nodes[x as usize];
        node.in_lru = true;
        node.prev = t;
        node.next = NIL;
        if t == NIL {
            self.lru_head = x;
        } else {
            self.nodes[t as usize].next = x;
        }
        self.lru_tail = x;
    }

    /// A parent whose last child was evicted goes to the front: the same
    /// chain's tail is evicted next (an approximation of exact LRU, which
    /// would place it by its last-use time).
    fn lru_push_front(&mut self, x: u32) {
        let h = self.lru_head;
        let node = &mut self.nodes[x as usize];
        node.in_lru = true;
        node.prev = NIL;
        node.next = h;
        if h == NIL {
            self.lru_tail = x;
        } else {
            self.nodes[h as usize].prev = x;
        }
        self.lru_head = x;
    }

    #[inline]
    fn lock(&mut self, x: u32) {
        if self.nodes[x as usize].in_lru {
            self.lru_remove(x);
        }
        self.nodes[x as usize].lock += 1;
    }

    /// Splits `x` after `k` pages; the new node takes the head, so `x` (which
    /// holders and the LRU name) keeps the tail and its children.
    fn split(&mut self, x: u32, k: usize) -> u32 {
        let cut = k * self.ps;
        let (parent, start, salt, lock) = {
            let n = &self.nodes[x as usize];
            (n.parent, n.start, n.salt, n.lock)
        };
        let p = self.alloc(parent, start, salt);
        let (head, tail) = if p < x {
            let (a, b) = self.nodes.split_at_mut(x as usize);
            (&mut a[p as usize], &mut b[0])
        } else {
            let (a, b) = self.nodes.split_at_mut(p as usize);
            (&mut b[0], &mut a[x as usize])
        };
        head.tokens.clear();
        head.tokens.extend_from_slice(&tail.tokens[..cut]);
        tail.tokens.drain(..cut);
        head.pages.clear();
        head.pages.extend_from_slice(&tail.pages[..k]);
        tail.pages.drain(..k);
        head.hashes.clear();
        if !tail.hashes.is_empty() {
            head.hashes.extend_from_slice(&tail.hashes[..k]);
            tail.hashes.drain(..k);
        }
        head.lock = lock;
        head.slot = tail.slot;
        head.children.clear();
        head.children.push((tail.tokens[0], x));
        tail.parent = p;
        tail.slot = 0;
        tail.start += cut as u32;
        let at = self.nodes[p as usize].slot as usize;
        self.nodes[parent as usize].children[at].1 = p;
        p
    }

    /// The child of `cur` whose first page starts `rest`, how many of its
    /// tokens `rest` matches (whole pages), and whether all of them.
    #[inline]
    fn descend(&mut self, cur: u32, rest: &[i32]) -> Option<(u32, usize, bool)> {
        let ps = self.ps;
        if rest.len() < ps {
            return None;
        }
        let nodes = &self.nodes;
        let &(_, child) = nodes[cur as usize]
            .children
            .iter()
            .find(|&&(k, c)| k == rest[0] && nodes[c as usize].tokens[..ps] == rest[..ps])?;
        let n = &nodes[child as usize].tokens;
        let m = common_prefix(n, rest) / ps * ps;
        if m < n.len() {
            return Some((self.split(child, m / ps), m, false));
        }
        Some((child, m, true))
    }

    /// Longest cached prefix of `tokens[..limit]`: its pages go to `out`,
    /// every node on its path is held. Returns (tokens matched, last node:
    /// pass it to `unlock`, or to `insert` as `from`).
    pub fn match_and_lock(
        &mut self,
        salt: i64,
        tokens: &[i32],
        limit: usize,
        out: &mut Vec<u32>,
    ) -> (usize, u32) {
        let end = limit.min(tokens.len()) / self.ps * self.ps;
        let mut cur = self.root(salt);
        self.lock(cur);
        let mut pos = 0;
        while let Some((c, m, whole)) = self.descend(cur, &tokens[pos..end]) {
            self.lock(c);
            out.extend_from_slice(&self.nodes[c as usize].pages);
            pos += m;
            cur = c;
            if !whole {
                break;
            }
        }
        (pos, cur)
    }

    /// Drops one holder's hold on the path ending at `last`.
    pub fn unlock(&mut self, last: u32) {
        let mut x = last;
        while x != NIL {
            let n = &mut self.nodes[x as usize];
            n.lock -= 1;
            let parent = n.parent;
            if n.lock == 0 && n.children.is_empty() && parent != NIL {
                self.lru_push_back(x);
            }
            x = parent;
        }
    }

    /// Registers `tokens[pos..]` (whole pages, `pages` one per page) under
    /// `from`, the holder's last node at depth `pos`. Pages already cached
    /// keep theirs and the holder's go to `dup`. The hold moves to the
    /// returned last node.
    pub fn insert(
        &mut self,
        from: u32,
        tokens: &[i32],
        mut pos: usize,
        pages: &[u32],
        dup: &mut Vec<u32>,
    ) -> u32 {
        let ps = self.ps;
        let end = tokens.len() / ps * ps;
        let mut cur = from;
        let mut i = 0;
        while let Some((c, m, whole)) = self.descend(cur, &tokens[pos..end]) {
            self.lock(c);
            dup.extend_from_slice(&pages[i..i + m / ps]);
            i += m / ps;
            pos += m;
            cur = c;
            if !whole {
                break;
            }
        }
        if pos == end {
            return cur;
        }
        let salt = self.nodes[cur as usize].salt;
        let is_root = self.nodes[cur as usize].parent == NIL;
        let mut h = if is_root {
            hash::root(salt)
        } else {
            self.nodes[cur as usize].hashes.last().copied().unwrap_or(0)
        };
        let x = self.alloc(cur, pos as u32, salt);
        let count = (end - pos) / ps;
        let new_pages = &pages[i..i + count];
        let run = &tokens[pos..end];
        let (seed, events_on, hashes_on) = (self.seed, self.events_on, self.hashes_on);
        let slot = self.nodes[cur as usize].children.len() as u32;
        let n = &mut self.nodes[x as usize];
        n.tokens.clear();
        n.tokens.extend_from_slice(run);
        n.pages.clear();
        n.pages.extend_from_slice(new_pages);
        n.hashes.clear();
        n.children.clear();
        n.lock = 1;
        n.slot = slot;
        if hashes_on {
            n.hashes.reserve(count);
            if events_on {
                self.events.reserve(count);
                self.event_tokens.reserve(run.len());
            }
            let mut parent_field = if is_root { 0 } else { h };
            for (pg, &page) in run.chunks_exact(ps).zip(new_pages) {
                h = hash::page(seed, h, pg);
                n.hashes.push(h);
                if events_on {
                    self.events.push(Raw {
                        hash: h,
                        parent: parent_field,
                        salt,
                        page,
                        num_tokens: ps as u32,
                        kind: EVENT_STORED,
                        medium: 0,
                    });
                    self.event_tokens.extend_from_slice(pg);
                    parent_field = h;
                }
            }
        }
        self.nodes[cur as usize].children.push((run[0], x));
        x
    }

    /// Evicts up to `n` pages from least recently used unlocked leaves, each
    /// leaf tail first; their ids go to `freed`. Returns how many.
    pub fn evict(&mut self, n: usize, freed: &mut Vec<u32>) -> usize {
        let mut left = n;
        while left > 0 && self.lru_head != NIL {
            let x = self.lru_head;
            let ps = self.ps;
            let node = &mut self.nodes[x as usize];
            let np = node.pages.len();
            let take = np.min(left);
            let keep = np - take;
            if self.events_on {
                for j in (keep..np).rev() {
                    self.events.push(Raw {
                        hash: node.hashes[j],
                        parent: 0,
                        salt: node.salt,
                        page: node.pages[j],
                        num_tokens: 0,
                        kind: EVENT_REMOVED,
                        medium: 0,
                    });
                }
            }
            freed.extend(node.pages[keep..].iter().rev());
            left -= take;
            if keep > 0 {
                node.tokens.truncate(keep * ps);
                node.pages.truncate(keep);
                node.hashes.truncate(keep.min(node.hashes.len()));
                continue;
            }
            node.tokens.clear();
            node.pages.clear();
            node.hashes.clear();
            node.live = false;
            let (parent, at) = (node.parent, node.slot as usize);
            self.lru_remove(x);
            self.free_nodes.push(x);
            let p = &mut self.nodes[parent as usize];
            p.children.swap_remove(at);
            if let Some(&(_, moved)) = p.children.get(at) {
                self.nodes[moved as usize].slot = at as u32;
            }
            let p = &self.nodes[parent as usize];
            if p.children.is_empty() && p.lock == 0 && p.parent != NIL {
                self.lru_push_front(parent);
            }
        }
        n - left
    }
}
