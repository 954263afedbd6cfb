//! The prefix table's next size, mapped on a helper thread before the
//! growth that needs it.
//!
//! Why: past `TABLE_FLOOR_KEYS` the table doubles, and the step that
//! doubles it used to fault the new table in itself: fresh memory, which
//! the kernel zeroes on first touch, may compact memory first to back it
//! with huge pages (THP `defrag` "madvise", the default), and in a VM may
//! wait for the host to back it. Measured on a 16M-slot page-1 pool
//! (`python -m kvpool.bench prefix --scenarios tiered --pool-sizes 16M
//! --page-sizes 1`), the `cache()` call that doubled the table from 2^22
//! to 2^23 buckets took 8 ms in some runs and 340–460 ms in others, and
//! 3–4 ms when it found the table mapped. Here a thread maps the next
//! table once the load passes 3/8 (from there, the keys still to come
//! before the growth at 1/2 are a third of those stored), so the growing
//! step only moves the keys.
//!
//! The result comes back over a channel, never by joining: a growth whose
//! table is not ready (or a process forked while the thread ran, whose
//! child has no such thread) allocates inline, as before, and never
//! waits.

use std::sync::mpsc::{sync_channel, Receiver};

/// Tables at least this large (16 MiB of buckets: the table sized for
/// `TABLE_FLOOR_KEYS`) have their next size mapped ahead. A pool of fewer
/// pages sizes its table once for all of them and never grows it.
pub(super) const AHEAD_MIN_BUCKETS: usize = 1 << 21;

/// A table of `buckets` buckets being mapped, or none.
#[derive(Debug, Default)]
pub(super) struct Ahead<B> {
    pending: Option<(usize, Receiver<Vec<B>>)>,
}

impl<B> Clone for Ahead<B> {
    /// A clone maps its own next table when it needs one.
    fn clone(&self) -> Self {
        Ahead { pending: None }
    }
}

impl<B: crate::memory::Zeroable + Send + 'static> Ahead<B> {
    /// Buckets of the table being mapped (0 if none): counted in the
    /// index's memory from the start, since the thread is mapping them.
    pub(super) fn buckets(&self) -> usize {
        self.pending.as_ref().map_or(0, |p| p.0)
    }

    /// Starts mapping a zeroed table of `buckets` buckets, unless one is
    /// already pending. A failed allocation or spawn leaves none pending:
    /// the growth then allocates inline.
    pub(super) fn start(&mut self, buckets: usize) {
        if self.pending.is_some() {
            return;
        }
        let (tx, rx) = sync_channel(1);
        let spawned = std::thread::Builder::new()
            .name("kvpool-index-ahead".into())
            .spawn(move || {
                if let Ok(mut v) = crate::memory::zeroed_vec::<B>(buckets, "prefix index table") {
                    crate::memory::fault_in_all(&mut v);
                    // A dropped receiver (the pool is gone) drops the table.
                    let _ = tx.send(v);
                }
            });
        if spawned.is_ok() {
            self.pending = Some((buckets, rx));
        }
    }

    /// The mapped table if it has exactly `buckets` buckets and is ready
    /// now. Whatever is pending is given up either way: a table of another
    /// size is no use to this growth, and a thread not done by now would
    /// make the step wait.
    pub(super) fn take(&mut self, buckets: usize) -> Option<Vec<B>> {
        let (n, rx) = self.pending.take()?;
        rx.try_recv()
            .ok()
            .filter(|v| n == buckets && v.len() == buckets)
    }

    /// Waits until the pending table is mapped (tests: so the growth
    /// finds it ready); returns whether one was.
    #[cfg(test)]
    pub(super) fn wait(&mut self) -> bool {
        let Some((n, rx)) = self.pending.take() else {
            return false;
        };
        let Ok(v) = rx.recv() else {
            return false;
        };
        let (tx, rx) = sync_channel(1);
        let _ = tx.send(v);
        self.pending = Some((n, rx));
        true
    }
}
