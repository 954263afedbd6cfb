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
}

impl Events {
    pub fn len(&self) -> usize {
        self.kind.len()
    }

    pub fn is_empty(&self) -> bool {
        self.kind.is_empty()
    }
}

/// One recorded event (one push on the hot path; split into arrays on take).
#[derive(Debug, Clone, Copy)]
struct Raw {
    hash: u128,
    parent: u128,
    salt: i64,
    page: u32,
    num_tokens: u32,
    kind: u8,
}

/// Appends one page's token ids. At page sizes 1 and 16 the copy has a
/// length known at compile time and inlines; the general path calls
/// memcpy, a call per registered page.
#[inline]
fn push_page(out: &mut Vec<i32>, tokens: &[i32]) {
    if let [t] = tokens {
        out.push(*t);
    } else if let Ok(page) = <&[i32; 16]>::try_from(tokens) {
        out.extend_from_slice(page);
    } else {
        out.extend_from_slice(tokens);
    }
}

/// The recorder inside the allocator.
#[derive(Debug, Clone, Default)]
pub(crate) struct EventLog {
    raw: Vec<Raw>,
    token_ids: Vec<i32>,
    pub(crate) enabled: bool,
}

impl EventLog {
    pub(crate) fn new(enabled: bool) -> Self {
        EventLog {
            enabled,
            ..Default::default()
        }
    }

    /// Room for `n` more Stored events of `page_size` tokens, or an error.
    pub(crate) fn reserve(&mut self, n: usize, page_size: usize) -> crate::error::Result<()> {
        if self.enabled {
            crate::memory::reserve(&mut self.raw, n, "events")?;
            crate::memory::reserve(&mut self.token_ids, n.saturating_mul(page_size), "events")?;
        }
        Ok(())
    }

    pub(crate) fn capacity_bytes(&self) -> usize {
        self.raw.capacity() * std::mem::size_of::<Raw>() + self.token_ids.capacity() * 4
    }

    #[inline]
    pub(crate) fn stored(
        &mut self,
        hash: u128,
        parent: u128,
        page: u32,
        salt: i64,
        tokens: &[i32],
    ) {
        if self.enabled {
            let num_tokens = tokens.len() as u32;
            self.raw.push(Raw {
                hash,
                parent,
                salt,
                page,
                num_tokens,
                kind: EVENT_STORED,
            });
            push_page(&mut self.token_ids, tokens);
        }
    }

    #[inline]
    pub(crate) fn removed(&mut self, hash: u128, page: u32, salt: i64) {
        if self.enabled {
            self.raw.push(Raw {
                hash,
                parent: 0,
                salt,
                page,
                num_tokens: 0,
                kind: EVENT_REMOVED,
            });
        }
    }

    pub(crate) fn cleared(&mut self) {
        if self.enabled {
            self.raw.push(Raw {
                hash: 0,
                parent: 0,
                salt: 0,
                page: 0,
                num_tokens: 0,
                kind: EVENT_CLEARED,
            });
        }
    }

    /// Moves the recorded events out as arrays, leaving the log empty. The
    /// log keeps its capacity: a router drains every step, and a log that
    /// restarted empty would regrow (copying) on the hot path each time.
    pub(crate) fn take(&mut self) -> Events {
        let n = self.raw.len();
        let ids_cap = self.token_ids.capacity();
        let mut e = Events {
            token_ids: std::mem::replace(&mut self.token_ids, Vec::with_capacity(ids_cap)),
            ..Default::default()
        };
        e.kind.reserve_exact(n);
        for v in [
            &mut e.hash_hi,
            &mut e.hash_lo,
            &mut e.parent_hi,
            &mut e.parent_lo,
        ] {
            v.reserve_exact(n);
        }
        e.page.reserve_exact(n);
        e.num_tokens.reserve_exact(n);
        e.salt.reserve_exact(n);
        for r in self.raw.drain(..) {
            e.kind.push(r.kind);
            e.hash_hi.push((r.hash >> 64) as u64);
            e.hash_lo.push(r.hash as u64);
            e.parent_hi.push((r.parent >> 64) as u64);
            e.parent_lo.push(r.parent as u64);
            e.page.push(r.page as i32);
            e.num_tokens.push(r.num_tokens as i32);
            e.salt.push(r.salt);
        }
        e
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn push_page_appends_every_page_size_whole() {
        let mut out = vec![-1];
        for n in [1usize, 2, 15, 16, 17, 64] {
            let page: Vec<i32> = (0..n as i32).map(|t| t * 31 + n as i32).collect();
            let before = out.clone();
            super::push_page(&mut out, &page);
            assert_eq!(out, [before, page].concat(), "page size {n}");
        }
    }
}
