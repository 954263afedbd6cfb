//! A state group's queued copies: `(source, destination)` slot pairs, in
//! order, until the caller takes them and runs them before the next step.
//! A source of -1 zeroes the destination (a new request's empty state).
//!
//! No slot is ever both a queued source and a queued destination, and no
//! destination repeats, so a caller may run one drained batch as a single
//! parallel copy. A destination is always a slot nobody else reads: a new
//! request's, a fork's or a checkpoint's fresh slot, or a restored
//! request's own slot when no queued copy reads it. A source is resolved
//! at queue time: a slot still waiting for its own copy stands for that
//! copy's source (no step has run in between, since steps run only after
//! the queue is drained), so sources are never waiting destinations.
//!
//! A queued copy holds its source (one more holder) until taken, so the
//! slot is not reused or evicted meanwhile; a copy whose destination is let
//! go (its request closed, its checkpoint evicted) is dropped.

use crate::error::{PoolError, Result};
use crate::memory::zeroed_vec;
use crate::pages::PagePool;

#[derive(Debug, Clone)]
pub(crate) struct StateCopies {
    /// Queued copies, oldest first.
    runs: Vec<(i64, u32)>,
    /// Per slot: queued copies reading it.
    reading: Vec<u32>,
    /// Per slot: a queued copy writes it.
    writing: Vec<bool>,
}

impl StateCopies {
    pub(crate) fn new(num_slots: usize) -> Result<Self> {
        let mut writing = Vec::new();
        writing.try_reserve_exact(num_slots).map_err(|_| {
            PoolError::InvalidArgument("cannot allocate the state copy queue".into())
        })?;
        writing.resize(num_slots, false);
        Ok(StateCopies {
            runs: Vec::new(),
            reading: zeroed_vec(num_slots, "state copy queue")?,
            writing,
        })
    }

    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.runs.len()
    }

    #[inline]
    pub(crate) fn reading(&self, s: u32) -> u32 {
        self.reading[s as usize]
    }

    pub(crate) fn prepare(&mut self, n: usize) -> Result<()> {
        crate::memory::reserve(&mut self.runs, n, "state copy queue")
    }

    /// What slot `s`'s content will be once the queue runs: itself, or the
    /// source of the copy waiting to fill it.
    fn resolve(&self, s: i64) -> i64 {
        if s > 0 && self.writing[s as usize] {
            if let Some(&(src, _)) = self.runs.iter().find(|r| r.1 as i64 == s) {
                return src;
            }
        }
        s
    }

    /// Queues the copy of `src` (-1: zeros) into `dst`, a slot no queued
    /// copy touches; the source is held until the copy is taken.
    pub(crate) fn queue(&mut self, slots: &mut PagePool, src: i64, dst: u32) {
        let src = self.resolve(src);
        if src > 0 {
            slots.hold(&[src as u32]);
            self.reading[src as usize] += 1;
        }
        self.writing[dst as usize] = true;
        self.runs.push((src, dst));
    }

    /// Drops the copy waiting to fill `dst` (nobody reads `dst` any more),
    /// letting its source go.
    pub(crate) fn drop_into(&mut self, slots: &mut PagePool, dst: u32) {
        if !self.writing[dst as usize] {
            return;
        }
        self.writing[dst as usize] = false;
        if let Some(i) = self.runs.iter().position(|r| r.1 == dst) {
            let (src, _) = self.runs.remove(i);
            self.unread(slots, src);
        }
    }

    fn unread(&mut self, slots: &mut PagePool, src: i64) {
        if src > 0 {
            self.reading[src as usize] -= 1;
            slots.release_one(src as u32);
        }
    }

    /// Drains the queue: `(sources, destinations)` in order.
    pub(crate) fn take(&mut self, slots: &mut PagePool) -> (Vec<i64>, Vec<i64>) {
        let runs = std::mem::take(&mut self.runs);
        let mut src = Vec::with_capacity(runs.len());
        let mut dst = Vec::with_capacity(runs.len());
        for &(s, d) in &runs {
            src.push(s);
            dst.push(d as i64);
            self.writing[d as usize] = false;
            self.unread(slots, s);
        }
        // Keep the capacity for the next batch.
        self.runs = runs;
        self.runs.clear();
        (src, dst)
    }

    pub(crate) fn capacity_bytes(&self) -> usize {
        self.runs.capacity() * 16 + self.reading.capacity() * 4 + self.writing.capacity()
    }

    /// Adds each queued copy's hold to `holders`, and checks the queue's
    /// rules: sources and destinations in range, no destination twice, none
    /// read by a queued copy, each one a slot someone keeps (`kept`: a live
    /// slot or a checkpoint), and the per-slot counts.
    pub(crate) fn check(
        &self,
        holders: &mut [u32],
        kept: impl Fn(u32) -> bool,
    ) -> std::result::Result<(), String> {
        let n = holders.len();
        let mut reading = vec![0u32; n];
        let mut writing = vec![false; n];
        for &(s, d) in &self.runs {
            if d == 0 || d as usize >= n || writing[d as usize] {
                return Err(format!(
                    "a queued state copy writes slot {d} (repeated or out of range)"
                ));
            }
            writing[d as usize] = true;
            if s == 0 || s < -1 || s >= n as i64 {
                return Err(format!("a queued state copy reads slot {s}"));
            }
            if s > 0 {
                reading[s as usize] += 1;
                holders[s as usize] += 1;
            }
            if !kept(d) {
                return Err(format!(
                    "a queued state copy writes slot {d}, which nobody keeps"
                ));
            }
        }
        for s in 0..n {
            if reading[s] > 0 && writing[s] {
                return Err(format!(
                    "state slot {s} is both read and written by queued copies"
                ));
            }
            if reading[s] != self.reading[s] || writing[s] != self.writing[s] {
                return Err(format!(
                    "state slot {s}'s queued-copy counts disagree with the queue"
                ));
            }
        }
        Ok(())
    }
}
