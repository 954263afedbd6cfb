//! A partial take of the copy-on-write queue (`take_copies_from`, an
//! extend's own copies) run at once, and the older copies it leaves run
//! later, give every live request's pages the same K/V as running the
//! whole queue in order: down a chain of three copies, with the take
//! starting inside any copy, and with releases that drop the older copies
//! during the take.

use kvpool_core::{Counts, SlotAllocator};

mod common;

use common::{pool, seq};

const PS: usize = 8;

/// Runs slot pairs on `mem` (each slot's K/V stands as a number).
fn run(mem: &mut [i64], (src, dst): (Vec<i64>, Vec<i64>)) {
    for (s, d) in src.iter().zip(&dst) {
        mem[*d as usize] = mem[*s as usize];
    }
}

/// Each live request's K/V, token by token.
fn contents(a: &SlotAllocator, mem: &[i64], live: &[i64]) -> Vec<Vec<i64>> {
    live.iter()
        .map(|&h| {
            let n = a.length(h).unwrap();
            let pages = a.pages(h).unwrap();
            (0..n)
                .map(|t| mem[pages[t / PS] as usize * PS + t % PS])
                .collect()
        })
        .collect()
}

#[test]
fn a_partial_take_down_a_chain_of_copies_matches_the_queue_order() {
    for close in [false, true] {
        // A parent with a partly filled last page; each fork of the one
        // before writes a token into a copy of that page, which stays
        // queued: a chain of three copies, each out of the one before's
        // destination (each one slot longer).
        let mut a = pool(32, PS);
        let h = a.open(1).unwrap()[0];
        a.extend(&[h], Counts::Each(PS as i64 + 2), Some(&seq(PS + 2, 0)))
            .unwrap();
        let mut reqs = vec![h];
        let mut before = 0;
        for _ in 0..3 {
            let k = a.fork(*reqs.last().unwrap(), 1).unwrap()[0];
            before = a.pending_copies();
            a.extend(&[k], Counts::Each(1), None).unwrap();
            reqs.push(k);
        }
        assert_eq!(a.pending_copies(), 2 + 3 + 4);
        if close {
            // The middle requests let go: the last take releases pages
            // whose only holds are the older copies', which are dropped.
            a.close(&reqs[1..3], false).unwrap();
        }
        let live: Vec<i64> = if close {
            vec![reqs[0], reqs[3]]
        } else {
            reqs.clone()
        };
        a.check().unwrap();
        // Every slot's K/V is its own number: what each step wrote.
        let mem0: Vec<i64> = (0..(32 * PS) as i64).collect();
        let mut whole = a.clone();
        let mut want = mem0.clone();
        run(&mut want, whole.take_copies());
        let want = contents(&whole, &want, &live);
        for from in 0..=a.pending_copies() {
            let mut b = a.clone();
            let mut mem = mem0.clone();
            run(&mut mem, b.take_copies_from(from));
            b.check().unwrap();
            run(&mut mem, b.take_copies());
            b.check().unwrap();
            assert_eq!(
                contents(&b, &mem, &live),
                want,
                "closed {close}, taken from {from}"
            );
        }
        // The extend's own copy (the last one) alone, as `moved` takes it.
        let mut b = a.clone();
        let mut mem = mem0.clone();
        run(&mut mem, b.take_copies_from(before));
        assert_eq!(
            contents(&b, &mem, &live)[live.len() - 1],
            want[live.len() - 1]
        );
    }
}
