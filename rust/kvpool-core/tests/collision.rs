//! Forced hash collisions: with a 2-bit test-only hash almost every lookup
//! and registration collides, and a hit must still never hand a request KV
//! computed for other tokens or another salt.

use std::collections::HashMap;

use kvpool_core::{Counts, Options, SlotAllocator, EVENT_REMOVED, EVENT_STORED};

/// What a page's KV was computed for: the salt and every token up to the end of the page.
type Identity = (i64, Vec<i32>);

struct Tracker {
    pages: HashMap<i32, Identity>,
}

impl Tracker {
    /// Records the pages `h` just registered (from the Stored events), forgets removed ones.
    fn absorb(&mut self, a: &mut SlotAllocator, owner: Option<(&[i32], i64, &[i32])>, ps: usize) {
        let ev = a.take_events();
        for i in 0..ev.len() {
            match ev.kind[i] {
                EVENT_STORED => {
                    let (pages, salt, toks) = owner.expect("only cache() stores");
                    let k = pages
                        .iter()
                        .position(|&p| p == ev.page[i])
                        .expect("stored page is the request's");
                    self.pages
                        .insert(ev.page[i], (salt, toks[..(k + 1) * ps].to_vec()));
                }
                EVENT_REMOVED => {
                    self.pages.remove(&ev.page[i]);
                }
                _ => self.pages.clear(),
            }
        }
    }
}

#[test]
fn forced_collisions_never_serve_other_tokens() {
    let ps = 2;
    let opts = Options {
        weak_hash_bits: 2,
        hash_seed: Some(1),
        ..Options::new()
    };
    let mut a = SlotAllocator::with_options(48, ps, 8, 16, opts).unwrap();
    let mut t = Tracker {
        pages: HashMap::new(),
    };
    let mut x: u64 = 12345;
    let mut rnd = |n: u64| {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (x >> 33) % n
    };
    let (mut hit_pages, mut requests) = (0usize, 0usize);
    for _ in 0..3000 {
        let len = 1 + rnd(10) as usize;
        let salt = rnd(2) as i64;
        let prompt: Vec<i64> = (0..len).map(|_| rnd(2) as i64).collect();
        let (h, cached) = a
            .open_with_prefix(&prompt, &[len as i64], Counts::Each(salt))
            .unwrap();
        requests += 1;
        let cached = cached[0] as usize;
        // Every hit page holds KV of exactly this salt and token prefix.
        let pages = a.pages(h[0]).unwrap();
        for (k, p) in pages.iter().enumerate() {
            let want: Identity = (
                salt,
                prompt[..(k + 1) * ps].iter().map(|&v| v as i32).collect(),
            );
            assert_eq!(
                t.pages.get(p),
                Some(&want),
                "page {p} served for other tokens"
            );
        }
        hit_pages += cached / ps;
        a.extend(&h, Counts::Each((len - cached) as i64), None)
            .unwrap();
        let decode: Vec<i64> = (0..rnd(4)).map(|_| rnd(2) as i64).collect();
        a.extend(&h, Counts::Each(decode.len() as i64), Some(&decode))
            .unwrap();
        let toks = a.known_tokens(h[0]).unwrap();
        let pages = a.pages(h[0]).unwrap();
        if rnd(2) == 0 {
            a.cache(&h).unwrap();
            t.absorb(&mut a, Some((&pages, salt, &toks)), ps);
        }
        a.close(&h, rnd(4) != 0).unwrap();
        t.absorb(&mut a, Some((&pages, salt, &toks)), ps);
        if rnd(50) == 0 {
            a.evict(rnd(8) as usize);
            t.absorb(&mut a, None, ps);
        }
        a.check().unwrap();
    }
    // The test means something only if hits happened despite collisions.
    assert!(
        hit_pages > requests / 10,
        "{hit_pages} hit pages in {requests} requests"
    );
    // A 2-bit hash files at most 4 keys; the pages past a chain's first
    // that only their parent's hint reaches need none, so more may be
    // cached, each still verified against its tokens, salt and parent.
}

/// The benchmark-only `skip_hit_verification` skips the token compare, not
/// the salt and parent checks: a hinted walk does not read salts and relies
/// on every entry having its parent's. With a 2-bit hash a salt-1 prompt's
/// key finds a salt-0 entry; it must miss, so no salt-1 page gets
/// registered under the salt-0 chain.
#[test]
fn unverified_hits_still_check_the_salt() {
    let opts = Options {
        weak_hash_bits: 2,
        hash_seed: Some(1),
        skip_hit_verification: true,
        ..Options::new()
    };
    let mut a = SlotAllocator::with_options(64, 1, 4, 16, opts).unwrap();
    let (h, _) = a.open_with_prefix(&[5, 6], &[2], Counts::Each(0)).unwrap();
    a.extend(&h, Counts::Each(2), None).unwrap();
    a.close(&h, true).unwrap();
    // Only the salt-0 chain is registered, so any hit here crosses salts.
    for t in 0..64i64 {
        let (h, c) = a
            .open_with_prefix(&[t, 7, 8], &[3], Counts::Each(1))
            .unwrap();
        assert_eq!(
            c[0], 0,
            "a salt-1 prompt (first token {t}) hit a salt-0 page"
        );
        a.extend(&h, Counts::Each(3), None).unwrap();
        if t == 63 {
            a.cache(&h).unwrap(); // its own chain, from the salt-1 root
        }
        a.close(&h, false).unwrap();
        a.check().unwrap();
    }
    // A salt-0 prompt that starts like the first one still hits its pages.
    let (_, c) = a
        .open_with_prefix(&[5, 6, 9], &[3], Counts::Each(0))
        .unwrap();
    assert_eq!(c[0], 2);
    a.check().unwrap();
}
