//! The host tier's part of `check()`, beyond what the host owner checks on
//! its own (`host/check.rs`) and the index checks both ways with the host
//! records (`prefix/check.rs`):
//!
//! - the count of host-only entries is the index's;
//! - only swapped-out requests name host pages, in range (`check.rs`).

use super::SlotAllocator;

impl SlotAllocator {
    /// `host_holders[h]`: swapped-out requests naming host page `h`.
    pub(super) fn check_tier(&self, host_holders: Vec<u32>) -> std::result::Result<(), String> {
        let Some(host) = self.host.as_ref() else {
            return Ok(());
        };
        host.check(host_holders, self.geo.num_pages)?;
        let located = self.prefix.count_host_located();
        if located != host.host_only() {
            return Err(format!(
                "{located} index entries are on the host only but the tier counts {}",
                host.host_only()
            ));
        }
        Ok(())
    }
}
