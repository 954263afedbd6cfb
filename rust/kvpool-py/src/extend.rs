//! The extend family of `SlotAllocator`: extend (optionally writing a
//! caller's int32 table), extend_with_starts, and extend_packed (everything a
//! device request-to-token table needs, in one array). Each takes optional
//! token ids and can report copy-on-write work in one `cow` array:
//! `[rows | positions | src_slots | dst_slots]` (m each, one entry per moved
//! position), so the torch layer can copy the K/V and fix its table.

use kvpool_core::{Grown, SlotAllocator};
use pyo3::prelude::*;

use crate::allocator::PySlotAllocator;
use crate::caller_out::CallerOut;
use crate::convert::counts_of;
use crate::convert::{int_arg, CowFlag, IntArg};
use crate::errors::Result;
use crate::handles_arg::Handles;
use crate::output::Arr;
use crate::output::{extend_total, new_i64, vec_with_room, Bounded, OutBuf};
use crate::packed::PackedHead;
use crate::table::Table;
use crate::token_ids::TokenIds;

/// The copy-on-write work one extend queued, one `[row, position, src,
/// dst]` per moved position, in queue order; returned as `[rows |
/// positions | src | dst]`.
///
/// Everything it fills is allocated before the call (`PySlotAllocator::
/// moved_room`): the call takes the copies off the queue, so a MemoryError
/// (or an abort on a failed Rust allocation) after it would lose them.
struct Moved {
    each: Vec<[i64; 4]>,
}

impl Moved {
    fn note(&mut self, g: &Grown<'_>) {
        for j in 0..g.moved {
            self.each
                .push([g.row as i64, (g.start - g.moved + j) as i64, 0, 0]);
        }
    }

    /// Takes this call's copies off the queue (`queued_before`: the queue's
    /// length before the call), the moved positions' in the same order.
    /// Runs with the GIL released.
    fn take(&mut self, core: &mut SlotAllocator, queued_before: usize) {
        if self.each.is_empty() {
            return;
        }
        let mut k = 0;
        let each = &mut self.each;
        core.drain_copies_from(queued_before, |s, d| {
            if let Some(e) = each.get_mut(k) {
                e[2] = s;
                e[3] = d;
            }
            k += 1;
        });
        debug_assert_eq!(k, each.len(), "one copy per moved position");
    }

    /// The result array, in `room`; None when nothing moved.
    fn finish<'py>(self, room: Bounded<'py, i64>) -> PyResult<Option<Arr<'py, i64>>> {
        if self.each.is_empty() {
            return Ok(None);
        }
        room.fill_columns(&self.each).map(Some)
    }
}

impl PySlotAllocator {
    /// Room for the copy-on-write work of an extend of `n` requests. A
    /// request moves at most the filled part of its last page (`page_size -
    /// 1` positions), and a call that can succeed names at most
    /// `max_requests` requests.
    fn moved_room<'py>(&self, py: Python<'py>, n: usize) -> PyResult<(Bounded<'py, i64>, Moved)> {
        let most = n.min(self.max_requests) * (self.page_size - 1);
        let moved = Moved {
            each: vec_with_room(most)?,
        };
        Ok((Bounded::new(py, 4 * most)?, moved))
    }
}

/// The optional `tokens=` of extend and admit, copied as `TokenIds` copies
/// them (one memcpy for an int64 array).
pub(crate) fn tokens_arg(
    py: Python<'_>,
    tokens: Option<&Bound<'_, PyAny>>,
) -> Result<Option<TokenIds>> {
    Ok(match tokens {
        None => None,
        Some(t) => Some(TokenIds::extract(py, t)?),
    })
}

/// Where extend's slots go: a fresh result array, or the caller's `out=`.
pub(crate) enum Dest {
    Fresh(OutBuf),
    Caller(CallerOut),
}

impl Dest {
    /// The destination of `total` slots: the caller's `out` (validated,
    /// and checked not to overlap `table`), or a fresh array, returned too.
    pub(crate) fn new<'py>(
        py: Python<'py>,
        out: Option<&Bound<'py, PyAny>>,
        total: usize,
        table: Option<&Table>,
    ) -> Result<(Option<Arr<'py, i64>>, Dest)> {
        let avoid = table.map(|t| t.byte_range());
        Ok(match out {
            Some(o) => (
                None,
                Dest::Caller(CallerOut::validate(py, o, total, avoid)?),
            ),
            None => {
                let (arr, buf) = new_i64(py, total)?;
                (Some(arr), Dest::Fresh(buf))
            }
        })
    }

    /// Runs `apply` on the destination's buffer (the caller's `out` is
    /// written only if it succeeds).
    pub(crate) fn apply<R>(
        &mut self,
        apply: impl FnOnce(&mut [i64]) -> kvpool_core::Result<R>,
    ) -> kvpool_core::Result<R> {
        match self {
            Dest::Caller(o) => o.fill(apply),
            // SAFETY: the fresh array is alive and not yet shared (see OutBuf).
            Dest::Fresh(buf) => apply(unsafe { buf.slice() }),
        }
    }

    /// What the call returns for its slots: the fresh array, or `out` itself.
    pub(crate) fn result<'py>(
        py: Python<'py>,
        fresh: Option<Arr<'py, i64>>,
        out: Option<&Bound<'py, PyAny>>,
    ) -> Bound<'py, PyAny> {
        match (fresh, out) {
            (Some(arr), _) => arr.into_any(),
            (None, Some(o)) => o.clone(),
            (None, None) => py.None().into_bound(py),
        }
    }
}

/// One extend on the core: the slots into `dst`, the table (if any) filled,
/// and with `moved` the copy-on-write work this call queued taken into it.
fn extend_call(
    core: &mut SlotAllocator,
    handles: &[i64],
    counts: &IntArg,
    tokens: Option<&[i64]>,
    table: Option<&Table>,
    mut moved: Option<&mut Moved>,
    dst: &mut [i64],
) -> kvpool_core::Result<()> {
    let before = core.pending_copies();
    // SAFETY: validated by `table_arg` (int32, rows contiguous, writeable,
    // at least [max_requests, max_context_len]); the caller's array object
    // is referenced for the whole call, so its buffer stays alive.
    let mut view = table.map(|t| unsafe { t.view() });
    core.extend_into_table(
        handles,
        counts_of(counts),
        tokens,
        dst,
        view.as_mut(),
        |g| {
            if let Some(m) = moved.as_deref_mut() {
                m.note(g);
            }
        },
    )?;
    if let Some(m) = moved {
        m.take(core, before);
    }
    Ok(())
}

#[pymethods]
impl PySlotAllocator {
    /// extend(handles, counts, table=None, tokens=None, cow=False, out=None) -> slots | (slots, cow)
    ///
    /// Grows each request by counts[i] tokens (or `counts` for all); a new page
    /// is taken only when a request's last page is full (FREE pages first,
    /// then the least recently used cached page). Atomic.
    ///
    /// Args:
    ///     handles: int, sequence or 1-D integer array of open handles (no duplicates).
    ///     counts: int (for all) or one int per handle, >= 0.
    ///     table: optional int32 2-D numpy array [>= max_requests, >= max_context_len]
    ///         (e.g. req_to_token.numpy()): table[row, start:start+count] gets each
    ///         request's new slots in the same call (and the new slots of
    ///         positions a copy-on-write moved).
    ///     tokens: optional token ids of the new positions, flattened like the
    ///         slots (one per new position, in [0, 2^31)). Positions covered by
    ///         the prompt given to open_with_prefix take its ids (given ids must
    ///         agree); positions without ids make their pages uncacheable.
    ///     cow: also return the copy-on-write work of this call: None, or an
    ///         int64 array [rows | positions | src_slots | dst_slots] (m each).
    ///         Without cow=True the copies stay queued for take_copies().
    ///     out: optional writeable, contiguous 1-D int64 numpy array with room for
    ///         every new slot (sum(counts), or counts * len(handles) for one count),
    ///         kept from call to call so that a step allocates nothing: the new
    ///         slots go to out[:n] and the rest of out is left as it was. Written
    ///         only if the call succeeds.
    ///     table and out are written in place, possibly with the GIL released: no
    ///     other thread may resize or free them (or their torch owner) during the
    ///     call, as with any buffer handed to native code.
    ///
    /// Returns:
    ///     the new slots, flattened in request order (int64), as a new array;
    ///     with out=, out itself (the whole buffer: the slots are its first n
    ///     entries). With cow=True, (slots, cow).
    ///
    /// Raises:
    ///     InvalidHandleError: a handle is unknown, closed or stale.
    ///     RequestSwappedOutError: a request is swapped out (swap_in first).
    ///     PoolExhaustedError: not enough free or evictable pages (needed vs free).
    ///     ContextTooLongError: a request would pass max_context_len.
    ///     InvalidArgumentError: negative count, mismatched lengths, duplicate
    ///         handle, bad table, tokens of the wrong length or range, or
    ///         disagreeing with the prompt, or an out array that is too short,
    ///         not contiguous int64, read-only or overlapping the table.
    ///         Nothing changes on any error.
    #[pyo3(
        signature = (handles, counts, table=None, tokens=None, cow=CowFlag(false), out=None),
        text_signature = "($self, handles, counts, table=None, tokens=None, cow=False, out=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn extend<'py>(
        &self,
        py: Python<'py>,
        handles: &Bound<'py, PyAny>,
        counts: &Bound<'py, PyAny>,
        table: Option<&Bound<'py, PyAny>>,
        tokens: Option<&Bound<'py, PyAny>>,
        cow: CowFlag,
        out: Option<&Bound<'py, PyAny>>,
    ) -> Result<Py<PyAny>> {
        let cow = cow.0;
        let h = Handles::new(py, handles)?;
        let c = int_arg(py, counts, "counts")?;
        let toks = tokens_arg(py, tokens)?;
        // Validated fully before any change; `table` and `out` (borrowed
        // from the caller) keep their arrays alive while they are written.
        let t = self.table_arg(py, table)?;
        let n = h.len();
        let total = extend_total(n, &c, self.num_slots, self.max_context_len);
        let (fresh, mut dest) = Dest::new(py, out, total, t.as_ref())?;
        let (room, mut moved) = match cow {
            true => self.moved_room(py, n).map(|(r, m)| (Some(r), Some(m)))?,
            false => (None, None),
        };
        self.run_on(py, h, n.max(total), |core, h| {
            dest.apply(|dst| {
                extend_call(
                    core,
                    h,
                    &c,
                    toks.as_deref(),
                    t.as_ref(),
                    moved.as_mut(),
                    dst,
                )
            })
        })??;
        let result = Dest::result(py, fresh, out);
        if !cow {
            return Ok(result.unbind());
        }
        let cow_arr = match (room, moved) {
            (Some(room), Some(moved)) => moved.finish(room)?,
            _ => None,
        };
        Ok((result, cow_arr).into_pyobject(py)?.into_any().unbind())
    }

    /// extend_with_starts(handles, counts) -> (slots, starts)
    ///
    /// extend, also returning each request's length before the call (int64).
    ///
    /// Raises:
    ///     the same errors as extend; nothing changes on any error.
    fn extend_with_starts<'py>(
        &self,
        py: Python<'py>,
        handles: &Bound<'py, PyAny>,
        counts: &Bound<'py, PyAny>,
    ) -> Result<(Arr<'py, i64>, Arr<'py, i64>)> {
        let h = int_arg(py, handles, "handles")?.into_vec();
        let c = int_arg(py, counts, "counts")?;
        let (arr, mut out) = new_i64(
            py,
            extend_total(h.len(), &c, self.num_slots, self.max_context_len),
        )?;
        let (starts_arr, mut starts) = new_i64(py, h.len())?;
        py.detach(|| {
            // SAFETY: both arrays are alive and not yet shared (see OutBuf).
            let (dst, st) = unsafe { (out.slice(), starts.slice()) };
            self.lock().extend_into(&h, counts_of(&c), None, dst, |g| {
                // index < handles.len() == st.len(); get_mut keeps it panic-free.
                if let Some(s) = st.get_mut(g.index) {
                    *s = g.start as i64;
                }
            })
        })?;
        Ok((arr, starts_arr))
    }

    /// extend_packed(handles, counts, tokens=None) -> (packed, b, cow)
    ///
    /// `extend` plus everything a device copy of the request-to-token table
    /// needs, in one crossing and one int64 array, so that one host-to-device
    /// copy ships it: b = the number of requests and s = b rounded up to
    /// even, packed = [rows | starts | counts | offsets] (each s long, the
    /// padding zero) followed by the new slots. Every segment starts 16-byte
    /// aligned (Triton specializes pointers on it). `cow` is None, or the
    /// copy-on-write work as in extend(cow=True) (the table entries of the
    /// moved positions are not in `packed`: write them from `cow`).
    ///
    /// Raises:
    ///     the same errors as extend; nothing changes on any error.
    #[pyo3(signature = (handles, counts, tokens=None))]
    fn extend_packed<'py>(
        &self,
        py: Python<'py>,
        handles: &Bound<'py, PyAny>,
        counts: &Bound<'py, PyAny>,
        tokens: Option<&Bound<'py, PyAny>>,
    ) -> Result<(Arr<'py, i64>, usize, Option<Arr<'py, i64>>)> {
        let h = Handles::new(py, handles)?;
        let c = int_arg(py, counts, "counts")?;
        let toks = tokens_arg(py, tokens)?;
        let b = h.len();
        let total = extend_total(b, &c, self.num_slots, self.max_context_len);
        let (arr, mut out) = new_i64(py, PackedHead::len(b) + total)?;
        let (room, mut moved) = self.moved_room(py, b)?;
        self.run_on(py, h, b.max(total), |core, h| -> kvpool_core::Result<()> {
            // SAFETY: `arr` is alive and not yet shared (see OutBuf).
            let (mut head, dst) = PackedHead::split(unsafe { out.slice() }, b);
            let before = core.pending_copies();
            core.extend_into(h, counts_of(&c), toks.as_deref(), dst, |g| {
                head.note(g);
                moved.note(g);
            })?;
            moved.take(core, before);
            Ok(())
        })??;
        Ok((arr, b, moved.finish(room)?))
    }
}
