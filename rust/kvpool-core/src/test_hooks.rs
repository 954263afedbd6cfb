//! Test-only knobs that move the wrapping counters of a live allocator close
//! to their limits, so the wrap paths can be tested without 2^31 opens or
//! 2^32 batches. Hidden from the docs; not public API.

use crate::allocator::SlotAllocator;
use crate::error::{PoolError, Result};
use crate::handle::MAX_GENERATION;
use crate::rows::OPEN;

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
            if self.open_count > 0 {
                return Err(PoolError::InvalidArgument(
                    "close every request before moving generations".into(),
                ));
            }
            for r in self.rows.iter_mut() {
                r.generation = g & !OPEN;
            }
        }
        if let Some(e) = epoch {
            self.epoch = e;
        }
        Ok(())
    }
}
