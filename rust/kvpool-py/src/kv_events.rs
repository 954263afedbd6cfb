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
//!   token count; a non-zero salt becomes `extra_keys = [[salt]] * pages`;
//! - consecutive Removed events of one medium and group become one
//!   `BlockRemoved`; a Cleared event is an `AllBlocksCleared`;
//! - `medium` is "GPU" unless the arrays carry a `medium` code per event
//!   (0 GPU, 1 CPU, 2 STORAGE; `take_events` carries the core's: 0 device,
//!   1 host); `group_idx` is omitted unless they carry a `group_idx` per
//!   event (negative: omitted).

use std::io;

use numpy::{PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use rmp::encode as mp;

use crate::allocator::PySlotAllocator;
use crate::convert::int_arg;
use crate::errors::invalid_argument;

const STORED: u8 = 0;
const REMOVED: u8 = 1;
const CLEARED: u8 = 2;
/// Batches of more events than this are encoded with the GIL released.
const DETACH_EVENTS: usize = 4096;
/// vLLM's MEDIUM_GPU / MEDIUM_CPU / MEDIUM_STORAGE, by medium code.
const MEDIA: [&str; 3] = ["GPU", "CPU", "STORAGE"];

/// The event arrays, borrowed (optional ones as owned per-event values).
struct Arrays<'a> {
    kind: &'a [u8],
    hash_hi: &'a [u64],
    hash_lo: &'a [u64],
    parent_hi: &'a [u64],
    parent_lo: &'a [u64],
    num_tokens: &'a [i32],
    salt: &'a [i64],
    token_ids: &'a [i32],
    medium: Option<Vec<i64>>,
    group: Option<Vec<i64>>,
}

enum Fail {
    Bad(String),
    Write(io::Error),
}

impl From<mp::ValueWriteError<io::Error>> for Fail {
    fn from(e: mp::ValueWriteError<io::Error>) -> Self {
        Fail::Write(e.into())
    }
}

impl From<io::Error> for Fail {
    fn from(e: io::Error) -> Self {
        Fail::Write(e)
    }
}

type Out<T> = std::result::Result<T, Fail>;

impl Arrays<'_> {
    fn hash(&self, i: usize) -> [u8; 16] {
        (((self.hash_hi[i] as u128) << 64) | self.hash_lo[i] as u128).to_be_bytes()
    }

    fn parent(&self, i: usize) -> u128 {
        ((self.parent_hi[i] as u128) << 64) | self.parent_lo[i] as u128
    }

    fn medium(&self, i: usize) -> Out<&'static str> {
        let Some(m) = &self.medium else {
            return Ok(MEDIA[0]);
        };
        usize::try_from(m[i])
            .ok()
            .and_then(|c| MEDIA.get(c).copied())
            .ok_or_else(|| {
                Fail::Bad(format!(
                    "medium[{i}] = {} is not a medium code; codes are 0 GPU, 1 CPU, 2 STORAGE",
                    m[i]
                ))
            })
    }

    fn group(&self, i: usize) -> Option<i64> {
        self.group.as_ref().map(|g| g[i]).filter(|&g| g >= 0)
    }

    /// Events `i` and `j` go to the same wire event's medium and group.
    fn same_place(&self, i: usize, j: usize) -> bool {
        self.medium.as_ref().map_or(true, |m| m[i] == m[j])
            && self.group.as_ref().map_or(true, |g| g[i] == g[j])
    }
}

fn len32(n: usize, what: &str) -> Out<u32> {
    u32::try_from(n)
        .map_err(|_| Fail::Bad(format!("{what}: {n} is more than a msgpack array holds")))
}

fn hashes(w: &mut Vec<u8>, a: &Arrays<'_>, i: usize, j: usize) -> Out<()> {
    w.extend_from_slice(b"\xacblock_hashes"); // fixstr(12)
    mp::write_array_len(w, len32(j - i, "block_hashes")?)?;
    for k in i..j {
        mp::write_bin(w, &a.hash(k))?;
    }
    Ok(())
}

fn place(w: &mut Vec<u8>, a: &Arrays<'_>, i: usize) -> Out<()> {
    mp::write_str(w, "medium")?;
    mp::write_str(w, a.medium(i)?)?;
    if let Some(g) = a.group(i) {
        mp::write_str(w, "group_idx")?;
        mp::write_sint(w, g)?;
    }
    Ok(())
}

/// One `BlockStored` for events `i..j` (one chain run) whose tokens are
/// `tokens`.
fn stored(w: &mut Vec<u8>, a: &Arrays<'_>, i: usize, j: usize, tokens: &[i32]) -> Out<()> {
    let salt = a.salt[i];
    // type, block_hashes, parent_block_hash, token_ids, block_size, lora_id,
    // medium, lora_name: the fields vLLM always sends; then the optional ones.
    let fields = 8 + (salt != 0) as u32 + a.group(i).is_some() as u32;
    mp::write_map_len(w, fields)?;
    mp::write_str(w, "type")?;
    mp::write_str(w, "BlockStored")?;
    hashes(w, a, i, j)?;
    mp::write_str(w, "parent_block_hash")?;
    match a.parent(i) {
        0 => mp::write_nil(w)?,
        p => mp::write_bin(w, &p.to_be_bytes())?,
    }
    mp::write_str(w, "token_ids")?;
    mp::write_array_len(w, len32(tokens.len(), "token_ids")?)?;
    token_ids(w, tokens);
    mp::write_str(w, "block_size")?;
    mp::write_sint(w, a.num_tokens[i] as i64)?;
    mp::write_str(w, "lora_id")?;
    mp::write_nil(w)?;
    place(w, a, i)?;
    mp::write_str(w, "lora_name")?;
    mp::write_nil(w)?;
    if salt != 0 {
        mp::write_str(w, "extra_keys")?;
        mp::write_array_len(w, len32(j - i, "extra_keys")?)?;
        for _ in i..j {
            mp::write_array_len(w, 1)?;
            mp::write_sint(w, salt)?;
        }
    }
    Ok(())
}

/// Appends token ids as msgpack ints, each in the shortest form as rmp's
/// `write_uint` would choose. Token ids are most of a batch's bytes, and
/// this loop (no `Result` per value, no per-value dispatch) encodes them
/// several times faster than calling rmp per id.
fn token_ids(w: &mut Vec<u8>, tokens: &[i32]) {
    // Written by index into room made first: pushing value by value would
    // make every id pay for a capacity check and a variable-length copy.
    let start = w.len();
    w.resize(start + 9 * tokens.len(), 0);
    let buf = &mut w[start..];
    let mut k = 0;
    for &t in tokens {
        // Ids are in [0, 2^31) (the core checks them); a negative one is
        // written as the int64 it is.
        if (0..0x80).contains(&t) {
            buf[k] = t as u8;
            k += 1;
        } else if (0..0x1_0000).contains(&t) {
            let b = (t as u32).to_be_bytes();
            if t < 0x100 {
                buf[k..k + 2].copy_from_slice(&[0xcc, b[3]]);
                k += 2;
            } else {
                buf[k..k + 3].copy_from_slice(&[0xcd, b[2], b[3]]);
                k += 3;
            }
        } else if t >= 0 {
            buf[k] = 0xce;
            buf[k + 1..k + 5].copy_from_slice(&(t as u32).to_be_bytes());
            k += 5;
        } else {
            buf[k] = 0xd3;
            buf[k + 1..k + 9].copy_from_slice(&(t as i64).to_be_bytes());
            k += 9;
        }
    }
    w.truncate(start + k);
}

fn removed(w: &mut Vec<u8>, a: &Arrays<'_>, i: usize, j: usize) -> Out<()> {
    mp::write_map_len(w, 3 + a.group(i).is_some() as u32)?;
    mp::write_str(w, "type")?;
    mp::write_str(w, "BlockRemoved")?;
    hashes(w, a, i, j)?;
    place(w, a, i)
}

/// Pages each kind of event names: (stored, removed, cleared).
type Tally = (usize, usize, usize);

/// The events array's wire events, how many there are, and the tally.
fn events(a: &Arrays<'_>) -> Out<(Vec<u8>, u32, Tally)> {
    let n = a.kind.len();
    let mut w = Vec::with_capacity(64 * n + 5 * a.token_ids.len() + 16);
    let (mut count, mut tok, mut i) = (0u32, 0usize, 0usize);
    let mut tally: Tally = (0, 0, 0);
    while i < n {
        let mut j = i + 1;
        match a.kind[i] {
            STORED => {
                while j < n
                    && a.kind[j] == STORED
                    && a.parent(j) == u128::from_be_bytes(a.hash(j - 1))
                    && a.salt[j] == a.salt[i]
                    && a.num_tokens[j] == a.num_tokens[i]
                    && a.same_place(i, j)
                {
                    j += 1;
                }
                let per = usize::try_from(a.num_tokens[i]).map_err(|_| {
                    Fail::Bad(format!("num_tokens[{i}] = {} is negative", a.num_tokens[i]))
                })?;
                let end = tok + per * (j - i);
                let tokens = a.token_ids.get(tok..end).ok_or_else(|| {
                    Fail::Bad(format!(
                        "token_ids has {} ids, fewer than the Stored events' num_tokens add up to",
                        a.token_ids.len()
                    ))
                })?;
                stored(&mut w, a, i, j, tokens)?;
                tok = end;
                tally.0 += j - i;
            }
            REMOVED => {
                while j < n && a.kind[j] == REMOVED && a.same_place(i, j) {
                    j += 1;
                }
                removed(&mut w, a, i, j)?;
                tally.1 += j - i;
            }
            CLEARED => {
                mp::write_map_len(&mut w, 1)?;
                mp::write_str(&mut w, "type")?;
                mp::write_str(&mut w, "AllBlocksCleared")?;
                tally.2 += 1;
            }
            k => {
                return Err(Fail::Bad(format!(
                    "kind[{i}] = {k} is not an event kind (0 Stored, 1 Removed, 2 Cleared)"
                )))
            }
        }
        count += 1;
        i = j;
    }
    if tok != a.token_ids.len() {
        return Err(Fail::Bad(format!(
            "token_ids has {} ids but the Stored events' num_tokens add up to {tok}",
            a.token_ids.len()
        )));
    }
    Ok((w, count, tally))
}

/// The batch's bytes and its tally.
fn batch(a: &Arrays<'_>, ts: f64, dp_rank: Option<i64>) -> Out<(Vec<u8>, Tally)> {
    let (body, count, tally) = events(a)?;
    let mut w = Vec::with_capacity(body.len() + 24);
    // KVEventBatch is array_like: [ts, events, data_parallel_rank], the
    // rank left off when None (omit_defaults drops a trailing default).
    mp::write_array_len(&mut w, 2 + dp_rank.is_some() as u32)?;
    mp::write_f64(&mut w, ts)?;
    mp::write_array_len(&mut w, count)?;
    w.extend_from_slice(&body);
    if let Some(r) = dp_rank {
        mp::write_sint(&mut w, r)?;
    }
    Ok((w, tally))
}

fn array<'py, T: numpy::Element>(
    py: Python<'py>,
    d: &Bound<'py, PyDict>,
    key: &str,
    dtype: &str,
) -> PyResult<PyReadonlyArray1<'py, T>> {
    let v = d
        .get_item(key)?
        .ok_or_else(|| invalid_argument(py, format!("events has no {key:?} array")))?;
    v.extract::<PyReadonlyArray1<'py, T>>().map_err(|_| {
        invalid_argument(
            py,
            format!("events[{key:?}] must be a 1-D {dtype} numpy array (what take_events returns)"),
        )
    })
}

fn slice<'a, T: numpy::Element>(
    py: Python<'_>,
    a: &'a PyReadonlyArray1<'_, T>,
    key: &str,
) -> PyResult<&'a [T]> {
    a.as_slice()
        .map_err(|_| invalid_argument(py, format!("events[{key:?}] must be contiguous")))
}

fn optional(
    py: Python<'_>,
    d: &Bound<'_, PyDict>,
    key: &str,
    n: usize,
) -> PyResult<Option<Vec<i64>>> {
    let Some(v) = d.get_item(key)? else {
        return Ok(None);
    };
    let v = int_arg(py, &v, key)?.into_vec();
    if v.len() != n {
        return Err(invalid_argument(
            py,
            format!("events[{key:?}] has {} entries for {n} events", v.len()),
        ));
    }
    Ok(Some(v))
}

/// encode_kv_events(events, ts, data_parallel_rank=None) -> tuple[bytes, int, int, int]
///
/// Encodes drained KV events (the dict take_events returns) as one msgpack
/// KVEventBatch in vLLM's schema (vllm/distributed/kv_events.py): the
/// payload a ZmqEventPublisher sends. Consecutive Stored events of one
/// chain become one BlockStored, consecutive Removed events one
/// BlockRemoved. Optional per-event arrays "medium" (0 GPU, 1 CPU,
/// 2 STORAGE; "GPU" without it) and "group_idx" (omitted without it or
/// where negative) are used when present.
///
/// Returns:
///     (payload, stored, removed, cleared): the msgpack bytes, and how many
///     pages the Stored and Removed events name and how many Cleared events
///     there are.
///
/// Raises:
///     InvalidArgumentError: a missing or mistyped array, arrays of
///         different lengths, an unknown kind or medium code, token_ids that
///         do not match the Stored events' num_tokens.
#[pyfunction]
#[pyo3(signature = (events, ts, data_parallel_rank=None))]
pub fn encode_kv_events<'py>(
    py: Python<'py>,
    events: &Bound<'py, PyAny>,
    ts: &Bound<'py, PyAny>,
    data_parallel_rank: Option<&Bound<'py, PyAny>>,
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
    let kind = array::<u8>(py, events, "kind", "uint8")?;
    let hash_hi = array::<u64>(py, events, "hash_hi", "uint64")?;
    let hash_lo = array::<u64>(py, events, "hash_lo", "uint64")?;
    let parent_hi = array::<u64>(py, events, "parent_hi", "uint64")?;
    let parent_lo = array::<u64>(py, events, "parent_lo", "uint64")?;
    let num_tokens = array::<i32>(py, events, "num_tokens", "int32")?;
    let salt = array::<i64>(py, events, "salt", "int64")?;
    let token_ids = array::<i32>(py, events, "token_ids", "int32")?;
    let n = kind.len();
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
        medium: optional(py, events, "medium", n)?,
        group: optional(py, events, "group_idx", n)?,
    };
    finish(py, &a, ts, data_parallel_rank)
}

/// A batch's `ts` (a number of seconds, not a bool) and optional
/// `data_parallel_rank` (an int), as InvalidArgumentError when mistyped.
fn batch_args(
    py: Python<'_>,
    ts: &Bound<'_, PyAny>,
    rank: Option<&Bound<'_, PyAny>>,
) -> PyResult<(f64, Option<i64>)> {
    let ts = crate::retention_args::seconds_arg(py, ts, "ts")?;
    let rank = rank
        .filter(|r| !r.is_none())
        .map(|r| crate::convert::int_scalar(py, r, "data_parallel_rank"))
        .transpose()?;
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
    // is up to 64K events) release it; the arrays stay borrowed meanwhile.
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
        Err(Fail::Write(e)) => Err(pyo3::exceptions::PySystemError::new_err(format!(
            "encoding KV events failed writing to memory: {e}"
        ))),
    }
}

#[pymethods]
impl PySlotAllocator {
    /// take_events_msgpack(ts, data_parallel_rank=None) -> tuple[bytes, int, int, int]
    ///
    /// take_events() and encode_kv_events() in one call, without building
    /// the arrays: drains the KV events and returns them as one msgpack
    /// KVEventBatch in vLLM's schema (what ZmqEventPublisher.publish sends).
    ///
    /// Returns:
    ///     (payload, stored, removed, cleared), as encode_kv_events; with no
    ///     event, a batch of none and three zeros.
    #[pyo3(signature = (ts, data_parallel_rank=None))]
    fn take_events_msgpack<'py>(
        &self,
        py: Python<'py>,
        ts: &Bound<'py, PyAny>,
        data_parallel_rank: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<(Bound<'py, PyBytes>, usize, usize, usize)> {
        // Converted before anything is drained.
        let (ts, data_parallel_rank) = batch_args(py, ts, data_parallel_rank)?;
        let mut kept = self.undelivered(py);
        let e = self.oldest_events(py, &mut kept);
        let a = Arrays {
            kind: &e.kind,
            hash_hi: &e.hash_hi,
            hash_lo: &e.hash_lo,
            parent_hi: &e.parent_hi,
            parent_lo: &e.parent_lo,
            num_tokens: &e.num_tokens,
            salt: &e.salt,
            token_ids: &e.token_ids,
            medium: Some(e.medium.iter().map(|&m| m as i64).collect()),
            group: None,
        };
        let r = finish(py, &a, ts, data_parallel_rank);
        if r.is_err() {
            // Kept for the next drain, as take_events keeps them.
            *kept = Some(e);
        }
        r
    }
}
