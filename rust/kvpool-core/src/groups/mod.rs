//! Layer groups: a pool whose layers keep different things per request.
//! [`GroupedAllocator`] composes one request table with one page engine per
//! group; a pool without groups stays a [`SlotAllocator`], untouched.
//!
//! # The owners
//!
//! - **The anchor**: a `SlotAllocator` that carries the request table
//!   (handles, lengths, prompts, known token ids) and the *anchor chain*,
//!   the prefix index that proves what a cached prefix is. It is the first
//!   full group whose page size divides every group's page size (a Gemma-3
//!   or Qwen3-Next pool's full-attention group), or, when there is none (an
//!   all-sliding Mistral pool, or page sizes that do not nest), a token-only
//!   anchor: a full group of page size `gcd(page sizes)` whose pages hold
//!   token ids and no K/V (`anchor_pages` of them, by default room for every
//!   request's longest context twice over).
//! - **A page engine per other full or sliding group** (`paged.rs`): its own
//!   page pool (records, free stack, LRU eviction, copy-on-write queue: the
//!   `pages/` owner, one per group), page size, page lists per row (a
//!   sliding group's start with null pages where the window moved on), and
//!   a cache index keyed by the anchor chain (`regmap.rs`).
//! - **A state engine per state group** (`state.rs`): one state slot per
//!   request, checkpoints filed like pages, and a queue of slot copies
//!   (`copies.rs`) in `take_copies`'s form.
//!
//! Why an owner above the allocator and not groups inside it: an ungrouped
//! pool then runs exactly the code it ran before (no dispatch, no group
//! loop, no field it does not use), so it costs what it cost; and the host
//! tier and eviction policies that change the allocator's own paths stay
//! out of the groups' way. The price is that a grouped call checks the
//! anchor's part before the groups' (`allocator/group_hooks.rs` mirrors
//! each operation's checks) and then runs the anchor's operation as is.
//!
//! # Atomicity
//!
//! Every call checks everything before it changes anything: the anchor's
//! own checks in the operation's order (handles, counts, lengths, token
//! ids), then each group's room in group order (`GroupExhausted` names the
//! first group short of pages or slots; the token-only anchor is group
//! `len(groups)`), then for `truncate` each group's ability to roll back
//! (`RollbackUnavailable`). Only then does the anchor's operation run (it
//! cannot fail on what was checked) and each group apply its part, which
//! cannot fail either. A refusal in the last group leaves the first ones
//! as they were.
//!
//! # Prefix hits (the hit rule)
//!
//! Every group's content at position e depends on every token before e, so
//! a group's page (or checkpoint) may serve a prompt only if the prompt's
//! whole prefix [0, e) is the one it was computed on, not only its own
//! tokens. The anchor chain proves that page by page (tokens, salt, parent
//! registration: a collision costs a miss, never wrong K/V), and every
//! other group files its page ending at e (or its checkpoint at e) under
//! the registration id of the anchor entry ending at e. Ids are reused
//! only for the very prefix they stood for (a revived ghost,
//! `prefix/ghosts.rs`), so a lookup by the id the anchor walk verified is
//! exact by construction. A hit of length L then needs:
//!
//! - the anchor chain's pages for [0, L) (verified walk);
//! - every other full group's pages for [0, L);
//! - every sliding group's pages for [L - window + 1, L), the positions the
//!   next token attends to (all of [0, L) when L < window);
//! - every state group's checkpoint at L (L = 0 needs none: the empty state).
//!
//! L is the longest length all groups satisfy, a multiple of the hit step
//! (`lcm` of every page size), at most `len - 1` (a step computes at least
//! one token). Where groups disagree: full groups and the anchor are
//! monotone (they cap L), sliding and state groups are not (a window at
//! 2048 may be cached while the one at 1024 was evicted), so each of those
//! lowers L to the longest length at most L it can serve, and the rounds
//! repeat until no group lowers it (vLLM's coordinator does the same fixed
//! point with two attention types and one page size).
//!
//! # Sliding windows
//!
//! A sliding group's request of length L keeps the pages covering
//! [L - window + 1, L). An extend from `start` releases the pages wholly
//! before `start - window + 1` (what the step's first token no longer
//! attends to) before taking new ones, registered pages to the cache as
//! usual; released positions read as the null page (page 0's slots) in
//! `slots`, `pages` and tables, and `page_table` lists only held pages.
//!
//! # State
//!
//! A state slot holds the state after the request's last computed token.
//! `cache()` keeps a checkpoint when the request's length is a multiple of
//! the group's `checkpoint_every` and its anchor chain covers it (at most
//! one per position, so at most one per anchor page); call it after the
//! step has run, as for pages. `truncate` to a shorter length restores the
//! slot from a checkpoint at exactly that length (or the empty state at 0),
//! else refuses. A hybrid pool with a host memory tier is not supported.

mod copies;
mod paged;
mod regmap;
mod spec;
mod state;

mod check;
mod grow;
mod hits;
mod queries;
mod release;
mod share;

pub use spec::{GroupKind, GroupSpec};

use crate::allocator::group_hooks::BatchRow;
use crate::allocator::options::Options;
use crate::allocator::SlotAllocator;
use crate::error::{GroupShortage, PoolError, Result};
use crate::memory::{filled_vec, MAX_PAGES};
use paged::PageEngine;
use spec::{gcd, lcm};
use state::StateEngine;

/// Most groups a pool may have.
pub const MAX_GROUPS: usize = 64;

#[derive(Debug, Clone)]
pub(crate) enum Group {
    /// The user's group that is also the anchor (its pages are the anchor's).
    Anchor,
    Pages(PageEngine),
    State(StateEngine),
}

/// A KV pool of several layer groups sharing one request handle space. See
/// the module docs (`groups/mod.rs`) for the design and the hit rule.
#[derive(Debug, Clone)]
pub struct GroupedAllocator {
    anchor: SlotAllocator,
    /// The user group the anchor is; None: a token-only anchor.
    anchor_group: Option<usize>,
    specs: Vec<GroupSpec>,
    groups: Vec<Group>,
    /// The anchor's page size.
    a: usize,
    /// Hit lengths are multiples of this (lcm of every page size).
    step: usize,
    /// Per row: the anchor registration id at the end of each page of the
    /// row's anchor chain (as long as the chain).
    regs: Vec<Vec<u64>>,
}

impl GroupedAllocator {
    /// A pool of `groups` (at least one, at most [`MAX_GROUPS`]) for
    /// `max_requests` requests of up to `max_context_len` tokens.
    /// `anchor_pages` sizes a token-only anchor (unused when a full group
    /// is the anchor, but checked to be in [2, 2**31 - 1] either way):
    /// default `2 * max_requests * ceil(max_context_len / anchor page size) + 1`.
    ///
    /// Errors: `InvalidArgument` for no or too many groups, a group's size,
    /// page size or window out of range, a `checkpoint_every` that is not a
    /// multiple of the anchor's page size, a state-only pool without
    /// `checkpoint_every`, an `anchor_pages` out of range, sizes whose least
    /// common multiple overflows, or
    /// what [`SlotAllocator::with_options`] refuses.
    pub fn new(
        groups: &[GroupSpec],
        max_requests: usize,
        max_context_len: usize,
        opts: Options,
        anchor_pages: Option<usize>,
    ) -> Result<Self> {
        let bad = |m: String| Err(PoolError::InvalidArgument(m));
        if groups.is_empty() || groups.len() > MAX_GROUPS {
            return bad(format!(
                "a grouped pool needs 1 to {MAX_GROUPS} groups, got {}",
                groups.len()
            ));
        }
        for (g, s) in groups.iter().enumerate() {
            s.validate(g)?;
        }
        let page_sizes = groups.iter().filter(|s| s.has_pages()).map(|s| s.page_size);
        let every = groups.iter().filter_map(|s| match s.kind {
            GroupKind::State { checkpoint_every } if checkpoint_every > 0 => Some(checkpoint_every),
            _ => None,
        });
        let a = match page_sizes.clone().reduce(gcd) {
            Some(g) => g,
            None => match every.clone().reduce(gcd) {
                Some(g) => g,
                None => {
                    return bad(
                        "a pool of state groups only needs checkpoint_every on one of them \
                         (it sets where prefix hits can land)"
                            .into(),
                    )
                }
            },
        };
        let mut step = a;
        for p in page_sizes {
            step = match lcm(step, p) {
                Some(s) => s,
                None => return bad("the groups' page sizes have no representable lcm".into()),
            };
        }
        // Checked whether or not a full group holds the anchor (and the value goes
        // unused): anchor_pages=1 was accepted beside a full group and refused on an
        // all-sliding pool, and an out-of-range one was reported as num_pages.
        if let Some(n) = anchor_pages {
            if !(2..=MAX_PAGES).contains(&n) {
                return bad(format!(
                    "anchor_pages must be in [2, {MAX_PAGES}] (it includes the reserved page 0), got {n}"
                ));
            }
        }
        let anchor_group = groups
            .iter()
            .position(|s| s.kind == GroupKind::Full && s.page_size == a);
        // A grouped pool has no host tier: its groups' pages would need
        // copies of their own, which nothing offloads or loads.
        let opts = Options {
            host_pages: 0,
            ..opts
        };
        // The anchor first: it validates the request table's sizes before
        // any group allocates for them.
        let anchor = match anchor_group {
            Some(g) => SlotAllocator::with_options(
                groups[g].num_pages,
                a,
                max_requests,
                max_context_len,
                opts,
            )?,
            None => {
                let pages = match anchor_pages {
                    Some(n) => n,
                    None => max_requests
                        .saturating_mul(max_context_len.div_ceil(a))
                        .saturating_mul(2)
                        .saturating_add(1)
                        .min(i32::MAX as usize),
                };
                // (A given one is checked above; the default can be 1 with no
                // requests, and the anchor's own refusal would name num_pages.)
                if !(2..=MAX_PAGES).contains(&pages) {
                    return bad(format!(
                        "anchor_pages must be in [2, {MAX_PAGES}] (it includes the reserved page 0), got {pages}"
                    ));
                }
                SlotAllocator::with_options(pages, a, max_requests, max_context_len, opts)?
            }
        };
        let mut engines = Vec::with_capacity(groups.len());
        for (g, s) in groups.iter().enumerate() {
            let window = match s.kind {
                GroupKind::Sliding { window } => Some(window),
                _ => None,
            };
            engines.push(match s.kind {
                _ if Some(g) == anchor_group => Group::Anchor,
                GroupKind::Full | GroupKind::Sliding { .. } => Group::Pages(PageEngine::new(
                    s.num_pages,
                    s.page_size,
                    window,
                    max_requests,
                    max_context_len,
                )?),
                GroupKind::State { checkpoint_every } => {
                    let every = if checkpoint_every == 0 {
                        step
                    } else {
                        checkpoint_every
                    };
                    if every % a != 0 {
                        return bad(format!(
                            "groups[{g}]: checkpoint_every = {every} must be a multiple of the \
                             anchor page size {a}"
                        ));
                    }
                    Group::State(StateEngine::new(s.num_pages, every, max_requests)?)
                }
            });
        }
        let regs = filled_vec(anchor.max_requests(), Vec::new(), "anchor registrations")?;
        Ok(GroupedAllocator {
            anchor,
            anchor_group,
            specs: groups.to_vec(),
            groups: engines,
            a,
            step,
            regs,
        })
    }

    /// The group index errors use for the token-only anchor.
    #[inline]
    fn anchor_index(&self) -> usize {
        self.anchor_group.unwrap_or(self.groups.len())
    }

    /// `InvalidArgument` unless `g` names a group.
    fn group(&self, g: usize) -> Result<&Group> {
        self.groups.get(g).ok_or_else(|| {
            PoolError::InvalidArgument(format!(
                "group {g} does not exist; this pool has groups 0 to {}",
                self.groups.len() - 1
            ))
        })
    }

    /// The anchor's room for `need` more pages, as group `anchor_index`.
    fn anchor_room(&self, need: usize) -> Result<()> {
        let free = self.anchor.free_pages();
        if need > free {
            return Err(PoolError::GroupExhausted(Box::new(GroupShortage {
                group: self.anchor_index(),
                kind: if self.anchor_group.is_some() {
                    "full"
                } else {
                    "anchor"
                },
                needed_pages: need,
                free_pages: free,
                page_size: self.a,
                held_back: 0,
            })));
        }
        Ok(())
    }

    fn exhausted(&self, g: usize, need: usize, free: usize) -> PoolError {
        self.exhausted_holding_back(g, need, free, 0)
    }

    /// `exhausted`, where `held_back` evictable slots were not counted free
    /// because the call itself needs them kept (`GroupShortage::held_back`).
    fn exhausted_holding_back(
        &self,
        g: usize,
        need: usize,
        free: usize,
        held_back: usize,
    ) -> PoolError {
        PoolError::GroupExhausted(Box::new(GroupShortage {
            group: g,
            kind: self.specs[g].kind.name(),
            needed_pages: need,
            free_pages: free,
            page_size: self.specs[g].page_size,
            held_back,
        }))
    }

    /// Each row's registration ids follow its anchor chain again after an
    /// anchor call that may have cut it (truncate), and the groups' cache
    /// progress stays within it.
    fn sync_rows(&mut self, rows: &[BatchRow]) {
        for r in rows {
            let pages = self.anchor.group_chain_pages(r.row);
            self.regs[r.row].truncate(pages);
            let end = self.regs[r.row].len() * self.a;
            for g in self.groups.iter_mut() {
                if let Group::Pages(e) = g {
                    let p = end / e.page_size();
                    e.clamp_progress(r.row, p);
                }
            }
        }
    }
}
