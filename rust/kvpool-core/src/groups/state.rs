//! A state group (linear attention, Mamba): one state slot per open
//! request, overwritten each step, and checkpoints of it for prefix hits.
//!
//! Slots reuse the page pool (`pages/`) with one slot per page: a request's
//! live slot is HELD, a checkpoint is a registered slot, CACHED (evicted
//! LRU) unless a queued copy reads it, and slot 0 is reserved (the padding
//! sink). Checkpoints are filed by the anchor chain's registration id at
//! their position (`regmap.rs`), so a checkpoint at L serves exactly the
//! prompts whose first L tokens verified against that chain.
//!
//! The core never moves state: every slot that must change content gets a
//! queued copy (`copies.rs`), taken with `take_copies` and run before the
//! next step, like copy-on-write pages. A new request's slot is queued from
//! -1 (zero it), a fork's or a hit's from the parent's slot or the
//! checkpoint, a checkpoint from the live slot.

use crate::error::Result;
use crate::memory::zeroed_vec;
use crate::pages::PagePool;

use super::copies::StateCopies;
use super::regmap::RegMap;

#[derive(Debug, Clone)]
pub(crate) struct StateEngine {
    pub(super) slots: PagePool,
    pub(super) map: RegMap,
    /// Per row: its live slot (0: no open request).
    live: Vec<u32>,
    /// Checkpoints are taken at multiples of this many tokens.
    pub(super) every: usize,
    pub(super) copies: StateCopies,
    /// Slots, the reserved slot 0 included.
    num_slots: usize,
}

impl StateEngine {
    pub(crate) fn new(num_slots: usize, every: usize, max_requests: usize) -> Result<Self> {
        Ok(StateEngine {
            slots: PagePool::new(num_slots, false)?,
            map: RegMap::new(num_slots)?,
            live: zeroed_vec(max_requests, "state rows")?,
            every,
            copies: StateCopies::new(num_slots)?,
            num_slots,
        })
    }

    #[inline]
    pub(crate) fn live(&self, row: usize) -> u32 {
        self.live[row]
    }

    /// Slots a call can take now: FREE + CACHED checkpoints.
    #[inline]
    pub(crate) fn available(&self) -> usize {
        self.slots.available()
    }

    /// A slot for a new holder: FREE first, else the LRU checkpoint, which
    /// leaves the index (a copy still waiting to fill it is dropped). The
    /// caller checked `available()`.
    fn take_slot(&mut self) -> u32 {
        if let Some(s) = self.slots.pop_free() {
            return s;
        }
        match self.slots.pop_victim() {
            Some(s) => {
                self.slots.take_entry(s);
                self.map.remove_page(s);
                self.slots.hold_evicted(s);
                self.copies.drop_into(&mut self.slots, s);
                s
            }
            None => 0,
        }
    }

    /// Room for `n` more queued copies.
    pub(crate) fn prepare(&mut self, n: usize) -> Result<()> {
        self.copies.prepare(n)
    }

    /// A new request in `row`: a fresh slot, zeroed before its first step.
    pub(crate) fn open_row(&mut self, row: usize) {
        let s = self.take_slot();
        self.live[row] = s;
        self.copies.queue(&mut self.slots, -1, s);
    }

    /// `row` closes: its slot is let go (a copy still waiting to fill it is
    /// dropped; one still reading it keeps it until taken).
    pub(crate) fn close_row(&mut self, row: usize) {
        let s = std::mem::replace(&mut self.live[row], 0);
        if s != 0 && self.slots.release_one(s) {
            self.copies.drop_into(&mut self.slots, s);
        }
    }

    /// `child` starts as a copy of `parent`'s state.
    pub(crate) fn fork_row(&mut self, parent: usize, child: usize) {
        let s = self.take_slot();
        self.live[child] = s;
        let src = self.live[parent] as i64;
        self.copies.queue(&mut self.slots, src, s);
    }

    /// Whether restoring `row` needs a fresh slot: a queued copy still
    /// reads its live slot, which must keep its content until taken.
    pub(crate) fn restore_needs_slot(&self, row: usize) -> bool {
        self.copies.reading(self.live[row]) > 0
    }

    /// `row`'s state becomes checkpoint `from` (-1: the empty state).
    pub(crate) fn restore(&mut self, row: usize, from: i64) {
        let s = self.live[row];
        if self.copies.reading(s) > 0 {
            let fresh = self.take_slot();
            self.copies.queue(&mut self.slots, from, fresh);
            self.live[row] = fresh;
            self.slots.release_one(s);
        } else {
            self.copies.drop_into(&mut self.slots, s);
            self.copies.queue(&mut self.slots, from, s);
        }
    }

    /// Holds slot `s` for the length of a call (a hit's checkpoint, so that
    /// taking slots for the batch cannot evict it).
    pub(crate) fn pin(&mut self, s: u32) {
        self.slots.hold(&[s]);
    }

    /// Lets go of a `pin`.
    pub(crate) fn unpin(&mut self, s: u32) {
        self.slots.release_one(s);
    }

    /// A request opened on a hit: a fresh slot filled from checkpoint
    /// `from` (-1: the empty state).
    pub(crate) fn start_hit(&mut self, row: usize, from: i64) {
        let s = self.take_slot();
        self.live[row] = s;
        self.copies.queue(&mut self.slots, from, s);
    }

    /// The checkpoint of the state at the position whose anchor entry is
    /// `reg`, if this group keeps one there.
    #[inline]
    pub(crate) fn checkpoint(&self, reg: u64) -> Option<u32> {
        self.map.get(reg)
    }

    /// Keeps a checkpoint of `row`'s state under `reg` unless one is there
    /// already or no slot is free or evictable (a checkpoint is a cache
    /// entry, never worth refusing a call for). Room in the index was made.
    pub(crate) fn take_checkpoint(&mut self, row: usize, reg: u64) {
        if self.map.get(reg).is_some() || self.available() == 0 {
            return;
        }
        let c = self.take_slot();
        self.slots.set_entry(c, 1);
        self.map.insert(reg, c);
        let src = self.live[row] as i64;
        self.copies.queue(&mut self.slots, src, c);
        // Registered and held by nobody: CACHED, an eviction candidate.
        self.slots.release_one(c);
    }

    /// Evicts up to `n` CACHED checkpoints, LRU first; returns how many.
    pub(crate) fn evict(&mut self, n: usize) -> usize {
        let mut k = 0;
        while k < n {
            let Some(s) = self.slots.pop_victim() else {
                break;
            };
            self.slots.take_entry(s);
            self.map.remove_page(s);
            self.slots.free_evicted(s);
            self.copies.drop_into(&mut self.slots, s);
            k += 1;
        }
        k
    }

    /// Drops every checkpoint: CACHED ones become FREE; one a queued copy
    /// reads stays held until taken, then goes FREE.
    pub(crate) fn clear(&mut self) {
        self.evict(usize::MAX);
        let held: Vec<u32> = self.map.entries().map(|(_, s)| s).collect();
        for s in held {
            self.slots.take_entry(s);
            self.map.remove_page(s);
        }
    }

    /// Drains the queued copies: `(src, dst)` slot ids in queue order; a
    /// source of -1 means "zero the destination".
    pub(crate) fn take_copies(&mut self) -> (Vec<i64>, Vec<i64>) {
        self.copies.take(&mut self.slots)
    }

    pub(crate) fn pending_copies(&self) -> usize {
        self.copies.len()
    }

    pub(crate) fn capacity_bytes(&self) -> usize {
        self.slots.capacity_bytes()
            + self.map.capacity_bytes()
            + self.live.capacity() * 4
            + self.copies.capacity_bytes()
    }

    /// This group's invariants, given the open rows: one live slot each,
    /// held; every slot's holder count is its row plus the copies reading
    /// it; checkpoints and index agree; the copy queue's own rules.
    pub(crate) fn check(&self, open: &[bool]) -> std::result::Result<(), String> {
        let n = self.num_slots;
        let mut holders = vec![0u32; n];
        let mut live = vec![false; n];
        for (row, &s) in self.live.iter().enumerate() {
            let open = open[row];
            if open != (s != 0) {
                return Err(format!("row {row} (open {open}) has live state slot {s}"));
            }
            if s as usize >= n {
                return Err(format!("row {row} has out-of-range state slot {s}"));
            }
            if s != 0 {
                holders[s as usize] += 1;
                live[s as usize] = true;
                if self.map.reg_of(s) != 0 {
                    return Err(format!("row {row}'s live slot {s} is a checkpoint"));
                }
            }
        }
        self.copies.check(&mut holders, |s| {
            live[s as usize] || self.map.reg_of(s) != 0
        })?;
        // Copies are this engine's, not the pool's: its own queue is empty.
        self.slots.check(holders, 2)?;
        self.map.check(|s| self.slots.is_registered(s))
    }
}
