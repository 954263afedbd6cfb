//! `encode_kv_events`: drained KV events (the arrays `take_events` returns)
//! as one msgpack `KVEventBatch` in vLLM's schema, the payload of one ZMQ
//! message of `kvpool.events.ZmqEventPublisher`.
//!
//! Why native: a publisher runs every scheduler step, and building one
//! Python object per event (or a dozen numpy calls per batch) costs tens of
//! microseconds for a typical step's few dozen events; here a batch is one
//! pass over the arrays.
//!
//! Mapping (docs/events-and-metrics.md has the full table):
//! - consecutive Stored events of one chain (each one's parent is the event
//!   before, same salt, medium and group) become one `BlockStored` whose
//!   `block_hashes` are the pages' 16-byte big-endian hashes, whose
//!   `parent_block_hash` is the first page's parent (nil at a chain's root)
//!   and whose `token_ids` are the pages' tokens; `block_size` is the page's
//!   token count; a non-zero salt becomes `extra_keys = [[str(salt)]] * pages`;
//! - consecutive Removed events of one medium and group become one
//!   `BlockRemoved`; a Cleared event is an `AllBlocksCleared`;
//! - `medium` is "GPU" unless the arrays carry a `medium` code per event
//!   (0 GPU, 1 CPU, 2 STORAGE; `take_events` carries the core's: 0 device,
//!   1 host); `group_idx` is omitted unless they carry a `group_idx` per
//!   event (negative: omitted);
//! - with `int_block_hashes`, every hash (and parent hash) is vLLM's int
//!   form instead: the low 64 bits of the 16-byte big-endian hash, an
//!   unsigned int, as vLLM sends by default (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`)
//!   and as consumers typed against it (SGLang's event classes, routers
//!   that key blocks by u64) decode.

use numpy::PyUntypedArrayMethods;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::allocator::PySlotAllocator;
use crate::convert::IntBlockHashesFlag;
use crate::errors::invalid_argument;
use crate::kv_events_args::{item, optional, owned, slice, Borrowed, KEYS};
use crate::kv_events_wire::{batch, Arrays, Fail};

/// Batches of more events than this are encoded with the GIL released.
const DETACH_EVENTS: usize = 4096;

/// encode_kv_events(events, ts, data_parallel_rank=None, int_block_hashes=False) -> tuple[bytes, int, int, int]
///
/// Encodes drained KV events (the dict take_events returns) as one msgpack
/// KVEventBatch in vLLM's schema (vllm/distributed/kv_events.py): the
/// payload a ZmqEventPublisher sends. Consecutive Stored events of one
/// chain become one BlockStored, consecutive Removed events one
/// BlockRemoved. Optional per-event arrays "medium" (0 GPU, 1 CPU,
/// 2 STORAGE; "GPU" without it) and "group_idx" (omitted without it or
/// where negative) are used when present. With int_block_hashes, block
/// hashes are sent as vLLM's int form (the low 64 bits of the 16-byte
/// big-endian hash, unsigned), which vLLM sends by default, instead of
/// the 16 bytes.
///
/// Returns:
///     (payload, stored, removed, cleared): the msgpack bytes, and how many
///     pages the Stored and Removed events name and how many Cleared events
///     there are.
///
/// Raises:
///     InvalidArgumentError: a missing or mistyped array, arrays of
///         different lengths, an unknown kind or medium code, token_ids that
///         do not match the Stored events' num_tokens or hold a negative id;
///         ts not a finite number, a data_parallel_rank not an int >= 0.
#[pyfunction]
#[pyo3(
    signature = (events, ts, data_parallel_rank=None, int_block_hashes=IntBlockHashesFlag(false)),
    text_signature = "(events, ts, data_parallel_rank=None, int_block_hashes=False)"
)]
pub fn encode_kv_events<'py>(
    py: Python<'py>,
    events: &Bound<'py, PyAny>,
    ts: &Bound<'py, PyAny>,
    data_parallel_rank: Option<&Bound<'py, PyAny>>,
    int_block_hashes: IntBlockHashesFlag,
) -> PyResult<(Bound<'py, PyBytes>, usize, usize, usize)> {
    let (ts, data_parallel_rank) = batch_args(py, ts, data_parallel_rank)?;
    let events = events.cast::<PyDict>().map_err(|_| {
        invalid_argument(
            py,
            format!(
                "events must be the dict take_events returns, got {}",
                crate::convert::type_name(events)
            ),
        )
    })?;
    // Every value first (lookups can run Python code), then the optional
    // arrays converted (their items' __index__ runs Python code, which can
    // resize or reallocate a caller's array), and only then the arrays
    // borrowed and sliced, with no Python code until the slices are done: an
    // array resized under a borrow gave slices of other lengths than the
    // checks saw (an index past one of them panicked) and then aborted the
    // process (numpy's borrow tracker could not find the moved array).
    let objs = KEYS
        .iter()
        .map(|key| item(py, events, key))
        .collect::<PyResult<Vec<_>>>()?;
    let (medium, group) = (events.get_item("medium")?, events.get_item("group_idx")?);
    // The types checked (and the length read) before any conversion, so a
    // mistyped array is named first; these borrows end here.
    let n = Borrowed::of(py, &objs)?.kind.len();
    let medium = optional(py, medium, "medium", n)?;
    let group = optional(py, group, "group_idx", n)?;
    let Borrowed {
        kind,
        hash_hi,
        hash_lo,
        parent_hi,
        parent_lo,
        num_tokens,
        salt,
        token_ids,
    } = Borrowed::of(py, &objs)?;
    if kind.len() != n {
        return Err(invalid_argument(
            py,
            format!(
                "events[\"kind\"] had {n} entries before medium / group_idx were converted \
                 and {} after (an item's __index__ resized it); pass arrays nothing changes \
                 during the call",
                kind.len()
            ),
        ));
    }
    for (key, len) in [
        ("hash_hi", hash_hi.len()),
        ("hash_lo", hash_lo.len()),
        ("parent_hi", parent_hi.len()),
        ("parent_lo", parent_lo.len()),
        ("num_tokens", num_tokens.len()),
        ("salt", salt.len()),
    ] {
        if len != n {
            return Err(invalid_argument(
                py,
                format!("events[{key:?}] has {len} entries but kind has {n}"),
            ));
        }
    }
    let a = Arrays {
        kind: slice(py, &kind, "kind")?,
        hash_hi: slice(py, &hash_hi, "hash_hi")?,
        hash_lo: slice(py, &hash_lo, "hash_lo")?,
        parent_hi: slice(py, &parent_hi, "parent_hi")?,
        parent_lo: slice(py, &parent_lo, "parent_lo")?,
        num_tokens: slice(py, &num_tokens, "num_tokens")?,
        salt: slice(py, &salt, "salt")?,
        token_ids: slice(py, &token_ids, "token_ids")?,
        medium,
        group,
        int_hashes: int_block_hashes.0,
    };
    if n <= DETACH_EVENTS {
        return finish(py, &a, ts, data_parallel_rank);
    }
    // A batch this big is encoded with the GIL released (`finish`): from
    // copies taken now, since another thread may write the caller's arrays
    // meanwhile (a payload read from arrays being rewritten mixed old and
    // new hashes).
    let copies = (
        owned(a.kind)?,
        owned(a.hash_hi)?,
        owned(a.hash_lo)?,
        owned(a.parent_hi)?,
        owned(a.parent_lo)?,
        owned(a.num_tokens)?,
        owned(a.salt)?,
        owned(a.token_ids)?,
    );
    let a = Arrays {
        kind: &copies.0,
        hash_hi: &copies.1,
        hash_lo: &copies.2,
        parent_hi: &copies.3,
        parent_lo: &copies.4,
        num_tokens: &copies.5,
        salt: &copies.6,
        token_ids: &copies.7,
        ..a
    };
    finish(py, &a, ts, data_parallel_rank)
}

/// A batch's `ts` (a finite number of seconds, not a bool) and optional
/// `data_parallel_rank` (an int >= 0), as InvalidArgumentError otherwise:
/// a NaN or infinite timestamp, or a negative rank, would reach every
/// router that reads the batch (msgpack carries them as they are).
fn batch_args(
    py: Python<'_>,
    ts: &Bound<'_, PyAny>,
    rank: Option<&Bound<'_, PyAny>>,
) -> PyResult<(f64, Option<i64>)> {
    let ts = crate::retention_args::seconds_arg(py, ts, "ts")?;
    if !ts.is_finite() {
        return Err(crate::errors::invalid_argument(
            py,
            format!(
                "ts must be a finite number of seconds (a timestamp such as time.time()), got {ts}"
            ),
        ));
    }
    let rank = rank
        .filter(|r| !r.is_none())
        .map(|r| crate::convert::int_scalar(py, r, "data_parallel_rank"))
        .transpose()?;
    if let Some(r) = rank.filter(|&r| r < 0) {
        return Err(crate::errors::invalid_argument(
            py,
            format!("data_parallel_rank must be >= 0 (the engine's data-parallel rank) or None, got {r}"),
        ));
    }
    Ok((ts, rank))
}

/// Encodes `a` (see `encode_kv_events`) into Python bytes with its tally.
fn finish<'py>(
    py: Python<'py>,
    a: &Arrays<'_>,
    ts: f64,
    data_parallel_rank: Option<i64>,
) -> PyResult<(Bound<'py, PyBytes>, usize, usize, usize)> {
    // A step's few hundred events encode in microseconds: releasing the GIL
    // for them let a waiting thread (the publisher's sender) take it, and
    // this call then waited for it. Big batches (a backlog that overflowed
    // is up to 64K events) release it: `a` must then be the call's own
    // memory, which no other thread can write (encode_kv_events copies).
    let encoded = if a.kind.len() > DETACH_EVENTS {
        py.detach(|| batch(a, ts, data_parallel_rank))
    } else {
        batch(a, ts, data_parallel_rank)
    };
    match encoded {
        // Fallibly: PyBytes::new panics when Python cannot allocate.
        Ok((bytes, (st, rm, cl))) => Ok((
            PyBytes::new_with(py, bytes.len(), |b| {
                b.copy_from_slice(&bytes);
                Ok(())
            })?,
            st,
            rm,
            cl,
        )),
        Err(Fail::Bad(m)) => Err(invalid_argument(py, m)),
        Err(Fail::NoMemory(n)) => Err(pyo3::exceptions::PyMemoryError::new_err(format!(
            "cannot allocate the KV events' msgpack payload ({n} bytes)"
        ))),
        Err(Fail::Write(e)) => Err(pyo3::exceptions::PySystemError::new_err(format!(
            "encoding KV events failed writing to memory: {e}"
        ))),
    }
}

#[pymethods]
impl PySlotAllocator {
    /// take_events_msgpack(ts, data_parallel_rank=None, int_block_hashes=False) -> tuple[bytes, int, int, int]
    ///
    /// take_events() and encode_kv_events() in one call, without building
    /// the arrays: drains the KV events and returns them as one msgpack
    /// KVEventBatch in vLLM's schema (what ZmqEventPublisher.publish sends);
    /// int_block_hashes as encode_kv_events. A payload that cannot be
    /// allocated raises MemoryError and keeps the drained events, which the
    /// next drain (of either kind) returns first.
    ///
    /// Returns:
    ///     (payload, stored, removed, cleared), as encode_kv_events; with no
    ///     event, a batch of none and three zeros.
    ///
    /// Raises:
    ///     InvalidArgumentError: ts not a finite number, a data_parallel_rank
    ///         not an int >= 0 (nothing is drained).
    ///     RuntimeError: called during a drain of the same pool on the same
    ///         thread (a finalizer that a garbage collection ran inside it).
    #[pyo3(
        signature = (ts, data_parallel_rank=None, int_block_hashes=IntBlockHashesFlag(false)),
        text_signature = "($self, ts, data_parallel_rank=None, int_block_hashes=False)"
    )]
    fn take_events_msgpack<'py>(
        &self,
        py: Python<'py>,
        ts: &Bound<'py, PyAny>,
        data_parallel_rank: Option<&Bound<'py, PyAny>>,
        int_block_hashes: IntBlockHashesFlag,
    ) -> PyResult<(Bound<'py, PyBytes>, usize, usize, usize)> {
        // Converted before anything is drained.
        let (ts, data_parallel_rank) = batch_args(py, ts, data_parallel_rank)?;
        let mut kept = self.undelivered(py)?;
        let e = match kept.take() {
            Some(e) => e,
            None => {
                // Drained into vectors reserved first: a MemoryError there
                // leaves every event in the pool.
                let pending = self.query(py, |a| a.pending_events());
                crate::events::drained_events(pending, |sink| {
                    self.run(py, pending.0, |core| core.take_events_into(sink))
                })?
            }
        };
        let mut medium = Vec::new();
        if let Err(err) = crate::events::room(&mut medium, e.medium.len()) {
            *kept = Some(e);
            return Err(err);
        }
        medium.extend(e.medium.iter().map(|&m| m as i64));
        let a = Arrays {
            kind: &e.kind,
            hash_hi: &e.hash_hi,
            hash_lo: &e.hash_lo,
            parent_hi: &e.parent_hi,
            parent_lo: &e.parent_lo,
            num_tokens: &e.num_tokens,
            salt: &e.salt,
            token_ids: &e.token_ids,
            medium: Some(medium),
            group: None,
            int_hashes: int_block_hashes.0,
        };
        let r = finish(py, &a, ts, data_parallel_rank);
        if r.is_err() {
            // Kept for the next drain, as take_events keeps them.
            *kept = Some(e);
        }
        r
    }
}
