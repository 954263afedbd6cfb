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
    /// A slot an older copy left queued has yet to fill reads from that
    /// copy's source (down the chain): the pairs are right to run at once.
    pub fn take_copies_from(&mut self, from: usize) -> (Vec<i64>, Vec<i64>) {
        let slot = |p: usize, j: usize| (p * self.ps + j) as i64;
        // What stays queued of each copy: its first `keep` slots (a suffix
        // of the queue is taken whole).
        let mut seen = 0;
        let keeps: Vec<usize> = self
            .queue
            .iter()
            .map(|c| {
                let keep = from.saturating_sub(seen).min(c.len);
                seen += c.len;
                keep
            })
            .collect();
        let source = |i: usize, j: usize| {
            let (mut p, mut upto) = (self.queue[i].src, i);
            while let Some(o) = (0..upto).rev().find(|&o| self.queue[o].dst == p) {
                if j >= keeps[o] {
                    break;
                }
                p = self.queue[o].src;
                upto = o;
            }
            p
        };
        let (mut src, mut dst) = (Vec::new(), Vec::new());
        for (i, c) in self.queue.iter().enumerate() {
            for j in keeps[i]..c.len {
                src.push(slot(source(i, j), j));
                dst.push(slot(c.dst, j));
            }
        }
        let whole = keeps.iter().position(|&k| k == 0).unwrap_or(keeps.len());
        for (c, &k) in self.queue.iter_mut().zip(&keeps) {
            c.len = k;
        }
        // Each taken copy (the queue's last ones) lets its source go, in
        // queue order, one at a time: a release may drop older copies whose
        // destination nobody holds any more, never a taken one.
        for left in (1..=self.queue.len() - whole).rev() {
            let c = self.queue.remove(self.queue.len() - left);
            self.holding -= 1;
            if self.release(c.src) {
                self.drop_copy_into(c.src);
            }
        }
        (src, dst)
    }
}
