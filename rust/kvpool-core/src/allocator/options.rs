//! The argument types of construction and of the batch calls.

use crate::error::{PoolError, Result};
use crate::host::HostPolicy;

/// Per-request token counts (or target lengths, or salts) of a batch call:
/// one value broadcast to every handle, or one value per handle.
#[derive(Debug, Clone, Copy)]
pub enum Counts<'a> {
    Each(i64),
    PerRequest(&'a [i64]),
}

impl Counts<'_> {
    #[inline]
    pub fn get(&self, i: usize) -> i64 {
        match self {
            Counts::Each(c) => *c,
            Counts::PerRequest(v) => v[i],
        }
    }

    pub(crate) fn check_len(&self, what: &str, n: usize) -> Result<()> {
        match self {
            Counts::PerRequest(v) if v.len() != n => Err(PoolError::InvalidArgument(format!(
                "{what} has {} entries but there are {n} requests; pass one per request or a single int",
                v.len()
            ))),
            _ => Ok(()),
        }
    }
}

/// Construction options beyond the four sizes.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Seed of the prefix hash. Random per pool when None; ranks and routers
    /// that must agree on page hashes pass the same seed.
    pub hash_seed: Option<u64>,
    /// Seed of the handle generations. Random per pool when None; a seed makes
    /// the handles a pure function of the seed and the call sequence, so
    /// tensor-parallel ranks that make the same calls get the same handles.
    /// Pools with different seeds still tell each other's handles apart
    /// (about 1 in 2^31), as with random bases.
    pub handle_seed: Option<u64>,
    /// Record Stored/Removed/Cleared events for `take_events`. The caller
    /// drains them; past max(num_pages, 65536) undrained events the backlog
    /// becomes one Cleared event (`dropped_events` counts what went).
    pub kv_events: bool,
    /// Test only: keep just this many low bits of every page hash (0 = all
    /// 128), to force collisions. Not public API.
    #[doc(hidden)]
    pub weak_hash_bits: u32,
    /// Test only: generation of each row's first request (random otherwise).
    #[doc(hidden)]
    pub generation_base: Option<u32>,
    /// Test only: generation of each row's first request when it should
    /// differ from the base (to reach a row's retirement quickly).
    #[doc(hidden)]
    pub generation_start: Option<u32>,
    /// Benchmark only: accept a key's prefix hit without comparing its
    /// token ids (the salt and parent are still checked), to measure what
    /// the compare costs. Unsafe against collisions; not public API.
    #[doc(hidden)]
    pub skip_hit_verification: bool,
    /// Test only: starting value of the batch-stamp epoch.
    #[doc(hidden)]
    pub epoch_start: u32,
    /// Leave the request page lists, page records and slot token ids to be
    /// mapped on first use (the lists and ids on 4 KiB pages), instead of at
    /// construction on huge pages, and let the index's entry slab grow with
    /// its registrations instead of reserving it for every page at the
    /// first `cache()`: for a pool sized far beyond what it will hold, whose
    /// first requests may pay page faults (see `memory::fault_in`,
    /// `memory::reserve_mapped`).
    pub lazy_metadata: bool,
    /// Host pages of a host tier, the reserved page 0 included (0: no tier,
    /// and everything behaves and costs as without one; otherwise >= 2).
    pub host_pages: usize,
    /// When registered pages get a host copy (see [`HostPolicy`]).
    pub host_policy: HostPolicy,
    /// Most registered pages that may be pinned (priority 100 with no
    /// duration) at once, at most the pool's capacity in pages. None: a
    /// quarter of it. A pin past the bound is given as priority 99.
    pub max_pinned_pages: Option<usize>,
    /// Retention durations run on a clock only `set_clock` moves, instead
    /// of the system's monotonic clock.
    pub manual_clock: bool,
}

impl Options {
    /// Defaults: random hash seed, events on.
    pub fn new() -> Self {
        Options {
            kv_events: true,
            ..Default::default()
        }
    }
}
