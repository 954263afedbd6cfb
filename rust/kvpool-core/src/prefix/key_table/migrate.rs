//! Incremental growth of the key table: the old array drains into the new
//! one a few buckets per insert and per registered page, in bucket order.
//!
//! Invariants while growing (`old` non-empty, n = its length):
//! 1. `old[..cursor]` is empty.
//! 2. Each array is a valid linear-probing table: every key sits in the
//!    probe run of its home in that array, with no empty bucket between.
//! 3. So a key whose old home is below the cursor is not in `old` (its home
//!    bucket there is empty, so no run holding it can start there).
//!
//! Why 1 holds. Only three things write `old`. Draining bucket `i` (the
//! cursor) and `remove` both backward-shift (`shift_out`), which writes
//! only at the hole and after it, up to the run's next empty bucket. An
//! insert stores into `old` only at a bucket >= the cursor (below).
//!
//! Wrap-around. Before the first drain a run may wrap from bucket n-1 to
//! bucket 0. Draining bucket 0 re-checks it until empty, which takes every
//! wrapped key too (a wrapped key's home is not in (0, j], so the shift
//! pulls it in). Once bucket 0 is empty no run wraps (by 2, a wrapped run
//! passes through it), and since every insert drains before it stores, the
//! cursor is >= 1 whenever an insert probes `old`: a probe or shift that
//! runs off bucket n-1 reaches bucket 0, empty, and stops there. So holes
//! appear only at the cursor, and runs ahead of it stay intact.
//!
//! Where an insert goes. It probes `old` from its home for the first empty
//! bucket q; if q >= cursor it stores there (a plain insert: 1 and 2 hold),
//! otherwise (home below the cursor, or the run ran off the end into the
//! drained part) in the new array. Why not always the new one: on hosts
//! that back fresh memory slowly the new array's first touch is most of a
//! growth's cost (`clear_page_erms` at 100-170 MB/s here), and random
//! inserts would touch every one of its pages within a few hundred keys,
//! all in one call. This way the new array is written where the drain
//! writes it: a key from old bucket h < cursor has its new home at h or
//! h + n (one more tag bit), so the new array is faulted in along two
//! sequential fronts behind the cursor.
//!
//! Lookups, by 3: a key whose old home is below the cursor only in the new
//! array; any other first in `old`, then (on a miss there) in the new one,
//! which holds such a key only if its run wrapped, as above.
//!
//! Progress. Each insert drains S = `MIGRATE_STEP` buckets, and so does
//! each page a call is about to register (`drain`, from the index's
//! reservation): the index reserves room for every live entry, keyed or
//! not (`register.rs`), and at page size 1 most entries are reached by
//! their parent's hint and never keyed, so inserts alone can be too few to
//! end a growth before the next (measured: a 16M-slot pool's 2^21-bucket
//! drain was still under way at the next growth), and none come in a
//! steady state of evictions. Both are bounded by the call's own work.
//!
//! Bounds (the old array has n buckets, the new one cap >= 2n):
//! - The new array never passes load 1/2: it holds a subset of the keys,
//!   and `reserve` sized it for all of them.
//! - `old` always has an empty bucket, so its probes end: before the first
//!   drain it is as the last reserve left it (load <= 1/2); after, bucket 0
//!   is empty. (Its load is at most 1/2 + 1/S: one key per insert, over the
//!   at most n/S inserts a growth lasts.)
//! - The growth ends before the next one: the growing reservation asked
//!   for a0 <= cap/2 keys (live entries plus the call's pages, p0), the
//!   next must ask for more than cap/2 >= n. Live entries only grow by
//!   registrations, each of which drained S buckets in its call, so the
//!   drain is over by then if S (cap/2 - a0 - p1) >= n, p1 the pages of
//!   the call that asks: e.g. for a growth from load 1/2 (a0 just past
//!   n/2) and calls of at most 7n/16 pages at S = 16. A larger call
//!   finishes the drain at once in its growing reserve.
//! - Each drained bucket moves the keys whose home it is (after bucket 0,
//!   which also moves the wrapped run), about one at load 1/2.

use super::{free_slot, shift_out, Bucket, KeyTable};

/// Old buckets each insert (and each page a call registers) drains while
/// the table grows: 16 reads two
/// cache lines of `old` and moves ~8 keys, and ends a growth well before
/// the next (above). Tests drain slowly so that growths overlap many
/// operations.
pub(super) const MIGRATE_STEP: usize = if cfg!(test) { 2 } else { 16 };

/// Half a 2 MiB page of buckets (see `migrate`).
const FRONT_LEAD: usize = (1 << 20) / std::mem::size_of::<Bucket>();

impl KeyTable {
    /// Drains `steps` more old buckets into the new array (all, for
    /// `usize::MAX`); frees the old array when it is empty.
    pub(super) fn migrate(&mut self, steps: usize) {
        let end = self.cursor.saturating_add(steps).min(self.old.len());
        for i in self.cursor..end {
            // Re-check: the shift may pull another key of this home in.
            while self.old[i].entry != 0 {
                let b = self.old[i];
                shift_out(&mut self.old, i);
                let j = free_slot(&self.buckets, b.tag);
                self.buckets[j] = b;
            }
        }
        self.cursor = end;
        let n = self.old.len();
        if end == n {
            self.old = Vec::new();
            self.cursor = 0;
            return;
        }
        // The fronts above the first (new buckets k*n + cursor, k >= 1)
        // reach a 2 MiB page boundary at the same cursor as the first, so
        // one call would fault two (or more) fresh huge pages at once.
        // Each front past the first writes its bucket half a huge page
        // ahead, so its pages fault in between the first front's.
        if end + FRONT_LEAD < n {
            for j in (n + end + FRONT_LEAD..self.buckets.len()).step_by(n) {
                let b = self.buckets[j];
                self.buckets[j] = std::hint::black_box(b);
            }
        }
    }

    /// `insert` while growing: drains first, then stores in `old` ahead
    /// of the cursor or else in the new array (above).
    #[cold]
    #[inline(never)]
    pub(super) fn insert_growing(&mut self, b: Bucket) {
        self.migrate(MIGRATE_STEP);
        self.len += 1;
        if !self.old.is_empty() {
            let q = free_slot(&self.old, b.tag);
            if q >= self.cursor {
                self.old[q] = b;
                return;
            }
        }
        let j = free_slot(&self.buckets, b.tag);
        self.buckets[j] = b;
    }

    /// Old buckets not drained yet (0 when not growing).
    #[cfg(test)]
    pub(super) fn old_keys(&self) -> usize {
        self.old.iter().filter(|b| b.entry != 0).count()
    }

    /// Invariants 1 and 2 above, and the count.
    #[cfg(test)]
    pub(super) fn check(&self) -> std::result::Result<(), String> {
        let valid = |b: &[Bucket]| {
            let mask = b.len().wrapping_sub(1);
            b.iter().enumerate().all(|(p, x)| {
                x.entry == 0 || {
                    let h = super::home(b, x.tag);
                    (0..=(p.wrapping_sub(h) & mask)).all(|d| b[(h + d) & mask].entry != 0)
                }
            })
        };
        if self.old[..self.cursor.min(self.old.len())]
            .iter()
            .any(|b| b.entry != 0)
        {
            return Err("a drained old bucket holds a key".into());
        }
        if !valid(&self.old) || !valid(&self.buckets) {
            return Err("a key is off its probe run".into());
        }
        if self.entries().count() != self.len {
            return Err(format!(
                "{} keys stored, len {}",
                self.entries().count(),
                self.len
            ));
        }
        Ok(())
    }
}
