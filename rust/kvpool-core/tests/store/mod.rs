//! A simulated K/V store for the tests of the host tier: every device slot
//! and every host slot holds the id of the content it carries, and the
//! allocator's queued transfers are run on it in the documented order
//! (offloads, then loads, then copy-on-write copies).
//!
//! A position's content is a pure function of what a model computes there:
//! the salt and the token ids of positions `0..=i` (`content`), or, where
//! a token id is unknown, a write id of its own. So a request reads the
//! right K/V exactly when every slot it holds carries the content of its
//! own context: a prefix hit that served a page computed for other tokens,
//! a host copy overwritten before its load ran, or a page offloaded before
//! its load or copy filled it all show up as a wrong id.

#![allow(dead_code)]

use kvpool_core::SlotAllocator;

/// The content id of position `ctx.len() - 1` computed with `salt` over
/// the token ids `ctx` (FNV-1a; the high bit stays clear, see `unique`).
pub fn content(salt: i64, ctx: &[i32]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for x in std::iter::once(salt).chain(ctx.iter().map(|&t| t as i64 + (1 << 40))) {
        for b in x.to_le_bytes() {
            h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
    }
    h >> 1
}

/// A content id that no context has (a write of unknown tokens).
pub fn unique(n: u64) -> u64 {
    (1 << 63) | n
}

/// Content ids of every device and host slot. A slot never written holds
/// junk of its own (`unique` ids past 2^40), so a read of it is a mismatch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Store {
    pub ps: usize,
    pub dev: Vec<u64>,
    pub host: Vec<u64>,
}

/// One drain's transfers, as the allocator hands them out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Drained {
    pub offloads: (Vec<i64>, Vec<i64>),
    pub loads: (Vec<i64>, Vec<i64>),
    pub copies: (Vec<i64>, Vec<i64>),
}

impl Drained {
    pub fn is_empty(&self) -> bool {
        self.offloads.0.is_empty() && self.loads.0.is_empty() && self.copies.0.is_empty()
    }
}

impl Store {
    pub fn new(a: &SlotAllocator) -> Self {
        let ps = a.page_size();
        let junk = |base: u64, n: usize| (0..n as u64).map(|i| unique(base + i)).collect();
        Store {
            ps,
            dev: junk(1 << 40, a.num_pages() * ps),
            host: junk(1 << 41, a.host_pages() * ps),
        }
    }

    /// Runs one drain's transfers in the documented order.
    pub fn run(&mut self, d: &Drained) {
        let ps = self.ps;
        for (&dp, &hp) in d.offloads.0.iter().zip(&d.offloads.1) {
            let (dp, hp) = (dp as usize * ps, hp as usize * ps);
            self.host[hp..hp + ps].copy_from_slice(&self.dev[dp..dp + ps]);
        }
        for (&hp, &dp) in d.loads.0.iter().zip(&d.loads.1) {
            let (hp, dp) = (hp as usize * ps, dp as usize * ps);
            self.dev[dp..dp + ps].copy_from_slice(&self.host[hp..hp + ps]);
        }
        for (&s, &t) in d.copies.0.iter().zip(&d.copies.1) {
            self.dev[t as usize] = self.dev[s as usize];
        }
    }

    /// Takes every queued transfer from `a` and runs it; returns them.
    pub fn drain(&mut self, a: &mut SlotAllocator) -> Drained {
        let d = take_all(a);
        self.run(&d);
        d
    }

    /// What the store will hold once `a`'s queued transfers have run
    /// (`a` itself unchanged).
    pub fn settled(&self, a: &SlotAllocator) -> Store {
        let mut s = self.clone();
        s.run(&take_all(&mut a.clone()));
        s
    }
}

/// Every queued transfer of `a`, in the order an engine takes them.
pub fn take_all(a: &mut SlotAllocator) -> Drained {
    Drained {
        offloads: a.take_offloads(),
        loads: a.take_loads(),
        copies: a.take_copies(),
    }
}
