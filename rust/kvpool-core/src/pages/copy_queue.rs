//! The copy-on-write queue: the copies extend queues (the valid slots of a
//! shared, partly filled page to the writer's new page) until the caller
//! takes them (`take_copies`) and runs them on the device. This file keeps
//! the queue's own order and counts; the holds it puts on pages and the
//! drop-on-release rule are the pool's (`copies.rs`).
//!
//! The queue keeps one run per copy (source page, destination page, slots
//! from offset 0) and expands it to slot pairs when taken. Dropped runs stay
//! in place, marked dead, until they are half the queue (order matters: a
//! copy out of a page that is itself a waiting copy's destination must run
//! after it); a page's live run is found through `into` in O(1).

use crate::error::Result;
use crate::memory::{reserve, zeroed_vec};

/// `CopyQueue::into` bit: the page lost its last holder in the release
/// being processed, and its copy is dropped once that release is done.
const RELEASED: u32 = 1 << 31;

/// One queued copy: slots `0..len` of page `src` to the same slots of `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Run {
    pub(super) src: u32,
    pub(super) dst: u32,
    /// Slots to copy; 0 for a dropped run.
    pub(super) len: u32,
}

#[derive(Debug, Clone, Default)]
pub(super) struct CopyQueue {
    /// Queued runs, oldest first, dropped ones included.
    runs: Vec<Run>,
    /// Per page: index + 1 in `runs` of the live run copying into it (0:
    /// none), with `RELEASED`. Allocated at the first copy (zeroed, so only
    /// the parts touched are mapped).
    into: Vec<u32>,
    /// Slots of the live runs (`pending_copies`).
    slots: usize,
    /// Dropped runs still in `runs`.
    dead: usize,
}

impl CopyQueue {
    /// No live copy: the release paths skip every look-up.
    #[inline]
    pub(super) fn is_empty(&self) -> bool {
        self.slots == 0
    }

    /// Slots of the live runs.
    #[inline]
    pub(super) fn slots(&self) -> usize {
        self.slots
    }

    /// Runs queued so far, dropped ones included.
    #[inline]
    pub(super) fn runs(&self) -> &[Run] {
        &self.runs
    }

    /// Makes room for `n` more runs before a batch changes anything.
    pub(super) fn prepare(&mut self, n: usize, num_pages: usize) -> Result<()> {
        if self.into.is_empty() {
            self.into = zeroed_vec(num_pages, "copy-on-write queue")?;
        }
        reserve(&mut self.runs, n, "copy-on-write queue")
    }

    /// Index + 1 of the live run copying into page `p` (0: none).
    #[inline]
    pub(super) fn run_into(&self, p: u32) -> u32 {
        self.into.get(p as usize).map_or(0, |&i| i & !RELEASED)
    }

    /// The page slot `j` of page `p` will be read from once the live runs
    /// into it have run: `p`, or (while a live run copies slot `j` into it)
    /// that run's source, and so on down the chain. Runs only ever copy out
    /// of pages older than their destination, so the chain ends.
    pub(super) fn source_of(&self, mut p: u32, j: usize) -> u32 {
        loop {
            match self.run_into(p).checked_sub(1) {
                Some(i) if j < self.runs[i as usize].len as usize => p = self.runs[i as usize].src,
                _ => return p,
            }
        }
    }

    /// The live runs, oldest first.
    pub(super) fn live(&self) -> impl Iterator<Item = &Run> + '_ {
        self.runs.iter().filter(|r| r.len > 0)
    }

    pub(super) fn push(&mut self, src: u32, dst: u32, len: usize) {
        self.runs.push(Run {
            src,
            dst,
            len: len as u32,
        });
        self.into[dst as usize] = self.runs.len() as u32;
        self.slots += len;
    }

    /// Marks run `i` dropped; returns its source page.
    pub(super) fn kill(&mut self, i: usize) -> u32 {
        let r = &mut self.runs[i];
        self.slots -= r.len as usize;
        self.dead += 1;
        r.len = 0;
        self.into[r.dst as usize] = 0;
        r.src
    }

    /// Keeps the first `keep` slots of run `i` queued (a partial take).
    pub(super) fn shorten(&mut self, i: usize, keep: usize) {
        let r = &mut self.runs[i];
        self.slots -= r.len as usize - keep;
        r.len = keep as u32;
    }

    /// Notes that page `p` has just lost its last holder; returns whether
    /// it was a waiting copy's destination (its copy is dropped by the
    /// pool once the release is done).
    #[inline]
    pub(super) fn mark_released(&mut self, p: u32) -> bool {
        match self.into.get_mut(p as usize) {
            Some(i) if *i != 0 => {
                *i |= RELEASED;
                true
            }
            _ => false,
        }
    }

    #[inline]
    pub(super) fn is_released(&self, p: u32) -> bool {
        self.into
            .get(p as usize)
            .is_some_and(|&i| i & RELEASED != 0)
    }

    /// Sheds dropped runs at the end, and compacts once they are more than
    /// half the queue (a compaction walks fewer than twice the runs dropped
    /// since the last: O(1) per drop, amortized; and the queue stays within
    /// twice its live runs).
    pub(super) fn tidy(&mut self) {
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

    pub(super) fn capacity_bytes(&self) -> usize {
        self.runs.capacity() * std::mem::size_of::<Run>() + self.into.capacity() * 4
    }

    /// The queue's own invariants: runs in range and shorter than a page,
    /// each live run the one its destination names, counts that agree.
    pub(super) fn check(
        &self,
        num_pages: usize,
        page_size: usize,
    ) -> std::result::Result<(), String> {
        let (mut slots, mut dead) = (0usize, 0usize);
        for (i, r) in self.runs.iter().enumerate() {
            if r.len == 0 {
                dead += 1;
                continue;
            }
            let in_range = |p: u32| p != 0 && (p as usize) < num_pages;
            if !in_range(r.src) || !in_range(r.dst) || r.src == r.dst {
                return Err(format!(
                    "queued copy {i} runs from page {} to {}",
                    r.src, r.dst
                ));
            }
            if r.len as usize >= page_size {
                return Err(format!("queued copy {i} copies {} slots of a page", r.len));
            }
            if self.into[r.dst as usize] != i as u32 + 1 {
                return Err(format!(
                    "queued copy {i} into page {} is not the page's copy",
                    r.dst
                ));
            }
            slots += r.len as usize;
        }
        if slots != self.slots || dead != self.dead || dead * 2 > self.runs.len() {
            return Err(format!(
                "copy queue counts {} slots and {} dropped runs of {}, has {slots} and {dead}",
                self.slots,
                self.dead,
                self.runs.len()
            ));
        }
        for (p, &i) in self.into.iter().enumerate() {
            let ok = i == 0
                || self
                    .runs
                    .get(i as usize - 1)
                    .is_some_and(|r| r.len > 0 && r.dst as usize == p);
            if !ok {
                return Err(format!(
                    "page {p} names queued copy {i}, which does not write it"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
impl CopyQueue {
    /// Test only: direct access to break the queue's invariants.
    pub(super) fn parts_mut(&mut self) -> (&mut Vec<Run>, &mut Vec<u32>, &mut usize, &mut usize) {
        (
            &mut self.runs,
            &mut self.into,
            &mut self.slots,
            &mut self.dead,
        )
    }
}
