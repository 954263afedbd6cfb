//! KV cache events for KV-aware routers, in struct-of-arrays form so the
//! bindings hand each field out as one numpy array.
//!
//! They carry what vLLM's `KVEventBatch` does: `BlockStored` (page hash,
//! parent hash, page id, token count, the page's token ids, and the salt in
//! place of vLLM's lora id), `BlockRemoved` (page hash, page id) and
//! `AllBlocksCleared`.

/// A page was registered in the prefix index.
pub const EVENT_STORED: u8 = 0;
/// A registered page left the index (evicted, or unregistered before an
/// in-place write).
pub const EVENT_REMOVED: u8 = 1;
/// `clear_cache` dropped every entry.
pub const EVENT_CLEARED: u8 = 2;

/// Drained events, oldest first; event `i` is row `i` of every per-event
/// array. Hashes are 128-bit, split in high and low 64-bit halves.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Events {
    pub kind: Vec<u8>,
    pub hash_hi: Vec<u64>,
    pub hash_lo: Vec<u64>,
    /// Parent page hash of a Stored event; 0 for the first page of a chain
    /// and for other events.
    pub parent_hi: Vec<u64>,
    pub parent_lo: Vec<u64>,
    pub page: Vec<i32>,
    /// Tokens in the page (page_size for Stored, 0 otherwise).
    pub num_tokens: Vec<i32>,
    pub salt: Vec<i64>,
    /// Token ids of the Stored events, concatenated (num_tokens each).
    pub token_ids: Vec<i32>,
    /// Whether events are recorded at all (not drained by `take`).
    pub(crate) enabled: bool,
}

impl Events {
    pub(crate) fn new(enabled: bool) -> Self {
        Events {
            enabled,
            ..Default::default()
        }
    }

    pub fn len(&self) -> usize {
        self.kind.len()
    }

    pub fn is_empty(&self) -> bool {
        self.kind.is_empty()
    }

    fn push(&mut self, kind: u8, hash: u128, parent: u128, page: u32, salt: i64, tokens: &[i32]) {
        self.kind.push(kind);
        self.hash_hi.push((hash >> 64) as u64);
        self.hash_lo.push(hash as u64);
        self.parent_hi.push((parent >> 64) as u64);
        self.parent_lo.push(parent as u64);
        self.page.push(page as i32);
        self.num_tokens.push(tokens.len() as i32);
        self.salt.push(salt);
        self.token_ids.extend_from_slice(tokens);
    }

    #[inline]
    pub(crate) fn stored(&mut self, hash: u128, parent: u128, page: u32, salt: i64, tokens: &[i32]) {
        if self.enabled {
            self.push(EVENT_STORED, hash, parent, page, salt, tokens);
        }
    }

    #[inline]
    pub(crate) fn removed(&mut self, hash: u128, page: u32, salt: i64) {
        if self.enabled {
            self.push(EVENT_REMOVED, hash, 0, page, salt, &[]);
        }
    }

    pub(crate) fn cleared(&mut self) {
        if self.enabled {
            self.push(EVENT_CLEARED, 0, 0, 0, 0, &[]);
        }
    }

    /// Moves the recorded events out, leaving this empty (still enabled).
    pub(crate) fn take(&mut self) -> Events {
        let enabled = self.enabled;
        let mut out = std::mem::take(self);
        out.enabled = enabled;
        self.enabled = enabled;
        out
    }
}
