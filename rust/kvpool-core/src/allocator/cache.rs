//! Registration: `cache` (and `close(cache=True)`) files a request's full
//! pages of known tokens in the prefix index, continuing its chain, so
//! later prompts can hit them. Each page's record (`pages/`) names its
//! entry, and a Stored event reports it.

use super::SlotAllocator;
use crate::error::Result;
use crate::handle::handle_row;
use crate::location::is_host;
use crate::prefix::index::{PrefixIndex, LOOKAHEAD};
use crate::prefix::run_builder::RunBuilder;
use crate::prefix::tip::ChainTip;
use crate::requests::Chain;

use super::fresh_stretch::{file_fresh_stretch, Chunk};
use super::register_page::{register_page_named, register_past_orphan};

impl SlotAllocator {
    /// Registers every full page of each request whose token ids are all
    /// known and that is not registered yet, so later prompts can hit it.
    /// Call it once the step that wrote those pages has run. Under a host
    /// tier's `write_through` policy each page registered also gets a host
    /// copy (an offload, see `take_offloads`). All-or-nothing.
    /// Errors: `InvalidHandle` (e.g. a closed request), `RequestSwappedOut`,
    /// `InvalidArgument` (a handle twice; the index cannot grow).
    pub fn cache(&mut self, handles: &[i64]) -> Result<()> {
        self.requests.resolve_batch(handles)?;
        self.register_batch(handles)
    }

    /// Registers the handles' pages; the handles are resolved already.
    pub(super) fn register_batch(&mut self, handles: &[i64]) -> Result<()> {
        for &h in handles {
            self.requests.check_resident(handle_row(h) as usize, h)?;
        }
        for &h in handles {
            self.restart_dead_chain(handle_row(h) as usize);
        }
        let mut todo = 0usize;
        for &h in handles {
            let row = handle_row(h) as usize;
            todo += self
                .registrable_pages(row)
                .saturating_sub(self.requests.chain(row).pages);
        }
        // `todo` counts a page shared by forked requests once per holder;
        // no call registers more pages than the pool has unregistered.
        let todo = todo.min(self.prefix.room());
        self.reserve_registrations(todo)?;
        for &h in handles {
            self.register_row(handle_row(h) as usize);
        }
        Ok(())
    }

    /// Room for `todo` registrations and what they may bring: each page's
    /// Stored event, and either, where it takes over an unheld copy's
    /// registration (`take_over`), that copy's Removed event and the end of
    /// its priority, or, where it replaces an orphan (`orphans.rs`), the
    /// Removed events of the orphan's device and host copies.
    pub(super) fn reserve_registrations(&mut self, todo: usize) -> Result<()> {
        self.prefix.reserve(todo)?;
        let ps = self.geo.page_size;
        if self.writes_through() {
            // Each page: its Stored event and its host copy's, the Removed
            // events above, and that of the host copy its host page may
            // evict.
            self.events.reserve_with_removed(2 * todo, 3 * todo, ps)?;
            if let Some(h) = self.host.as_mut() {
                h.reserve_transfers(todo)?;
            }
        } else {
            self.events.reserve_with_removed(todo, 2 * todo, ps)?;
        }
        if self.pages.has_priority_ends() {
            self.pages.reserve_priority_ends(todo)?;
        }
        Ok(())
    }

    /// Restarts `row`'s chain where its tip's registration is gone, and
    /// returns whether it did.
    ///
    /// A request's tip is another request's entry where it computed a page
    /// again that was cached and held elsewhere (its own page is then an
    /// unregistered duplicate); once eviction takes that entry, pages filed
    /// under it could never be hit (a lookup verifies each page's parent
    /// registration), which used to stop the chain for good. The request's
    /// own registered pages keep their entries (it holds them), so the chain
    /// resumes after the longest run of them from page 0 that still chains,
    /// each entry's parent registration the one before and its salt the
    /// request's, and the pages after it, the duplicate among them, are
    /// registered again. Only where registration resumes changes: lookups
    /// find what they found before.
    ///
    /// The tip is not the only registration that can go: a duplicate page
    /// inside the chain stands for another request's entry, and pages the
    /// request registered after it are filed under that entry. A row whose
    /// chain has such a page (`foreign`) is walked again from page 0 when
    /// any registration was removed since its last walk; then its own pages
    /// after a gone one are relinked under the entry now registered for the
    /// same content, or registered anew (`register_row`).
    pub(super) fn restart_dead_chain(&mut self, row: usize) -> bool {
        let chain = self.requests.chain(row);
        if chain.broken {
            return false;
        }
        let salt = self.requests.salt(row);
        // A live tip: the chain holds unless it passes through another's
        // entry and some registration went since it was last walked.
        if self.prefix.is_live(&chain.tip)
            && (!chain.foreign || chain.checked == self.prefix.removals() || self.chain_holds(row))
        {
            return false;
        }
        let mut tip = ChainTip::root(salt);
        let mut k = 0;
        for &p in self.requests.pages(row, chain.pages) {
            match self.prefix.continues(self.pages.entry(p), &tip, salt) {
                Some(next) => tip = next,
                None => break,
            }
            k += 1;
        }
        // (The pages before `k` are the row's own registrations.)
        self.requests.resume_chain(row, k, tip, false);
        true
    }

    /// Whether every page of `row`'s chain still chains from the root to the
    /// same tip (`walk_chain`; an entry registered anew for a gone one's
    /// content ends the walk elsewhere). Notes the walk (`checked`) if so.
    pub(super) fn chain_holds(&mut self, row: usize) -> bool {
        let chain = self.requests.chain(row);
        match self.walk_chain(row, chain.pages) {
            Some(tip) if (tip.entry, tip.reg) == (chain.tip.entry, chain.tip.reg) => {
                let removals = self.prefix.removals();
                self.requests.set_checked(row, removals);
                true
            }
            _ => false,
        }
    }

    /// The tip after `row`'s first `n` pages walked as its chain: each page
    /// its own entry under the page before, or, for a duplicate, the entry
    /// its content is registered under there. None where one is missing,
    /// or where that entry's only copy is on the host: the chain restarts
    /// then, and its registration makes the row's page the entry's device
    /// copy (`register_page`), as when `cache()` first met the duplicate;
    /// kept unregistered, the page's content would be hit only through a
    /// load, and not at all while no device page is free.
    pub(super) fn walk_chain(&self, row: usize, n: usize) -> Option<ChainTip> {
        let salt = self.requests.salt(row);
        let (prefix, pages) = (&self.prefix, &self.pages);
        // (Only a host tier's entries are host-only; without one the bit means nothing here.)
        let tiered = self.host.is_some();
        let mut tip = ChainTip::root(salt);
        for &p in self.requests.pages(row, n) {
            tip = prefix.continues(pages.entry(p), &tip, salt).or_else(|| {
                let h = prefix.page_hash(tip.hash, p);
                match prefix.child_of(&tip, h) {
                    Some((i, loc))
                        if !(tiered && is_host(loc))
                            && prefix.verify(i, prefix.page_tokens(p), salt, tip.reg) =>
                    {
                        Some(prefix.tip(i))
                    }
                    _ => None,
                }
            })?;
        }
        Some(tip)
    }

    /// Full pages of `row` whose every token id is known.
    pub(super) fn registrable_pages(&self, row: usize) -> usize {
        if self.requests.chain(row).broken {
            return 0;
        }
        self.requests.known_len(row).min(self.requests.len(row)) / self.geo.page_size
    }

    /// Continues `row`'s chain over its registrable pages. A page whose hash
    /// is registered already for a different page with the same content and
    /// parent is a duplicate: the existing entry stays, on this page if
    /// nobody holds its copy (see `prefix/index.rs`). An orphan of the same
    /// content gives way to the page (`orphans.rs`). Any other mismatch (a
    /// collision) stops the row's chain for good.
    fn register_row(&mut self, row: usize) {
        let upto = self.registrable_pages(row);
        let chain = self.requests.chain(row);
        if upto > chain.pages {
            self.requests.set_shared(row);
        }
        // Split borrows: the row's page list stays in hand while the index,
        // the page records and the event log change.
        let Self {
            requests,
            pages,
            prefix,
            events,
            host,
            ..
        } = self;
        let list = requests.pages(row, upto);
        let mut ring = prefix.take_hash_scratch();
        // The chain's tip and length live in locals while the row grows:
        // each page's registration starts from the one before.
        let (salt, mut tip) = (requests.salt(row), chain.tip);
        let mut k = chain.pages;
        let (mut broken, mut foreign) = (false, false);
        // Whether the tip is the entry the last page registered anew
        // (`Registered::fresh`): nothing between two pages removes one.
        let mut fresh = false;
        // The pages filed anew one after another (`prefix/runs.rs`), ended
        // before any call that may remove or relink an entry.
        let mut run = RunBuilder::default();
        let checked = walked_at(prefix, &chain);
        // The end of the pages whose records were prefetched.
        let mut fetched = 0;
        'restart: while k < upto {
            // The chain hash is serial (each page's waits on the one
            // before), so it runs a chunk of LOOKAHEAD pages ahead of the
            // registrations, in the same loop: the CPU overlaps the next
            // chunk's hashing with this page's probe and inserts instead
            // of doing one after the other. Each chunk's buckets and
            // records are prefetched together as it starts: a big index
            // misses cache and TLB on each, and those misses overlap only
            // when the prefetches are issued back to back (not one per
            // registration, as each hash comes out). Page k's hash is
            // `ring[(k - k0) % LOOKAHEAD]`, k0 being the `k` this pass
            // starts at: `slot` below, counted from 0 at each chunk's start
            // (one chunk per pass of the middle loop, so no page tests
            // whether a chunk starts at it).
            let mut last = tip.hash;
            ring.clear();
            for &p in &list[k..upto.min(k + LOOKAHEAD)] {
                last = prefix.page_hash(last, p);
                ring.push(last);
            }
            while k < upto {
                let end = upto.min(k + LOOKAHEAD);
                // A chunk starts at slot 0: its pages' hashes are ring[..].
                // Under a childless tip the chunk's pages go unkeyed
                // (`register_page`): their buckets are not read.
                let probes = !prefix.childless(&tip);
                if probes {
                    for &h in &ring[..end - k] {
                        prefix.prefetch_bucket(h);
                    }
                }
                // Records a chunk ahead, with the tokens the next chunk
                // hashes: a closing request's output pages were taken one
                // decode step at a time, scattered over the pool, and a
                // prefetch issued as the chunk starts comes too late for
                // its first pages. (The first chunk of a pass fetches its
                // own.)
                let ahead = upto.min(end + LOOKAHEAD);
                for &p in &list[fetched.clamp(k, end)..end] {
                    pages.prefetch_record(p);
                }
                for &p in &list[end..ahead] {
                    prefix.prefetch_tokens(p);
                    pages.prefetch_record(p);
                }
                fetched = ahead;
                let mut chunk = Chunk {
                    ring: &mut ring[..],
                    last,
                    start: k,
                    end,
                    refill_end: upto.saturating_sub(LOOKAHEAD),
                };
                while k < end {
                    if fresh && prefix.orphans() == 0 && pages.entry(list[k]) == 0 {
                        // The page before was registered anew, so it has
                        // no child: this unregistered page is its only one,
                        // and so are the unregistered pages after it
                        // (`file_fresh_stretch`), without the tests of
                        // `register_page_named`, which the other cases need.
                        k = file_fresh_stretch(
                            prefix, pages, events, &mut chunk, list, k, &mut tip, salt, &mut run,
                        );
                        continue;
                    }
                    let p = list[k];
                    let h = chunk.take::<false>(prefix, list, k);
                    run.end(prefix, &tip, list);
                    let parent = tip;
                    match register_page_named(
                        prefix,
                        pages,
                        events,
                        host,
                        p,
                        k == 0,
                        h,
                        &tip,
                        salt,
                        fresh,
                    ) {
                        Some(r) => {
                            debug_assert_eq!(r.named, pages.entry(p) == r.tip.entry);
                            tip = r.tip;
                            foreign |= !r.named;
                            fresh = r.fresh;
                            if fresh {
                                run.start(&parent, &tip, k);
                            }
                        }
                        None => match register_past_orphan(
                            prefix,
                            pages,
                            events,
                            host,
                            p,
                            k == 0,
                            h,
                            &tip,
                            salt,
                        ) {
                            Some(next) => {
                                tip = next;
                                foreign |= pages.entry(p) != tip.entry;
                                fresh = false;
                            }
                            None => {
                                broken = true;
                                break 'restart;
                            }
                        },
                    }
                    k += 1;
                    if tip.hash != h {
                        // The tip is an entry found under this hash's key whose
                        // own hash differs (only a test's weak hash gets here):
                        // chain the rest on from the entry, as a lookup would.
                        continue 'restart;
                    }
                }
                last = chunk.last;
            }
        }
        run.end(prefix, &tip, list);
        prefix.put_hash_scratch(ring);
        self.requests
            .set_chain(row, k, tip, broken, foreign, checked);
        if k > chain.pages && self.writes_through() {
            self.write_through(row, chain.pages, k);
        }
    }
}

/// The removal count to note for a chain that `register_row` (or the
/// grouped allocator's recording of it) extends, read before it registers
/// anything. A chain already through another's entry keeps its note: a
/// removal later in the same batch (another row's write-through evicting a
/// host-only entry, before this row's turn) may have taken that entry, and
/// noting the count after it would hide it from the next `cache()`. A chain
/// of the row's own entries (held by it) is intact now, and the entries it
/// chains through from here are live when chained, so any later removal
/// moves the count past this one.
pub(super) fn walked_at(prefix: &PrefixIndex, chain: &Chain) -> u32 {
    if chain.foreign {
        chain.checked
    } else {
        prefix.removals()
    }
}
