//! Per-request state, split by temperature. A decode step touches only the
//! 16-byte hot [`Row`]; the prompt and prefix-chain progress in [`RowCold`]
//! are read when a request takes the slow path (a pending prompt, a page to
//! copy on write) or when it is cached, forked or truncated.

use crate::prefix::tip::ChainTip;

/// `Row::generation` bit: the row holds an open request.
pub(super) const OPEN: u32 = 1 << 31;
/// `Row::last` bit: the next extend must take the slow path, because the
/// request has prompt tokens at positions not yet extended, or its last page
/// may be shared or registered (so writing into it needs copy-on-write or an
/// unregister). Set conservatively; the slow path clears it.
pub(super) const SLOW: u32 = 1 << 31;
/// `Row::last` of a swapped-out request (`swap_out`): SLOW, so the decode
/// loops stop at it and the general path refuses it, and a page id no pool
/// has (pages are below 2^31 - 1), so the mark costs the hot row nothing.
/// Its page list then names host pages too (`location.rs`).
pub(crate) const SWAPPED: u32 = u32::MAX;

/// Hot per-row state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(C)]
pub(crate) struct Row {
    /// Current generation, with `OPEN` while a request holds the row.
    pub(super) generation: u32,
    /// Tokens in the request.
    pub(super) len: u32,
    /// Last page held (0 when none), with the `SLOW` bit.
    pub(super) last: u32,
    /// Batch stamp for duplicate detection.
    pub(super) stamp: u32,
}

impl Row {
    /// Holds an open request.
    #[inline]
    pub(super) fn is_open(&self) -> bool {
        self.generation & OPEN != 0
    }
}

/// Cold per-row state: the prompt, the salt and the prefix chain's progress.
#[derive(Debug, Clone, Default)]
pub(crate) struct RowCold {
    /// The prompt given to `open_with_prefix` (token ids of positions
    /// `0..prompt.len()`); extends past the request's length take their ids
    /// from here.
    pub(super) prompt: Vec<i32>,
    /// Leading full pages whose chain hash is computed (registered, or a
    /// verified duplicate of a registered page).
    pub(super) hashed_pages: u32,
    /// The chain stopped at `hashed_pages` (a hash collision with a
    /// different page); nothing past it is registered.
    pub(super) chain_broken: bool,
    /// The index entry page `hashed_pages - 1` matched (the root when 0).
    pub(super) tip: ChainTip,
    /// Some page of the chain is an unregistered duplicate of another
    /// request's entry: that entry can be evicted while this request holds
    /// its own copy, and the pages chained under it then cannot be hit.
    pub(super) foreign: bool,
    /// The index's `removals` when the chain was last walked: while it is
    /// the same, no entry of the chain can have gone.
    pub(super) checked: u32,
    pub(super) salt: i64,
    /// No other request (and no cache entry) can hold any of this request's
    /// pages: it never forked or was forked, hit no cached page and
    /// registered none. Its pages are then freed without reading refcounts.
    pub(super) exclusive: bool,
}

impl RowCold {
    pub(super) fn reset(&mut self, salt: i64) {
        self.prompt.clear();
        self.salt = salt;
        self.restart_chain();
        self.exclusive = true;
    }

    /// Makes `prompt` the row's prompt, keeping whichever buffer is larger.
    /// A row's prompt capacity then only grows (until a close returns a
    /// buffer past 4096 tokens), so `metadata_bytes` settles once every row
    /// has held its longest prompt instead of following which row last took
    /// which prompt; a leak check can then trust it.
    pub(super) fn set_prompt(&mut self, prompt: Vec<i32>) {
        if self.prompt.capacity() >= prompt.len() {
            self.prompt.clear();
            self.prompt.extend_from_slice(&prompt);
        } else {
            self.prompt = prompt;
        }
    }

    /// Forgets the chain (it is recomputed from page 0 by the next `cache`).
    pub(super) fn restart_chain(&mut self) {
        self.hashed_pages = 0;
        self.chain_broken = false;
        self.tip = ChainTip::root(self.salt);
        self.foreign = false;
    }

    /// Everything but the prompt (which the caller copies fallibly).
    pub(super) fn clone_without_prompt(&self) -> RowCold {
        RowCold {
            prompt: Vec::new(),
            hashed_pages: self.hashed_pages,
            chain_broken: self.chain_broken,
            tip: self.tip,
            foreign: self.foreign,
            checked: self.checked,
            salt: self.salt,
            exclusive: false,
        }
    }
}
