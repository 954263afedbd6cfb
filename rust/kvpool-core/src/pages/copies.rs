//! Copy-on-write copies and the pages they hold.
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

use super::PagePool;
use crate::error::Result;

/// How many copies one extend makes of shared, partly filled last pages:
/// `pages` names each growing request's such page (sorted here), and
/// `holders(p)` is `p`'s holder count when the requests grow. A page with
/// `h` holders, `m` of them growing, is copied `min(m, h - 1)` times: each
/// copy drops a holder, and the last holder to grow finds the page its own
/// and writes in place.
pub(crate) fn copies_of_shared(pages: &mut [u32], holders: impl Fn(u32) -> usize) -> usize {
    pages.sort_unstable();
    let mut copies = 0;
    let mut i = 0;
    while i < pages.len() {
        let p = pages[i];
        let m = pages[i..].iter().take_while(|&&q| q == p).count();
        copies += m.min(holders(p).saturating_sub(1));
        i += m;
    }
    copies
}

impl PagePool {
    /// Makes room for `n` more copies before a batch changes anything.
    pub(crate) fn prepare_copies(&mut self, n: usize) -> Result<()> {
        self.copies.prepare(n, self.records.len())
    }

    /// Queues the copy of slots `0..len` of page `src` to page `dst` (taken
    /// just now). Room was made by `prepare_copies`.
    #[inline]
    pub(crate) fn queue_copy(&mut self, src: u32, dst: u32, len: usize) {
        self.copies.push(src, dst, len);
    }

    /// Runs queued so far, dropped ones included (the start of a call's).
    #[inline]
    pub(crate) fn queued_runs(&self) -> usize {
        self.copies.runs().len()
    }

    /// The end of a call that queued runs `from..`: each holds its source
    /// page from now on.
    pub(crate) fn hold_copy_sources(&mut self, from: usize) {
        for r in &self.copies.runs()[from..] {
            // Still held by a request: a holder leaves a page in this call
            // only by copying it, and only while another holds it.
            self.records[r.src as usize].extra += 1;
        }
    }

    /// Whether a waiting copy writes into page `p`.
    #[inline]
    pub(crate) fn is_copy_destination(&self, p: u32) -> bool {
        self.copies.run_into(p) != 0
    }

    /// After a release of `pages` marked some of them: drops their copies,
    /// last page first, as the pages were released.
    pub(crate) fn drop_released_copies(&mut self, pages: &[u32]) {
        for &p in pages.iter().rev() {
            if self.copies.is_released(p) {
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
            if !self.release_one(src) {
                return;
            }
            p = src;
        }
    }

    /// Drains the queued copies from index `from` on (slot pairs, in
    /// queue order), leaving earlier ones queued, their source pages still
    /// held; `page_size` expands a run of a page into its slots. A slot
    /// that an earlier copy left queued has yet to fill is read from that
    /// copy's source (down a chain of them), so the pairs taken are right
    /// to run at once, whenever the earlier copies run.
    pub(crate) fn take_copies_from(
        &mut self,
        from: usize,
        page_size: usize,
    ) -> (Vec<i64>, Vec<i64>) {
        let n = self.copies.slots() - from.min(self.copies.slots());
        let (mut src, mut dst) = (Vec::with_capacity(n), Vec::with_capacity(n));
        self.drain_copies_from(from, page_size, |s, d| {
            src.push(s);
            dst.push(d);
        });
        (src, dst)
    }

    /// [`Self::take_copies_from`], handing each slot pair to `each` instead
    /// of collecting them: it allocates nothing, for a caller that has
    /// made room for them before the call that queued them.
    pub(crate) fn drain_copies_from(
        &mut self,
        from: usize,
        page_size: usize,
        mut each: impl FnMut(i64, i64),
    ) {
        let q = &self.copies;
        let from = from.min(q.slots());
        if q.slots() == from {
            return;
        }
        // The newest runs hold the last slots; a run that straddles
        // `from` keeps its first `head` slots queued (and its hold).
        let runs = q.runs();
        let mut i = runs.len();
        let mut before = q.slots();
        while before > from {
            i -= 1;
            before -= runs[i].len as usize;
        }
        let head = from - before;
        let ps = page_size;
        for k in i..runs.len() {
            let r = self.copies.runs()[k];
            let skip = if k == i { head } else { 0 };
            if r.len as usize <= skip {
                continue;
            }
            let d = r.dst as usize * ps;
            if self.copies.run_into(r.src) == 0 {
                let s = r.src as usize * ps;
                for j in skip..r.len as usize {
                    each((s + j) as i64, (d + j) as i64);
                }
            } else {
                // The source is an older copy's destination, and that copy
                // stays queued: the caller runs this one now, before it, so
                // the slots it would fill are read where it reads them.
                for j in skip..r.len as usize {
                    let s = self.copies.source_of(r.src, j) as usize * ps;
                    each((s + j) as i64, (d + j) as i64);
                }
            }
            if skip > 0 {
                self.copies.shorten(k, skip);
            } else {
                let s = self.copies.kill(k);
                if self.release_one(s) {
                    // Its source was an earlier waiting copy's destination
                    // (a chain), now held by nobody: that copy goes too.
                    self.drop_copy_into(s);
                }
            }
        }
        self.copies.tidy();
    }

    /// Queued copy-on-write copies (slot pairs) not yet taken.
    #[inline]
    pub(crate) fn pending_copies(&self) -> usize {
        self.copies.slots()
    }
}
