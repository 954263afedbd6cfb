//! Retention priorities: `cache_with_priority` / `close_with_priority` give
//! the pages of each request's cached prefix a priority (0..=100, for a
//! duration or for good), `unpin` takes pins back, `set_clock` moves a
//! manual clock. What a priority does is the eviction room's
//! (`eviction/retention.rs`); this file finds the pages, which crosses the
//! requests, the prefix index and the page pool.
//!
//! A request's cached prefix is its leading pages whose chain `cache`
//! walked: each is the request's own page where that is registered, or,
//! where it duplicated content cached already and the index kept the
//! existing copy (another holder had it), that copy, found by the same
//! verified lookup a prefix hit makes.

use super::options::Counts;
use super::SlotAllocator;
use crate::clock::duration_ns;
use crate::error::{PoolError, Result};
use crate::eviction::MAX_PRIORITY;
use crate::handle::handle_row;
use crate::location::is_host;
use crate::memory::reserve;
use crate::prefix::tip::ChainTip;

/// Pages to give a priority to, with the priority, in order.
type Targets = Vec<(u32, u8)>;

impl SlotAllocator {
    /// Like [`Self::cache`], then gives every page of each request's cached
    /// prefix priority `priority` (one for all, or one per request; 0..=100),
    /// for `retain_s` seconds on the pool's clock (None: until changed).
    /// Eviction takes the lowest priority first, least recently used within
    /// one; a page no caller gave a priority has `DEFAULT_PRIORITY`. A page
    /// keeps the highest priority callers gave it (at equal priority, the
    /// later end); when its duration ends it has the default again.
    /// Priority 100 with no duration pins the page: it is never evicted
    /// (and not counted free) until `unpin` or `clear_cache`; past
    /// `max_pinned_pages` pinned pages, a pin is given as 99 instead. Pages
    /// are taken request by request, each prefix from its first page.
    /// All-or-nothing.
    ///
    /// Errors: `InvalidHandle`, `RequestSwappedOut`, `InvalidArgument` (a
    /// handle twice, a priority outside [0, 100] or of the wrong length, `retain_s` not in
    /// (0, 1e9]; the index cannot grow).
    pub fn cache_with_priority(
        &mut self,
        handles: &[i64],
        priority: Counts<'_>,
        retain_s: Option<f64>,
    ) -> Result<()> {
        self.resolve_resident_batch(handles)?;
        let (dur, mut targets) = self.prepare_priorities(handles, priority, retain_s)?;
        self.register_batch(handles)?;
        self.give_priorities(handles, priority, dur, &mut targets);
        Ok(())
    }

    /// `close(handles, cache=true)` with the priorities of
    /// [`Self::cache_with_priority`]: the pages are given them before they
    /// are released. All-or-nothing.
    ///
    /// Errors: `InvalidHandle`, `RequestSwappedOut`, `InvalidArgument` (as
    /// `cache_with_priority`).
    pub fn close_with_priority(
        &mut self,
        handles: &[i64],
        priority: Counts<'_>,
        retain_s: Option<f64>,
    ) -> Result<()> {
        self.cache_with_priority(handles, priority, retain_s)?;
        for &h in handles {
            self.close_row(handle_row(h) as usize);
        }
        Ok(())
    }

    /// Gives every pinned page of each request's cached prefix the default
    /// priority (cached ones become evictable at once); returns how many
    /// pages were unpinned. A pinned prefix no open request holds is
    /// reached by opening one on it (`open_with_prefix`). All-or-nothing.
    ///
    /// Errors: `InvalidHandle`, `InvalidArgument` (a handle twice),
    /// `RequestSwappedOut`.
    pub fn unpin(&mut self, handles: &[i64]) -> Result<usize> {
        self.resolve_resident_batch(handles)?;
        if self.pages.pinned() == 0 {
            return Ok(0);
        }
        let mut targets = Vec::new();
        reserve(&mut targets, self.prefix_bound(handles), "pages to unpin")?;
        for &h in handles {
            self.cached_prefix(handle_row(h) as usize, 0, &mut targets);
        }
        Ok(targets
            .iter()
            .filter(|&&(p, _)| self.pages.unpin(p))
            .count())
    }

    /// Resolves the batch and refuses swapped-out requests: their page
    /// lists name host pages, and priorities are the device's.
    fn resolve_resident_batch(&mut self, handles: &[i64]) -> Result<()> {
        self.requests.resolve_batch(handles)?;
        for &h in handles {
            self.requests.check_resident(handle_row(h) as usize, h)?;
        }
        Ok(())
    }

    /// Sets the manual clock to `now_s` seconds and ends the priorities
    /// whose duration is over by then (soonest first).
    ///
    /// Errors: `InvalidArgument` (the pool runs on the system clock; a time
    /// that is not finite, is negative, past 1e9 or earlier than the clock's).
    pub fn set_clock(&mut self, now_s: f64) -> Result<()> {
        self.clock.set(now_s)?;
        self.expire_due();
        Ok(())
    }

    /// The pool's clock in seconds: since construction (the system clock),
    /// or as last set (a manual clock, from 0).
    pub fn clock(&self) -> f64 {
        self.clock.now() as f64 / 1e9
    }

    /// Registered pages that are pinned (held or cached); at most
    /// `max_pinned_pages`.
    pub fn pinned_pages(&self) -> usize {
        self.pages.pinned()
    }

    /// Most registered pages that may be pinned at once.
    pub fn max_pinned_pages(&self) -> usize {
        self.pages.max_pinned()
    }

    /// Evictable pages (cached, not pinned) at each priority 0..=100, as
    /// last filed: a duration that is over moves its page when the clock is
    /// next read (a victim sought, a priority given, the clock set).
    pub fn evictable_pages_by_priority(&self) -> [usize; MAX_PRIORITY as usize + 1] {
        self.pages.evictable_by_priority()
    }

    /// Ends the priorities whose duration is over. Reads the clock only
    /// when some duration is pending.
    #[inline]
    pub(super) fn expire_due(&mut self) {
        if self.pages.has_priority_ends() {
            let now = self.clock.now();
            self.pages.expire_priorities(now);
        }
    }

    /// The checks of the priority calls and the room they need, before
    /// anything changes: the priorities, the duration (as nanoseconds), the
    /// per-page priority arrays (the first time) and room for the pages'
    /// ends and for the list of pages to give priorities to.
    fn prepare_priorities(
        &mut self,
        handles: &[i64],
        priority: Counts<'_>,
        retain_s: Option<f64>,
    ) -> Result<(Option<u64>, Targets)> {
        priority.check_len("priority", handles.len())?;
        let each;
        let given = match priority {
            Counts::Each(q) => {
                each = [q];
                &each[..]
            }
            Counts::PerRequest(v) => v,
        };
        for (i, &q) in given.iter().enumerate() {
            if !(0..=MAX_PRIORITY as i64).contains(&q) {
                let at = match priority {
                    Counts::Each(_) => String::new(),
                    Counts::PerRequest(_) => format!("[{i}]"),
                };
                return Err(PoolError::InvalidArgument(format!(
                    "priority{at} = {q} is out of range: a retention priority is an int in \
                     [0, {MAX_PRIORITY}] (higher is kept longer; {MAX_PRIORITY} with no \
                     retain_s pins)"
                )));
            }
        }
        let dur = retain_s.map(duration_ns).transpose()?;
        let bound = self.prefix_bound(handles);
        let mut targets = Vec::new();
        reserve(&mut targets, bound, "pages to give priorities to")?;
        self.pages.use_priorities()?;
        if dur.is_some() {
            self.pages.reserve_priority_ends(bound)?;
        }
        Ok((dur, targets))
    }

    /// Gives the pages of each request's cached prefix its priority (the
    /// handles are resolved, registration done).
    fn give_priorities(
        &mut self,
        handles: &[i64],
        priority: Counts<'_>,
        dur: Option<u64>,
        targets: &mut Targets,
    ) {
        self.expire_due();
        let end = dur.map(|d| self.clock.now().saturating_add(d));
        for (i, &h) in handles.iter().enumerate() {
            self.cached_prefix(handle_row(h) as usize, priority.get(i) as u8, targets);
        }
        for &(p, q) in targets.iter() {
            self.pages.raise_priority(p, q, end);
        }
    }

    /// At most how many pages the requests' cached prefixes hold: their
    /// full pages.
    fn prefix_bound(&self, handles: &[i64]) -> usize {
        handles
            .iter()
            .map(|&h| self.requests.len(handle_row(h) as usize) / self.geo.page_size)
            .sum()
    }

    /// Pushes `(page, q)` for each page of `row`'s cached prefix (see the
    /// module docs), in order; stops where a duplicated page's copy is gone
    /// from the device.
    fn cached_prefix(&self, row: usize, q: u8, out: &mut Targets) {
        let n = self.requests.chain(row).pages;
        let salt = self.requests.salt(row);
        let mut at = ChainTip::root(salt);
        for &p in self.requests.pages(row, n) {
            let (page, tip) = match self.prefix.tip_at(self.pages.entry(p)) {
                Some((tip, _)) => (p, tip),
                None => {
                    let h = self.prefix.page_hash(at.hash, p);
                    match self.prefix.child_of(&at, h) {
                        // A copy only on the host tier is gone from the
                        // device, where priorities apply.
                        Some((i, copy))
                            if !is_host(copy)
                                && self.prefix.verify(
                                    i,
                                    self.prefix.page_tokens(p),
                                    salt,
                                    at.reg,
                                ) =>
                        {
                            (copy, self.prefix.tip(i))
                        }
                        _ => break,
                    }
                }
            };
            out.push((page, q));
            at = tip;
        }
    }
}
