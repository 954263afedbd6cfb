//! With a host tier, the index holds more live entries than the device has
//! pages: an entry whose device page was evicted stays live while its host
//! copy does. Its room for registrations (and its key table's) must count
//! those entries, or a full table leaves a lookup of an absent key probing
//! forever.

use kvpool_core::{Counts, HostPolicy, Options, SlotAllocator};
use std::sync::mpsc;
use std::time::Duration;

/// 8 usable device pages of one token, 63 host pages under `write_back`.
fn pool() -> SlotAllocator {
    let opts = Options {
        hash_seed: Some(3),
        host_pages: 64,
        host_policy: HostPolicy::WriteBack,
        ..Options::new()
    };
    SlotAllocator::with_options(9, 1, 16, 16, opts).unwrap()
}

/// Caches eight one-token requests of tokens `first..first + 8`.
fn cache_eight(a: &mut SlotAllocator, first: i64) {
    let h = a.open(8).unwrap();
    let tokens: Vec<i64> = (first..first + 8).collect();
    a.extend(&h, Counts::Each(1), Some(&tokens)).unwrap();
    a.close(&h, true).unwrap();
}

/// Runs `f` on its own thread and fails the test if it has not returned
/// within a minute (a hang would otherwise stall the whole test run); a
/// panic in `f` fails the test as it is.
fn within_a_minute<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    let worker = std::thread::spawn(move || {
        let out = f();
        let _ = tx.send(());
        out
    });
    if let Err(mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(Duration::from_secs(60)) {
        panic!("the call did not return: a lookup is probing a full key table");
    }
    worker
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e))
}

#[test]
fn entries_kept_by_their_host_copies_leave_the_index_room_for_the_device_pages() {
    within_a_minute(|| {
        let mut a = pool();
        cache_eight(&mut a, 100);
        assert_eq!(a.evict(8), 8, "all eight go to the host");
        let (src, _) = a.take_offloads();
        assert_eq!(src.len(), 8, "each evicted entry is offloaded");
        assert_eq!(
            a.host_cached_pages(),
            8,
            "the entries stay, on the host alone"
        );
        // Eight more registrations: 16 live entries on an 8-page device.
        cache_eight(&mut a, 200);
        assert_eq!((a.cached_pages(), a.host_cached_pages()), (8, 8));
        a.check().unwrap();
        // A prompt nobody cached: its first page's key is absent.
        let (h, cached) = a
            .open_with_prefix(&[1000, 1001], &[2], Counts::Each(0))
            .unwrap();
        assert_eq!(cached, [0]);
        a.close(&h, false).unwrap();
        // And one that was: its page is on the host, a hit that loads it.
        let (h, cached) = a
            .open_with_prefix(&[100, 7], &[2], Counts::Each(0))
            .unwrap();
        assert_eq!(cached, [1], "the host copy is a hit");
        a.close(&h, false).unwrap();
        a.check().unwrap();
    });
}
