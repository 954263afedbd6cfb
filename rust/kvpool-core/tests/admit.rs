//! `admit`: the same requests, slots, table rows and events as `open`
//! followed by `extend`, and on every refusal no change at all, down to the
//! handles the next open hands out.

use kvpool_core::{Counts, Options, PoolError, SlotAllocator, SlotTable};

fn pool() -> SlotAllocator {
    let opts = Options {
        hash_seed: Some(3),
        handle_seed: Some(11),
        ..Options::new()
    };
    SlotAllocator::with_options(16, 4, 6, 24, opts).unwrap()
}

/// A pool in use: two requests running, one closed with its pages cached.
fn busy() -> (SlotAllocator, Vec<i64>) {
    let mut a = pool();
    let prompt: Vec<i64> = (100..108).collect();
    let (h, _) = a.open_with_prefix(&prompt, &[8], Counts::Each(0)).unwrap();
    a.extend(&h, Counts::Each(8), None).unwrap();
    a.close(&h, true).unwrap();
    let run = a.open(2).unwrap();
    a.extend(&run, Counts::PerRequest(&[5, 3]), None).unwrap();
    a.take_events();
    (a, run)
}

fn observable(a: &mut SlotAllocator, hs: &[i64]) -> String {
    let per: Vec<_> = hs.iter().map(|&h| a.slots(h).ok()).collect();
    format!(
        "{per:?} {:?} {} {} {} {} {:?}",
        a.take_events(),
        a.free_pages(),
        a.cached_pages(),
        a.evictable_pages(),
        a.open_requests(),
        a.metadata_bytes()
    )
}

#[test]
fn admit_is_open_then_extend() {
    let counts = [6i64, 0, 9];
    let tokens: Vec<i64> = (0..15).collect();
    let (mut a, run_a) = busy();
    let (mut b, run_b) = busy();
    let (ha, sa) = a.admit(&counts, Some(&tokens)).unwrap();
    let hb = b.open(3).unwrap();
    let sb = b
        .extend(&hb, Counts::PerRequest(&counts), Some(&tokens))
        .unwrap();
    assert_eq!((ha.clone(), sa), (hb.clone(), sb));
    for (x, y) in ha.iter().zip(&hb) {
        assert_eq!(a.slots(*x).unwrap(), b.slots(*y).unwrap());
        assert_eq!(a.known_tokens(*x).unwrap(), b.known_tokens(*y).unwrap());
        assert_eq!(a.rows(&[*x]).unwrap(), b.rows(&[*y]).unwrap());
    }
    a.check().unwrap();
    let all_a = [run_a, ha].concat();
    let all_b = [run_b, hb].concat();
    assert_eq!(observable(&mut a, &all_a), observable(&mut b, &all_b));
    // The admitted requests cache like any other.
    a.cache(&all_a[2..]).unwrap();
    a.check().unwrap();
}

#[test]
fn admit_fills_the_table_rows_of_the_new_requests() {
    let mut a = pool();
    let mut cells = vec![-1i32; 6 * 24];
    let mut out = vec![0i64; 7];
    let mut handles = Vec::new();
    {
        let mut t = SlotTable::new(&mut cells, 24);
        a.admit_into(&[3, 4], None, &mut out, Some(&mut t), &mut handles, |_| {})
            .unwrap();
    }
    for (i, &h) in handles.iter().enumerate() {
        let row = a.rows(&[h]).unwrap()[0] as usize;
        let slots = a.slots(h).unwrap();
        let got: Vec<i64> = cells[row * 24..row * 24 + slots.len()]
            .iter()
            .map(|&x| x as i64)
            .collect();
        assert_eq!(got, slots, "request {i}");
    }
    assert_eq!(
        out,
        [a.slots(handles[0]).unwrap(), a.slots(handles[1]).unwrap()].concat()
    );
}

#[test]
fn a_refused_admit_changes_nothing_not_even_the_next_handles() {
    type Case = (
        &'static str,
        Vec<i64>,
        Option<Vec<i64>>,
        fn(&PoolError) -> bool,
    );
    let cases: Vec<Case> = vec![
        ("too many requests", vec![1, 1, 1, 1, 1], None, |e| {
            matches!(e, PoolError::TooManyRequests { .. })
        }),
        ("pool exhausted", vec![24, 24, 8], None, |e| {
            matches!(e, PoolError::Exhausted { .. })
        }),
        ("context too long", vec![4, 25], None, |e| {
            matches!(e, PoolError::ContextTooLong { .. })
        }),
        ("negative count", vec![4, -1], None, |e| {
            matches!(e, PoolError::InvalidArgument(_))
        }),
        (
            "tokens of the wrong length",
            vec![2, 2],
            Some(vec![1, 2, 3]),
            |e| matches!(e, PoolError::InvalidArgument(_)),
        ),
        ("a token id out of range", vec![2], Some(vec![1, -5]), |e| {
            matches!(e, PoolError::InvalidArgument(_))
        }),
    ];
    for (what, counts, tokens, want) in cases {
        let (mut a, run) = busy();
        let (mut b, run_b) = busy();
        let before = observable(&mut a, &run);
        match a.admit(&counts, tokens.as_deref()) {
            Err(e) => assert!(want(&e), "{what}: got {e:?}"),
            Ok(r) => panic!("{what}: admitted {r:?}"),
        }
        a.check().unwrap();
        assert_eq!(observable(&mut a, &run), before, "{what}");
        // The same handles as a pool that never saw the refused call.
        assert_eq!(a.open(2).unwrap(), b.open(2).unwrap(), "{what}");
        assert_eq!(
            observable(&mut a, &run),
            observable(&mut b, &run_b),
            "{what}"
        );
    }
}

#[test]
fn admit_evicts_cached_pages_like_extend() {
    let (mut a, run) = busy();
    let free = a.free_pages();
    assert_eq!((free, a.evictable_pages()), (12, 2));
    // Every page the pool can give: FREE first, then the cached ones.
    let (h, slots) = a.admit(&[24, 16, 8], None).unwrap();
    assert_eq!(slots.len(), free * 4);
    assert_eq!(
        (a.free_pages(), a.evictable_pages(), a.cached_pages()),
        (0, 0, 0)
    );
    let ev = a.take_events();
    assert!(ev.kind.iter().all(|&k| k == kvpool_core::EVENT_REMOVED) && !ev.is_empty());
    a.check().unwrap();
    a.close(&[run, h].concat(), false).unwrap();
    a.check().unwrap();
}
