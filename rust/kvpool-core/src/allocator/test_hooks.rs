//! Test-only knobs: move the wrapping counters of a live allocator close to
//! their limits, so the wrap paths can be tested without 2^31 opens or 2^32
//! batches, and break an invariant on purpose, so a test can see `check()`
//! report it. Compiled only with the `test-hooks` feature (the core's tests
//! and dev builds of the bindings turn it on); hidden from the docs, not
//! public API.

use super::SlotAllocator;
use crate::error::{PoolError, Result};
use crate::handle::MAX_GENERATION;

impl SlotAllocator {
    /// Sets every closed row's last generation to `generation` (the next open
    /// of a row issues the generation after it) and/or the batch-stamp epoch.
    /// Refuses to move generations while a request is open, since its handle
    /// would no longer resolve.
    #[doc(hidden)]
    pub fn set_counters_for_tests(
        &mut self,
        generation: Option<u32>,
        epoch: Option<u32>,
    ) -> Result<()> {
        if let Some(g) = generation {
            if g == 0 || g > MAX_GENERATION {
                return Err(PoolError::InvalidArgument(format!(
                    "generation must be in [1, {MAX_GENERATION}], got {g}"
                )));
            }
            self.requests.set_generations_for_tests(g)?;
        }
        if let Some(e) = epoch {
            self.requests.set_epoch_for_tests(e);
        }
        Ok(())
    }

    /// Overwrites the salt recorded with `page`'s registration (its hash,
    /// key and chain stay), breaking the rule that an entry has its live
    /// parent's salt. `InvalidArgument` for a page that is not registered.
    #[doc(hidden)]
    pub fn set_registration_salt_for_tests(&mut self, page: u32, salt: i64) -> Result<()> {
        if page == 0 || page as usize >= self.geo.num_pages || !self.pages.is_registered(page) {
            return Err(PoolError::InvalidArgument(format!(
                "page {page} is not registered"
            )));
        }
        self.prefix.set_salt_for_tests(self.pages.entry(page), salt);
        Ok(())
    }

    /// How the prefix index files its entries: `(live entries, keyed
    /// entries, orphans)` (see `prefix/links.rs`).
    #[doc(hidden)]
    pub fn index_links_for_tests(&self) -> (usize, usize, usize) {
        self.prefix.links_for_tests()
    }

    /// The prefix index's runs (`prefix/runs.rs`): `(first slab slot,
    /// length, parent)` of each, in slab order (none unless the page size
    /// is 1); `parent` is the slab slot + 1 of the entry the run's first
    /// entry was filed under (0: a chain's first page).
    #[doc(hidden)]
    pub fn index_runs_for_tests(&self) -> Vec<(u32, u32, u32)> {
        self.prefix.runs_for_tests()
    }

    /// Ghost registrations the prefix index keeps (`prefix/ghosts.rs`).
    #[doc(hidden)]
    pub fn index_ghosts_for_tests(&self) -> usize {
        self.prefix.ghosts_for_tests()
    }

    /// Per page of the request `handle` holds, in order: its registration
    /// id and its parent's (`prefix/index.rs`), or None for an unregistered
    /// page. Ids are internal: a test reads them only to pin how a chain's
    /// consecutive registrations are numbered (docs/design-per-run-prefix.md).
    #[doc(hidden)]
    pub fn registrations_for_tests(&self, handle: i64) -> Result<Vec<Option<(u64, u64)>>> {
        let row = self.requests.resolve(handle)?;
        Ok(self
            .requests
            .held_pages(row)
            .iter()
            .map(|&p| match self.pages.entry(p) {
                0 => None,
                e => Some(self.prefix.registration_for_tests(e)),
            })
            .collect())
    }
}
