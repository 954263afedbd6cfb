//! Where a prefix chain stands: the last verified page's entry. Used by the
//! index (lookups and registrations end on a tip) and by the requests
//! (each remembers the tip its chain reached), so it sits below both.

use super::hashing::root;

/// The last verified page of a chain: its chain hash, registration id and
/// entry (the root values before page 0). The three always describe the
/// same entry, which is what lets a later page's hash be chained on from
/// `hash` and checked against `reg`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct ChainTip {
    pub(crate) hash: u128,
    /// Registration id (0 at the root).
    pub(crate) reg: u64,
    /// Entry index + 1 (0 at the root): where the child hint is read.
    pub(crate) entry: u32,
}

impl ChainTip {
    pub(crate) fn root(salt: i64) -> Self {
        ChainTip {
            hash: root(salt),
            reg: 0,
            entry: 0,
        }
    }
}

/// A prompt's longest verified cached prefix, found before anything changes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Match {
    pub(crate) pages: usize,
    pub(crate) tip: ChainTip,
}

impl Match {
    /// No page matched yet.
    pub(crate) fn root(salt: i64) -> Self {
        Match {
            pages: 0,
            tip: ChainTip::root(salt),
        }
    }
}
