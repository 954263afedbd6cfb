//! Child hints (`lookup.rs`): a lookup follows each entry's latest child
//! before it hashes. These cases make the hint wrong on purpose (a branch,
//! an evicted chain whose slab slots were reused) and check that the match
//! is still exactly the verified prefix, never more and never other pages.

use kvpool_core::{Counts, Options, SlotAllocator};

fn pool(pages: usize) -> SlotAllocator {
    let opts = Options {
        hash_seed: Some(3),
        ..Options::new()
    };
    SlotAllocator::with_options(pages, 4, 8, 64, opts).unwrap()
}

/// Opens `prompt`, prefills it, registers it and closes it; returns its pages.
fn serve(a: &mut SlotAllocator, prompt: &[i64]) -> Vec<i32> {
    let (h, cached) = a
        .open_with_prefix(prompt, &[prompt.len() as i64], Counts::Each(0))
        .unwrap();
    a.extend(&h, Counts::Each(prompt.len() as i64 - cached[0]), None)
        .unwrap();
    let pages = a.pages(h[0]).unwrap();
    a.close(&h, true).unwrap();
    a.check().unwrap();
    pages
}

/// Cached length and pages of `prompt` when opened now (then closed).
fn hit(a: &mut SlotAllocator, prompt: &[i64]) -> (i64, Vec<i32>) {
    let (h, cached) = a
        .open_with_prefix(prompt, &[prompt.len() as i64], Counts::Each(0))
        .unwrap();
    let pages = a.pages(h[0]).unwrap();
    a.close(&h, false).unwrap();
    a.check().unwrap();
    (cached[0], pages)
}

#[test]
fn a_branch_moves_the_hint_but_both_branches_still_hit() {
    let mut a = pool(64);
    let root: Vec<i64> = (100..108).collect(); // 2 pages
    let left = [root.clone(), (200..208).collect(), vec![1]].concat();
    let right = [root.clone(), (300..308).collect(), vec![1]].concat();
    let lp = serve(&mut a, &left);
    let rp = serve(&mut a, &right); // root's last page now hints at `right`
    assert_eq!(rp[..2], lp[..2]);
    assert_eq!(hit(&mut a, &left), (16, lp[..4].to_vec()));
    assert_eq!(hit(&mut a, &right), (16, rp[..4].to_vec()));
    // A third branch that diverges inside the hinted child's page.
    let third = [root, vec![200, 201, 202, 999, 5]].concat();
    assert_eq!(hit(&mut a, &third), (8, lp[..2].to_vec()));
}

#[test]
fn hints_into_an_evicted_chain_never_match_its_reused_slots() {
    let mut a = pool(64);
    let first: Vec<i64> = (0..17).collect();
    serve(&mut a, &first);
    assert_eq!(a.evict(usize::MAX), 4);
    // The same tokens, cached again under another first page: the entries
    // reuse the freed slab slots, and the pages hold the same token ids.
    let other: Vec<i64> = [vec![50, 51, 52, 53], (4..17).collect()].concat();
    let op = serve(&mut a, &other);
    // `first` shares no first page with anything cached: no hit at all.
    assert_eq!(hit(&mut a, &first).0, 0);
    // Cache it again; every page must be its own, fully matched.
    let fp = serve(&mut a, &first);
    assert_eq!(hit(&mut a, &first), (16, fp[..4].to_vec()));
    assert_eq!(hit(&mut a, &other), (16, op[..4].to_vec()));
    assert!(fp[..4].iter().all(|p| !op[..4].contains(p)));
}

#[test]
fn a_truncated_and_rewritten_page_is_not_reached_through_its_old_hint() {
    let mut a = pool(64);
    let prompt: Vec<i64> = (0..13).collect(); // 3 full pages
    let h = a.open(1).unwrap();
    a.extend(&h, Counts::Each(12), Some(&prompt[..12])).unwrap();
    a.cache(&h).unwrap();
    // Rewrite the third page's last two tokens: the core must not write
    // into the registered page in place (it copies it or unregisters it).
    a.truncate(&h, Counts::Each(10)).unwrap();
    a.extend(&h, Counts::Each(2), Some(&[70, 71])).unwrap();
    a.check().unwrap();
    let mine = a.pages(h[0]).unwrap();
    match hit(&mut a, &prompt) {
        (8, _) => {}
        (12, pages) => assert_ne!(pages[2], mine[2], "the old content must be another page"),
        other => panic!("unexpected hit {other:?}"),
    }
    a.cache(&h).unwrap();
    let rewritten = [(0..10).collect::<Vec<i64>>(), vec![70, 71, 9]].concat();
    assert_eq!(hit(&mut a, &rewritten), (12, mine[..3].to_vec()));
    a.close(&h, false).unwrap();
}

#[test]
fn a_hint_to_an_evicted_child_or_its_reused_slot_never_matches() {
    let mut a = pool(64);
    let (x, b, z): (Vec<i64>, Vec<i64>, Vec<i64>) =
        ((0..4).collect(), (10..14).collect(), (20..24).collect());
    let xb = [x.clone(), b.clone(), vec![1]].concat();
    serve(&mut a, &xb);
    // The tail page goes first: the child of x's page is evicted, and the
    // hint of x's entry now names a freed slot on a FREE page that still
    // holds b's token ids.
    assert_eq!(a.evict(1), 1);
    assert_eq!(hit(&mut a, &xb).0, 4);
    // b cached again after another first page takes the freed slot: same
    // tokens and salt, another parent, so other KV.
    let zb = [z, b, vec![1]].concat();
    let zp = serve(&mut a, &zb);
    let (c, pages) = hit(&mut a, &xb);
    assert_eq!(c, 4);
    assert!(!pages.contains(&zp[1]));
    assert_eq!(hit(&mut a, &zb), (8, zp[..2].to_vec()));
}

/// At page size 1 a walk checks a chain laid out in slab order a block of
/// hops at a time (`follow_hints_one`). A prompt that diverges at any
/// position, in a block or at its edge, matches exactly the tokens before
/// it, with the served pages; so does one whose chain branches mid-block,
/// and one that meets slab slots an eviction reused for another chain.
#[test]
fn page1_walk_stops_exactly_where_the_prompt_diverges() {
    let opts = Options {
        hash_seed: Some(5),
        ..Options::new()
    };
    let mut a = SlotAllocator::with_options(80, 1, 8, 128, opts).unwrap();
    let prompt: Vec<i64> = (1000..1041).collect();
    let served = serve(&mut a, &prompt);
    for d in 0..40 {
        let mut other = prompt.clone();
        other[d] = 7;
        assert_eq!(
            hit(&mut a, &other),
            (d as i64, served[..d].to_vec()),
            "diverging at {d}"
        );
    }
    assert_eq!(hit(&mut a, &prompt), (40, served[..40].to_vec()));
    // A branch after 13 tokens, registered in one go: token 13's entry now
    // hints at the branch, which sits elsewhere in the slab.
    let branch = [prompt[..13].to_vec(), (5000..5020).collect()].concat();
    let bp = serve(&mut a, &branch);
    assert_eq!(bp[..13], served[..13]);
    assert_eq!(hit(&mut a, &prompt), (40, served[..40].to_vec()));
    assert_eq!(hit(&mut a, &branch), (32, bp[..32].to_vec()));
    // Other prompts take the pool over: the old chains are evicted, their
    // slab slots reused by the new chain, which the old hints may name.
    let fresh: Vec<i64> = (9000..9079).collect();
    let fp = serve(&mut a, &fresh);
    assert_eq!(hit(&mut a, &fresh), (78, fp[..78].to_vec()));
    let (n, pages) = hit(&mut a, &prompt);
    assert_eq!(pages, served[..n as usize].to_vec(), "only verified pages");
    assert!(n < 40, "the pool could not keep both chains");
}
