//! Error messages that name what the caller did: a refused fork names fork,
//! a state group's shortage counts state slots; and the kv_events option
//! reads back.

use kvpool_core::{GroupSpec, GroupedAllocator, Options, PoolError, SlotAllocator};

fn opts(kv_events: bool) -> Options {
    Options {
        hash_seed: Some(7),
        handle_seed: Some(3),
        kv_events,
        ..Options::new()
    }
}

#[test]
fn kv_events_reads_back() {
    for on in [true, false] {
        assert_eq!(
            SlotAllocator::with_options(8, 4, 4, 32, opts(on))
                .unwrap()
                .kv_events(),
            on
        );
        let g = GroupedAllocator::new(&[GroupSpec::full(8, 4)], 4, 32, opts(on), None).unwrap();
        assert_eq!(g.kv_events(), on);
    }
}

#[test]
fn a_refused_fork_names_fork() {
    let mut a = SlotAllocator::with_options(16, 4, 3, 32, opts(true)).unwrap();
    let mut g = GroupedAllocator::new(&[GroupSpec::full(16, 4)], 3, 32, opts(true), None).unwrap();
    let (ha, hg) = (a.open(2).unwrap(), g.open(2).unwrap());
    for e in [a.fork(ha[0], 2).unwrap_err(), g.fork(hg[0], 2).unwrap_err()] {
        assert!(matches!(e, PoolError::TooManyRequests { call: "fork", .. }));
        let msg = e.to_string();
        assert!(
            msg.starts_with("too many requests: fork asks for 2 new requests")
                && msg.contains("at most 1 more"),
            "{msg}"
        );
    }
    assert_eq!((a.open_requests(), g.open_requests()), (2, 2));
}

#[test]
fn a_state_groups_shortage_counts_state_slots() {
    let specs = [GroupSpec::full(16, 4), GroupSpec::state(3, 0)];
    let mut g = GroupedAllocator::new(&specs, 4, 32, opts(true), None).unwrap();
    let msg = g.open(3).unwrap_err().to_string();
    assert!(
        msg.contains("group 1 (state)")
            && msg.contains("needs 3 of its state slots (one per request) but only 2"),
        "{msg}"
    );
    assert!(!msg.contains("pages"), "{msg}");
}

#[test]
fn a_shortage_names_the_checkpoints_the_call_must_keep() {
    let shortage = |held_back| {
        PoolError::GroupExhausted(Box::new(kvpool_core::GroupShortage {
            group: 1,
            kind: "state",
            needed_pages: 2,
            free_pages: 0,
            page_size: 1,
            held_back,
        }))
        .to_string()
    };
    assert!(!shortage(0).contains("checkpoint"), "{}", shortage(0));
    assert!(
        shortage(1)
            .contains("but only 0 are free or evictable (1 more is the checkpoint a prefix hit"),
        "{}",
        shortage(1)
    );
    assert!(
        shortage(2).contains("(2 more are checkpoints prefix hits of this call restore from"),
        "{}",
        shortage(2)
    );
}
