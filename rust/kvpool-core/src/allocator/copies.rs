//! Copy-on-write, the allocator's side: the calls that hand queued copies
//! to the caller, and the end of a call that queued some. The queue and
//! the holds its copies put on pages are the pool's (`pages/copies.rs`).

use super::SlotAllocator;

impl SlotAllocator {
    /// The end of a call that queued runs `from..`: each holds its source
    /// page from now on, and a request whose partly filled last page is one
    /// of them (only requests this call grew can have left the slow path
    /// since the page was shared) must copy it before writing.
    pub(super) fn hold_copy_sources(
        &mut self,
        from: usize,
        grown_rows: impl Iterator<Item = usize>,
    ) {
        self.pages.hold_copy_sources(from);
        for row in grown_rows {
            let (len, last, _) = self.requests.tail(row);
            if self.needs_slow(row, len, last) {
                self.requests.mark_slow(row);
            }
        }
    }

    /// Drains the queued copy-on-write copies: `(src_slots, dst_slots)`.
    /// Run them (every layer's K and V, slot `src[i]` to `dst[i]`, in
    /// order) before the next write to the destination pages; each source
    /// page stays held until its copy is taken here, so nothing reuses it
    /// while the copy waits. `KVPool.extend` runs them itself. A copy whose
    /// destination page was released (its requests closed or truncated
    /// past it, or `reset`) is gone: the queue holds at most one copy of
    /// fewer than `page_size` slots per held page, however long it is left
    /// undrained. It keeps its capacity (like the event log), so draining it
    /// every step does not regrow it.
    pub fn take_copies(&mut self) -> (Vec<i64>, Vec<i64>) {
        self.take_copies_from(0)
    }

    /// Drains the queued copies from index `from` on (those a caller saw
    /// being queued: `pending_copies()` before the call), leaving earlier
    /// ones queued, their source pages still held.
    pub fn take_copies_from(&mut self, from: usize) -> (Vec<i64>, Vec<i64>) {
        self.pages.take_copies_from(from, self.geo.page_size)
    }

    /// [`Self::take_copies_from`], handing each (source, destination) slot
    /// pair to `each` in queue order instead of collecting them, so that it
    /// allocates nothing: for a caller that made room for them before the
    /// call that queued them.
    pub fn drain_copies_from(&mut self, from: usize, each: impl FnMut(i64, i64)) {
        self.pages.drain_copies_from(from, self.geo.page_size, each)
    }

    /// Queued copy-on-write copies (slot pairs) not yet taken.
    pub fn pending_copies(&self) -> usize {
        self.pages.pending_copies()
    }
}
