//! Unit tests of the core; the property test against a model is in tests/model.rs.
use crate::*;

mod check;
mod config;

fn opts() -> Options {
    Options {
        generation_base: Some(1),
        ..Options::new()
    }
}

fn alloc(pages: usize, ps: usize) -> SlotAllocator {
    SlotAllocator::with_options(pages, ps, 4, 64, opts()).expect("valid config")
}

/// Observable state, to assert that a failing call changed nothing.
fn snapshot(a: &SlotAllocator, hs: &[i64]) -> (usize, usize, Vec<Option<Vec<i64>>>) {
    let slots = hs.iter().map(|&h| a.slots(h).ok()).collect();
    (a.free_pages(), a.open_requests(), slots)
}

#[test]
fn fresh_pool_hands_out_pages_in_order_and_skips_page_0() {
    let mut a = alloc(8, 1);
    let h = a.open(1).unwrap();
    assert_eq!(a.extend(&h, Counts::Each(3), None).unwrap(), vec![1, 2, 3]);
    assert_eq!(a.free_pages(), 4);
    a.check().unwrap();
}

#[test]
fn new_page_only_when_last_page_is_full() {
    let mut a = alloc(8, 4);
    let h = a.open(2).unwrap();
    assert_eq!(
        a.extend(&h[..1], Counts::Each(3), None).unwrap(),
        vec![4, 5, 6]
    );
    assert_eq!(a.used_pages(), 1);
    // One more token fits in page 1; the next starts page 2.
    assert_eq!(
        a.extend(&h[..1], Counts::Each(2), None).unwrap(),
        vec![7, 8]
    );
    assert_eq!(a.pages(h[0]).unwrap(), vec![1, 2]);
    assert_eq!(
        a.extend(&h, Counts::PerRequest(&[0, 1]), None).unwrap(),
        vec![12]
    );
    assert_eq!(a.slots(h[0]).unwrap(), vec![4, 5, 6, 7, 8]);
    a.check().unwrap();
}

#[test]
fn non_power_of_two_page_size() {
    let mut a = alloc(6, 3);
    let h = a.open(1).unwrap();
    assert_eq!(
        a.extend(&h, Counts::Each(4), None).unwrap(),
        vec![3, 4, 5, 6]
    );
    a.truncate(&h, Counts::Each(3)).unwrap();
    assert_eq!(a.pages(h[0]).unwrap(), vec![1]);
    let t = a.page_table(&h).unwrap();
    assert_eq!(
        (t.indptr, t.indices, t.last_page_len),
        (vec![0, 1], vec![1], vec![3])
    );
    a.check().unwrap();
}

#[test]
fn freed_pages_are_reused_first_in_their_old_order() {
    let mut a = alloc(16, 1);
    let h = a.open(2).unwrap();
    a.extend(&h, Counts::PerRequest(&[3, 2]), None).unwrap(); // 1,2,3 | 4,5
    a.close(&h[..1], false).unwrap();
    let h2 = a.open(1).unwrap();
    assert_eq!(
        a.extend(&h2, Counts::Each(4), None).unwrap(),
        vec![1, 2, 3, 6]
    );
    a.check().unwrap();
}

#[test]
fn handles_carry_row_and_generation() {
    let mut a = alloc(8, 1);
    let h = a.open(2).unwrap();
    assert_eq!(h, vec![make_handle(1, 0), make_handle(1, 1)]);
    a.close(&h[..1], false).unwrap();
    let h2 = a.open(1).unwrap();
    assert_eq!(
        h2[0],
        make_handle(2, 0),
        "row 0 is reused with a new generation"
    );
    assert_eq!(a.rows(&[h2[0], h[1]]).unwrap(), vec![0, 1]);
    let err = a.length(h[0]).unwrap_err();
    assert_eq!(
        err,
        PoolError::InvalidHandle {
            handle: h[0],
            problem: HandleProblem::Stale
        }
    );
    a.close(&h2, false).unwrap();
    let err = a.length(h2[0]).unwrap_err();
    assert!(matches!(
        err,
        PoolError::InvalidHandle {
            problem: HandleProblem::Closed,
            ..
        }
    ));
    for bad in [-1, make_handle(1, 4), make_handle(0, 1), make_handle(9, 1)] {
        let err = a.length(bad).unwrap_err();
        assert!(
            matches!(
                err,
                PoolError::InvalidHandle {
                    problem: HandleProblem::Unknown,
                    ..
                }
            ),
            "{bad}"
        );
        assert!(!a.is_open(bad));
    }
}

#[test]
fn handle_seed_makes_handles_a_function_of_the_seed() {
    let seeded = |seed: u64| {
        let o = Options {
            handle_seed: Some(seed),
            ..Options::new()
        };
        SlotAllocator::with_options(8, 1, 4, 64, o).expect("valid config")
    };
    let (mut a, mut b, mut c) = (seeded(7), seeded(7), seeded(8));
    let (ha, hb, hc) = (a.open(3).unwrap(), b.open(3).unwrap(), c.open(3).unwrap());
    assert_eq!(ha, hb, "same seed, same calls -> same handles");
    assert_ne!(ha, hc, "nearby seeds give unrelated generation bases");
    for h in &ha {
        let g = handle_generation(*h);
        assert!((1..MAX_GENERATION).contains(&g), "{g}");
        assert!(!c.is_open(*h), "another seed's handle is not valid here");
    }
    // Seeds at the extremes still land in the valid range.
    for seed in [0, u64::MAX] {
        let g = handle_generation(seeded(seed).open(1).unwrap()[0]);
        assert!((1..MAX_GENERATION).contains(&g), "{seed}: {g}");
    }
}

#[test]
fn failed_batches_change_nothing() {
    let mut a = alloc(6, 2); // 5 usable pages = 10 slots
    let h = a.open(3).unwrap();
    a.extend(&h, Counts::PerRequest(&[3, 1, 0]), None).unwrap();
    let before = snapshot(&a, &h);
    let stale = make_handle(7, 2);
    let cases: Vec<(Vec<i64>, Vec<i64>)> = vec![
        (h.clone(), vec![4, 4, 4]),  // exhausted: needs 2+2+2 pages, 2 free
        (h.clone(), vec![1, -1, 1]), // negative
        (vec![h[0], h[1], h[0]], vec![1, 1, 1]), // duplicate
        (vec![h[0], stale], vec![1, 1]), // stale handle
        (h.clone(), vec![1, 1]),     // length mismatch
        (h.clone(), vec![1, 64, 1]), // context too long on the 2nd (1 + 64 > 64)
    ];
    let kinds = [
        "Exhausted",
        "InvalidArgument",
        "InvalidArgument",
        "InvalidHandle",
        "InvalidArgument",
        "ContextTooLong",
    ];
    for ((hs, cs), want) in cases.iter().zip(kinds) {
        let err = a.extend(hs, Counts::PerRequest(cs), None).unwrap_err();
        let got = format!("{err:?}");
        assert!(
            got.starts_with(want),
            "{hs:?} {cs:?}: wanted {want}, got {got}"
        );
        assert_eq!(snapshot(&a, &h), before, "{err}");
        a.check().unwrap();
    }
    // Stale, not merely unknown.
    assert!(matches!(
        a.extend(&[stale], Counts::Each(1), None).unwrap_err(),
        PoolError::InvalidHandle {
            problem: HandleProblem::Unknown,
            ..
        }
    ));
    assert!(matches!(
        a.extend(&h, Counts::PerRequest(&[1, 64, 1]), None)
            .unwrap_err(),
        PoolError::ContextTooLong {
            length: 65,
            max: 64,
            ..
        }
    ));
    assert!(matches!(
        a.extend(&h, Counts::Each(4), None).unwrap_err(),
        PoolError::Exhausted {
            needed_pages: 6,
            free_pages: 2,
            ..
        }
    ));
    let arg = |e: PoolError| matches!(e, PoolError::InvalidArgument(_));
    let bad_handle = |e: PoolError| matches!(e, PoolError::InvalidHandle { .. });
    assert!(arg(a
        .truncate(&h, Counts::PerRequest(&[1, 2, 0]))
        .unwrap_err())); // 2 > length 1
    assert!(arg(a.truncate(&h, Counts::Each(-1)).unwrap_err()));
    assert!(arg(a.close(&[h[0], h[0]], false).unwrap_err()));
    assert!(bad_handle(a.close(&[h[0], stale], false).unwrap_err()));
    assert!(bad_handle(a.cache(&[h[0], stale]).unwrap_err()));
    assert!(matches!(
        a.open(2).unwrap_err(),
        PoolError::TooManyRequests {
            call: "open",
            requested: 2,
            open: 3,
            max: 4
        }
    ));
    assert_eq!(snapshot(&a, &h), before);
    a.check().unwrap();
}

#[test]
fn truncate_frees_pages_past_the_end_only() {
    let mut a = alloc(8, 2);
    let h = a.open(1).unwrap();
    a.extend(&h, Counts::Each(5), None).unwrap(); // pages 1,2,3
    a.truncate(&h, Counts::Each(3)).unwrap(); // keeps pages 1,2 (2nd half full)
    assert_eq!((a.length(h[0]).unwrap(), a.used_pages()), (3, 2));
    a.truncate(&h, Counts::Each(3)).unwrap(); // no-op
    assert_eq!(a.extend(&h, Counts::Each(2), None).unwrap(), vec![5, 6]); // refills page 2, retakes page 3
    a.truncate(&h, Counts::Each(0)).unwrap();
    assert_eq!((a.used_pages(), a.free_pages()), (0, 7));
    a.check().unwrap();
}

#[test]
fn page_table_is_flashinfer_csr() {
    let mut a = alloc(16, 4);
    let h = a.open(3).unwrap();
    a.extend(&h, Counts::PerRequest(&[5, 0, 4]), None).unwrap();
    let t = a.page_table(&[h[2], h[1], h[0]]).unwrap();
    assert_eq!(t.indptr, vec![0, 1, 1, 3]);
    assert_eq!(t.indices, vec![3, 1, 2]);
    assert_eq!(t.last_page_len, vec![4, 0, 1]);
}

#[test]
fn reset_closes_everything() {
    let mut a = alloc(16, 1);
    let h = a.open(4).unwrap();
    a.extend(&h, Counts::Each(3), None).unwrap();
    a.reset();
    assert_eq!((a.open_requests(), a.free_pages()), (0, 15));
    assert!(!a.is_open(h[0]));
    assert_eq!(a.open(1).unwrap(), vec![make_handle(2, 0)]);
    a.check().unwrap();
}

#[test]
fn extend_into_checks_the_output_length_before_any_change() {
    let mut a = alloc(8, 2);
    let h = a.open(2).unwrap();
    let before = snapshot(&a, &h);
    let mut short = vec![0; 4];
    let err = a
        .extend_into(&h, Counts::PerRequest(&[3, 2]), None, &mut short, |_| {
            panic!("called on a failing batch")
        })
        .unwrap_err();
    assert!(matches!(err, PoolError::InvalidArgument(_)));
    assert_eq!(snapshot(&a, &h), before);
    let mut out = vec![0; 5];
    let mut rows = Vec::new();
    a.extend_into(&h, Counts::PerRequest(&[3, 2]), None, &mut out, |g| {
        rows.push((g.index, g.row, g.start, g.slots.to_vec()))
    })
    .unwrap();
    assert_eq!(out, vec![2, 3, 4, 6, 7]);
    assert_eq!(rows, vec![(0, 0, 0, vec![2, 3, 4]), (1, 1, 0, vec![6, 7])]);
    a.check().unwrap();
}

#[test]
fn chain_transfer_matches_only_verified_pages() {
    let seeded = |seed: u64| {
        let o = Options {
            hash_seed: Some(seed),
            ..opts()
        };
        SlotAllocator::with_options(16, 4, 4, 64, o).expect("valid config")
    };
    let prompt: Vec<i64> = (0..10).collect();
    let (mut src, mut dst, mut other) = (seeded(3), seeded(3), seeded(4));
    for a in [&mut dst, &mut other] {
        let (h, _) = a.open_with_prefix(&prompt, &[10], Counts::Each(7)).unwrap();
        a.extend(&h, Counts::Each(10), None).unwrap();
        a.close(&h, true).unwrap(); // 2 pages cached
    }
    let h = src.open(1).unwrap(); // unknown tokens: an empty chain
    src.extend(&h, Counts::Each(8), None).unwrap();
    assert!(src.prefix_chain(h[0]).unwrap().hashes.is_empty());
    let (hs, _) = src
        .open_with_prefix(&prompt, &[10], Counts::Each(7))
        .unwrap();
    src.extend(&hs, Counts::Each(10), None).unwrap();
    let c = src.prefix_chain(hs[0]).unwrap();
    assert_eq!((c.hashes.len(), c.tokens.len(), c.salt), (2, 8, 7));
    let toks: Vec<i64> = c.tokens.iter().map(|&t| t as i64).collect();
    assert_eq!(dst.match_chain(&c.hashes, &toks, 7).unwrap(), 2);
    assert_eq!(
        other.match_chain(&c.hashes, &toks, 7).unwrap(),
        0,
        "another seed misses"
    );
    assert_eq!(
        dst.match_chain(&c.hashes, &toks, 8).unwrap(),
        0,
        "another salt misses"
    );
    let mut forged = toks.clone();
    forged[5] += 1; // right hashes, other tokens: page 1 must not match
    assert_eq!(dst.match_chain(&c.hashes, &forged, 7).unwrap(), 1);
    assert!(dst.match_chain(&c.hashes, &toks[..7], 7).is_err());
    let free = dst.free_pages();
    let (d, len) = dst.open_with_chain(&c.hashes, &toks, 7, 1, None).unwrap();
    assert_eq!((len, dst.length(d).unwrap()), (4, 4));
    assert_eq!(dst.free_pages(), free - 1, "the cached page is held now");
    dst.check().unwrap();
    dst.extend(&[d], Counts::Each(6), None).unwrap();
    assert_eq!(dst.known_tokens(d).unwrap(), (0..8).collect::<Vec<i32>>());
    dst.close(&[d], false).unwrap();
    dst.check().unwrap();
}
