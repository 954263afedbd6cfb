//! `check()` for the priority lists: every list walked from its oldest
//! page, against the counts, the non-empty mask and each page's priority.
//! Apart from `levels.rs` because it reads every list end to end, which no
//! operation on the lists does.

use super::{Levels, LISTS, PINNED};
use crate::eviction::lru::{Linked, Links};

impl Levels {
    /// Walks every list from its oldest page: links both ways, each page on
    /// the list its priority names, the counts and the mask. `visit` as in
    /// `Lru::check`. Returns the pages walked.
    pub(crate) fn check<R: Linked>(
        &self,
        recs: &[R],
        mut visit: impl FnMut(u32) -> bool,
    ) -> std::result::Result<usize, String> {
        if *recs[0].links() != Links::UNLINKED {
            return Err("record 0 is linked while the pool keeps priority lists".into());
        }
        let mut total = 0usize;
        let (mut mask, mut evictable) = (0u128, 0usize);
        for l in 0..LISTS {
            let (mut walked, mut prev) = (0usize, 0u32);
            let mut p = self.ends[l].oldest;
            while p != 0 {
                if p as usize >= recs.len() || walked >= recs.len() || !visit(p) {
                    return Err(format!(
                        "priority list {l}: entry {p} is out of range, repeated or on the free stack"
                    ));
                }
                if recs[p as usize].links().older != prev {
                    return Err(format!(
                        "priority list {l}: back link of page {p} is broken"
                    ));
                }
                if self.list_of(p) != l {
                    return Err(format!(
                        "page {p} is on priority list {l} but its priority files it on {}",
                        self.list_of(p)
                    ));
                }
                walked += 1;
                prev = p;
                p = recs[p as usize].links().newer;
            }
            if self.ends[l].newest != prev || walked != self.lens[l] {
                return Err(format!(
                    "priority list {l} walks {walked} pages but counts {}",
                    self.lens[l]
                ));
            }
            if l < PINNED {
                evictable += walked;
                if walked > 0 {
                    mask |= 1 << l;
                }
            }
            total += walked;
        }
        if mask != self.nonempty || evictable != self.evictable {
            return Err("the non-empty priority mask or the evictable count is wrong".into());
        }
        Ok(total)
    }
}
