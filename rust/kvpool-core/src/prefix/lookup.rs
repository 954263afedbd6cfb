//! Finding a prompt's cached prefix: the walk that extends a chain tip
//! (`tip.rs`) page by page, and the walk of a chain another pool sent.
//!
//! Two ways to find page `k + 1`'s entry, both checked the same way:
//! - **The tip's child hint.** Each entry remembers the latest child
//!   registered (or re-verified) under it. A cached prompt that continues
//!   the way its prefix was first cached (a chat's next turn, a prompt sent
//!   again) then walks its chain like a radix tree: compare the page's
//!   tokens with the hinted child's, and no hash is computed.
//! - **The lookup key.** Where the hint is absent or fails (a branch point,
//!   such as the end of a shared system prompt), the page's chain hash is
//!   computed and its key (`keys.rs`) probed in the table (`key_table.rs`),
//!   a few pages at a time with their buckets prefetched: 4 the first
//!   time, twice as many at each refill, up to `LOOKAHEAD`. A walk that is
//!   back on hints after one probe (the common case) then hashes little it
//!   does not use.
//!
//! Either candidate is accepted only if it verifies (`index.rs`): same
//! tokens, same salt (a hinted child's follows from its parent's, below),
//! and its parent registration is the tip's. Entries are
//! unique per key, and a key is a function of the salt and the token
//! sequence, so a verified hinted child is the very entry the key lookup
//! would find, or an entry left unkeyed because its parent's hint reaches
//! it (`links.rs`): the hint changes the cost of a match, never its result.
//! (Save under a 64-bit key collision, which can file two live entries
//! under one key, e.g. an orphan and another entry whose chain a revival
//! brings back, `ghosts.rs`: then the key finds one of them, and the other
//! may miss by key where its parent's hint finds it. Either way a hit is
//! verified.)
//!
//! A hinted child's salt is not read: an entry is only ever registered or
//! relinked under a tip of its own salt, so a child whose parent
//! registration is the tip's has the tip's salt, and the walk's first page
//! was checked against the request's salt by key. `check()` verifies that
//! every entry's salt is its live parent's. The walk then reads the hot
//! 32-byte entries alone (`index.rs`).

use super::hashing::ChainKind;
use super::index::{Entry, PrefixIndex, LOOKAHEAD};
use super::keys::key_of;
use super::runs::common_prefix;
use super::tip::{ChainTip, Match};
use crate::location::is_host;
use crate::memory::prefetch;

/// Pages hashed ahead the first time a walk falls back on keys.
const FIRST_AHEAD: usize = 4;

/// Hops a page-size-1 walk checks at once, outside runs, while the chain is
/// laid out in slab order (`follow_hints_one`).
const WALK_BLOCK: usize = 8;

/// The child hinted by entry `cur` (`parent`), with its index, if the hint
/// names an entry of the slab.
///
/// A chain registered in one go sits in consecutive slab slots, so the
/// hinted child is usually the next slot. Reading that slot before the hint
/// is known lets the CPU start the next hop's loads while this one's are in
/// flight (the branch is predicted, a data dependency is not).
#[inline(always)]
fn hinted_child<'a>(ents: &'a [Entry], cur: u32, parent: &Entry) -> Option<(u32, &'a Entry)> {
    let next = cur + 1;
    match ents.get(next as usize) {
        Some(g) if parent.child == next + 1 => Some((next, g)),
        _ => {
            let c = parent.child.checked_sub(1)?;
            Some((c, ents.get(c as usize)?))
        }
    }
}

impl PrefixIndex {
    /// Follows the child hints from `tip` over consecutive pages of
    /// `tokens` while each hinted child verifies; pushes the matched pages
    /// to `out`, moves `tip` to the last one and returns how many matched.
    /// `tip` must be the root or a live entry's tip (one just verified).
    #[inline]
    fn follow_hints(
        &self,
        tip: &mut ChainTip,
        tokens: &[i32],
        salt: i64,
        out: &mut Vec<u32>,
    ) -> usize {
        let Some(mut cur) = tip.entry.checked_sub(1) else {
            return 0;
        };
        if self.page_size == 1 && out.spare_capacity_mut().len() >= tokens.len() {
            return self.follow_hints_one(tip, cur, tokens, salt, out);
        }
        let ents = &self.entries[..];
        let mut n = 0;
        for t in tokens.chunks_exact(self.page_size) {
            // `cur` is a live entry: the tip's, then each verified child.
            let Some(parent) = ents.get(cur as usize) else {
                break;
            };
            let Some((child, e)) = hinted_child(ents, cur, parent) else {
                break;
            };
            if e.parent_reg != parent.reg || !self.holds(e, t) {
                break;
            }
            debug_assert_eq!(
                self.idents[child as usize].salt, salt,
                "a child has its parent's salt"
            );
            debug_assert!(
                !self.is_keyed(child)
                    || self.table.contains(
                        key_of(self.hasher.page(self.idents[cur as usize].hash, t)),
                        child
                    ),
                "a verified hinted child is filed under the key a lookup probes, if keyed"
            );
            out.push(e.page);
            cur = child;
            n += 1;
        }
        if n > 0 {
            *tip = self.tip(cur);
        }
        n
    }

    /// `follow_hints` at page size 1, from live entry `cur` (the tip's),
    /// with room in `out` for every token. Inside a run (`runs.rs`) the
    /// prompt's tokens are compared with the run's and its pages copied,
    /// span by span; between runs, and where a prompt leaves one, hops
    /// follow the hints as `follow_hints` does, reading one 32-byte entry
    /// a hop (whose `first_token` is the page's token), eight at a time
    /// where the chain lies in slab order. The pages go straight into
    /// `out`'s spare room, its length set once.
    #[inline]
    fn follow_hints_one(
        &self,
        tip: &mut ChainTip,
        mut cur: u32,
        tokens: &[i32],
        salt: i64,
        out: &mut Vec<u32>,
    ) -> usize {
        let ents = &self.entries[..];
        let room = &mut out.spare_capacity_mut()[..tokens.len()];
        let mut n = 0;
        loop {
            let run = self.runs.after(cur);
            if !run.is_empty() {
                let want = run.len().min(tokens.len() - n);
                let span = run.start..run.start + want;
                // The entry the walk hops from if the span matches whole
                // (its child hint), asked for before the compare.
                prefetch(ents, span.end - 1);
                let m = common_prefix(self.runs.tokens(span.clone()), &tokens[n..n + want]);
                let pages = self.runs.pages(span.start..span.start + m);
                for (slot, &p) in room[n..n + m].iter_mut().zip(pages) {
                    slot.write(p);
                }
                for j in 0..m {
                    let c = span.start + j;
                    debug_assert!(self.holds(&ents[c], &tokens[n + j..=n + j]));
                    debug_assert_eq!(ents[c].parent_reg, ents[c - 1].reg);
                    debug_assert_eq!(self.idents[c].salt, salt, "a child has its parent's salt");
                }
                n += m;
                cur += m as u32;
            }
            // Outside runs (slots after a cut, revived or relinked chains, a
            // grouped pool's anchor chain), blocks of a chain laid out in slab
            // order: the hops' checks are independent of each other there, so
            // a block checks them all and branches once. Where a run goes on,
            // or a block fails, the loop starts over: the span, or one hop.
            let mut blocked = false;
            while let (true, Some(ts), Some(blk), Some(parent)) = (
                self.runs.after(cur).is_empty(),
                tokens.get(n..n + WALK_BLOCK),
                ents.get(cur as usize + 1..cur as usize + 1 + WALK_BLOCK),
                ents.get(cur as usize),
            ) {
                let first = cur + 1;
                let mut ok = (parent.child == first + 1)
                    & (blk[0].parent_reg == parent.reg)
                    & (blk[0].first_token == ts[0]);
                for j in 1..WALK_BLOCK {
                    ok &= (blk[j - 1].child == first + j as u32 + 1)
                        & (blk[j].parent_reg == blk[j - 1].reg)
                        & (blk[j].first_token == ts[j]);
                }
                if !ok {
                    break;
                }
                for (j, (e, slot)) in blk.iter().zip(&mut room[n..n + WALK_BLOCK]).enumerate() {
                    debug_assert!(self.holds(e, &ts[j..=j]));
                    debug_assert_eq!(
                        self.idents[first as usize + j].salt,
                        salt,
                        "a child has its parent's salt"
                    );
                    slot.write(e.page);
                }
                cur += WALK_BLOCK as u32;
                n += WALK_BLOCK;
                blocked = true;
            }
            if blocked {
                continue;
            }
            // The run is left (or there was none), and no block follows: one
            // hop by the hint.
            let Some(&t) = tokens.get(n) else {
                break;
            };
            let Some(parent) = ents.get(cur as usize) else {
                break;
            };
            let Some((child, e)) = hinted_child(ents, cur, parent) else {
                break;
            };
            self.runs.prefetch_from(child);
            if e.parent_reg != parent.reg || e.first_token != t {
                break;
            }
            debug_assert!(self.holds(e, &[t]));
            debug_assert_eq!(
                self.idents[child as usize].salt, salt,
                "a child has its parent's salt"
            );
            debug_assert!(
                !self.is_keyed(child)
                    || self.table.contains(
                        key_of(self.hasher.page(self.idents[cur as usize].hash, &[t])),
                        child
                    ),
                "a verified hinted child is filed under the key a lookup probes, if keyed"
            );
            room[n].write(e.page);
            cur = child;
            n += 1;
        }
        // SAFETY: the first `n` spare slots were written just above.
        unsafe { out.set_len(out.len() + n) };
        if n > 0 {
            *tip = self.tip(cur);
        }
        n
    }

    /// Walks `prompt`'s pages from the root while each page's entry
    /// verifies; appends the matched pages' locations to `out` (a host
    /// location where an entry's only copy is on the host). Read-only (the key
    /// scratch aside). At most `(len - 1) / page_size` pages match, so at
    /// least one token is left to compute.
    pub(crate) fn match_prompt(&mut self, prompt: &[i32], salt: i64, out: &mut Vec<u32>) -> Match {
        let ps = self.page_size;
        let max_pages = prompt.len().saturating_sub(1) / ps;
        let mut m = Match::root(salt);
        let mut hashes = std::mem::take(&mut self.hash_scratch);
        hashes.clear();
        // hashes[j] is the chain hash of page `first_hashed + j`.
        let mut first_hashed = 0usize;
        let mut ahead = FIRST_AHEAD;
        let ix = &*self;
        while m.pages < max_pages {
            let k = m.pages;
            m.pages += ix.follow_hints(&mut m.tip, &prompt[k * ps..max_pages * ps], salt, out);
            let k = m.pages;
            if k == max_pages {
                break;
            }
            // The hint is absent or wrong here: probe by key.
            if k >= first_hashed + hashes.len() {
                // Hash the next pages from the tip (every page before `k`
                // matched, so their hashes chain on from it).
                let end = max_pages.min(k + ahead);
                let pages = prompt[k * ps..end * ps].chunks_exact(ps);
                ix.hashes_ahead(m.tip.hash, pages, &mut hashes);
                first_hashed = k;
                ahead = (2 * ahead).min(LOOKAHEAD);
            }
            let tokens = &prompt[k * ps..(k + 1) * ps];
            match ix.lookup(hashes[k - first_hashed]) {
                Some((i, page)) if ix.verify(i, tokens, salt, m.tip.reg) => {
                    out.push(page);
                    m.tip = ix.tip(i);
                    m.pages += 1;
                }
                _ => break,
            }
        }
        self.hash_scratch = hashes;
        m
    }

    /// Walks a chain another pool sent (`hashes[k]` the chain hash of page
    /// `k`, `tokens` its token ids) while each entry verifies and has a
    /// device copy; pushes the matched pages to `out` if given.
    pub(crate) fn walk_chain(
        &self,
        hashes: &[u128],
        tokens: &[i32],
        salt: i64,
        mut out: Option<&mut Vec<u32>>,
    ) -> Match {
        let mut m = Match::root(salt);
        // The sent chain recomputed from the sent tokens, where the index
        // keys by its internal chain: the sent hashes are checked against
        // it instead of against the entries (`hashing.rs`).
        let mut sent = m.tip.hash;
        for (&h, t) in hashes.iter().zip(tokens.chunks_exact(self.page_size)) {
            let key = match self.hasher.kind() {
                ChainKind::Interop => h,
                ChainKind::Internal => {
                    sent = self.hasher.interop(sent, t);
                    if sent != h {
                        break;
                    }
                    self.hasher.page(m.tip.hash, t)
                }
            };
            // Filed under the sent hash's key (or this pool's own key for
            // the page), and the hash must be the entry's (a sender with
            // another seed misses); verification then checks the page's
            // tokens, salt and parent, so the sent hash is never trusted.
            // Device copies only: a page whose bytes are on the host would
            // need a load, which a chain transfer does not queue.
            match self.child_of(&m.tip, key) {
                Some((i, page))
                    if !is_host(page)
                        && self.idents[i as usize].hash == key
                        && self.verify(i, t, salt, m.tip.reg) =>
                {
                    if let Some(o) = out.as_deref_mut() {
                        o.push(page);
                    }
                    m.tip = self.tip(i);
                    m.pages += 1;
                }
                _ => break,
            }
        }
        m
    }
}
