//! Extending, as the harness drives and checks it: token ids for a batch,
//! the pages and copy-on-write slots a valid batch must take, and the
//! model update after a successful call.

use crate::model::Model;
use arbitrary::Arbitrary;
use kvpool_core::{Counts, PoolError, SlotAllocator};

/// Tokens come from a small alphabet so that prefixes repeat.
const ALPHABET: u8 = 3;

pub fn tok(b: u8) -> i32 {
    (b % ALPHABET) as i32
}

/// Token ids for an extend.
#[derive(Arbitrary, Debug)]
pub enum Toks {
    None,
    /// The request's prompt where it covers the position, else these.
    Follow(Vec<u8>),
    /// Exactly these (wrong length or out of range now and then).
    Raw(Vec<i64>),
}

/// Token ids for an extend batch (None for the no-tokens form).
pub fn extend_tokens(m: &Model, hs: &[i64], cs: &[i64], toks: &Toks) -> Option<Vec<i64>> {
    match toks {
        Toks::None => None,
        Toks::Raw(v) => Some(v.iter().take(64).copied().collect()),
        Toks::Follow(v) => {
            let mut out = Vec::new();
            let mut k = 0usize;
            for (&h, &c) in hs.iter().zip(cs) {
                let r = m.reqs.get(&h);
                let start = r.map_or(0, |r| r.tokens.len());
                for pos in start..start + c.max(0) as usize {
                    let from_prompt = r.and_then(|r| r.prompt.get(pos).copied());
                    let b = v.get(k % v.len().max(1)).copied().unwrap_or(0);
                    out.push(from_prompt.unwrap_or(tok(b)) as i64);
                    k += 1;
                }
            }
            Some(out)
        }
    }
}

/// What a valid extend batch takes.
pub struct Need {
    /// Pages, exactly: a holder that copies a shared last page leaves one
    /// holder fewer for the next request of the batch.
    pub exact: usize,
    /// Pages the core's validation counts: one copy for every request whose
    /// last page is shared before the batch (an upper bound).
    pub upper: usize,
    /// Slots copied on write.
    pub copies: usize,
}

/// None when the batch is invalid in a way the model can see.
pub fn extend_need(a: &SlotAllocator, m: &Model, hs: &[i64], cs: &[i64]) -> Option<Need> {
    let ps = a.page_size();
    let before = m.holders(a);
    let mut holders = before.clone();
    let mut n = Need {
        exact: 0,
        upper: 0,
        copies: 0,
    };
    for (&h, &c) in hs.iter().zip(cs) {
        let len = a.length(h).ok()?;
        let c = usize::try_from(c).ok()?;
        let new_pages = (len + c).div_ceil(ps) - len.div_ceil(ps);
        n.exact += new_pages;
        n.upper += new_pages;
        if len % ps != 0 && c > 0 {
            let last = *a.pages(h).ok()?.last()?;
            n.upper += (before[&last] > 1) as usize;
            let k = holders.get_mut(&last)?;
            if *k > 1 {
                *k -= 1;
                n.exact += 1;
                n.copies += len % ps;
            }
        }
    }
    Some(n)
}

/// Known core bug (see docs/reliability.md): when extend's decode fast path
/// has already taken pages for the leading requests of a batch that then
/// runs out, `Exhausted` reports the pages still free after those (undone)
/// takes and only the rest of the batch's need. The batch is still refused
/// and rolled back correctly. Set to false once the core reports the whole
/// batch's need against the pages free before the call.
const EXHAUSTED_COUNTS_BUG: bool = false;

pub fn extend(
    a: &mut SlotAllocator,
    m: &mut Model,
    hs: &[i64],
    cs: &[i64],
    toks: Option<&[i64]>,
    broadcast: bool,
) -> bool {
    let free = a.free_pages();
    let need = extend_need(a, m, hs, cs);
    let counts = if broadcast && !cs.is_empty() {
        Counts::Each(cs[0])
    } else {
        Counts::PerRequest(cs)
    };
    let slots = match a.extend(hs, counts, toks) {
        Ok(s) => s,
        Err(PoolError::Exhausted {
            needed_pages,
            free_pages,
            ..
        }) => {
            // Only a batch valid in every other way gets this far. The core
            // counts a copy for every holder of a shared last page in the
            // batch, so it may ask for more than the exact need, never less.
            let need = need.expect("Exhausted on an invalid batch");
            assert!(
                need.upper > free,
                "Exhausted, but {} pages needed of {free} free",
                need.upper
            );
            if !EXHAUSTED_COUNTS_BUG {
                assert_eq!(free_pages, free, "Exhausted reports the wrong free pages");
                assert!(needed_pages >= need.exact && needed_pages <= need.upper);
            }
            return false;
        }
        Err(_) => return false,
    };
    let need = need.expect("an invalid batch succeeded");
    // The core may succeed with fewer free pages than `upper`: the last
    // holder of a shared page in the batch writes it in place, so what it
    // needs is `exact` (checked just below), never more.
    assert!(
        need.exact <= free,
        "extend took {} pages of {free} free",
        need.exact
    );
    assert_eq!(a.free_pages(), free - need.exact, "pages taken by extend");
    let copied = record_extend(a, m, hs, cs, toks, &slots);
    assert_eq!(copied, need.copies, "copy-on-write slots");
    true
}

/// Applies a successful extend to the model: queued transfers first (the
/// device runs them before the new positions are written), then the writes.
/// With `m.defer` they stay queued unless a new position's slot is one a
/// queued copy touches, or its page one a queued offload reads or load
/// writes. Returns how many slots this call queued.
pub fn record_extend(
    a: &mut SlotAllocator,
    m: &mut Model,
    hs: &[i64],
    cs: &[i64],
    toks: Option<&[i64]>,
    slots: &[i64],
) -> usize {
    assert_eq!(slots.len() as i64, cs.iter().sum::<i64>());
    let queued = a.pending_copies() - m.pending;
    let q = crate::model::queued(a);
    let ps = a.page_size() as i64;
    let touched = |s: &i64| {
        q.copies.0.contains(s)
            || q.copies.1.contains(s)
            || q.offloads.0.contains(&(s / ps))
            || q.loads.1.contains(&(s / ps))
    };
    if m.defer && !slots.iter().any(touched) {
        m.pending = a.pending_copies();
    } else {
        m.drain(a);
    }
    let mut k = 0usize;
    for (&h, &c) in hs.iter().zip(cs) {
        let c = c as usize;
        let r = m
            .reqs
            .get_mut(&h)
            .expect("extended a request the model lacks");
        let start = r.tokens.len();
        for j in 0..c {
            let pos = start + j;
            let t = match toks {
                Some(t) => Some(t[k + j] as i32),
                None => r.prompt.get(pos).copied(),
            };
            r.tokens.push(t);
        }
        // The new slots are the request's last c slots, in order.
        let all = a.slots(h).expect("open");
        assert_eq!(&all[start..], &slots[k..k + c]);
        for j in 0..c {
            m.write(h, start + j, slots[k + j]);
        }
        k += c;
    }
    queued
}
