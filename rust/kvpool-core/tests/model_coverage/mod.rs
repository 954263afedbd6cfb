//! What the property test's sequences exercised, counted per test thread,
//! and the test that guards the generator with those counts.

use crate::{allocator_matches_model, case_count};
use std::cell::Cell;

// What the sequences exercised, per test thread: proptest runs a test's
// cases on its own thread, so the guard below sees exactly its own run,
// not the other test's running beside it.
thread_local! {
    pub static OK_CALLS: Cell<usize> = const { Cell::new(0) };
    pub static HIT_TOKENS: Cell<u64> = const { Cell::new(0) };
    pub static COPIES: Cell<usize> = const { Cell::new(0) };
    pub static STORED: Cell<usize> = const { Cell::new(0) };
    pub static DROPPED: Cell<usize> = const { Cell::new(0) };
    pub static HELD_ALONE: Cell<usize> = const { Cell::new(0) };
    pub static DIVERGED: Cell<usize> = const { Cell::new(0) };
    pub static HOST_HITS: Cell<u64> = const { Cell::new(0) };
    pub static MOVED: Cell<[usize; 3]> = const { Cell::new([0; 3]) };
    pub static SWAPS: Cell<usize> = const { Cell::new(0) };
    pub static HOST_STORED: Cell<usize> = const { Cell::new(0) };
    pub static BOUNCED: Cell<usize> = const { Cell::new(0) };
    pub static PRIO_OKS: Cell<usize> = const { Cell::new(0) };
    pub static PINNED_ENDS: Cell<usize> = const { Cell::new(0) };
    pub static ENDED: Cell<usize> = const { Cell::new(0) };
    pub static TAKEN_OVER: Cell<usize> = const { Cell::new(0) };
    pub static ORPHANS_REPLACED: Cell<usize> = const { Cell::new(0) };
    pub static REVIVED: Cell<usize> = const { Cell::new(0) };
    /// Page-size-1 runs (`prefix/runs.rs`), by what an op did to them:
    /// [started, grown by a later pass (merged), cut short, ended, started
    /// under an entry inside another run (a branch from its middle)].
    pub static RUNS: Cell<[usize; 5]> = const { Cell::new([0; 5]) };
}

/// Counts what one op did to the index's runs, from `(first slot, length,
/// parent slot + 1)` before and after it (`index_runs_for_tests`).
pub fn count_runs(before: &[(u32, u32, u32)], after: &[(u32, u32, u32)]) {
    let len_in = |runs: &[(u32, u32, u32)], first: u32| {
        runs.binary_search_by_key(&first, |r| r.0)
            .ok()
            .map(|i| runs[i].1)
    };
    // Whether slot `s` lies in a run of `after` and is not its last slot.
    let inside = |s: u32| {
        let i = after.partition_point(|r| r.0 <= s);
        i > 0 && s + 1 < after[i - 1].0 + after[i - 1].1
    };
    let mut n = RUNS.with(Cell::get);
    for &(first, len, parent) in after {
        match len_in(before, first) {
            None => {
                n[0] += 1;
                n[4] += (parent != 0 && inside(parent - 1)) as usize;
            }
            Some(old) if len > old => n[1] += 1,
            Some(old) if len < old => n[2] += 1,
            Some(_) => {}
        }
    }
    n[3] += before
        .iter()
        .filter(|r| len_in(after, r.0).is_none())
        .count();
    RUNS.with(|c| c.set(n));
}

pub fn count<T: Copy + std::ops::Add<Output = T>>(
    c: &'static std::thread::LocalKey<Cell<T>>,
    n: T,
) {
    c.with(|c| c.set(c.get() + n));
}

/// Guards the generator itself: most calls must succeed, prefixes must hit
/// (on both tiers), copies, offloads, loads and swaps must happen, or the
/// comparison only exercises easy paths.
#[test]
fn generated_sequences_exercise_sharing() {
    allocator_matches_model();
    let cases = case_count();
    let (oks, hits, copies, stored) = (
        OK_CALLS.with(Cell::get),
        HIT_TOKENS.with(Cell::get),
        COPIES.with(Cell::get),
        STORED.with(Cell::get),
    );
    let (dropped, alone, diverged) = (
        DROPPED.with(Cell::get),
        HELD_ALONE.with(Cell::get),
        DIVERGED.with(Cell::get),
    );
    let (host_hits, moved, swaps, host_stored) = (
        HOST_HITS.with(Cell::get),
        MOVED.with(Cell::get),
        SWAPS.with(Cell::get),
        HOST_STORED.with(Cell::get),
    );
    let bounced = BOUNCED.with(Cell::get);
    eprintln!(
        "{cases} sequences: {oks} successful calls, {hits} prefix-hit tokens ({host_hits} from \
         the host), {copies} copy-on-write slots queued, {dropped} copies dropped with their \
         destination, {alone} op ends with a source held by its copy alone, {diverged} \
         truncations into a prompt; queued: {} offloads, {} loads; run: {} copied slots; {swaps} \
         swap-outs (and the pages they moved), {bounced} requests swapped out and in twice \
         undrained, {host_stored} host Stored events, {stored} Stored events drained \
         mid-sequence",
        moved[0], moved[1], moved[2]
    );
    assert!(
        oks > cases as usize * 10,
        "only {oks} successful calls in {cases} sequences"
    );
    assert!(hits > cases as u64 / 6, "only {hits} prefix-hit tokens");
    assert!(
        copies > cases as usize / 20,
        "only {copies} copy-on-write slots"
    );
    // Typically 3700-4400 (chains stop at an evicted tip, so the
    // eviction-heavy sequences register fewer pages than they write).
    assert!(
        stored > cases as usize / 2,
        "only {stored} Stored events drained mid-sequence"
    );
    // Typically 28-56 over random seeds: the guard is for none, not for a
    // count this rare path happens to reach.
    assert!(
        dropped > cases as usize / 300,
        "only {dropped} queued copies dropped"
    );
    assert!(
        alone > cases as usize / 100,
        "only {alone} sources held by their copy alone"
    );
    assert!(
        diverged > cases as usize / 10,
        "only {diverged} truncations into a prompt"
    );
    assert!(
        // Random seeds give about 100 to 200 here; the guard is for none.
        host_hits > cases as u64 / 60,
        "only {host_hits} host-hit tokens"
    );
    assert!(
        moved[0] > cases as usize / 5 && moved[1] > cases as usize / 30,
        "only {} offloads and {} loads queued",
        moved[0],
        moved[1]
    );
    assert!(swaps > cases as usize / 10, "only {swaps} swap-outs");
    assert!(bounced > cases as usize / 30, "only {bounced} bounces");
    assert!(
        host_stored > cases as usize / 10,
        "only {host_stored} host Stored events"
    );
    let (prio, pinned, ended, taken_over) = (
        PRIO_OKS.with(Cell::get),
        PINNED_ENDS.with(Cell::get),
        ENDED.with(Cell::get),
        TAKEN_OVER.with(Cell::get),
    );
    eprintln!(
        "{prio} priority calls succeeded, {pinned} pinned pages summed over op ends, {ended} \
         durations ended by the clock, {taken_over} recomputed pages took over an unheld copy's \
         registration"
    );
    assert!(
        prio > cases as usize / 2,
        "only {prio} priority calls succeeded"
    );
    // Typically 1500-2500: a request stops registering once its tip's
    // registration is evicted, so under these eviction-heavy sequences fewer
    // chains reach a priority call than pages are written.
    assert!(
        pinned > cases as usize / 4,
        "only {pinned} pinned pages at op ends"
    );
    // Typically 70-150 over random seeds.
    assert!(ended > cases as usize / 100, "only {ended} durations ended");
    // A request opened on a shorter prompt than one cached, then extended
    // over the rest of it (typically 80-115 over random seeds).
    assert!(
        taken_over > cases as usize / 100,
        "only {taken_over} recomputed pages took over an unheld copy's registration"
    );
    // Rare here (0-2 a run): `orphans.rs` and `hit_oracle.rs` build them.
    let replaced = ORPHANS_REPLACED.with(Cell::get);
    eprintln!("{replaced} orphans replaced by a recomputed page");
    // A recomputed page taking a ghost's registration back (`ghosts.rs`).
    let revived = REVIVED.with(Cell::get);
    eprintln!("{revived} removed registrations revived by a recomputed page");
    // Runs split and merge under the same random ops (a third of the cases
    // run at page size 1); `tests/runs.rs` shapes each case on purpose.
    let [started, grown, cut, ended, branched] = RUNS.with(Cell::get);
    eprintln!(
        "page-1 runs: {started} started, {grown} grown by a later pass, {cut} cut short, \
         {ended} ended, {branched} branched from inside another run"
    );
    // Typically (over random seeds) 560-640 started, 240-300 ended, 30-45
    // grown, 40-60 cut and 8-17 branched: the guards are for none.
    for (what, n, floor) in [
        ("started", started, cases / 30),
        ("ended", ended, cases / 30),
        ("grown by a later pass", grown, cases / 300),
        ("cut short", cut, cases / 300),
        ("branched from inside another run", branched, cases / 1000),
    ] {
        assert!(n > floor as usize, "only {n} runs {what}");
    }
}
