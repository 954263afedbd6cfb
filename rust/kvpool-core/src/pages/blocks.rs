//! Block holds: one holder count for an aligned block of `BLOCK`
//! consecutive page ids, added to every page of the block at once.
//!
//! At page size 1 a shared system prompt is thousands of pages, mostly
//! consecutive ids (`stretches.rs`), and every request that hits it adds a
//! holder to each of them and takes it away at close: a read and a write
//! of each page's 16-byte record, twice a request. A request that holds a
//! whole aligned block counts once in the block's count instead, one
//! 4-byte count per eight pages.
//!
//! A page's holders are its record's count plus its block's. The counts
//! are interchangeable: a hold taken on the block may be let go page by
//! page and the other way round, since only the sum is ever read.
//!
//! **Invariant.** A block with a count has every page held at least twice
//! by its record alone (`is_shared`). So a page whose record holds it
//! once or not at all has no block holder: a last holder's release (a
//! request's own pages, the common close), the CACHED and FREE states, the
//! eviction lists and the free stack never read this room. A block takes
//! holders only while that holds, and only a record going from two holders
//! to one could break it: that path (`holders.rs`, `mod.rs`) first folds
//! the block's count into its eight records (`flatten`), which keeps every
//! sum. A prompt hit by one running request at a time therefore keeps its
//! holders in its records; from the third at once on, they go to blocks.

use super::record::PageState;
use crate::error::Result;
use crate::memory::{advise_huge, zeroed_vec};

/// Pages per block: aligned, so a page's block is its id / BLOCK.
pub(super) const BLOCK: usize = 8;

#[derive(Debug, Clone, Default)]
pub(super) struct BlockHolds {
    /// Per block of page ids: holders of all of its pages beyond their
    /// records' counts. Zero-filled (calloc), mapped as blocks are held.
    counts: Vec<u32>,
    /// Blocks with a count: while 0, nothing reads `counts` (a release
    /// runs its loop without block tests, a hold tries no block run).
    live: usize,
}

impl BlockHolds {
    pub(super) fn new(num_pages: usize) -> Result<Self> {
        let counts = zeroed_vec::<u32>(num_pages.div_ceil(BLOCK), "page block holds")?;
        advise_huge(&counts);
        Ok(BlockHolds { counts, live: 0 })
    }

    /// Holders page `p` has through its block.
    #[inline(always)]
    pub(super) fn of(&self, p: u32) -> u32 {
        match self.live {
            0 => 0,
            _ => self.counts[p as usize / BLOCK],
        }
    }

    /// One more holder of every page of the block starting at page
    /// `first` (aligned), whose records each hold their page twice or
    /// more (the caller tested).
    #[inline(always)]
    pub(super) fn add(&mut self, first: u32) {
        let c = &mut self.counts[first as usize / BLOCK];
        self.live += (*c == 0) as usize;
        *c += 1;
    }

    /// One more holder of each block of the run of whole blocks that
    /// `list` starts with, as far as the list goes on block by block (the
    /// next eight consecutive ids, aligned) and each block has holders
    /// already; returns how many pages took one. No record is read: a
    /// block with holders has its records shared.
    #[inline]
    pub(super) fn hold_run(&mut self, list: &[u32]) -> usize {
        let Some(&first) = list.first() else {
            return 0;
        };
        if self.live == 0 || first as usize % BLOCK != 0 {
            return 0;
        }
        let counts = self
            .counts
            .get_mut(first as usize / BLOCK..)
            .unwrap_or_default();
        let mut n = 0;
        for (ids, c) in list.chunks_exact(BLOCK).zip(counts) {
            if *c == 0 || !ids_from(ids, first.wrapping_add(n as u32)) {
                break;
            }
            *c += 1;
            n += BLOCK;
        }
        n
    }

    /// One holder fewer of each block of the run of whole blocks that
    /// `list` ends with (`release` goes from the end), as far as each has
    /// holders; returns how many pages, from the end, let one go.
    #[inline]
    pub(super) fn release_run(&mut self, list: &[u32]) -> usize {
        let Some(&last) = list.last() else {
            return 0;
        };
        let end = last as usize + 1;
        if self.live == 0 || end % BLOCK != 0 {
            return 0;
        }
        let counts = self.counts.get_mut(..end / BLOCK).unwrap_or_default();
        let mut n = 0;
        for (ids, c) in list.rchunks_exact(BLOCK).zip(counts.iter_mut().rev()) {
            if *c == 0 || !ids_from(ids, (end - n - BLOCK) as u32) {
                break;
            }
            *c -= 1;
            self.live -= (*c == 0) as usize;
            n += BLOCK;
        }
        n
    }

    /// Whether a page of `q`, whose records' counts are `e` (`extra`),
    /// would be left holding its page once in its record beside block
    /// holders, were each to lose a holder: it must go the one-by-one way
    /// (`flatten`).
    #[inline(always)]
    pub(super) fn single(&self, q: [u32; 4], e: [u32; 4]) -> bool {
        self.live != 0
            && q.iter()
                .zip(e)
                .any(|(&p, x)| x == 1 && self.counts[p as usize / BLOCK] != 0)
    }

    /// Folds page `p`'s block count into the block's records, before `p`'s
    /// record goes from two holders to one. Every page's sum stays.
    #[inline(always)]
    pub(super) fn flatten(&mut self, st: &mut [PageState], p: u32) {
        let b = p as usize / BLOCK;
        if self.live != 0 && self.counts[b] != 0 {
            self.flatten_block(st, b);
        }
    }

    #[cold]
    #[inline(never)]
    fn flatten_block(&mut self, st: &mut [PageState], b: usize) {
        let c = std::mem::take(&mut self.counts[b]);
        self.live -= 1;
        let end = ((b + 1) * BLOCK).min(st.len());
        for r in &mut st[b * BLOCK..end] {
            debug_assert!(r.is_shared(), "a held block's records hold twice");
            r.extra += c;
        }
    }

    /// Blocks with a count, and their counts (every block read, whatever
    /// `live` says: `check` compares the two).
    pub(super) fn held(&self) -> impl Iterator<Item = (usize, u32)> + '_ {
        self.counts
            .iter()
            .enumerate()
            .filter(|&(_, &c)| c > 0)
            .map(|(b, &c)| (b, c))
    }

    pub(super) fn live(&self) -> usize {
        self.live
    }

    pub(super) fn capacity_bytes(&self) -> usize {
        self.counts.capacity() * 4
    }
}

/// Whether the pages are `base`, `base + 1`, ...: one fold of xors, not a
/// search, so it compiles to a vector compare (`stretches::consecutive` too).
#[inline(always)]
pub(super) fn ids_from(ids: &[u32], base: u32) -> bool {
    let off = ids
        .iter()
        .enumerate()
        .fold(0, |d, (j, &p)| d | (p ^ base.wrapping_add(j as u32)));
    off == 0
}
