//! What a grouped pool is made of: one [`GroupSpec`] per layer group.

use crate::error::{PoolError, Result};

/// How a group's layers use the tokens before the current one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupKind {
    /// Full attention: every token's K/V stays while the request is open.
    Full,
    /// Sliding-window attention as Hugging Face and vLLM define it: a token
    /// attends to itself and the `window - 1` tokens before it, so a request
    /// needs only the pages covering its last `window - 1` positions.
    Sliding { window: usize },
    /// Linear attention or Mamba: one fixed-size state per request,
    /// overwritten each step. `checkpoint_every` (a multiple of the anchor
    /// page size; 0 picks the pool's hit step) is where `cache()` may keep a
    /// copy of it for prefix hits.
    State { checkpoint_every: usize },
}

impl GroupKind {
    /// The kind's name in messages and in Python (`"full"`, `"sliding"`,
    /// `"state"`).
    pub fn name(&self) -> &'static str {
        match self {
            GroupKind::Full => "full",
            GroupKind::Sliding { .. } => "sliding",
            GroupKind::State { .. } => "state",
        }
    }
}

/// One layer group of a [`crate::GroupedAllocator`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupSpec {
    pub kind: GroupKind,
    /// Pages of the group's own pool, the reserved page 0 included; for a
    /// state group, state slots, the reserved slot 0 included (slot 0 is
    /// the padding sink, as page 0 is).
    pub num_pages: usize,
    /// Slots per page; 1 for a state group (a slot is one request's state).
    pub page_size: usize,
}

impl GroupSpec {
    pub fn full(num_pages: usize, page_size: usize) -> Self {
        GroupSpec {
            kind: GroupKind::Full,
            num_pages,
            page_size,
        }
    }

    pub fn sliding(num_pages: usize, page_size: usize, window: usize) -> Self {
        GroupSpec {
            kind: GroupKind::Sliding { window },
            num_pages,
            page_size,
        }
    }

    /// `num_slots` state slots, slot 0 reserved; checkpoints every
    /// `checkpoint_every` tokens (0: the pool's hit step).
    pub fn state(num_slots: usize, checkpoint_every: usize) -> Self {
        GroupSpec {
            kind: GroupKind::State { checkpoint_every },
            num_pages: num_slots,
            page_size: 1,
        }
    }

    /// A page group (full or sliding).
    pub(crate) fn has_pages(&self) -> bool {
        !matches!(self.kind, GroupKind::State { .. })
    }

    pub(crate) fn validate(&self, g: usize) -> Result<()> {
        let bad = |m: String| Err(PoolError::InvalidArgument(format!("groups[{g}]: {m}")));
        if self.num_pages < 2 || self.num_pages > i32::MAX as usize {
            // A state group's size is its slots: the message names the key it was given as.
            let name = if self.has_pages() {
                "num_pages"
            } else {
                "num_slots"
            };
            return bad(format!(
                "{name} must be in [2, {}] (it includes the reserved {} 0), got {}",
                i32::MAX,
                if self.has_pages() { "page" } else { "slot" },
                self.num_pages
            ));
        }
        match self.kind {
            GroupKind::State { .. } if self.page_size != 1 => bad(format!(
                "a state group's page_size is 1, got {}",
                self.page_size
            )),
            _ if self.page_size == 0 => bad("page_size must be >= 1".into()),
            GroupKind::Sliding { window: 0 } => bad("a sliding window must be >= 1".into()),
            _ => match self.num_pages.checked_mul(self.page_size) {
                Some(s) if s <= i64::MAX as usize => Ok(()),
                _ => bad(format!(
                    "num_pages * page_size = {} * {} overflows",
                    self.num_pages, self.page_size
                )),
            },
        }
    }
}

pub(crate) fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Least common multiple, None on overflow.
pub(crate) fn lcm(a: usize, b: usize) -> Option<usize> {
    (a / gcd(a, b)).checked_mul(b)
}
