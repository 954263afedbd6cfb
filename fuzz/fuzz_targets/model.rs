//! The harness's own record of what every open request and every slot
//! holds (device and host), and the checks run against the allocator after
//! each operation.
//!
//! Each write into a slot gets a fresh id, and the slot remembers it along
//! with the writer's salt and the writer's full token context (positions
//! `0..=i`, when all are known). A request remembers the write ids at its
//! positions. So if the core ever lets a request write into a page another
//! request (or the cache) still needs, or serves a prefix hit from a page
//! computed for other tokens, another salt or another parent chain, the
//! slot's cell no longer matches what a request believes it holds.

use kvpool_core::{
    Events, SlotAllocator, EVENT_CLEARED, EVENT_REMOVED, EVENT_STORED, MEDIUM_DEVICE,
};
use std::collections::{HashMap, HashSet};

/// What a slot holds: the write that filled it, and the KV identity it has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cell {
    pub write: u64,
    pub salt: i64,
    /// The writer's token ids at positions `0..=i` (None if any is unknown).
    pub ctx: Option<Vec<i32>>,
}

/// The copy-on-write copies queued in `a`, in order, without draining them.
pub fn queued_copies(a: &SlotAllocator) -> (Vec<i64>, Vec<i64>) {
    a.clone().take_copies()
}

/// Every transfer queued in `a`, in the order an engine takes them.
pub struct Queued {
    pub offloads: (Vec<i64>, Vec<i64>),
    pub loads: (Vec<i64>, Vec<i64>),
    pub copies: (Vec<i64>, Vec<i64>),
}

pub fn queued(a: &SlotAllocator) -> Queued {
    let mut b = a.clone();
    Queued {
        offloads: b.take_offloads(),
        loads: b.take_loads(),
        copies: b.take_copies(),
    }
}

/// One open request as the harness sees it.
#[derive(Debug, Clone, Default)]
pub struct Req {
    pub salt: i64,
    pub prompt: Vec<i32>,
    /// Token id at each position (None: unknown).
    pub tokens: Vec<Option<i32>>,
    /// Write id each position's slot must hold.
    pub writes: Vec<u64>,
    /// While swapped out: the device pages `swap_out` left it holding
    /// (`allocator/swap.rs`): shared ones (another holder, swapped out or
    /// not, or a queued copy reading it) and ones a queued copy or load was
    /// still to fill. It holds them as before, so they count as its pages.
    pub kept_on_device: Vec<i32>,
}

impl Req {
    /// Leading known token ids (what `known_tokens` must return).
    pub fn known(&self) -> Vec<i32> {
        self.tokens.iter().map_while(|t| *t).collect()
    }
}

pub struct Model {
    pub reqs: HashMap<i64, Req>,
    content: Vec<Option<Cell>>,
    /// What each host slot holds.
    host: Vec<Option<Cell>>,
    ps: usize,
    next_write: u64,
    /// Registered pages of each tier (medium, page), replayed from the
    /// Stored/Removed/Cleared events.
    pub registered: HashSet<(u8, i32)>,
    /// Token sequences seen (prompts, closed requests' tokens), for new
    /// prompts to reuse so that prefixes repeat.
    pub texts: Vec<Vec<i32>>,
    /// Leave copy-on-write copies queued until a step writes into a queued
    /// copy's destination, a call registers pages, or `Drain` (otherwise
    /// every extend runs its copies at once, as `KVPool.extend` does).
    pub defer: bool,
    /// Copies (slot pairs) queued as of the harness's last look.
    pub pending: usize,
}

impl Model {
    pub fn new(a: &SlotAllocator) -> Self {
        Model {
            reqs: HashMap::new(),
            content: vec![None; a.num_slots()],
            host: vec![None; a.host_pages() * a.page_size()],
            ps: a.page_size(),
            next_write: 1,
            registered: HashSet::new(),
            texts: Vec::new(),
            defer: false,
            pending: 0,
        }
    }

    /// Takes every queued transfer and runs it, as an engine does before a
    /// step's K/V writes: offloads, loads, copies.
    pub fn drain(&mut self, a: &mut SlotAllocator) {
        let q = Queued {
            offloads: a.take_offloads(),
            loads: a.take_loads(),
            copies: a.take_copies(),
        };
        Self::run(&mut self.content, &mut self.host, self.ps, &q);
        self.pending = 0;
        assert_eq!(a.pending_copies(), 0, "copies left after take_copies");
        assert_eq!(
            (a.pending_offloads(), a.pending_loads()),
            (0, 0),
            "transfers left after taking them"
        );
    }

    /// Runs `q` on the device and host cells, in the documented order.
    fn run(dev: &mut [Option<Cell>], host: &mut [Option<Cell>], ps: usize, q: &Queued) {
        for (&d, &h) in q.offloads.0.iter().zip(&q.offloads.1) {
            let (d, h) = (d as usize * ps, h as usize * ps);
            host[h..h + ps].clone_from_slice(&dev[d..d + ps]);
        }
        for (&h, &d) in q.loads.0.iter().zip(&q.loads.1) {
            let (h, d) = (h as usize * ps, d as usize * ps);
            dev[d..d + ps].clone_from_slice(&host[h..h + ps]);
        }
        Self::run_copies(dev, &q.copies.0, &q.copies.1);
    }

    /// What the device slots will hold once `a`'s queued transfers ran.
    pub fn settled(&self, a: &SlotAllocator) -> Vec<Option<Cell>> {
        let (mut dev, mut host) = (self.content.clone(), self.host.clone());
        Self::run(&mut dev, &mut host, self.ps, &queued(a));
        dev
    }

    /// Request `h` writes position `pos` (already pushed to its tokens) to `slot`.
    pub fn write(&mut self, h: i64, pos: usize, slot: i64) {
        let r = self.reqs.get_mut(&h).expect("model request");
        let ctx: Option<Vec<i32>> = r.tokens[..=pos].iter().copied().collect();
        let write = self.next_write;
        self.next_write += 1;
        if r.writes.len() <= pos {
            r.writes.resize(pos + 1, 0);
        }
        r.writes[pos] = write;
        self.content[slot as usize] = Some(Cell {
            write,
            salt: r.salt,
            ctx,
        });
    }

    /// Forgets a closed request, remembering its known tokens.
    pub fn close(&mut self, h: i64) {
        if let Some(r) = self.reqs.remove(&h) {
            let t = r.known();
            if !t.is_empty() && self.texts.len() < 64 {
                self.texts.push(t);
            }
        }
    }

    /// Runs copy-on-write copies in queue order. (A copy can read an
    /// earlier one's destination only when the queue was left undrained
    /// across the calls that queued them.)
    fn run_copies(content: &mut [Option<Cell>], src: &[i64], dst: &[i64]) {
        assert_eq!(
            src.len(),
            dst.len(),
            "take_copies: src and dst differ in length"
        );
        for (&s, &d) in src.iter().zip(dst) {
            content[d as usize] = content[s as usize].clone();
        }
    }

    /// Replays drained events into `registered`, checking each Stored
    /// device page holds exactly the full known context and salt the event
    /// claims once the queued transfers have run (a host hit's page is
    /// Stored when its load is queued; a host page's copy is still queued
    /// when its event is sent, and host events are not checked here).
    pub fn apply_events(&mut self, e: &Events, a: &SlotAllocator) {
        let ps = a.page_size();
        // A device page Stored by a host hit is filled by its queued load:
        // check what each page holds once the queued transfers have run.
        let settled = self.settled(a);
        let mut tok = 0usize;
        for i in 0..e.len() {
            let p = e.page[i];
            let at = (e.medium[i], p);
            match e.kind[i] {
                EVENT_STORED => {
                    assert_eq!(e.num_tokens[i] as usize, ps, "Stored a partial page");
                    assert!(self.registered.insert(at), "page {at:?} Stored twice");
                    let ids = &e.token_ids[tok..tok + ps];
                    tok += ps;
                    if e.medium[i] != MEDIUM_DEVICE {
                        continue;
                    }
                    for (j, &id) in ids.iter().enumerate() {
                        let slot = p as i64 * ps as i64 + j as i64;
                        let c = settled[slot as usize]
                            .as_ref()
                            .expect("Stored a page never written");
                        let ctx = c.ctx.as_ref().expect("Stored a page with unknown tokens");
                        assert_eq!(
                            ctx.last(),
                            Some(&id),
                            "Stored token ids differ from the page's"
                        );
                        assert_eq!(c.salt, e.salt[i], "Stored salt differs from the writer's");
                    }
                }
                EVENT_REMOVED => {
                    assert!(
                        self.registered.remove(&at),
                        "Removed page {at:?} was not registered"
                    );
                }
                EVENT_CLEARED => self.registered.clear(),
                k => panic!("unknown event kind {k}"),
            }
        }
        assert_eq!(tok, e.token_ids.len(), "Stored token ids left over");
    }

    /// Holders of every held page: the requests naming it in their public
    /// page lists, swapped-out requests for the device pages they kept, and
    /// the queued copies reading it (one per copy, not per slot pair: a
    /// copy's pairs start at offset 0 of its pages).
    pub fn holders(&self, a: &SlotAllocator) -> HashMap<i32, usize> {
        let mut m = HashMap::new();
        for (&h, r) in &self.reqs {
            if a.is_swapped(h) == Ok(true) {
                for &p in &r.kept_on_device {
                    *m.entry(p).or_insert(0) += 1;
                }
                continue;
            }
            for p in a.pages(h).expect("open") {
                *m.entry(p).or_insert(0) += 1;
            }
        }
        let ps = a.page_size() as i64;
        for &s in &queued_copies(a).0 {
            if s % ps == 0 {
                *m.entry((s / ps) as i32).or_insert(0) += 1;
            }
        }
        m
    }

    /// Everything checked after every operation.
    pub fn verify(&self, a: &SlotAllocator) {
        if let Err(e) = a.check() {
            panic!("check() failed: {e}");
        }
        let ps = a.page_size() as i64;
        assert_eq!(a.open_requests(), self.reqs.len(), "open request count");
        // What each slot holds once the queued transfers have run: one
        // still queued reads its source page now, so that page must still
        // hold what it held when the transfer was queued.
        let (src, dst) = queued_copies(a);
        assert_eq!(a.pending_copies(), src.len(), "pending_copies");
        let content = self.settled(a);
        let cell = |s: i64| content[s as usize].as_ref();
        // Page -> (holder, index in its page list).
        let mut seen: HashMap<i32, Vec<(i64, usize)>> = HashMap::new();
        // Pages swapped-out requests still hold on the device.
        let mut kept: HashSet<i32> = HashSet::new();
        for (&h, r) in &self.reqs {
            assert_eq!(a.length(h), Ok(r.tokens.len()), "length of {h}");
            if a.is_swapped(h) == Ok(true) {
                // Its pages are refused (checked again after swap_in).
                assert!(a.slots(h).is_err() && a.pages(h).is_err());
                assert_eq!(a.known_tokens(h).expect("open"), r.known());
                kept.extend(r.kept_on_device.iter().copied());
                continue;
            }
            let slots = a.slots(h).expect("open");
            let pages = a.pages(h).expect("open");
            assert_eq!(pages.len() as i64, (r.tokens.len() as i64 + ps - 1) / ps);
            for (k, &p) in pages.iter().enumerate() {
                assert!(
                    p > 0 && (p as usize) < a.num_pages(),
                    "page {p} out of range"
                );
                seen.entry(p).or_default().push((h, k));
            }
            for (i, &s) in slots.iter().enumerate() {
                assert_eq!(
                    s / ps,
                    pages[i / ps as usize] as i64,
                    "slot {s} outside its page"
                );
                assert_eq!(s % ps, i as i64 % ps, "slot {s} at the wrong offset");
                let c = cell(s).map(|c| c.write);
                assert_eq!(
                    c,
                    Some(r.writes[i]),
                    "request {h} position {i} (slot {s}) was overwritten or never written"
                );
            }
            assert_eq!(
                a.known_tokens(h).expect("open"),
                r.known(),
                "known tokens of {h}"
            );
        }
        // A page shared by several requests (or twice by one) sits at the
        // same position of each list: shared prefixes and forks only.
        for (p, hs) in &seen {
            let mut owners = HashSet::new();
            for &(h, k) in hs {
                assert!(owners.insert(h), "request {h} holds page {p} twice");
                assert_eq!(k, hs[0].1, "page {p} shared at different positions");
            }
        }
        // A copy's destination is a page some request holds (a copy into a
        // released page is dropped); its source is held until it is taken.
        for &d in &dst {
            assert!(
                seen.contains_key(&((d / ps) as i32))
                    || kept.contains(&((d / ps) as i32))
                    || src.iter().any(|&s| s / ps == d / ps),
                "a queued copy writes slot {d} of a page nobody holds"
            );
        }
        let sources: HashSet<i32> = src
            .iter()
            .map(|&s| (s / ps) as i32)
            .filter(|p| !seen.contains_key(p))
            .collect();
        let kept: HashSet<i32> = kept
            .into_iter()
            .filter(|p| !seen.contains_key(p) && !sources.contains(p))
            .collect();
        let held = seen.len() + sources.len() + kept.len();
        assert_eq!(a.used_pages(), held, "used_pages vs pages held");
        assert_eq!(
            a.free_pages() + a.used_pages(),
            a.capacity_pages(),
            "free + held != capacity"
        );
        let registered = |m: u8| self.registered.iter().filter(|k| k.0 == m).count();
        assert_eq!(
            a.cached_pages(),
            registered(MEDIUM_DEVICE),
            "cached_pages vs Stored - Removed"
        );
        assert_eq!(
            a.host_cached_pages(),
            self.registered.len() - registered(MEDIUM_DEVICE),
            "host_cached_pages vs Stored - Removed"
        );
        let evictable = self
            .registered
            .iter()
            .filter(|k| {
                k.0 == MEDIUM_DEVICE
                    && !seen.contains_key(&k.1)
                    && !sources.contains(&k.1)
                    && !kept.contains(&k.1)
            })
            .count();
        assert_eq!(
            a.evictable_pages(),
            evictable,
            "evictable vs registered and unheld"
        );
    }
}

/// An open request's slots, pages and known tokens (swapped out: its length,
/// no pages, and known tokens).
type OpenRequest = (Vec<i64>, Vec<i32>, Vec<i32>);

/// Everything a caller can observe, for the all-or-nothing check.
#[derive(Debug, PartialEq, Eq)]
pub struct Snapshot {
    counters: [u64; 16],
    /// Per handle: open (with slots, pages and known tokens, or, swapped
    /// out, its length and known tokens) or not.
    requests: Vec<(i64, Option<OpenRequest>)>,
    queued: (Vec<i64>, Vec<i64>, Vec<i64>, Vec<i64>),
    /// What a fixed probe sees on a clone (free-stack and LRU order).
    probe: Vec<i64>,
}

impl Snapshot {
    pub fn of(a: &SlotAllocator, issued: &[i64]) -> Self {
        let requests = issued
            .iter()
            .map(|&h| {
                let detail = a.is_open(h).then(|| {
                    let open = "is_open";
                    let known = a.known_tokens(h).expect(open);
                    match a.is_swapped(h) {
                        Ok(true) => (vec![a.length(h).expect(open) as i64], vec![-1], known),
                        _ => (a.slots(h).expect(open), a.pages(h).expect(open), known),
                    }
                });
                (h, detail)
            })
            .collect();
        Snapshot {
            counters: [
                a.free_pages() as u64,
                a.used_pages() as u64,
                a.open_requests() as u64,
                a.cached_pages() as u64,
                a.evictable_pages() as u64,
                a.hit_tokens(),
                a.miss_tokens(),
                a.pending_copies() as u64,
                a.admissible_tokens() as u64,
                a.host_free_pages() as u64,
                a.host_cached_pages() as u64,
                a.host_hit_tokens(),
                a.pending_offloads() as u64,
                a.pending_loads() as u64,
                a.offloaded_pages(),
                a.loaded_pages(),
            ],
            requests,
            queued: {
                let q = queued(a);
                (q.offloads.0, q.offloads.1, q.loads.0, q.loads.1)
            },
            probe: probe(a),
        }
    }
}

/// Runs a fixed sequence on a clone: evict everything (LRU order shows in
/// the Removed events), close everything, then fill fresh requests page by
/// page (free-stack order shows in the slots).
fn probe(a: &SlotAllocator) -> Vec<i64> {
    let mut b = a.clone();
    let mut out = Vec::new();
    b.take_events();
    b.evict(usize::MAX);
    out.extend(b.take_events().page.iter().map(|&p| p as i64));
    out.push(-1);
    b.reset();
    let (ps, mcl) = (b.page_size(), b.max_context_len());
    while let Ok(h) = b.open(1) {
        let mut len = 0;
        while len < mcl {
            let c = ps.min(mcl - len) as i64;
            match b.extend(&h, kvpool_core::Counts::Each(c), None) {
                Ok(s) => out.push(s[0]),
                Err(_) => return out,
            }
            len += c as usize;
        }
    }
    out
}
