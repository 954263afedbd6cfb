//! KV cache events for KV-aware routers, in struct-of-arrays form so the
//! bindings hand each field out as one numpy array.
//!
//! They carry what vLLM's `KVEventBatch` does: `BlockStored` (page hash,
//! parent hash, page id, token count, the page's token ids, and the salt in
//! place of vLLM's lora id), `BlockRemoved` (page hash, page id) and
//! `AllBlocksCleared`.
//!
//! With a host tier, Stored and Removed say which tier they are about
//! (`medium`: [`MEDIUM_DEVICE`] or [`MEDIUM_HOST`], and `page` is that
//! tier's page id): a page stored on the host is reported when it gets its
//! host copy, and Removed for a tier when that tier's copy goes. Cleared
//! covers both.
//!
//! The backlog is bounded. A pool whose events nobody drains (an engine
//! without a router that left them on) must not grow without end, so past
//! `cap` undrained events the backlog is dropped and replaced by one
//! Cleared event, and `dropped` counts what went. A router then forgets
//! this pool's pages and relearns them from the Stored events that follow:
//! it may miss pages that stay cached (fewer predicted hits), but it never
//! believes in a page the pool no longer has.

mod sink;

pub use sink::{Drained, EventSink};

/// A page was registered in the prefix index.
pub const EVENT_STORED: u8 = 0;
/// A registered page left the index (evicted, or unregistered before an
/// in-place write).
pub const EVENT_REMOVED: u8 = 1;
/// `clear_cache` dropped every entry.
pub const EVENT_CLEARED: u8 = 2;

/// `Events::medium` of an event about a device page (vLLM's "GPU").
pub const MEDIUM_DEVICE: u8 = 0;
/// `Events::medium` of an event about a host page (vLLM's "CPU").
pub const MEDIUM_HOST: u8 = 1;

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
    /// The tier a Stored or Removed event is about ([`MEDIUM_DEVICE`] or
    /// [`MEDIUM_HOST`]; `page` is that tier's page id); 0 for Cleared.
    pub medium: Vec<u8>,
}

impl Events {
    pub fn len(&self) -> usize {
        self.kind.len()
    }

    pub fn is_empty(&self) -> bool {
        self.kind.is_empty()
    }
}

/// One recorded event (one push on the hot path; split into arrays on take).
#[derive(Debug, Clone, Copy)]
struct Raw {
    hash: u128,
    parent: u128,
    salt: i64,
    page: u32,
    num_tokens: u32,
    kind: u8,
    medium: u8,
}

const CLEARED: Raw = Raw {
    hash: 0,
    parent: 0,
    salt: 0,
    page: 0,
    num_tokens: 0,
    kind: EVENT_CLEARED,
    medium: MEDIUM_DEVICE,
};

/// Appends one page's token ids. At page sizes 1 and 16 the copy has a
/// length known at compile time and inlines; the general path calls
/// memcpy, a call per registered page.
#[inline]
fn push_page(out: &mut Vec<i32>, tokens: &[i32]) {
    if let [t] = tokens {
        out.push(*t);
    } else if let Ok(page) = <&[i32; 16]>::try_from(tokens) {
        out.extend_from_slice(page);
    } else {
        out.extend_from_slice(tokens);
    }
}

/// Fewest undrained events a pool keeps before dropping its backlog (a
/// pool keeps at least one per page).
pub(crate) const MIN_BACKLOG: usize = 1 << 16;

/// The recorder inside the allocator.
#[derive(Debug, Clone, Default)]
pub(crate) struct EventLog {
    raw: Vec<Raw>,
    token_ids: Vec<i32>,
    enabled: bool,
    /// Most undrained events kept (see the module docs).
    cap: usize,
    /// Events dropped by overflows so far (cumulative).
    dropped: u64,
    /// The backlog starts with an overflow's Cleared event (not counted as
    /// dropped when a later overflow drops it).
    overflowed: bool,
}

impl EventLog {
    pub(crate) fn new(enabled: bool, cap: usize) -> Self {
        EventLog {
            enabled,
            cap: cap.max(1),
            ..Default::default()
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
        self.raw.clear();
        self.token_ids.clear();
        self.raw.push(CLEARED);
    }

    /// Room for `n` more Stored events of `page_size` tokens, or an error.
    /// Never more than the backlog holds: an overflow empties it.
    pub(crate) fn reserve(&mut self, n: usize, page_size: usize) -> crate::error::Result<()> {
        let n = n.min(self.cap);
        if self.enabled {
            crate::memory::reserve(&mut self.raw, n, "events")?;
            crate::memory::reserve(&mut self.token_ids, n.saturating_mul(page_size), "events")?;
        }
        Ok(())
    }

    /// Room for `stored` more Stored events of `page_size` tokens and
    /// `removed` more Removed events (which carry no token ids), or an
    /// error; capped as `reserve` is.
    pub(crate) fn reserve_with_removed(
        &mut self,
        stored: usize,
        removed: usize,
        page_size: usize,
    ) -> crate::error::Result<()> {
        self.reserve(stored, page_size)?;
        if self.enabled {
            let n = stored.saturating_add(removed).min(self.cap);
            crate::memory::reserve(&mut self.raw, n, "events")?;
        }
        Ok(())
    }

    /// Whether events are recorded (the pool's `kv_events` option).
    pub(crate) fn enabled(&self) -> bool {
        self.enabled
    }

    /// Events dropped by overflows so far (cumulative).
    pub(crate) fn dropped(&self) -> u64 {
        self.dropped
    }

    pub(crate) fn capacity_bytes(&self) -> usize {
        self.raw.capacity() * std::mem::size_of::<Raw>() + self.token_ids.capacity() * 4
    }

    #[inline]
    pub(crate) fn stored(
        &mut self,
        hash: u128,
        parent: u128,
        page: u32,
        salt: i64,
        tokens: &[i32],
    ) {
        self.stored_on(MEDIUM_DEVICE, hash, parent, page, salt, tokens);
    }

    /// A Stored event about `medium`'s page `page`. Always inlined: `cache()`
    /// calls it once a page, and out of line its call costs more than the
    /// `enabled` test and the push themselves.
    #[inline(always)]
    pub(crate) fn stored_on(
        &mut self,
        medium: u8,
        hash: u128,
        parent: u128,
        page: u32,
        salt: i64,
        tokens: &[i32],
    ) {
        if self.enabled {
            self.room();
            let num_tokens = tokens.len() as u32;
            self.raw.push(Raw {
                hash,
                parent,
                salt,
                page,
                num_tokens,
                kind: EVENT_STORED,
                medium,
            });
            push_page(&mut self.token_ids, tokens);
        }
    }

    #[inline]
    pub(crate) fn removed(&mut self, hash: u128, page: u32, salt: i64) {
        self.removed_on(MEDIUM_DEVICE, hash, page, salt);
    }

    /// A Removed event about `medium`'s page `page`.
    #[inline(always)]
    pub(crate) fn removed_on(&mut self, medium: u8, hash: u128, page: u32, salt: i64) {
        if self.enabled {
            self.room();
            self.raw.push(Raw {
                hash,
                parent: 0,
                salt,
                page,
                num_tokens: 0,
                kind: EVENT_REMOVED,
                medium,
            });
        }
    }

    pub(crate) fn cleared(&mut self) {
        if self.enabled {
            self.room();
            self.raw.push(CLEARED);
        }
    }

    /// Moves the recorded events out as arrays, leaving the log empty. The
    /// log keeps its capacity: a router drains every step, and a log that
    /// restarted empty would regrow (copying) on the hot path each time.
    pub(crate) fn take(&mut self) -> Events {
        self.overflowed = false;
        let ids_cap = self.token_ids.capacity();
        let token_ids = std::mem::replace(&mut self.token_ids, Vec::with_capacity(ids_cap));
        let e = columns(&self.raw, token_ids);
        self.raw.clear();
        e
    }
}

/// The records as one array per field, filled in one pass (`sink::fill`).
fn columns(raw: &[Raw], token_ids: Vec<i32>) -> Events {
    let n = raw.len();
    let mut e = Events {
        kind: Vec::with_capacity(n),
        hash_hi: Vec::with_capacity(n),
        hash_lo: Vec::with_capacity(n),
        parent_hi: Vec::with_capacity(n),
        parent_lo: Vec::with_capacity(n),
        page: Vec::with_capacity(n),
        num_tokens: Vec::with_capacity(n),
        salt: Vec::with_capacity(n),
        token_ids,
        medium: Vec::with_capacity(n),
    };
    sink::fill(raw, &mut e.spare_sink());
    // SAFETY: `fill` wrote slots 0..n of each per-event column (each has
    // capacity n); the token ids came whole.
    unsafe {
        e.commit_drained(Drained {
            events: n,
            tokens: 0,
        })
    };
    e
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_field_of_every_event_reaches_its_column_in_order() {
        let mut log = EventLog::new(true, 64);
        log.reserve(4, 4).unwrap();
        let h = |x: u64| ((x as u128) << 64) | (x as u128 + 1);
        log.stored(h(10), h(20), 3, -5, &[1, 2]);
        log.removed_on(MEDIUM_HOST, h(30), 7, 9);
        log.cleared();
        log.stored_on(MEDIUM_HOST, h(40), 0, 8, 11, &[4, 5]);
        let e = log.take();
        assert_eq!(
            e.kind,
            [EVENT_STORED, EVENT_REMOVED, EVENT_CLEARED, EVENT_STORED]
        );
        assert_eq!(e.hash_hi, [10, 30, 0, 40]);
        assert_eq!(e.hash_lo, [11, 31, 0, 41]);
        assert_eq!(e.parent_hi, [20, 0, 0, 0]);
        assert_eq!(e.parent_lo, [21, 0, 0, 0]);
        assert_eq!(e.page, [3, 7, 0, 8]);
        assert_eq!(e.num_tokens, [2, 0, 0, 2]);
        assert_eq!(e.salt, [-5, 9, 0, 11]);
        assert_eq!(e.medium, [MEDIUM_DEVICE, MEDIUM_HOST, 0, MEDIUM_HOST]);
        assert_eq!(e.token_ids, [1, 2, 4, 5]);
        assert!(log.take().is_empty(), "the log is empty after a take");
    }

    #[test]
    fn an_undrained_backlog_stays_bounded_and_becomes_one_cleared_event() {
        let mut log = EventLog::new(true, 4);
        log.reserve(3, 2).unwrap();
        for p in 1..=3u32 {
            log.stored(p as u128, 0, p, 0, &[p as i32, 7]);
        }
        log.removed(1, 1, 0); // the 4th: still within the cap
        assert_eq!(log.dropped, 0);
        log.stored(9, 0, 9, 0, &[9, 9]); // the 5th: the backlog goes
        assert_eq!(log.dropped, 4);
        let e = log.take();
        assert_eq!(e.kind, [EVENT_CLEARED, EVENT_STORED]);
        assert_eq!(e.page, [0, 9]);
        assert_eq!(e.token_ids, [9, 9], "the dropped events' tokens went too");
        for _ in 0..100 {
            log.removed(2, 2, 0);
        }
        let e = log.take();
        assert!(e.len() <= 4 && e.kind[0] == EVENT_CLEARED, "{:?}", e.kind);
        // 100 events were recorded; what was not drained was dropped.
        assert_eq!(log.dropped, 4 + 100 - (e.len() as u64 - 1));
    }

    #[test]
    fn push_page_appends_every_page_size_whole() {
        let mut out = vec![-1];
        for n in [1usize, 2, 15, 16, 17, 64] {
            let page: Vec<i32> = (0..n as i32).map(|t| t * 31 + n as i32).collect();
            let before = out.clone();
            super::push_page(&mut out, &page);
            assert_eq!(out, [before, page].concat(), "page size {n}");
        }
    }
}
