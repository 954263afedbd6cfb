//! Recording a registration pass's run (`runs.rs`): `register_row`
//! (`allocator/cache.rs`) says which pages it files anew, one under
//! another, and the run is written once the pass ends.

use super::index::PrefixIndex;
use super::tip::ChainTip;

/// The run a registration pass is filing: the slots from entry `first`'s
/// (index + 1; 0: none) to the pass's tip, each filed anew under the one
/// before, the first under `parent`. The pass says where a run starts
/// (`start`), and where a filing does not follow the one before in the
/// slab (`filed`): a page that does costs the pass one compare of values
/// it holds, and the run's arrays are written once it ends (`end`), from
/// the row's page list and the pages' slot tokens.
///
/// Nothing may remove, relink or look through runs between `start` and
/// `end`: the pass ends its run before any call that could.
#[derive(Debug, Default)]
pub(crate) struct RunBuilder {
    first: u32,
    /// The index in the row's page list of the run's first page.
    k: usize,
    parent: ChainTip,
}

impl RunBuilder {
    /// Entry `tip` was just filed anew under `parent` for page `k` of the
    /// row's page list `list`, the page before having been filed anew too
    /// (the run goes on).
    #[inline(always)]
    pub(crate) fn filed(
        &mut self,
        ix: &mut PrefixIndex,
        parent: &ChainTip,
        tip: &ChainTip,
        list: &[u32],
        k: usize,
    ) {
        debug_assert!(self.first != 0, "a fresh parent is in the run");
        if tip.entry != parent.entry + 1 {
            self.end(ix, parent, list);
            self.start(parent, tip, k);
        }
    }

    /// Entry `tip` was just filed anew under `parent` for page `k` of the
    /// row's page list, with no run going.
    #[inline]
    pub(crate) fn start(&mut self, parent: &ChainTip, tip: &ChainTip, k: usize) {
        self.first = tip.entry;
        self.k = k;
        self.parent = *parent;
    }

    /// Records the run, whose last entry is `last`'s, if one is going.
    #[inline]
    pub(crate) fn end(&mut self, ix: &mut PrefixIndex, last: &ChainTip, list: &[u32]) {
        if self.first != 0 {
            if ix.runs.on {
                let n = (last.entry + 1 - self.first) as usize;
                ix.record_run(self.first - 1, &list[self.k..self.k + n], &self.parent);
            }
            self.first = 0;
        }
    }
}

impl PrefixIndex {
    /// Records the slots from `first`, filed just now for `pages` each
    /// under the one before and the first under `parent`, as a run
    /// (`RunBuilder`). Out of line: once a pass, not once a page.
    #[inline(never)]
    fn record_run(&mut self, first: u32, pages: &[u32], parent: &ChainTip) {
        let ents = &self.entries[first as usize..first as usize + pages.len()];
        debug_assert!(ents.windows(2).all(|w| w[1].parent_reg == w[0].reg));
        debug_assert_eq!(ents[0].parent_reg, parent.reg);
        debug_assert!(ents.iter().zip(pages).all(|(e, &p)| e.page == p));
        // Under the live entry of the slot before (a root tip's `entry` is
        // 0, and its `reg` 0 is no entry's).
        let extends = parent.reg != 0
            && parent.entry == first
            && self.entries[first as usize - 1].reg == parent.reg;
        self.runs.record(first, pages, &self.tokens, extends);
    }
}
