//! The copy-on-write queue: the copies extend queues (the valid slots of a
//! shared, partly filled page to the writer's new page) until the caller
//! takes them (`take_copies`) and runs them on the device.
//!
//! A copy still queued when the call that queued it returns holds its
//! source page, counted as one more holder: until the copy is taken the page
//! is not freed, evicted or written in place (its requests copy it first),
//! so the copy still reads what it was queued to read however late the
//! caller runs it. Inside the queuing call it holds nothing: the caller runs
//! the copies before the step's K/V writes, so the page's last request may
//! still write in place past the copied slots in the same batch. Its hold
//! is taken when that call ends (`hold_copy_sources`).
//!
//! A copy whose destination page loses its last holder (close, truncate,
//! reset) is dropped and its source's hold released: nobody reads the
//! destination any more, and the page may go to another request. Each live
//! copy therefore has a held destination page of its own, so the queue never
//! holds more than one copy of fewer than `page_size` slots per held page,
//! and a caller that never drains it keeps it bounded by the pool.
//!
//! The queue keeps one run per copy (source page, destination page, slots
//! from offset 0) and expands it to slot pairs when taken. Dropped runs stay
//! in place, marked dead, until they are half the queue (order matters: a
//! copy out of a page that is itself a waiting copy's destination must run
//! after it); a page's live run is found through `into` in O(1).

use crate::allocator::SlotAllocator;
use crate::error::Result;
use crate::memory::{reserve, zeroed_vec};

/// `CopyQueue::into` bit: the page lost its last holder in the release
/// being processed, and its copy is dropped once that release is done.
const RELEASED: u32 = 1 << 31;

/// One queued copy: slots `0..len` of page `src` to the same slots of `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Run {
    pub(crate) src: u32,
    pub(crate) dst: u32,
    /// Slots to copy; 0 for a dropped run.
    pub(crate) len: u32,
}

#[derive(Debug, Clone, Default)]
pub(crate) struct CopyQueue {
    /// Queued runs, oldest first, dropped ones included.
    pub(crate) runs: Vec<Run>,
    /// Per page: index + 1 in `runs` of the live run copying into it (0:
    /// none), with `RELEASED`. Allocated at the first copy (zeroed, so only
    /// the parts touched are mapped).
    pub(crate) into: Vec<u32>,
    /// Slots of the live runs (`pending_copies`).
    pub(crate) slots: usize,
    /// Dropped runs still in `runs`.
    pub(crate) dead: usize,
}

impl CopyQueue {
    /// No live copy: the release paths skip every look-up.
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.slots == 0
    }

    /// Makes room for `n` more runs before a batch changes anything.
    pub(crate) fn prepare(&mut self, n: usize, num_pages: usize) -> Result<()> {
        if self.into.is_empty() {
            self.into = zeroed_vec(num_pages, "copy-on-write queue")?;
        }
        reserve(&mut self.runs, n, "copy-on-write queue")
    }

    /// Index + 1 of the live run copying into page `p` (0: none).
    #[inline]
    pub(crate) fn run_into(&self, p: u32) -> u32 {
        self.into.get(p as usize).map_or(0, |&i| i & !RELEASED)
    }

    /// The live runs, oldest first.
    pub(crate) fn live(&self) -> impl Iterator<Item = &Run> + '_ {
        self.runs.iter().filter(|r| r.len > 0)
    }

    fn push(&mut self, src: u32, dst: u32, len: usize) {
        self.runs.push(Run {
            src,
            dst,
            len: len as u32,
        });
        self.into[dst as usize] = self.runs.len() as u32;
        self.slots += len;
    }

    /// Marks run `i` dropped; returns its source page.
    fn kill(&mut self, i: usize) -> u32 {
        let r = &mut self.runs[i];
        self.slots -= r.len as usize;
        self.dead += 1;
        r.len = 0;
        self.into[r.dst as usize] = 0;
        r.src
    }

    /// Sheds dropped runs at the end, and compacts once they are more than
    /// half the queue (a compaction walks fewer than twice the runs dropped
    /// since the last: O(1) per drop, amortized; and the queue stays within
    /// twice its live runs).
    fn tidy(&mut self) {
        while self.runs.last().is_some_and(|r| r.len == 0) {
            self.runs.pop();
            self.dead -= 1;
        }
        if self.dead * 2 <= self.runs.len() {
            return;
        }
        self.runs.retain(|r| r.len > 0);
        for (i, r) in self.runs.iter().enumerate() {
            self.into[r.dst as usize] = i as u32 + 1;
        }
        self.dead = 0;
    }

    pub(crate) fn capacity_bytes(&self) -> usize {
        self.runs.capacity() * std::mem::size_of::<Run>() + self.into.capacity() * 4
    }
}

impl SlotAllocator {
    /// Queues the copy of slots `0..len` of page `src` to page `dst` (taken
    /// just now). Room was made by `CopyQueue::prepare`.
    #[inline]
    pub(crate) fn queue_copy(&mut self, src: u32, dst: u32, len: usize) {
        self.copies.push(src, dst, len);
    }

    /// The end of a call that queued runs `from..`: each holds its source
    /// page from now on, and a request whose partly filled last page is one
    /// of them (only requests this call grew can have cleared `SLOW` since
    /// the page was shared) must copy it before writing.
    pub(crate) fn hold_copy_sources(
        &mut self,
        from: usize,
        grown_rows: impl Iterator<Item = usize>,
    ) {
        for r in &self.copies.runs[from..] {
            // Still held by a request: a holder leaves a page in this call
            // only by copying it, and only while another holds it.
            self.index.state[r.src as usize].extra += 1;
        }
        for row in grown_rows {
            let (len, last) = (self.rows[row].len as usize, self.rows[row].last);
            self.rows[row].last = last | self.slow_bit(row, len, last);
        }
    }

    /// Runs queued so far, dropped ones included (the start of a call's).
    #[inline]
    pub(crate) fn queued_runs(&self) -> usize {
        self.copies.runs.len()
    }

    /// Notes that page `p` has just lost its last holder, in the release
    /// loops (`pages.rs`, `release.rs`), where only the queue's own array is
    /// at hand. Returns whether `p` was a waiting copy's destination.
    #[inline]
    pub(crate) fn mark_released(into: &mut [u32], p: u32) -> bool {
        match into.get_mut(p as usize) {
            Some(i) if *i != 0 => {
                *i |= RELEASED;
                true
            }
            _ => false,
        }
    }

    /// After a release of `page_lists[range]` marked some pages: drops
    /// their copies, last page first, as the pages were released.
    pub(crate) fn drop_released_copies(&mut self, range: std::ops::Range<usize>) {
        for k in range.rev() {
            let p = self.page_lists[k];
            if self.copies.into[p as usize] & RELEASED != 0 {
                self.drop_copy_into(p);
            }
        }
        self.copies.tidy();
    }

    /// Drops the live copy into page `p` (which nobody holds any more) and
    /// releases its source; a source that loses its last holder and is
    /// itself a waiting copy's destination loses that copy too, and so on
    /// down the chain.
    fn drop_copy_into(&mut self, mut p: u32) {
        loop {
            let i = self.copies.run_into(p);
            if i == 0 {
                return;
            }
            let src = self.copies.kill(i as usize - 1);
            if !self.release_held_page(src) {
                return;
            }
            p = src;
        }
    }

    /// Drains the queued copy-on-write copies: `(src_slots, dst_slots)`.
    /// Run them (every layer's K and V, slot `src[i]` to `dst[i]`, in
    /// order) before the next write to the destination pages; each source
    /// page stays held until its copy is taken here, so nothing reuses it
    /// while the copy waits. `KVPool.extend` runs them itself. A copy whose
    /// destination page was released (its requests closed or truncated
    /// past it, or `reset`) is gone: the queue holds at most one copy of
    /// fewer than `page_size` slots per held page, however long it is left
    /// undrained. It keeps its capacity (like the event log), so draining it
    /// every step does not regrow it.
    pub fn take_copies(&mut self) -> (Vec<i64>, Vec<i64>) {
        self.take_copies_from(0)
    }

    /// Drains the queued copies from index `from` on (those a caller saw
    /// being queued: `pending_copies()` before the call), leaving earlier
    /// ones queued, their source pages still held.
    pub fn take_copies_from(&mut self, from: usize) -> (Vec<i64>, Vec<i64>) {
        let q = &self.copies;
        let from = from.min(q.slots);
        let n = q.slots - from;
        let (mut src, mut dst) = (Vec::with_capacity(n), Vec::with_capacity(n));
        if n == 0 {
            return (src, dst);
        }
        // The newest runs hold the last `n` slots; a run that straddles
        // `from` keeps its first `head` slots queued (and its hold).
        let mut i = q.runs.len();
        let mut before = q.slots;
        while before > from {
            i -= 1;
            before -= q.runs[i].len as usize;
        }
        let head = from - before;
        let ps = self.page_size;
        for k in i..self.copies.runs.len() {
            let r = self.copies.runs[k];
            let skip = if k == i { head } else { 0 };
            if r.len as usize <= skip {
                continue;
            }
            let (s, d) = (r.src as usize * ps, r.dst as usize * ps);
            src.extend((s + skip..s + r.len as usize).map(|x| x as i64));
            dst.extend((d + skip..d + r.len as usize).map(|x| x as i64));
            if skip > 0 {
                self.copies.runs[k].len = skip as u32;
                self.copies.slots -= r.len as usize - skip;
            } else {
                let s = self.copies.kill(k);
                if self.release_held_page(s) {
                    // Its source was an earlier waiting copy's destination
                    // (a chain), now held by nobody: that copy goes too.
                    self.drop_copy_into(s);
                }
            }
        }
        self.copies.tidy();
        (src, dst)
    }

    /// Queued copy-on-write copies (slot pairs) not yet taken.
    pub fn pending_copies(&self) -> usize {
        self.copies.slots
    }
}

#[cfg(test)]
mod tests {
    use crate::{Counts, PoolError, SlotAllocator};

    /// Page size 4: a parent of 6 tokens (pages 1, 2), a fork that wrote
    /// one token, so page 2's slots 8, 9 wait to be copied to page 3.
    fn queued() -> SlotAllocator {
        let mut a = SlotAllocator::new(8, 4, 4, 16).unwrap();
        let h = a.open(1).unwrap();
        a.extend(&h, Counts::Each(6), None).unwrap();
        let k = a.fork(h[0], 1).unwrap();
        a.extend(&k, Counts::Each(1), None).unwrap();
        assert_eq!(a.copies.live().count(), 1);
        a.check().unwrap();
        a
    }

    #[test]
    fn check_detects_copy_queue_corruption() {
        let good = queued();
        type Corrupt = Box<dyn Fn(&mut SlotAllocator)>;
        let corruptions: Vec<Corrupt> = vec![
            Box::new(|a| a.index.state[2].extra -= 1), // the copy's hold not counted
            Box::new(|a| a.copies.into[3] = 0),        // page 3 forgets its copy
            Box::new(|a| a.copies.slots += 1),
            Box::new(|a| {
                // dropped without letting its source go
                a.copies.runs[0].len = 0;
                a.copies.dead += 1;
                a.copies.slots -= 2;
                a.copies.into[3] = 0;
            }),
            Box::new(|a| {
                // a copy into a free page
                let p = a.free_pages[0];
                a.copies.runs[0].dst = p;
                a.copies.into[3] = 0;
                a.copies.into[p as usize] = 1;
            }),
            Box::new(|a| a.copies.runs[0].len = 4), // a whole page
            Box::new(|a| {
                // The copier, alone on its pages once the parent is gone,
                // is marked as never having shared (its close would skip
                // dropping the copy into page 3).
                let parent = crate::make_handle(a.rows[0].generation & !crate::rows::OPEN, 0);
                a.close(&[parent], false).unwrap();
                a.check().unwrap();
                a.cold[1].exclusive = true;
            }),
        ];
        for (i, corrupt) in corruptions.iter().enumerate() {
            let mut b = good.clone();
            corrupt(&mut b);
            assert!(
                matches!(b.check(), Err(PoolError::Invariant(_))),
                "corruption {i}"
            );
        }
        good.check().unwrap();
    }
}
