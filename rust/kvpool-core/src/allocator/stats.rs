//! `Stats`: every changing counter of the allocator, read in one call.
//!
//! A reader that takes several figures with separate calls (a metrics
//! scrape: the pages by state, the evictable pages by priority, the events
//! dropped) can see another thread's call land between two of them, and
//! then its figures disagree (the priority bands do not add up to the
//! evictable pages). Under the caller's lock, this one call is one instant.

use super::SlotAllocator;
use crate::eviction::MAX_PRIORITY;

/// The allocator's changing counters at one instant (see each field's
/// `SlotAllocator` method of the same name).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stats {
    pub free_pages: usize,
    pub used_pages: usize,
    pub free_slots: usize,
    pub used_slots: usize,
    pub open_requests: usize,
    pub admissible_tokens: usize,
    pub metadata_bytes: usize,
    pub cached_pages: usize,
    pub evictable_pages: usize,
    pub hit_tokens: u64,
    pub miss_tokens: u64,
    pub pinned_pages: usize,
    pub host_free_pages: usize,
    pub host_cached_pages: usize,
    pub host_hit_tokens: u64,
    pub offloaded_pages: u64,
    pub loaded_pages: u64,
    pub dropped_events: u64,
    /// Evictable pages at each priority 0..=100; they add up to
    /// `evictable_pages`.
    pub evictable_pages_by_priority: [usize; MAX_PRIORITY as usize + 1],
}

impl SlotAllocator {
    /// Every changing counter, read together (see [`Stats`]).
    pub fn stats(&self) -> Stats {
        Stats {
            free_pages: self.free_pages(),
            used_pages: self.used_pages(),
            free_slots: self.free_slots(),
            used_slots: self.used_slots(),
            open_requests: self.open_requests(),
            admissible_tokens: self.admissible_tokens(),
            metadata_bytes: self.metadata_bytes(),
            cached_pages: self.cached_pages(),
            evictable_pages: self.evictable_pages(),
            hit_tokens: self.hit_tokens(),
            miss_tokens: self.miss_tokens(),
            pinned_pages: self.pinned_pages(),
            host_free_pages: self.host_free_pages(),
            host_cached_pages: self.host_cached_pages(),
            host_hit_tokens: self.host_hit_tokens(),
            offloaded_pages: self.offloaded_pages(),
            loaded_pages: self.loaded_pages(),
            dropped_events: self.dropped_events(),
            evictable_pages_by_priority: self.evictable_pages_by_priority(),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::{Counts, Options, SlotAllocator, DEFAULT_PRIORITY};

    #[test]
    fn stats_agree_with_the_single_queries_and_bands_add_up() {
        let o = Options {
            hash_seed: Some(5),
            host_pages: 6,
            ..Options::new()
        };
        let mut a = SlotAllocator::with_options(10, 2, 4, 16, o).unwrap();
        for (i, prio) in [(0i64, 10i64), (10, DEFAULT_PRIORITY as i64), (20, 90)] {
            let p = [i + 1, i + 2, i + 3, i + 4, i + 5];
            let (h, _) = a.open_with_prefix(&p, &[5], Counts::Each(0)).unwrap();
            a.extend(&h, Counts::Each(5), None).unwrap();
            a.close_with_priority(&h, Counts::Each(prio), None).unwrap();
        }
        let s = a.stats();
        assert_eq!(s.evictable_pages, 6);
        assert_eq!(s.evictable_pages_by_priority.iter().sum::<usize>(), 6);
        assert_eq!(s.evictable_pages_by_priority[10], 2);
        assert_eq!(s.evictable_pages_by_priority[DEFAULT_PRIORITY as usize], 2);
        assert_eq!(s.evictable_pages_by_priority[90], 2);
        assert_eq!(s.dropped_events, a.dropped_events());
        assert_eq!(
            (
                s.free_pages,
                s.used_pages,
                s.cached_pages,
                s.host_free_pages
            ),
            (
                a.free_pages(),
                a.used_pages(),
                a.cached_pages(),
                a.host_free_pages()
            )
        );
        assert_eq!(
            s,
            a.stats(),
            "a second read with nothing in between is equal"
        );
    }

    #[test]
    fn an_undone_open_takes_back_its_counts_and_never_below_zero() {
        let o = Options {
            hash_seed: Some(5),
            ..Options::new()
        };
        let mut a = SlotAllocator::with_options(10, 2, 4, 16, o).unwrap();
        let p = [1i64, 2, 3, 4, 5];
        let (h, _) = a.open_with_prefix(&p, &[5], Counts::Each(0)).unwrap();
        a.extend(&h, Counts::Each(5), None).unwrap();
        a.close(&h, true).unwrap();
        let before = (a.hit_tokens(), a.miss_tokens());
        let (h, cached) = a.open_with_prefix(&p, &[5], Counts::Each(0)).unwrap();
        assert_eq!(cached, vec![4]);
        a.close(&h, false).unwrap();
        a.uncount_opens(4, 1, 0);
        assert_eq!((a.hit_tokens(), a.miss_tokens()), before);
        a.uncount_opens(u64::MAX, u64::MAX, u64::MAX);
        assert_eq!(
            (a.hit_tokens(), a.miss_tokens(), a.host_hit_tokens()),
            (0, 0, 0)
        );
    }
}
