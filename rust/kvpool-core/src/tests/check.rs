//! `check()` finds each corruption of a good pool's pages, requests,
//! prefix index and copy queue.

use super::*;

type Corrupt = Box<dyn Fn(&mut SlotAllocator)>;

/// Each corruption of `good` makes `check()` report an invariant.
fn assert_check_finds(good: &SlotAllocator, corruptions: Vec<(&str, Corrupt)>) {
    for (what, corrupt) in &corruptions {
        let mut b = good.clone();
        corrupt(&mut b);
        assert!(
            matches!(b.check(), Err(PoolError::Invariant(_))),
            "corruption {what:?}"
        );
    }
    good.check().unwrap();
}

fn in_pages(what: &'static str) -> (&'static str, Corrupt) {
    (
        what,
        Box::new(move |a| a.pages_for_tests().corrupt_for_tests(what)),
    )
}

fn in_requests(what: &'static str) -> (&'static str, Corrupt) {
    (
        what,
        Box::new(move |a| a.requests_for_tests().corrupt_for_tests(what)),
    )
}

/// A corrupted index whose page records name what it says they should.
fn in_prefix(what: &'static str) -> (&'static str, Corrupt) {
    (
        what,
        Box::new(move |a| {
            for (page, entry) in a.prefix_for_tests().corrupt_for_tests(what) {
                a.pages_for_tests().set_entry(page, entry);
            }
        }),
    )
}

#[test]
fn check_detects_corruption() {
    let mut a = alloc(8, 1);
    let h = a.open(1).unwrap();
    a.extend(&h, Counts::Each(2), None).unwrap();
    assert_check_finds(
        &a,
        vec![
            in_pages("free and held"),
            in_pages("page 0 held"),
            in_pages("page lost"),
            in_pages("refcount"),
            in_pages("free with count 0"),
            in_pages("free and cached"),
            in_pages("registration the index lacks"),
            in_requests("len"),
            in_requests("last"),
            in_requests("open_count"),
            in_prefix("registration its page lacks"),
            in_prefix("first token"),
            in_prefix("hash"),
            in_prefix("child salt"),
            in_prefix("unreachable child"),
            in_prefix("children count"),
        ],
    );
}

#[test]
fn check_detects_copy_queue_corruption() {
    // Page size 4: a parent of 6 tokens (pages 1, 2), a fork that wrote
    // one token, so page 2's slots 8, 9 wait to be copied to page 3.
    let mut a = SlotAllocator::new(8, 4, 4, 16).unwrap();
    let h = a.open(1).unwrap();
    a.extend(&h, Counts::Each(6), None).unwrap();
    let k = a.fork(h[0], 1).unwrap();
    a.extend(&k, Counts::Each(1), None).unwrap();
    assert_eq!(a.pages_for_tests().live_copies_for_tests(), 1);
    let parent = h[0];
    assert_check_finds(
        &a,
        vec![
            in_pages("copy hold uncounted"),
            in_pages("copy forgotten"),
            in_pages("copy slots"),
            in_pages("copy dropped holding"),
            in_pages("copy into free page"),
            in_pages("copy of whole page"),
            (
                // The copier, alone on its pages once the parent is gone,
                // is marked as never having shared (its close would skip
                // dropping the copy into page 3).
                "exclusive copier",
                Box::new(move |a| {
                    a.close(&[parent], false).unwrap();
                    a.check().unwrap();
                    a.requests_for_tests().corrupt_for_tests("exclusive");
                }),
            ),
        ],
    );
}

#[test]
fn check_detects_stale_chains() {
    // Two requests of three pages each (page size 1), their chains
    // registered: rows 0 and 1.
    let mut a = alloc(16, 1);
    let h = a.open(2).unwrap();
    a.extend(&h, Counts::Each(3), Some(&[1, 2, 3, 4, 5, 6]))
        .unwrap();
    a.cache(&h).unwrap();
    let chain = |a: &mut SlotAllocator, row: usize| a.requests_for_tests().chain(row);
    let (mine, theirs) = (chain(&mut a, 0), chain(&mut a, 1));
    assert_eq!((mine.pages, theirs.pages), (3, 3));
    let resume = |pages: usize, tip: crate::prefix::tip::ChainTip| -> Corrupt {
        Box::new(move |a: &mut SlotAllocator| {
            a.requests_for_tests().resume_chain(0, pages, tip, false)
        })
    };
    // Row 0 truncated to two pages: its chain's tip is its second page's.
    let mut short = a.clone();
    short.truncate(&h[..1], Counts::Each(2)).unwrap();
    short.check().unwrap();
    let second = short.requests_for_tests().chain(0).tip;
    assert_eq!(short.requests_for_tests().chain(0).pages, 2);
    assert_check_finds(
        &a,
        vec![
            ("another row's chain", resume(3, theirs.tip)),
            ("chain longer than the pages it spells", resume(2, mine.tip)),
            ("chain past the row's pages", resume(4, mine.tip)),
        ],
    );
    assert_check_finds(
        &short,
        vec![
            ("tip of another row", resume(2, theirs.tip)),
            ("chain shorter than its pages", resume(1, second)),
        ],
    );
}
