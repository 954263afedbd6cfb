//! Typed errors of the sharing calls, each leaving the allocator exactly as
//! it was; handle identity, generation wraparound and the batch-stamp epoch.

use kvpool_core::{
    handle_generation, handle_row, make_handle, Counts, HandleProblem, Options, PoolError,
    SlotAllocator, MAX_GENERATION,
};

/// Everything observable, to assert that a failing call changed nothing.
fn snapshot(a: &mut SlotAllocator, hs: &[i64]) -> String {
    let per: Vec<_> = hs
        .iter()
        .map(|&h| (a.slots(h).ok(), a.known_tokens(h).ok()))
        .collect();
    let ev = a.take_events();
    assert!(ev.is_empty(), "a failing call emitted events");
    format!(
        "{per:?} {} {} {} {} {} {} {} {}",
        a.metadata_bytes(),
        a.free_pages(),
        a.cached_pages(),
        a.evictable_pages(),
        a.open_requests(),
        a.hit_tokens(),
        a.miss_tokens(),
        a.pending_copies()
    )
}

fn setup() -> (SlotAllocator, Vec<i64>) {
    let mut a = SlotAllocator::new(32, 4, 4, 32).unwrap();
    let (h, _) = a
        .open_with_prefix(&[1, 2, 3, 4, 5, 6], &[6], Counts::Each(0))
        .unwrap();
    a.extend(&h, Counts::Each(6), None).unwrap();
    a.cache(&h).unwrap();
    let h2 = a.fork(h[0], 1).unwrap();
    a.take_events();
    (a, vec![h[0], h2[0]])
}

fn arg(r: Result<impl std::fmt::Debug, PoolError>, words: &str) {
    match r {
        Err(PoolError::InvalidArgument(m)) => assert!(m.contains(words), "{m}"),
        other => panic!("wanted InvalidArgument ({words}), got {other:?}"),
    }
}

#[test]
fn sharing_calls_fail_typed_and_change_nothing() {
    let (mut a, h) = setup();
    let before = snapshot(&mut a, &h);
    arg(
        a.open_with_prefix(&[1, 2, 3], &[2, 2], Counts::Each(0)),
        "lengths add up to 4 tokens but tokens has 3",
    );
    arg(
        a.open_with_prefix(&[1, 2, 3], &[3, -1], Counts::Each(0)),
        "negative",
    );
    arg(
        a.open_with_prefix(&[1, -2, 3], &[3], Counts::Each(0)),
        "not a token id",
    );
    // A bad id in the second prompt: the first one's row (which the call
    // fills before it opens) must not keep a grown prompt buffer either.
    let mut two = vec![7i64; 20];
    two[15] = -1;
    arg(
        a.open_with_prefix(&two, &[10, 10], Counts::Each(0)),
        "tokens[15] = -1 is not a token id",
    );
    arg(
        a.open_with_prefix(&[1, 2, 3], &[3], Counts::PerRequest(&[0, 1])),
        "salt has 2 entries",
    );
    assert!(matches!(
        a.open_with_prefix(&[0; 33], &[33], Counts::Each(0)),
        Err(PoolError::ContextTooLong {
            length: 33,
            max: 32,
            ..
        })
    ));
    assert!(matches!(
        a.open_with_prefix(&[0; 9], &[3, 3, 3], Counts::Each(0)),
        Err(PoolError::TooManyRequests {
            requested: 3,
            open: 2,
            ..
        })
    ));
    arg(
        a.extend(&h, Counts::Each(1), Some(&[5])),
        "tokens has 1 entries but the batch adds 2",
    );
    arg(
        a.extend(&h[..1], Counts::Each(1), Some(&[1 << 40])),
        "not a token id",
    );
    assert!(matches!(
        a.fork(h[0], 3),
        Err(PoolError::TooManyRequests { requested: 3, .. })
    ));
    assert_eq!(snapshot(&mut a, &h), before);

    // A prompt token disagreeing with the remembered prompt.
    let (p, _) = a
        .open_with_prefix(&[1, 2, 3, 4, 5, 6, 7], &[7], Counts::Each(0))
        .unwrap();
    let before = snapshot(&mut a, &[h.clone(), p.clone()].concat());
    arg(
        a.extend(&p, Counts::Each(3), Some(&[5, 6, 8])),
        "disagrees with its prompt",
    );
    assert_eq!(snapshot(&mut a, &[h.clone(), p.clone()].concat()), before);

    // Closed and stale handles.
    a.close(&p, false).unwrap();
    let closed = |r: Result<_, PoolError>, problem| match r {
        Err(PoolError::InvalidHandle { problem: got, .. }) => assert_eq!(got, problem),
        other => panic!("wanted InvalidHandle {problem:?}, got {other:?}"),
    };
    closed(a.fork(p[0], 1).map(|_| ()), HandleProblem::Closed);
    closed(a.cache(&p), HandleProblem::Closed);
    closed(a.cache(&[h[0], p[0]]), HandleProblem::Closed);
    closed(a.close(&[h[0], p[0]], true), HandleProblem::Closed);
    let (q, _) = a.open_with_prefix(&[1], &[1], Counts::Each(0)).unwrap(); // reuses p's row
    assert_eq!(handle_row(q[0]), handle_row(p[0]));
    let before_q = snapshot(&mut a, &[h.clone(), q.clone()].concat());
    closed(a.fork(p[0], 1).map(|_| ()), HandleProblem::Stale);
    closed(a.cache(&p), HandleProblem::Stale);
    arg(a.cache(&[h[0], h[0]]), "more than once");
    assert_eq!(snapshot(&mut a, &[h.clone(), q.clone()].concat()), before_q);
    a.close(&q, false).unwrap();
    a.check().unwrap();
}

#[test]
fn handles_of_another_allocator_are_rejected() {
    let mut a = SlotAllocator::new(8, 1, 4, 8).unwrap();
    let mut b = SlotAllocator::new(8, 1, 4, 8).unwrap();
    let ha = a.open(2).unwrap();
    let hb = b.open(2).unwrap();
    assert_ne!(ha, hb, "independent allocators issue different handles");
    for &h in &hb {
        assert!(!a.is_open(h));
        assert!(matches!(a.length(h), Err(PoolError::InvalidHandle { .. })));
    }
}

fn with_base(base: u32, rows: usize) -> SlotAllocator {
    let opts = Options {
        generation_base: Some(base),
        ..Options::new()
    };
    SlotAllocator::with_options(8, 1, rows, 8, opts).unwrap()
}

#[test]
fn generations_wrap_past_the_maximum_and_stay_stale() {
    let mut a = with_base(MAX_GENERATION - 1, 1);
    let mut old = Vec::new();
    for _ in 0..4 {
        let h = a.open(1).unwrap();
        old.push(h[0]);
        a.close(&h, false).unwrap();
    }
    let gens: Vec<u32> = old.iter().map(|&h| handle_generation(h)).collect();
    assert_eq!(
        gens,
        vec![MAX_GENERATION - 1, MAX_GENERATION, 1, 2],
        "wraps to 1, never 0"
    );
    let cur = a.open(1).unwrap()[0];
    assert_eq!(handle_generation(cur), 3);
    for &h in &old {
        // Issued before the wrap or after, every old handle is stale.
        assert!(
            matches!(
                a.length(h),
                Err(PoolError::InvalidHandle {
                    problem: HandleProblem::Stale,
                    ..
                })
            ),
            "{h:x}"
        );
    }
    // Generations this row has not reached are unknown, not stale.
    assert!(matches!(
        a.length(make_handle(4, 0)),
        Err(PoolError::InvalidHandle {
            problem: HandleProblem::Unknown,
            ..
        })
    ));
    a.check().unwrap();
}

#[test]
fn a_row_whose_generation_would_return_to_its_base_is_retired() {
    // Base 5, first generation 3: a row hands out 3, 4 and then retires
    // rather than hand out 5 again (in real use: after 2^31 - 1 requests on
    // the row).
    let opts = Options {
        generation_base: Some(5),
        generation_start: Some(3),
        ..Options::new()
    };
    let mut a = SlotAllocator::with_options(8, 1, 2, 8, opts).unwrap();
    let mut issued = Vec::new();
    for _ in 0..2 {
        let h = a.open(1).unwrap();
        assert_eq!(handle_row(h[0]), 0);
        issued.push(h[0]);
        a.close(&h, false).unwrap();
        a.check().unwrap();
    }
    assert_eq!(
        issued
            .iter()
            .map(|&h| handle_generation(h))
            .collect::<Vec<_>>(),
        vec![3, 4]
    );
    // Row 0 is retired: the next request gets row 1, and only one fits now.
    let h = a.open(1).unwrap();
    assert_eq!(handle_row(h[0]), 1);
    assert!(matches!(
        a.open(1),
        Err(PoolError::TooManyRequests { max: 1, .. })
    ));
    for &old in &issued {
        assert!(matches!(
            a.length(old),
            Err(PoolError::InvalidHandle {
                problem: HandleProblem::Stale | HandleProblem::Closed,
                ..
            })
        ));
    }
    assert!(matches!(
        a.length(issued[0]),
        Err(PoolError::InvalidHandle {
            problem: HandleProblem::Stale,
            ..
        })
    ));
    a.reset();
    a.check().unwrap();
    assert_eq!(a.open(1).unwrap().len(), 1, "reset keeps row 0 retired");
    assert!(a.open(1).is_err());
}

#[test]
fn epoch_wrap_clears_stamps() {
    let opts = Options {
        epoch_start: u32::MAX - 2,
        ..Options::new()
    };
    let mut a = SlotAllocator::with_options(16, 1, 4, 16, opts).unwrap();
    let h = a.open(2).unwrap();
    for _ in 0..6 {
        // Every batch across the wrap: each handle once is fine, twice is not.
        a.extend(&h, Counts::Each(1), None).unwrap();
        assert!(matches!(
            a.extend(&[h[0], h[0]], Counts::Each(1), None),
            Err(PoolError::InvalidArgument(_))
        ));
    }
    assert_eq!(a.length(h[0]).unwrap(), 6);
    a.check().unwrap();
}

/// Found by the fuzzer: the decode run takes pages at a page boundary before
/// the batch is found too big; the error must still count from before the
/// call (3 pages needed, 2 free), and the batch must be undone.
#[test]
fn exhausted_counts_pages_taken_by_the_decode_run() {
    let mut a = SlotAllocator::new(3, 4, 8, 8).unwrap();
    let hs = a.open(3).unwrap();
    let before = snapshot(&mut a, &hs);
    let err = a
        .extend(&hs, Counts::Each(1), Some(&[1, 1, 1]))
        .unwrap_err();
    assert_eq!(
        err,
        PoolError::Exhausted {
            needed_pages: 3,
            free_pages: 2,
            page_size: 4,
            free_slots: 8
        }
    );
    assert_eq!(snapshot(&mut a, &hs), before);
    a.check().unwrap();
    let err = a.extend(&hs, Counts::Each(1), None).unwrap_err();
    assert!(
        matches!(
            err,
            PoolError::Exhausted {
                needed_pages: 3,
                free_pages: 2,
                ..
            }
        ),
        "{err:?}"
    );
}
