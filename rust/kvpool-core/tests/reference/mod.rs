//! A deliberately naive reference model of the allocator: one page list and
//! one token list per request, holders counted by scanning every request,
//! the prefix index keyed by the exact content (salt, every token up to the
//! end of the page) instead of a hash, each entry naming its device page
//! and its host copy, the LRU list a plain Vec, the copy-on-write queue a
//! Vec of (source page, destination page, slots) searched front to back,
//! retention priorities a map scanned for the lowest (`priorities.rs`),
//! and the host tier (`tier.rs`) the same way. Same policies as the
//! allocator, written the obvious way.

#![allow(dead_code)]

use std::collections::BTreeMap;

use kvpool_core::PoolError;

mod copies;
mod extend;
mod prefix;
mod priorities;
mod requests;
mod tier;

pub use copies::QueuedCopy;
pub use priorities::Prio;
pub use tier::{Tier, HOST};

pub const MAX_REQ: usize = 6;
pub const MAX_CTX: usize = 12;

#[derive(Debug, PartialEq, Clone, Copy)]
pub enum Kind {
    Exhausted,
    Handle,
    TooMany,
    TooLong,
    Arg,
    Swapped,
    HostFull,
    /// A grouped pool's group short of pages or slots.
    GroupExhausted(usize),
    /// A grouped pool's group that cannot roll a request back.
    Rollback(usize),
}

pub fn kind(e: &PoolError) -> Kind {
    match e {
        PoolError::Exhausted { .. } => Kind::Exhausted,
        PoolError::InvalidHandle { .. } => Kind::Handle,
        PoolError::TooManyRequests { .. } => Kind::TooMany,
        PoolError::ContextTooLong { .. } => Kind::TooLong,
        PoolError::InvalidArgument(_) => Kind::Arg,
        PoolError::RequestSwappedOut { .. } => Kind::Swapped,
        PoolError::HostExhausted { .. } => Kind::HostFull,
        PoolError::GroupExhausted(e) => Kind::GroupExhausted(e.group),
        PoolError::RollbackUnavailable(e) => Kind::Rollback(e.group),
        PoolError::Invariant(m) => panic!("invariant error from a valid op: {m}"),
    }
}

/// Asserts agreement; returns whether the call succeeded.
pub fn same<T: PartialEq + std::fmt::Debug>(
    real: Result<T, PoolError>,
    model: Result<T, Kind>,
) -> bool {
    match (real, model) {
        (Ok(a), Ok(b)) => {
            assert_eq!(a, b);
            return true;
        }
        (Err(e), Err(k)) => assert_eq!(kind(&e), k, "{e}"),
        (a, b) => panic!("allocator {a:?} but model {b:?}"),
    }
    false
}

#[derive(Debug, Clone, Default)]
pub struct Req {
    /// Device pages, and host pages (`| HOST`) while swapped out.
    pub pages: Vec<usize>,
    /// Token id of every position, None when unknown.
    pub tokens: Vec<Option<i32>>,
    pub prompt: Vec<i32>,
    pub salt: i64,
    pub hashed: usize,
    pub chain_reg: u64,
    pub broken: bool,
    pub swapped: bool,
    /// The registration id the chain reached at each of its pages (what a
    /// grouped pool files its other groups' pages under).
    pub regs: Vec<u64>,
    /// The registration ids the chain passes through as the core's chain
    /// sees them: `regs`, except that a restart rewrites the pages it
    /// walked with the ids it reached (`regs` keeps the ones the groups'
    /// pages were filed under). Whether the chain stands is read here.
    pub through: Vec<u64>,
}

impl Req {
    pub fn len(&self) -> usize {
        self.tokens.len()
    }
    pub fn known(&self) -> Vec<i32> {
        self.tokens.iter().map_while(|t| *t).collect()
    }
}

#[derive(Debug, Clone)]
pub struct Entry {
    pub key: (i64, Vec<i32>),
    pub reg: u64,
    pub parent_reg: u64,
    /// Its device page, and its host copy.
    pub dev: Option<usize>,
    pub host: Option<usize>,
}

pub struct Model {
    pub ps: usize,
    pub free: Vec<usize>,
    /// CACHED pages (pinned ones too), in the order they were last filed.
    pub lru: Vec<usize>,
    /// Entries by registration id.
    pub reg: BTreeMap<u64, Entry>,
    pub tier: Option<Tier>,
    /// Registered device pages a caller gave a priority (the others have
    /// the default).
    pub prio: BTreeMap<usize, Prio>,
    /// The manual clock, ns.
    pub now: u64,
    pub max_pinned: usize,
    /// Durations given so far.
    pub ends_given: u64,
    pub next_reg: u64,
    pub free_rows: Vec<usize>,
    pub generation: Vec<u32>,
    pub reqs: BTreeMap<usize, Req>,
    /// Queued copies, oldest first. The first `holding` hold their source
    /// page (those queued by earlier calls; inside extend, its own do not).
    pub queue: Vec<QueuedCopy>,
    pub holding: usize,
    /// Copies dropped because their destination was released.
    pub dropped: usize,
    /// Duplicates that took over an unheld copy's registration.
    pub taken_over: usize,
    /// Orphans replaced by a recomputed page of the same content.
    pub orphans_replaced: usize,
    /// Removed registrations with children (live or ghost): id -> (key,
    /// parent id). A registration of the same key under the same parent
    /// takes the id back (the core's `prefix/ghosts.rs`).
    pub ghosts: BTreeMap<u64, ((i64, Vec<i32>), u64)>,
    /// At most this many ghosts (the core's index entries: one per page of
    /// the pool and of its host tier, page 0 of each aside).
    pub max_ghosts: usize,
    /// Registrations that took a ghost's id back.
    pub revived: usize,
    /// Slots ever queued for copying.
    pub queued: usize,
    pub hit: u64,
    pub miss: u64,
}

impl Model {
    pub fn new(pages: usize, ps: usize) -> Self {
        Self::with_tier(pages, ps, None)
    }

    pub fn with_tier(pages: usize, ps: usize, tier: Option<Tier>) -> Self {
        let max_ghosts = pages - 1 + tier.as_ref().map_or(0, |t| t.free.len());
        Model {
            ps,
            free: (1..pages).rev().collect(),
            lru: Vec::new(),
            prio: BTreeMap::new(),
            now: 0,
            max_pinned: (pages - 1) / 4,
            ends_given: 0,
            reg: BTreeMap::new(),
            tier,
            next_reg: 1,
            free_rows: (0..MAX_REQ).rev().collect(),
            generation: vec![0; MAX_REQ],
            reqs: BTreeMap::new(),
            queue: Vec::new(),
            holding: 0,
            dropped: 0,
            taken_over: 0,
            orphans_replaced: 0,
            ghosts: BTreeMap::new(),
            max_ghosts,
            revived: 0,
            queued: 0,
            hit: 0,
            miss: 0,
        }
    }

    pub fn row(&self, h: i64) -> Option<usize> {
        let row = (h & 0xFFFF_FFFF) as usize;
        let open = h >= 0 && row < MAX_REQ && self.reqs.contains_key(&row);
        (open && (h >> 32) as u32 == self.generation[row]).then_some(row)
    }

    /// Requests naming `p`, plus the queued copies that read it.
    pub fn holders(&self, p: usize) -> usize {
        let requests: usize = self
            .reqs
            .values()
            .map(|r| r.pages.iter().filter(|&&q| q == p).count())
            .sum();
        requests
            + self.queue[..self.holding]
                .iter()
                .filter(|c| c.src == p)
                .count()
    }

    pub fn slots(&self, row: usize) -> Vec<i64> {
        let r = &self.reqs[&row];
        (0..r.len())
            .map(|t| (r.pages[t / self.ps] * self.ps + t % self.ps) as i64)
            .collect()
    }

    /// Registration `reg` leaves the index: it stays a ghost while it has
    /// children (room allowing), and ghosts left without any go.
    pub(crate) fn forget(&mut self, reg: u64) {
        let e = self.reg.remove(&reg).unwrap();
        if self.has_kids(reg) && self.ghosts.len() < self.max_ghosts {
            self.ghosts.insert(reg, (e.key, e.parent_reg));
        }
        self.prune_ghosts();
    }

    fn has_kids(&self, reg: u64) -> bool {
        self.reg.values().any(|e| e.parent_reg == reg) || self.ghosts.values().any(|g| g.1 == reg)
    }

    /// Drops the ghosts left without children, up their chains.
    pub(crate) fn prune_ghosts(&mut self) {
        while let Some(g) = self.ghosts.keys().copied().find(|&g| !self.has_kids(g)) {
            self.ghosts.remove(&g);
        }
    }

    fn find(&self, key: &(i64, Vec<i32>)) -> Option<Entry> {
        self.reg.values().find(|e| &e.key == key).cloned()
    }

    /// The registration whose device copy is page `p`.
    pub fn entry_at(&self, p: usize) -> Option<u64> {
        self.reg.values().find(|e| e.dev == Some(p)).map(|e| e.reg)
    }

    pub fn is_registered(&self, p: usize) -> bool {
        self.entry_at(p).is_some()
    }

    /// Registered device pages (`cached_pages`).
    pub fn device_registered(&self) -> usize {
        self.reg.values().filter(|e| e.dev.is_some()).count()
    }

    /// Rows of a batch, or the error kind of its first bad handle/duplicate.
    pub fn rows(&self, hs: &[i64]) -> Result<Vec<usize>, Kind> {
        let mut rows: Vec<usize> = Vec::new();
        for &h in hs {
            let r = self.row(h).ok_or(Kind::Handle)?;
            if rows.contains(&r) {
                return Err(Kind::Arg);
            }
            rows.push(r);
        }
        Ok(rows)
    }

    pub fn take_page(&mut self) -> usize {
        if let Some(p) = self.free.pop() {
            return p;
        }
        self.pop_victim()
    }

    /// One holder of `p` gone (already taken out of its list or the
    /// queue): if none is left, `p` is CACHED or FREE. Returns whether.
    /// A host page (`| HOST`) goes to the host tier's lists.
    pub(crate) fn release(&mut self, p: usize) -> bool {
        if p & HOST != 0 {
            self.host_release(p & !HOST);
            return false;
        }
        if self.holders(p) > 0 {
            return false;
        }
        if self.is_registered(p) {
            self.lru.push(p);
        } else {
            self.free.push(p);
        }
        true
    }

    pub fn hold(&mut self, p: usize) {
        self.lru.retain(|&q| q != p);
    }
}
