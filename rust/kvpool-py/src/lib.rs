//! `kvpool._core`: thin PyO3 bindings of kvpool-core. Argument conversion,
//! GIL release around batch work, and error mapping live here; all allocator
//! logic lives in the core crate.

use pyo3::prelude::*;

mod admit;
mod allocator;
mod allocator_release;
mod caller_out;
mod chain_hashes;
mod convert;
mod copy_refusal;
mod counters;
mod errors;
mod events;
mod extend;
mod fork_guard;
mod grouped;
mod grouped_args;
mod grouped_cache;
mod grouped_queries;
mod grouped_request_queries;
mod grouped_sharing;
mod grouped_stats;
mod grouped_truncate;
mod handles_arg;
mod hashing;
mod heap_prime;
mod kv_events;
mod kv_events_args;
mod kv_events_wire;
mod output;
mod packed;
mod request_queries;
mod retention;
mod retention_args;
mod rows;
mod sharing;
mod stats;
mod table;
mod tier;
mod tier_args;
mod token_ids;
mod torch_arg;
mod torch_dense;
mod widen;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    m.add_class::<allocator::PySlotAllocator>()?;
    m.add_class::<grouped::PyGroupedAllocator>()?;
    m.add_class::<stats::PoolStats>()?;
    m.add_function(wrap_pyfunction!(stats::_pool_stats, m)?)?;
    m.add_function(wrap_pyfunction!(fork_guard::_fork_prepare, m)?)?;
    m.add_function(wrap_pyfunction!(fork_guard::_fork_release, m)?)?;
    m.add_function(wrap_pyfunction!(hashing::page_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(kv_events::encode_kv_events, m)?)?;
    m.add_function(wrap_pyfunction!(rows::scatter_rows, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // The retention priority of pages no caller gave one, and the highest.
    m.add("DEFAULT_PRIORITY", kvpool_core::DEFAULT_PRIORITY)?;
    m.add("MAX_PRIORITY", kvpool_core::MAX_PRIORITY)?;
    // The bounds of a pool's shape, so that callers (the bench and demo command lines) can refuse
    // a size by its flag before they build anything.
    m.add("MAX_PAGES", kvpool_core::MAX_PAGES)?;
    m.add("MAX_REQUESTS", kvpool_core::MAX_REQUESTS)?;
    m.add("MAX_CONTEXT_LEN", kvpool_core::MAX_CONTEXT_LEN)?;
    Ok(())
}
