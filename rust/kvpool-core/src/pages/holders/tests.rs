//! `hold` and `release` in blocks against one-by-one order (`holders.rs`).

use super::PagePool;
use crate::pages::record::HINT_AHEAD;
use proptest::prelude::*;

/// The shapes below are drawn one choice at a time from a sequence
/// proptest generates, the way hypothesis draws: a failing shape shrinks
/// with the sequence, toward fewer and smaller choices, and a sequence
/// that runs out chooses 0 from then on.
#[derive(Debug)]
struct Choices(std::vec::IntoIter<u32>);

impl Choices {
    fn below(&mut self, n: usize) -> usize {
        self.0.next().map_or(0, |c| c as usize % n)
    }
}

fn choices() -> impl Strategy<Value = Choices> {
    prop::collection::vec(any::<u32>(), 256..512).prop_map(|v| Choices(v.into_iter()))
}

/// A pool of `n` pages (page 0 reserved) with every page taken by one
/// request, and that request's pages.
fn all_taken(n: usize) -> (PagePool, Vec<u32>) {
    let mut pool = PagePool::new(n, false).unwrap();
    let pages = (0..n - 1).map(|_| pool.pop_free().unwrap()).collect();
    (pool, pages)
}

/// The CACHED pages, oldest first.
fn eviction_order(pool: &PagePool) -> Vec<u32> {
    let mut out = Vec::new();
    let mut p = pool.victim();
    while p != 0 {
        out.push(p);
        p = pool.next_victim(p);
    }
    out
}

/// `hold` takes a CACHED run, and pages others hold, in blocks of four
/// and the rest page by page. Random page lists cut runs at every
/// offset inside a block (a HELD page, a page out of list order, a gap,
/// the list's end) and put HELD pages in blocks or alone, and
/// the result must be what one holder a page gives: the held pages off
/// the list, every other CACHED page still on it in its old order.
fn hold_cuts_cached_runs(mut rng: Choices) {
    const N: usize = 48;
    let (mut pool, all) = all_taken(N);
    for &p in &all {
        pool.set_entry(p, p);
    }
    // Some pages stay HELD by another request; the rest are
    // released in a few calls, each in its own order.
    let mut other = Vec::new();
    let mut released = Vec::new();
    for &p in &all {
        if rng.below(6) == 0 {
            other.push(p);
        } else {
            released.push(p);
        }
    }
    for i in (1..released.len()).rev() {
        if rng.below(3) == 0 {
            released.swap(i, rng.below(i + 1));
        }
    }
    for chunk in released.chunks(1 + rng.below(20)) {
        pool.release(chunk);
    }
    let before = eviction_order(&pool);
    // The list newest first is one long run; take it in pieces,
    // some skipped, some moved, with HELD pages between them.
    let mut newest_first = before.clone();
    newest_first.reverse();
    let mut pieces: Vec<Vec<u32>> = Vec::new();
    let mut at = 0;
    while at < newest_first.len() {
        let len = 1 + rng.below(11);
        let piece = &newest_first[at..(at + len).min(newest_first.len())];
        at += len;
        if rng.below(4) != 0 {
            pieces.push(piece.to_vec());
        }
    }
    if pieces.len() > 1 && rng.below(2) == 0 {
        let i = rng.below(pieces.len());
        pieces.swap(0, i);
    }
    let mut list = Vec::new();
    for piece in pieces {
        list.extend(piece);
        // Held pages between the pieces, up to a few blocks' worth.
        if !other.is_empty() && rng.below(3) == 0 {
            for _ in 0..1 + rng.below(9) {
                let h = other[rng.below(other.len())];
                if !list.contains(&h) {
                    list.push(h);
                }
            }
        }
    }

    pool.hold(&list);

    let mut holders = vec![0u32; N];
    for &p in other.iter().chain(&list) {
        holders[p as usize] += 1;
    }
    pool.check(holders.clone(), 1).unwrap();
    for &p in &list {
        assert_eq!(pool.holders(p), holders[p as usize], "page {p}");
    }
    let kept: Vec<u32> = before.into_iter().filter(|p| !list.contains(p)).collect();
    assert_eq!(eviction_order(&pool), kept);
}

/// `release` takes blocks of four alike pages at once and mixed blocks
/// page by page. Random lists mix pages that keep a holder, registered
/// pages that go CACHED and unregistered ones that go FREE; the result
/// must be one-by-one release, last page first: the CACHED ones appended
/// to the list newest last, the FREE ones pushed on the stack.
fn release_in_blocks(mut rng: Choices) {
    const N: usize = 64;
    let (mut pool, mut list) = all_taken(N);
    for i in (1..list.len()).rev() {
        list.swap(i, rng.below(i + 1));
    }
    // The pages past the list stay with a request of their own.
    let mut others = vec![0u32; N];
    for &p in &list[1 + rng.below(N - 1)..] {
        others[p as usize] = 1;
    }
    list.retain(|&p| others[p as usize] == 0);
    // Runs of alike pages, so that whole blocks of each kind occur.
    let mut kind = 0;
    let mut shared = [false; N];
    for &p in &list {
        if rng.below(4) == 0 {
            kind = rng.below(3);
        }
        match kind {
            0 => {
                pool.add_holder(p);
                others[p as usize] = 1;
                shared[p as usize] = true;
            }
            1 => pool.set_entry(p, p),
            _ => {}
        }
    }
    let mut cached = eviction_order(&pool);
    let mut freed = Vec::new();
    for &p in list.iter().rev() {
        match (shared[p as usize], pool.is_registered(p)) {
            (true, _) => {}
            (_, true) => cached.push(p),
            _ => freed.push(p),
        }
    }

    assert!(!pool.release(&list));

    pool.check(others.clone(), 1).unwrap();
    assert_eq!(eviction_order(&pool), cached);
    // A page that went CACHED names the page released HINT_AHEAD after it
    // (whatever that page became), or none where it was released on its
    // own rather than in a block of four.
    for (i, &p) in list.iter().enumerate() {
        if pool.records[p as usize].is_unheld() {
            let hint = pool.records[p as usize].victim_hint();
            let want = if i >= HINT_AHEAD {
                list[i - HINT_AHEAD]
            } else {
                0
            };
            assert!(hint == want || hint == 0, "page {p} at {i}: {hint}");
            assert_eq!(pool.holders(p), 0, "page {p}");
        }
    }
    let top: Vec<u32> = (0..freed.len()).map(|_| pool.pop_free().unwrap()).collect();
    freed.reverse();
    assert_eq!(top, freed);
    for (p, &n) in others.iter().enumerate().skip(1) {
        if n == 1 {
            assert_eq!(pool.holders(p as u32), 1, "page {p}");
        }
    }
}

/// A request's registered pages released to CACHED in blocks of four:
/// each names the page released `HINT_AHEAD` after it, which the eviction
/// walk takes that many victims later (the first `HINT_AHEAD` name none).
#[test]
fn cached_pages_name_the_victim_hint_ahead() {
    const N: usize = 41;
    let (mut pool, list) = all_taken(N);
    for &p in &list {
        pool.set_entry(p, p);
    }
    assert!(!pool.release(&list));
    let order = eviction_order(&pool);
    assert_eq!(order.len(), N - 1);
    for (k, &p) in order.iter().enumerate() {
        let want = order.get(k + HINT_AHEAD).copied().unwrap_or(0);
        assert_eq!(pool.records[p as usize].victim_hint(), want, "victim {k}");
    }
    // A hit takes the hint away with the page's place on the list.
    pool.hold(&list[..1]);
    assert_eq!(pool.records[list[0] as usize].victim_hint(), 0);
    assert_eq!(pool.holders(list[0]), 1);
}

/// The state every test below compares: each page's holders, the CACHED
/// pages oldest first, and the free stack from its top.
fn observed(pool: &mut PagePool, n: usize) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let holders = (1..n as u32).map(|p| pool.holders(p)).collect();
    let order = eviction_order(pool);
    let mut free = Vec::new();
    while let Some(p) = pool.pop_free() {
        free.push(p);
    }
    for &p in free.iter().rev() {
        pool.unpop_free(p);
    }
    (holders, order, free)
}

/// `hold` and `release` of lists made of stretches of consecutive page ids
/// (`stretches.rs` takes eight at a time while every page keeps its state)
/// must leave what one page a call leaves: the same holders, the same
/// eviction order and the same free stack. The stretches mix pages one
/// other request holds, pages two others hold and CACHED pages, start
/// anywhere and have any length, so stretches break at every offset.
fn stretches_match_one_by_one(mut rng: Choices) {
    const N: usize = 96;
    let (mut pool, mut ids) = all_taken(N);
    ids.sort_unstable();
    // In runs of a kind, so that whole stretches of each occur.
    let mut kind = 0;
    let mut cached = Vec::new();
    for &p in &ids {
        if rng.below(5) == 0 {
            kind = rng.below(3);
        }
        match kind {
            0 => {}
            1 => pool.add_holder(p),
            _ => {
                pool.set_entry(p, p);
                cached.push(p);
            }
        }
    }
    pool.release(&cached);
    let list = random_stretches(&mut rng, N, 8, 24);
    let mut one = pool.clone();
    pool.hold(&list);
    for &p in &list {
        one.hold(&[p]);
    }
    assert_eq!(
        observed(&mut pool, N),
        observed(&mut one, N),
        "hold {list:?}"
    );
    pool.release(&list);
    for &p in list.iter().rev() {
        one.release(&[p]);
    }
    assert_eq!(
        observed(&mut pool, N),
        observed(&mut one, N),
        "release {list:?}"
    );
}

/// A few prompts (stretches of consecutive ids) held by several requests
/// at once, so that their aligned blocks take holders in block counts from
/// the third holder on (`blocks.rs`), then let go in any order: whole
/// lists, a list's tail, a hold no list names (a copy's source,
/// `release_one` and `drop_shared_holder`). Every step must leave what one
/// page a call leaves (that path never uses blocks), and `check` must hold.
fn block_holds_match_one_by_one(mut rng: Choices) {
    const N: usize = 80;
    let (mut pool, mut ids) = all_taken(N);
    ids.sort_unstable();
    for &p in &ids {
        pool.set_entry(p, p);
    }
    pool.release(&ids);
    let mut one = pool.clone();
    let prompts: Vec<Vec<u32>> = (0..3)
        .map(|_| random_stretches(&mut rng, N, 3, 40))
        .collect();
    let mut lists: Vec<Vec<u32>> = Vec::new();
    let mut extra_holds: Vec<u32> = Vec::new();
    for _ in 0..48 {
        match rng.below(6) {
            0..=2 => {
                let list = prompts[rng.below(prompts.len())].clone();
                pool.hold(&list);
                for &p in &list {
                    one.hold(&[p]);
                }
                lists.push(list);
            }
            3 if !lists.is_empty() => {
                let list = lists.swap_remove(rng.below(lists.len()));
                pool.release(&list);
                for &p in list.iter().rev() {
                    one.release(&[p]);
                }
            }
            4 if !lists.is_empty() => {
                let i = rng.below(lists.len());
                let keep = rng.below(lists[i].len() + 1);
                let tail = lists[i].split_off(keep);
                pool.release(&tail);
                for &p in tail.iter().rev() {
                    one.release(&[p]);
                }
            }
            5 if !extra_holds.is_empty() && rng.below(2) == 0 => {
                let p = extra_holds.swap_remove(rng.below(extra_holds.len()));
                // A page a list still names keeps a holder: both ways apply.
                if lists.iter().any(|l| l.contains(&p)) && rng.below(2) == 0 {
                    pool.drop_shared_holder(p);
                    one.drop_shared_holder(p);
                } else {
                    assert_eq!(pool.release_one(p), one.release_one(p));
                }
            }
            5 => {
                let held: Vec<u32> = lists.iter().flatten().copied().collect();
                if let Some(&p) = held.get(rng.below(held.len().max(1))) {
                    pool.add_holder(p);
                    one.add_holder(p);
                    extra_holds.push(p);
                }
            }
            _ => {}
        }
        assert_eq!(
            observed(&mut pool, N),
            observed(&mut one, N),
            "lists {lists:?}"
        );
        let mut named = vec![0u32; N];
        for &p in lists.iter().flatten().chain(&extra_holds) {
            named[p as usize] += 1;
        }
        pool.check(named, 1).unwrap();
    }
}

/// The third holder of an aligned block of HELD pages holds it in the
/// block's count, and the counts come back to the records as holders go.
#[test]
fn a_third_holder_of_a_block_counts_once() {
    let (mut pool, _) = all_taken(40);
    let list: Vec<u32> = (8..24).collect(); // two aligned blocks
    pool.hold(&list);
    assert_eq!(pool.blocks.live(), 0, "two holders stay in the records");
    pool.hold(&list);
    assert_eq!(pool.blocks.live(), 2, "the third goes to both blocks");
    assert!(list.iter().all(|&p| pool.holders(p) == 3));
    assert_eq!(pool.records[8].holders(), 2);
    // Its first page let go alone: the record would hold it once, so the
    // block's count comes back to its records first.
    pool.release(&list[..1]);
    assert_eq!(pool.blocks.live(), 1);
    assert_eq!(pool.holders(8), 2);
    assert!(list[1..].iter().all(|&p| pool.holders(p) == 3));
    pool.release(&list[1..]);
    pool.release(&list);
    assert!(list.iter().all(|&p| pool.holders(p) == 1));
    assert_eq!(pool.blocks.live(), 0);
    let mut named = vec![1u32; 40];
    named[0] = 0;
    pool.check(named, 1).unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn hold_cuts_cached_runs_anywhere_inside_a_block(rng in choices()) {
        hold_cuts_cached_runs(rng);
    }

    #[test]
    fn release_in_blocks_keeps_the_one_by_one_order(rng in choices()) {
        release_in_blocks(rng);
    }

    #[test]
    fn stretches_of_consecutive_pages_match_one_by_one(rng in choices()) {
        stretches_match_one_by_one(rng);
    }

    #[test]
    fn block_holds_of_many_holders_match_one_by_one(rng in choices()) {
        block_holds_match_one_by_one(rng);
    }
}

/// A page list of 1..=`most` stretches of consecutive ids (each under
/// `longest` pages) at random places in pages 1..`n`, each page at most
/// once.
fn random_stretches(rng: &mut Choices, n: usize, most: usize, longest: usize) -> Vec<u32> {
    let mut list = Vec::new();
    for _ in 0..1 + rng.below(most) {
        let start = 1 + rng.below(n - 1);
        let end = (start + 1 + rng.below(longest)).min(n);
        for p in start as u32..end as u32 {
            if !list.contains(&p) {
                list.push(p);
            }
        }
    }
    list
}
