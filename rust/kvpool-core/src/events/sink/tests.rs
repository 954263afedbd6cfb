use std::mem::MaybeUninit;

use super::super::{EventLog, Events, MEDIUM_HOST};
use super::{Drained, EventSink};

/// Arrays a test drains into: `rows` events, `ids` token ids, each slot
/// set to a marker first so that a write past what a drain reports shows.
struct Arrays {
    kind: Vec<MaybeUninit<u8>>,
    hash_hi: Vec<MaybeUninit<u64>>,
    hash_lo: Vec<MaybeUninit<u64>>,
    parent_hi: Vec<MaybeUninit<u64>>,
    parent_lo: Vec<MaybeUninit<u64>>,
    page: Vec<MaybeUninit<i32>>,
    num_tokens: Vec<MaybeUninit<i32>>,
    salt: Vec<MaybeUninit<i64>>,
    medium: Vec<MaybeUninit<u8>>,
    token_ids: Vec<MaybeUninit<i32>>,
}

const MARK: i32 = -777;

impl Arrays {
    fn new(rows: usize, ids: usize) -> Self {
        Arrays {
            kind: vec![MaybeUninit::new(0xee); rows],
            hash_hi: vec![MaybeUninit::new(7); rows],
            hash_lo: vec![MaybeUninit::new(7); rows],
            parent_hi: vec![MaybeUninit::new(7); rows],
            parent_lo: vec![MaybeUninit::new(7); rows],
            page: vec![MaybeUninit::new(MARK); rows],
            num_tokens: vec![MaybeUninit::new(MARK); rows],
            salt: vec![MaybeUninit::new(7); rows],
            medium: vec![MaybeUninit::new(0xee); rows],
            token_ids: vec![MaybeUninit::new(MARK); ids],
        }
    }

    fn sink(&mut self) -> EventSink<'_> {
        EventSink {
            kind: &mut self.kind,
            hash_hi: &mut self.hash_hi,
            hash_lo: &mut self.hash_lo,
            parent_hi: &mut self.parent_hi,
            parent_lo: &mut self.parent_lo,
            page: &mut self.page,
            num_tokens: &mut self.num_tokens,
            salt: &mut self.salt,
            medium: &mut self.medium,
            token_ids: &mut self.token_ids,
        }
    }

    /// The first `d` rows and token ids as `Events` (every slot was
    /// initialized by `new`, so reading past `d` is defined too).
    fn events(&self, d: Drained) -> Events {
        fn take<T: Copy>(v: &[MaybeUninit<T>], n: usize) -> Vec<T> {
            // SAFETY: `new` initialized every slot.
            v[..n].iter().map(|x| unsafe { x.assume_init() }).collect()
        }
        let n = d.events;
        Events {
            kind: take(&self.kind, n),
            hash_hi: take(&self.hash_hi, n),
            hash_lo: take(&self.hash_lo, n),
            parent_hi: take(&self.parent_hi, n),
            parent_lo: take(&self.parent_lo, n),
            page: take(&self.page, n),
            num_tokens: take(&self.num_tokens, n),
            salt: take(&self.salt, n),
            token_ids: take(&self.token_ids, d.tokens),
            medium: take(&self.medium, n),
        }
    }

    fn untouched_from(&self, d: Drained) -> bool {
        // SAFETY: `new` initialized every slot.
        let page = self.page[d.events..]
            .iter()
            .all(|x| unsafe { x.assume_init() } == MARK);
        let ids = self.token_ids[d.tokens..]
            .iter()
            .all(|x| unsafe { x.assume_init() } == MARK);
        page && ids
    }
}

/// A log of mixed events: Stored with 2 tokens, Removed, Cleared, host ones.
fn log_of(n: u32) -> EventLog {
    let mut log = EventLog::new(true, 1 << 16);
    log.reserve(n as usize, 2).unwrap();
    for p in 1..=n {
        let h = ((p as u128) << 64) | (p as u128 * 3);
        match p % 4 {
            0 => log.removed(h, p, -(p as i64)),
            1 => log.stored(h, h - 1, p, p as i64, &[p as i32, -(p as i32)]),
            2 => log.stored_on(MEDIUM_HOST, h, 0, p, 0, &[p as i32 * 5, 1]),
            _ => log.cleared(),
        }
    }
    log
}

/// `a`'s events, then `b`'s.
fn concat(mut a: Events, b: Events) -> Events {
    a.kind.extend(b.kind);
    a.hash_hi.extend(b.hash_hi);
    a.hash_lo.extend(b.hash_lo);
    a.parent_hi.extend(b.parent_hi);
    a.parent_lo.extend(b.parent_lo);
    a.page.extend(b.page);
    a.num_tokens.extend(b.num_tokens);
    a.salt.extend(b.salt);
    a.token_ids.extend(b.token_ids);
    a.medium.extend(b.medium);
    a
}

#[test]
fn a_drain_sized_by_pending_writes_what_take_returns_and_empties_the_log() {
    let (mut a, mut b) = (log_of(23), log_of(23));
    let (rows, ids) = a.pending();
    assert_eq!((rows, ids), (23, 2 * 12));
    let mut out = Arrays::new(rows, ids);
    let d = a.take_into(out.sink());
    assert_eq!(
        d,
        Drained {
            events: rows,
            tokens: ids
        }
    );
    assert_eq!(out.events(d), b.take(), "the same rows as take()'s columns");
    assert_eq!(a.pending(), (0, 0));
    assert!(a.take().is_empty());
}

#[test]
fn a_small_sink_takes_the_oldest_events_whose_tokens_fit_and_keeps_the_rest_in_order() {
    let whole = log_of(40).take();
    for (rows, ids) in [(0, 0), (5, 100), (40, 7), (3, 0), (17, 18), (64, 64)] {
        let mut log = log_of(40);
        let mut got = Arrays::new(rows, ids);
        let d = log.take_into(got.sink());
        assert!(
            d.events <= rows && d.tokens <= ids,
            "{d:?} within {rows} x {ids}"
        );
        assert!(
            got.untouched_from(d),
            "nothing written past what was drained"
        );
        // Every event up to the first that did not fit, with exactly its tokens.
        let tokens: usize = whole.num_tokens[..d.events]
            .iter()
            .map(|&t| t as usize)
            .sum();
        assert_eq!(d.tokens, tokens);
        let next_fits = d.events < whole.len()
            && d.events < rows
            && tokens + whole.num_tokens[d.events] as usize <= ids;
        assert!(
            !next_fits,
            "{d:?}: the next event would have fit ({rows} x {ids})"
        );
        // What is drained and what is left, together, are the log in order.
        let joined = concat(got.events(d), log.take());
        assert_eq!(joined, whole, "{rows} x {ids}");
    }
}

#[test]
fn draining_past_an_overflow_counts_later_drops_as_take_does() {
    // An overflow leaves the backlog as one Cleared event; once a drain took
    // it, the next overflow counts every event it drops.
    let mut log = EventLog::new(true, 4);
    log.reserve(4, 1).unwrap();
    for p in 1..=5u32 {
        log.stored(p as u128, 0, p, 0, &[p as i32]);
    }
    assert_eq!(log.dropped(), 4);
    let mut out = Arrays::new(1, 0);
    let d = log.take_into(out.sink());
    assert_eq!(
        d,
        Drained {
            events: 1,
            tokens: 0
        },
        "the Cleared event alone fits"
    );
    assert_eq!(log.pending(), (1, 1), "the Stored event after it waits");
    for p in 6..=9u32 {
        log.stored(p as u128, 0, p, 0, &[p as i32]);
    }
    assert_eq!(
        log.dropped(),
        4 + 4,
        "the 5th undrained event dropped all four"
    );
    assert_eq!(log.take().kind.len(), 2);
}

#[test]
fn a_drain_into_spare_capacity_appends_to_events_it_is_committed_to() {
    // What a binding does with vectors it reserved (fallibly) first: the
    // drained rows follow those already there.
    let whole = concat(log_of(7).take(), log_of(12).take());
    let mut got = log_of(7).take();
    let mut log = log_of(12);
    let (rows, ids) = log.pending();
    got.kind.reserve_exact(rows);
    got.medium.reserve_exact(rows);
    got.hash_hi.reserve_exact(rows);
    got.hash_lo.reserve_exact(rows);
    got.parent_hi.reserve_exact(rows);
    got.parent_lo.reserve_exact(rows);
    got.page.reserve_exact(rows);
    got.num_tokens.reserve_exact(rows);
    got.salt.reserve_exact(rows);
    got.token_ids.reserve_exact(ids);
    let d = log.take_into(got.spare_sink());
    assert_eq!(
        d,
        Drained {
            events: rows,
            tokens: ids
        }
    );
    // SAFETY: `d` is what the drain into `spare_sink` returned.
    unsafe { got.commit_drained(d) };
    assert_eq!(got, whole);
    assert_eq!(log.pending(), (0, 0));
}

#[test]
fn a_commit_grows_each_column_from_its_own_length() {
    // `Events`' fields are public: columns of unequal lengths are a caller's
    // to make. A drain writes at most the smallest spare capacity of them
    // (none here: every column but `kind` has no room), and the commit must
    // count into each column only what the drain wrote there.
    let mut got = Events {
        kind: vec![0; 4],
        ..Default::default()
    };
    let mut log = log_of(3);
    let d = log.take_into(got.spare_sink());
    assert_eq!(d, Drained::default());
    // SAFETY: `d` is what the drain into `spare_sink` returned.
    unsafe { got.commit_drained(d) };
    assert_eq!(
        (got.kind.len(), got.hash_hi.len(), got.token_ids.len()),
        (4, 0, 0)
    );
    assert_eq!(log.pending().0, log_of(3).pending().0);
}
