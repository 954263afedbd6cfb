//! The host tier's transfer hazards, each in the smallest pool that reaches
//! it. A queued transfer's pages are checked through the simulated store
//! (`store/mod.rs`): the engine (`engine/mod.rs`) runs offloads, loads and
//! copies in the documented order before a step's writes, and every open
//! request must then read exactly what it wrote or was served.
//!
//! The rule (docs/allocator.md): within what one call queues, no page
//! (device or host) that is the source of a queued transfer is overwritten
//! by another queued transfer before it runs, given the order offloads,
//! loads, copies. Across calls, whatever is left queued accumulates and the
//! same order applied to all of it stays safe.

mod engine;
mod store;

use engine::Engine;
use kvpool_core::HostPolicy::WriteBack;

const A: [i32; 3] = [1, 2, 9];
const B: [i32; 3] = [5, 6, 9];
const FILL: [i32; 4] = [3, 3, 3, 3];

/// (a) Taking a device page for a host hit evicts a CACHED page, whose
/// write-back needs a host page; the only one there is the host page the
/// hit loads from. Guard: the hit's host page is pinned (the load's pin)
/// before any device page is taken, so the write-back finds no host page
/// and the evicted page is dropped instead.
#[test]
fn a_host_hit_is_never_overwritten_by_the_write_back_its_page_causes() {
    // 3 device pages, 1 host page, page size 2.
    let mut e = Engine::new(4, 2, 2, WriteBack);
    e.serve(&A, 0);
    assert_eq!(e.a.evict(1), 1, "A's first page goes to the host");
    e.drain();
    assert_eq!((e.a.host_cached_pages(), e.a.host_free_pages()), (1, 1));
    e.serve(&B, 0); // B's first page: CACHED on the device, no host copy
    let (c, _) = e.open(&FILL, 0);
    e.prefill(c); // the last two device pages, held
    assert_eq!((e.a.free_pages(), e.a.evictable_pages()), (1, 1));
    let (h, cached) = e.open(&A, 0);
    assert_eq!(cached, 2, "A's first page is a host hit");
    let d = e.drain();
    assert!(
        d.offloads.0.is_empty(),
        "B's page had nowhere to go: dropped"
    );
    assert_eq!(d.loads.0, [1], "the load reads host page 1");
    e.verify().unwrap();
    e.close(c, false);
    e.prefill(h);
    e.verify().unwrap();
    assert_eq!(e.a.host_cached_pages(), 1);
}

/// (b) `swap_in` takes a device page per host page; each may evict a CACHED
/// page whose write-back needs a host page. The host pages swap_in lets go
/// must not be those: the offload would run before their loads. Guard: the
/// request's hold on each host page becomes its load's pin, released only
/// when the load is taken.
#[test]
fn host_pages_swap_in_lets_go_receive_no_write_back_of_the_same_call() {
    // 4 device pages, 2 host pages.
    let mut e = Engine::new(5, 2, 3, WriteBack);
    let (r, _) = e.open(&[1, 1, 1, 1], 0);
    e.prefill(r);
    e.swap_out(r);
    e.drain();
    assert_eq!(e.a.host_free_pages(), 0);
    e.serve(&A, 0);
    e.serve(&B, 0);
    let (f, _) = e.open(&FILL, 0);
    e.prefill(f);
    assert_eq!((e.a.free_pages(), e.a.evictable_pages()), (2, 2));
    e.swap_in(r);
    let d = e.drain();
    assert!(
        d.offloads.0.is_empty(),
        "the evicted pages found no host page: {d:?}"
    );
    assert_eq!(d.loads.0.len(), 2);
    e.verify().unwrap();
}

/// (c) An offload's device source, left queued, is reused by a later call:
/// here as the destination of a host hit's load, then as a new holder's
/// page. Protection: the order. Every queued offload (of any call since the
/// last drain) runs before any load, copy or step write, so it reads the
/// page first; the core pins no device page for it. The same transfers run
/// loads-first would give A's host copy B's content, which this test sees.
#[test]
fn a_queued_offloads_source_reused_by_a_later_call_is_read_first() {
    let mut e = Engine::new(5, 2, 4, WriteBack);
    e.serve(&B, 0);
    assert_eq!(e.a.evict(1), 1);
    e.drain(); // B's first page lives on the host now
    e.serve(&A, 0);
    assert_eq!(e.a.evict(1), 1, "A's first page: its offload stays queued");
    let q = queued(&e);
    let (d, ha) = (q.offloads.0[0], q.offloads.1[0]);
    // A later call: B's host hit loads into the page A's offload reads.
    let (hb, cached) = e.open(&B, 0);
    assert_eq!(cached, 2);
    let q = queued(&e);
    assert_eq!(
        (q.offloads.0.clone(), q.loads.1.clone()),
        (vec![d], vec![d])
    );
    let want_a: Vec<u64> = (0..2).map(|i| store::content(0, &A[..=i])).collect();
    let host_a = |s: &store::Store| s.host[ha as usize * 2..ha as usize * 2 + 2].to_vec();
    // Loads first: A's host copy gets B's page.
    let mut wrong = e.s.clone();
    let (mut loads, mut offloads) = (q.clone(), q.clone());
    loads.offloads = Default::default();
    loads.copies = Default::default();
    offloads.loads = Default::default();
    offloads.copies = Default::default();
    wrong.run(&loads);
    wrong.run(&offloads);
    assert_ne!(host_a(&wrong), want_a, "loads first corrupt A's host copy");
    // The documented order.
    e.verify().unwrap();
    e.drain();
    assert_eq!(host_a(&e.s), want_a);
    // And as a new holder's page: the step's writes come after the drain.
    e.prefill(hb);
    let (ha_req, cached) = e.open(&A, 0);
    assert_eq!(cached, 2, "A's first page is a host hit");
    e.verify().unwrap();
    e.drain();
    e.prefill(ha_req);
    e.verify().unwrap();
}

/// The transfers queued in `e` (not taken).
fn queued(e: &Engine) -> store::Drained {
    store::take_all(&mut e.a.clone())
}

/// (d) A page a queued load has yet to fill is swapped out by a later call
/// (swap_in, then swap_out again before the loads ran). Offloading it
/// would copy what the page held before the load (offloads run first).
/// Guard: pages with a load (or a copy) still queued into them stay on the
/// device, held by the swapped-out request, as shared pages do.
#[test]
fn a_page_a_queued_load_must_fill_is_not_offloaded() {
    let mut e = Engine::new(6, 2, 4, WriteBack);
    let (r, _) = e.open(&[1, 1, 1, 1], 0);
    e.prefill(r);
    e.swap_out(r);
    e.drain();
    // Another request writes the pages r let go.
    let (f, _) = e.open(&FILL, 0);
    e.prefill(f);
    e.close(f, false);
    e.swap_in(r);
    assert_eq!(e.a.pending_loads(), 2);
    e.swap_out(r);
    assert_eq!(e.a.pending_offloads(), 0, "nothing to offload yet");
    e.swap_in(r);
    e.drain();
    e.verify().unwrap();
}

/// (d') The same for a copy-on-write copy still queued into a page.
#[test]
fn a_page_a_queued_copy_must_fill_is_not_offloaded() {
    let mut e = Engine::new(6, 2, 4, WriteBack);
    let (r, _) = e.open(&[1, 1, 1], 0);
    e.prefill(r);
    let kid = e.a.fork(r, 1).unwrap()[0];
    e.reqs.insert(kid, e.reqs[&r].clone());
    e.extend(r, &[2], false); // the shared last page is copied (queued)
    assert_eq!(e.a.pending_copies(), 1);
    e.swap_out(r);
    assert_eq!(e.a.pending_offloads(), 0, "nothing of r moves yet");
    e.swap_in(r);
    e.write(r);
    e.verify().unwrap();
    assert_eq!(e.a.known_tokens(r).unwrap(), [1, 1, 1, 2]);
}

/// (d'') A shared, partly filled page a swapped-out request keeps. Its
/// fork parent grows into the page while the child is out: writing in
/// place would put the parent's token where the child's next one goes
/// once it swaps back in. Guard: the swapped-out child still holds the
/// page it shares (`swap_out` leaves it on the device), so the parent's
/// extend copies it and takes one page, as with a resident child.
#[test]
fn a_shared_page_a_swapped_out_request_keeps_is_copied_before_a_write() {
    let mut e = Engine::new(6, 2, 4, WriteBack);
    let (r, _) = e.open(&[1, 1, 1], 0);
    e.prefill(r);
    let kid = e.a.fork(r, 1).unwrap()[0];
    e.reqs.insert(kid, e.reqs[&r].clone());
    e.swap_out(kid);
    let free = e.a.free_pages();
    e.extend(r, &[2], true);
    assert_eq!(e.a.pending_copies(), 0, "the step ran the copy");
    assert_eq!(
        e.a.free_pages(),
        free - 1,
        "the shared last page was copied"
    );
    e.swap_in(kid);
    e.extend(kid, &[3], true);
    e.verify().unwrap();
    assert_eq!(e.a.known_tokens(r).unwrap(), [1, 1, 1, 2]);
    assert_eq!(e.a.known_tokens(kid).unwrap(), [1, 1, 1, 3]);
}

/// (e) One batch: prompt A hits a host-only page, prompt B a CACHED device
/// page, the only page left to take. Guard: every hit of the batch is held
/// or pinned before any page is taken; A's load then cannot evict the page
/// B was matched on. B's hit needs that page too (holding it would leave
/// A's load none), so B's match ends there.
#[test]
fn a_batchs_load_never_takes_a_page_another_prompt_of_the_batch_hit() {
    let mut e = Engine::new(4, 2, 3, WriteBack);
    e.serve(&A, 0);
    assert_eq!(e.a.evict(1), 1);
    e.drain();
    e.serve(&B, 0);
    let (c, _) = e.open(&FILL, 0);
    e.prefill(c);
    let got = e.open_batch(&[(&A, 0), (&B, 0)]);
    assert_eq!((got[0].1, got[1].1), (2, 0));
    e.verify().unwrap();
    e.drain();
    // The other order: B's hit is served, A's load finds no page.
    let mut e = Engine::new(4, 2, 3, WriteBack);
    e.serve(&A, 0);
    e.a.evict(1);
    e.drain();
    e.serve(&B, 0);
    let (c, _) = e.open(&FILL, 0);
    e.prefill(c);
    let got = e.open_batch(&[(&B, 0), (&A, 0)]);
    assert_eq!((got[0].1, got[1].1), (2, 0));
    assert_eq!(e.a.pending_loads(), 0);
    e.verify().unwrap();
}

/// Two prompts of one batch hit the same host-only page: one load, both
/// requests on its device page.
#[test]
fn two_prompts_of_a_batch_share_one_load() {
    let mut e = Engine::new(8, 2, 4, WriteBack);
    e.serve(&A, 0);
    e.a.evict(1);
    e.drain();
    let got = e.open_batch(&[(&A, 0), (&A, 0)]);
    assert_eq!((got[0].1, got[1].1), (2, 2));
    assert_eq!(e.a.pending_loads(), 1);
    assert_eq!(e.a.pages(got[0].0), e.a.pages(got[1].0));
    e.verify().unwrap();
    for (h, _) in got {
        e.prefill(h);
    }
    e.verify().unwrap();
}

/// Requests that hit the same pages before their swap_out hold the same host
/// copies, and swap_in re-takes the one device copy each names: its room
/// counts each copy once (it counted one per request, and refused this
/// swap_in, which fits: 2 copies and 1 load in 3 pages).
#[test]
fn swap_in_counts_a_device_copy_several_requests_re_take_once() {
    let mut e = Engine::new(8, 1, 12, WriteBack);
    let (a, _) = e.open(&[1, 2], 0);
    e.prefill(a);
    e.cache(a);
    e.swap_out(a);
    e.drain();
    let (b, cached) = e.open(&[1, 2, 3], 0);
    assert_eq!(cached, 2);
    e.prefill(b);
    e.swap_out(b); // reuses the host copies `a` holds
    e.drain();
    let (c, _) = e.open(&[9, 9, 9, 9], 0);
    e.prefill(c);
    assert_eq!(e.a.evictable_pages(), 2);
    e.a.swap_in(&[a, b]).expect("room for 2 copies and 1 load");
    e.a.check().unwrap();
    assert_eq!(e.drain().loads.0.len(), 1);
    assert_eq!(e.a.pages(a).unwrap(), e.a.pages(b).unwrap()[..2]);
    e.verify().unwrap();
}
