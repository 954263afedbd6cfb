//! The host tier's invariants, given how many swapped-out requests name
//! each host page:
//!
//! - every host page is in exactly one state: FREE (free stack, holders 0,
//!   unregistered), HELD (holders >= 1) or CACHED (holders 0, registered,
//!   on the eviction list); page 0 is in none;
//! - each page's holders are the swapped-out requests that name it plus
//!   the queued transfers that pin it (a load's source, an offload's
//!   destination);
//! - every queued transfer names pages in range, and the per-device-page
//!   count of queued loads agrees with the load queue;
//! - the registered count is the pages that hold an entry's copy.
//!
//! Which entry each page names, and that the index agrees, is the
//! allocator's check (`allocator/check.rs`).

use super::HostTier;

impl HostTier {
    /// `holders[h]`: swapped-out requests naming host page `h`; `num_pages`:
    /// the device pool's pages.
    pub(crate) fn check(
        &self,
        mut holders: Vec<u32>,
        num_pages: usize,
    ) -> std::result::Result<(), String> {
        let n = self.records.len();
        if holders.len() != n {
            return Err("the per-host-page holder array has the wrong length".into());
        }
        let mut into = vec![0u32; num_pages];
        for (what, q) in [("offload", &self.offloads), ("load", &self.loads)] {
            for t in q {
                let (d, h) = (t.device as usize, t.host as usize);
                if d == 0 || d >= num_pages || h == 0 || h >= n {
                    return Err(format!(
                        "a queued {what} names device page {d} and host page {h}, out of range"
                    ));
                }
                holders[h] += 1;
                if what == "load" {
                    into[d] += 1;
                }
            }
        }
        if into != self.load_into {
            return Err(
                "the count of queued loads per device page disagrees with the queue".into(),
            );
        }
        // 0 unseen, 1 free stack, 2 eviction list.
        let mut listed = vec![0u8; n];
        for &h in &self.free {
            let h = h as usize;
            if h == 0 || h >= n || listed[h] != 0 {
                return Err(format!(
                    "host free stack entry {h} is out of range or repeated"
                ));
            }
            listed[h] = 1;
        }
        let recs = &self.records;
        self.eviction.check(recs, |h| {
            let seen = std::mem::replace(&mut listed[h as usize], 2);
            seen == 0
        })?;
        let mut registered = 0usize;
        for h in 1..n {
            let r = recs[h];
            registered += (r.entry != 0) as usize;
            if r.holders != holders[h] {
                return Err(format!(
                    "host page {h} has {} holders but {} swapped requests and queued transfers \
                     name it",
                    r.holders, holders[h]
                ));
            }
            let ok = match listed[h] {
                1 => r.holders == 0 && r.entry == 0,
                2 => r.holders == 0 && r.entry != 0,
                _ => r.holders > 0,
            };
            if !ok {
                return Err(format!(
                    "host page {h} is in no single state (holders {}, entry {}, list {})",
                    r.holders, r.entry, listed[h]
                ));
            }
        }
        if recs[0].holders != 0 || recs[0].entry != 0 {
            return Err("host page 0 is held or registered".into());
        }
        if registered != self.registered {
            return Err(format!(
                "{registered} host pages hold an entry's copy but the tier counts {}",
                self.registered
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
impl HostTier {
    /// Test only: breaks one of the invariants above (or one the allocator
    /// checks across owners), named by `what`.
    pub(crate) fn corrupt_for_tests(&mut self, what: &str) {
        match what {
            "host free and held" => self.free.push(self.free[0]),
            "host holders" => self.records[1].holders += 1,
            "host registered count" => self.registered += 1,
            "host only count" => self.host_only += 1,
            "host load map" => self.load_into[1] += 1,
            _ => panic!("no corruption {what:?}"),
        }
    }
}
