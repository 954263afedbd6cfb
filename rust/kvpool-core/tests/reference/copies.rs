//! The reference model's copy-on-write queue: a Vec of queued copies searched
//! front to back. A copy holds its source page (`Model::holders` counts the
//! first `holding` copies) until it is taken or its destination is released.

use super::Model;

/// A queued copy: slots `0..len` of page `src` to page `dst`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QueuedCopy {
    pub src: usize,
    pub dst: usize,
    pub len: usize,
}

impl Model {
    /// Slots queued for copying.
    pub fn pending_copies(&self) -> usize {
        self.queue.iter().map(|c| c.len).sum()
    }

    /// `p` is held by nobody: the copy into it is dropped, its source
    /// released, and so on down a chain of copies.
    pub(crate) fn drop_copy_into(&mut self, mut p: usize) {
        while let Some(i) = self.queue.iter().position(|c| c.dst == p) {
            let c = self.queue.remove(i);
            self.holding -= 1;
            self.dropped += 1;
            if !self.release(c.src) {
                return;
            }
            p = c.src;
        }
    }

    /// Takes the copies from slot pair `from` on, as (src slots, dst slots).
    pub fn take_copies_from(&mut self, from: usize) -> (Vec<i64>, Vec<i64>) {
        let slot = |p: usize, j: usize| (p * self.ps + j) as i64;
        let (mut src, mut dst, mut seen) = (Vec::new(), Vec::new(), 0);
        let mut taken = Vec::new();
        for (i, c) in self.queue.iter_mut().enumerate() {
            let keep = from.saturating_sub(seen).min(c.len);
            seen += c.len;
            for j in keep..c.len {
                src.push(slot(c.src, j));
                dst.push(slot(c.dst, j));
            }
            if keep == 0 {
                taken.push(i);
            } else {
                c.len = keep;
            }
        }
        // Each taken copy lets its source go, in queue order.
        for (n, i) in taken.into_iter().enumerate() {
            let c = self.queue.remove(i - n);
            self.holding -= 1;
            if self.release(c.src) {
                self.drop_copy_into(c.src);
            }
        }
        (src, dst)
    }
}
