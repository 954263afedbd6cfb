//! KV cache events for KV-aware routers, in struct-of-arrays form so the
//! bindings hand each field out as one numpy array.
//!
//! They carry what vLLM's `KVEventBatch` does: `BlockStored` (page hash,
//! parent hash, page id, token count, the page's token ids, and the salt in
//! place of vLLM's lora id), `BlockRemoved` (page hash, page id) and
//! `AllBlocksCleared`. A Stored event's hash, salt and token ids are read
//! when it is drained (see `EventLog`).
//!
//! The backlog is bounded. A pool whose events nobody drains (an engine
//! without a router that left them on) must not grow without end, so past
//! `cap` undrained events the backlog is dropped and replaced by one
//! Cleared event, and `dropped` counts what went. A router then forgets
//! this pool's pages and relearns them from the Stored events that follow:
//! it may miss pages that stay cached (fewer predicted hits), but it never
//! believes in a page the pool no longer has.

/// A page was registered in the prefix index.
pub const EVENT_STORED: u8 = 0;
/// A registered page left the index (evicted, or unregistered before an
/// in-place write).
pub const EVENT_REMOVED: u8 = 1;
/// `clear_cache` dropped every entry.
pub const EVENT_CLEARED: u8 = 2;

/// Drained events, oldest first; event `i` is row `i` of every per-event
/// array. Hashes are 128-bit, split in high and low 64-bit halves.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Events {
    pub kind: Vec<u8>,
    pub hash_hi: Vec<u64>,
    pub hash_lo: Vec<u64>,
    /// Parent page hash of a Stored event; 0 for the first page of a chain
    /// and for other events.
    pub parent_hi: Vec<u64>,
    pub parent_lo: Vec<u64>,
    pub page: Vec<i32>,
    /// Tokens in the page (page_size for Stored, 0 otherwise).
    pub num_tokens: Vec<i32>,
    pub salt: Vec<i64>,
    /// Token ids of the Stored events, concatenated (num_tokens each).
    pub token_ids: Vec<i32>,
}

impl Events {
    pub fn len(&self) -> usize {
        self.kind.len()
    }

    pub fn is_empty(&self) -> bool {
        self.kind.is_empty()
    }
}

/// One recorded event, 32 bytes. Stored: `h` is the parent hash and `x`
/// the page's registration number; the page's own hash, salt and token
/// ids are read when the event is drained, from the index while the
/// registration lives, else from the copy `EventLog::save` made as it
/// ended. Removed: `h` is the page hash and `x` its salt (as i64 bits).
#[derive(Debug, Clone, Copy)]
struct Raw {
    h: u128,
    x: u64,
    page: u32,
    kind: u8,
}

const CLEARED: Raw = Raw {
    h: 0,
    x: 0,
    page: 0,
    kind: EVENT_CLEARED,
};

/// A registration that ended while its Stored event was undrained: what
/// the event needs that the index no longer has.
#[derive(Debug, Clone, Copy)]
struct Saved {
    reg: u64,
    hash: u128,
    salt: i64,
    /// Its token ids: `saved_tokens[at..at + len]`.
    at: u32,
    len: u32,
}

/// What a live registration gives a drained Stored event: page hash,
/// salt and token ids.
pub(crate) type Resolved<'a> = (u128, i64, &'a [i32]);

/// No Stored event undrained (`first_stored`).
const NONE_PENDING: u64 = u64::MAX;

/// Fewest undrained events a pool keeps before dropping its backlog (a
/// pool keeps at least one per page).
pub(crate) const MIN_BACKLOG: usize = 1 << 16;

/// The recorder inside the allocator.
///
/// Registering a page records 32 bytes and copies nothing: a registered
/// page's content never changes, so its token ids are read from the page
/// when the event is drained. Only a registration that ends (eviction,
/// unregistration before an in-place write, `clear_cache`) while its event
/// is undrained has its hash, salt and ids copied, by the allocator, with
/// `save`. A router that drains every step rarely sees that; an engine
/// that never drains pays per eviction what it used to pay per
/// registration. (Copying every page's ids at registration was a sixth of
/// `cache()` at page 16.)
#[derive(Debug, Clone)]
pub(crate) struct EventLog {
    raw: Vec<Raw>,
    /// Registration number of the oldest undrained Stored event; every
    /// later one has a larger number (they only grow). NONE_PENDING if none.
    first_stored: u64,
    saved: Vec<Saved>,
    saved_tokens: Vec<i32>,
    pub(crate) enabled: bool,
    /// Most undrained events kept (see the module docs).
    cap: usize,
    /// Events dropped by overflows so far (cumulative).
    pub(crate) dropped: u64,
    /// The backlog starts with an overflow's Cleared event (not counted as
    /// dropped when a later overflow drops it).
    overflowed: bool,
}

impl Default for EventLog {
    fn default() -> Self {
        EventLog::new(false, MIN_BACKLOG)
    }
}

impl EventLog {
    pub(crate) fn new(enabled: bool, cap: usize) -> Self {
        EventLog {
            raw: Vec::new(),
            first_stored: NONE_PENDING,
            saved: Vec::new(),
            saved_tokens: Vec::new(),
            enabled,
            cap: cap.max(1),
            dropped: 0,
            overflowed: false,
        }
    }

    /// Makes room for one more event: past `cap`, the backlog becomes one
    /// Cleared event.
    #[inline]
    fn room(&mut self) {
        if self.raw.len() >= self.cap {
            self.overflow();
        }
    }

    #[cold]
    fn overflow(&mut self) {
        self.dropped += (self.raw.len() - self.overflowed as usize) as u64;
        self.overflowed = true;
        self.forget_backlog();
        self.raw.push(CLEARED);
    }

    /// Empties the backlog, keeping its memory.
    fn forget_backlog(&mut self) {
        self.raw.clear();
        self.saved.clear();
        self.saved_tokens.clear();
        self.first_stored = NONE_PENDING;
    }

    /// Room for `n` more events, or an error. Never more than the backlog
    /// holds: an overflow empties it.
    pub(crate) fn reserve(&mut self, n: usize) -> crate::error::Result<()> {
        if self.enabled {
            crate::memory::reserve(&mut self.raw, n.min(self.cap), "events")?;
        }
        Ok(())
    }

    pub(crate) fn capacity_bytes(&self) -> usize {
        self.raw.capacity() * std::mem::size_of::<Raw>()
            + self.saved.capacity() * std::mem::size_of::<Saved>()
            + self.saved_tokens.capacity() * 4
    }

    /// Page `page` was registered as registration `reg` under the page
    /// whose hash is `parent` (0 for a chain's first page).
    #[inline]
    pub(crate) fn stored(&mut self, reg: u64, parent: u128, page: u32) {
        if self.enabled {
            self.room();
            self.first_stored = self.first_stored.min(reg);
            self.raw.push(Raw {
                h: parent,
                x: reg,
                page,
                kind: EVENT_STORED,
            });
        }
    }

    /// Whether any Stored event is undrained.
    #[inline]
    pub(crate) fn any_pending(&self) -> bool {
        self.first_stored != NONE_PENDING
    }

    /// Whether registration `reg`'s Stored event is undrained: the
    /// allocator then `save`s it before the registration ends.
    #[inline]
    pub(crate) fn is_pending(&self, reg: u64) -> bool {
        reg >= self.first_stored
    }

    /// Keeps what registration `reg`'s undrained Stored event needs, as
    /// the registration ends.
    pub(crate) fn save(&mut self, reg: u64, hash: u128, salt: i64, tokens: &[i32]) {
        self.saved.push(Saved {
            reg,
            hash,
            salt,
            at: self.saved_tokens.len() as u32,
            len: tokens.len() as u32,
        });
        self.saved_tokens.extend_from_slice(tokens);
    }

    /// The undrained Stored events' (page, registration), oldest first.
    pub(crate) fn pending_stored(&self) -> impl Iterator<Item = (u32, u64)> + '_ {
        self.raw
            .iter()
            .filter(|r| r.kind == EVENT_STORED)
            .map(|r| (r.page, r.x))
    }

    /// The registrations whose copies were saved.
    pub(crate) fn saved_regs(&self) -> impl Iterator<Item = u64> + '_ {
        self.saved.iter().map(|s| s.reg)
    }

    #[inline]
    pub(crate) fn removed(&mut self, hash: u128, page: u32, salt: i64) {
        if self.enabled {
            self.room();
            self.raw.push(Raw {
                h: hash,
                x: salt as u64,
                page,
                kind: EVENT_REMOVED,
            });
        }
    }

    pub(crate) fn cleared(&mut self) {
        if self.enabled {
            self.room();
            self.raw.push(CLEARED);
        }
    }

    /// Moves the recorded events out as arrays, leaving the log empty.
    /// `live(page, reg)` gives a live registration's hash, salt and token
    /// ids (None once it ended: the saved copy serves then). The log keeps
    /// its capacity: a router drains every step, and a log that restarted
    /// empty would regrow (copying) on the hot path each time.
    pub(crate) fn take<'a>(&mut self, live: impl Fn(u32, u64) -> Option<Resolved<'a>>) -> Events {
        let n = self.raw.len();
        let mut e = Events::default();
        e.kind.reserve_exact(n);
        for v in [
            &mut e.hash_hi,
            &mut e.hash_lo,
            &mut e.parent_hi,
            &mut e.parent_lo,
        ] {
            v.reserve_exact(n);
        }
        e.page.reserve_exact(n);
        e.num_tokens.reserve_exact(n);
        e.salt.reserve_exact(n);
        self.saved.sort_unstable_by_key(|s| s.reg);
        let (saved, saved_tokens) = (&self.saved, &self.saved_tokens);
        let from_saved = |reg: u64| -> Option<Resolved<'_>> {
            let s = &saved[saved.binary_search_by_key(&reg, |s| s.reg).ok()?];
            let ids = saved_tokens.get(s.at as usize..(s.at + s.len) as usize)?;
            Some((s.hash, s.salt, ids))
        };
        let mut lost = 0u64;
        for r in &self.raw {
            let (hash, parent, salt, ids) = match r.kind {
                EVENT_STORED => match live(r.page, r.x).or_else(|| from_saved(r.x)) {
                    Some((hash, salt, ids)) => (hash, r.h, salt, ids),
                    // Neither live nor saved: a bug (check() reports it).
                    // Better no event than one with the wrong content.
                    None => {
                        lost += 1;
                        continue;
                    }
                },
                EVENT_REMOVED => (r.h, 0, r.x as i64, &[][..]),
                _ => (0, 0, 0, &[][..]),
            };
            e.kind.push(r.kind);
            e.hash_hi.push((hash >> 64) as u64);
            e.hash_lo.push(hash as u64);
            e.parent_hi.push((parent >> 64) as u64);
            e.parent_lo.push(parent as u64);
            e.page.push(r.page as i32);
            e.num_tokens.push(ids.len() as i32);
            e.salt.push(salt);
            e.token_ids.extend_from_slice(ids);
        }
        self.dropped += lost;
        self.overflowed = false;
        self.forget_backlog();
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Page `p`'s registration `reg = p` is live with token ids [p, 7]
    /// while `p` is in `live`.
    fn lookup(live: &[u32]) -> impl Fn(u32, u64) -> Option<Resolved<'static>> + '_ {
        const IDS: [[i32; 2]; 10] = [
            [0, 7],
            [1, 7],
            [2, 7],
            [3, 7],
            [4, 7],
            [5, 7],
            [6, 7],
            [7, 7],
            [8, 7],
            [9, 7],
        ];
        move |p, reg| {
            (live.contains(&p) && reg == p as u64)
                .then(|| (p as u128 * 10, 0, &IDS[p as usize][..]))
        }
    }

    #[test]
    fn an_undrained_backlog_stays_bounded_and_becomes_one_cleared_event() {
        let mut log = EventLog::new(true, 4);
        log.reserve(3).unwrap();
        for p in 1..=3u32 {
            log.stored(p as u64, 0, p);
        }
        log.save(1, 10, 0, &[1, 7]);
        log.removed(10, 1, 0); // the 4th: still within the cap
        assert_eq!(log.dropped, 0);
        log.stored(9, 0, 9); // the 5th: the backlog goes, with what was saved
        assert_eq!(log.dropped, 4);
        assert!(!log.is_pending(3) && log.is_pending(9));
        let e = log.take(lookup(&[9]));
        assert_eq!(e.kind, [EVENT_CLEARED, EVENT_STORED]);
        assert_eq!(e.page, [0, 9]);
        assert_eq!(e.token_ids, [9, 7], "the dropped events' tokens went too");
        assert!(!log.is_pending(9), "drained");
        for _ in 0..100 {
            log.removed(2, 2, 0);
        }
        let e = log.take(lookup(&[]));
        assert!(e.len() <= 4 && e.kind[0] == EVENT_CLEARED, "{:?}", e.kind);
        // 100 events were recorded; what was not drained was dropped.
        assert_eq!(log.dropped, 4 + 100 - (e.len() as u64 - 1));
    }

    /// A Stored event reads a live registration when drained, and the copy
    /// saved as it ended otherwise; one that is neither is dropped, not
    /// sent with made-up content.
    #[test]
    fn stored_events_resolve_live_then_saved() {
        let mut log = EventLog::new(true, 64);
        log.stored(2, 0, 2);
        log.stored(3, 20, 3);
        log.stored(4, 30, 4);
        // Registration 3 ends (its page will be reused): saved.
        log.save(3, 30, -5, &[3, 7]);
        log.removed(30, 3, -5);
        let e = log.take(lookup(&[2]));
        assert_eq!(e.kind, [EVENT_STORED, EVENT_STORED, EVENT_REMOVED]);
        assert_eq!(e.page, [2, 3, 3]);
        assert_eq!(
            (e.hash_lo.clone(), e.parent_lo.clone()),
            (vec![20, 30, 30], vec![0, 20, 0])
        );
        assert_eq!(e.salt, [0, -5, -5]);
        assert_eq!(e.num_tokens, [2, 2, 0]);
        assert_eq!(e.token_ids, [2, 7, 3, 7]);
        assert_eq!(log.dropped, 1, "page 4 was neither live nor saved");
        assert!(log.take(lookup(&[2])).is_empty());
    }
}
