//! The msgpack encoding of drained KV events as one vLLM `KVEventBatch`
//! (`kv_events.rs` has the Python entry points and the mapping rules). Plain
//! Rust over borrowed arrays: the caller may run it with the GIL released.

use std::io;

use rmp::encode as mp;

const STORED: u8 = 0;
const REMOVED: u8 = 1;
const CLEARED: u8 = 2;
/// vLLM's MEDIUM_GPU / MEDIUM_CPU / MEDIUM_STORAGE, by medium code.
const MEDIA: [&str; 3] = ["GPU", "CPU", "STORAGE"];

/// The event arrays, borrowed (optional ones as owned per-event values).
pub(crate) struct Arrays<'a> {
    pub(crate) kind: &'a [u8],
    pub(crate) hash_hi: &'a [u64],
    pub(crate) hash_lo: &'a [u64],
    pub(crate) parent_hi: &'a [u64],
    pub(crate) parent_lo: &'a [u64],
    pub(crate) num_tokens: &'a [i32],
    pub(crate) salt: &'a [i64],
    pub(crate) token_ids: &'a [i32],
    pub(crate) medium: Option<Vec<i64>>,
    pub(crate) group: Option<Vec<i64>>,
    /// Hashes as vLLM's int form (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`, on
    /// by default in vLLM): the low 64 bits of the big-endian 16-byte hash,
    /// an unsigned int; else the 16 bytes.
    pub(crate) int_hashes: bool,
}

pub(crate) enum Fail {
    Bad(String),
    Write(io::Error),
    /// The payload could not grow to this many bytes.
    NoMemory(usize),
}

/// Most bytes one wire event writes, by what it holds, counted from the
/// writers below with every optional field present and every int at its
/// longest: a `BlockStored`'s fields and keys (177), per page its hash
/// (18) and salt key (22: a 20-character decimal str), per token id 9 (the room `token_ids` makes before
/// it trims); a `BlockRemoved`'s (71) and 18 per page; an
/// `AllBlocksCleared` (23).
const STORED_FIXED: usize = 177;
const STORED_PAGE: usize = 40;
const TOKEN_MAX: usize = 9;
const REMOVED_FIXED: usize = 71;
const REMOVED_PAGE: usize = 18;
const CLEARED_MAX: usize = 23;

/// Room for `n` more bytes, made fallibly. `events` makes it before each
/// wire event, for the most that event can write, so the writes themselves
/// (rmp into a Vec, infallible and inlined) never grow the buffer: a
/// backlog of 64K events at page size 1024 is a payload of hundreds of MiB,
/// and a Vec that cannot grow aborts the process.
fn room(w: &mut Vec<u8>, n: usize) -> Out<()> {
    w.try_reserve(n)
        .map_err(|_| Fail::NoMemory(w.len().saturating_add(n)))
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

pub(crate) type Out<T> = std::result::Result<T, Fail>;

impl Arrays<'_> {
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

    /// Event `j`'s parent is event `j - 1`'s page.
    #[inline]
    fn continues(&self, j: usize) -> bool {
        self.parent_hi[j] == self.hash_hi[j - 1] && self.parent_lo[j] == self.hash_lo[j - 1]
    }

    /// Events `i` and `j` go to the same wire event's medium and group.
    #[inline]
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
    if a.int_hashes {
        // As rmp's write_uint (the shortest form), by index into room made first.
        let start = w.len();
        w.resize(start + 9 * (j - i), 0);
        let buf = &mut w[start..];
        let mut at = 0;
        for &v in &a.hash_lo[i..j] {
            at += uint_at(&mut buf[at..], v);
        }
        w.truncate(start + at);
    } else {
        // Each page's bin8 of 16 bytes written by index into room made first
        // (rmp's write_bin makes three writes, the last a memcpy call: the
        // encoder's largest cost at page size 1, where a page is a token).
        let start = w.len();
        w.resize(start + 18 * (j - i), 0);
        for (k, out) in (i..j).zip(w[start..].chunks_exact_mut(18)) {
            out[0] = 0xc4;
            out[1] = 16;
            out[2..10].copy_from_slice(&a.hash_hi[k].to_be_bytes());
            out[10..].copy_from_slice(&a.hash_lo[k].to_be_bytes());
        }
    }
    Ok(())
}

/// Writes `v` as msgpack's shortest uint (the form rmp's `write_uint`
/// chooses) at the start of `out` (9 bytes or more); returns the bytes
/// written.
#[inline]
fn uint_at(out: &mut [u8], v: u64) -> usize {
    let b = v.to_be_bytes();
    if v < 0x80 {
        out[0] = v as u8;
        1
    } else if v < 0x100 {
        out[..2].copy_from_slice(&[0xcc, b[7]]);
        2
    } else if v < 0x1_0000 {
        out[..3].copy_from_slice(&[0xcd, b[6], b[7]]);
        3
    } else if v < 0x1_0000_0000 {
        out[0] = 0xce;
        out[1..5].copy_from_slice(&b[4..]);
        5
    } else {
        out[0] = 0xcf;
        out[1..9].copy_from_slice(&b);
        9
    }
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
        _ if a.int_hashes => {
            mp::write_uint(w, a.parent_lo[i])?;
        }
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
        // As a str, as vLLM's own extra keys are (a cache_salt, a LoRA name, an MM
        // digest): consumers typed against those (Dynamo's router reads each key as a
        // string) refuse the whole batch on an int.
        let key = salt.to_string();
        mp::write_str(w, "extra_keys")?;
        mp::write_array_len(w, len32(j - i, "extra_keys")?)?;
        for _ in i..j {
            mp::write_array_len(w, 1)?;
            mp::write_str(w, &key)?;
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
        // Ids are in [0, 2^31): the core checks a pool's, and `events`
        // refuses a negative one in a caller's batch before this runs.
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
pub(crate) type Tally = (usize, usize, usize);

/// The events array's wire events, how many there are, and the tally.
fn events(a: &Arrays<'_>) -> Out<(Vec<u8>, u32, Tally)> {
    let n = a.kind.len();
    let mut w = Vec::new();
    room(&mut w, 64 * n + 5 * a.token_ids.len() + 16)?;
    let (mut count, mut tok, mut i) = (0u32, 0usize, 0usize);
    let mut tally: Tally = (0, 0, 0);
    while i < n {
        let mut j = i + 1;
        match a.kind[i] {
            STORED => {
                while j < n
                    && a.kind[j] == STORED
                    && a.continues(j)
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
                // A pool never records a negative id (it takes ids in [0, 2^31)); one in a
                // hand-built batch would reach routers that read ids as unsigned (NVIDIA
                // Dynamo), which refuse the whole batch.
                if let Some(k) = tokens.iter().position(|&t| t < 0) {
                    return Err(Fail::Bad(format!(
                        "token_ids[{}] = {} is negative; token ids are in [0, 2**31), as a pool takes them",
                        tok + k,
                        tokens[k]
                    )));
                }
                room(
                    &mut w,
                    STORED_FIXED + STORED_PAGE * (j - i) + TOKEN_MAX * tokens.len(),
                )?;
                let cap = w.capacity();
                stored(&mut w, a, i, j, tokens)?;
                debug_assert_eq!(w.capacity(), cap, "a BlockStored outgrew its room");
                tok = end;
                tally.0 += j - i;
            }
            REMOVED => {
                while j < n && a.kind[j] == REMOVED && a.same_place(i, j) {
                    j += 1;
                }
                room(&mut w, REMOVED_FIXED + REMOVED_PAGE * (j - i))?;
                let cap = w.capacity();
                removed(&mut w, a, i, j)?;
                debug_assert_eq!(w.capacity(), cap, "a BlockRemoved outgrew its room");
                tally.1 += j - i;
            }
            CLEARED => {
                room(&mut w, CLEARED_MAX)?;
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
pub(crate) fn batch(a: &Arrays<'_>, ts: f64, dp_rank: Option<i64>) -> Out<(Vec<u8>, Tally)> {
    let (body, count, tally) = events(a)?;
    // The array header (1), ts (9), the events' array header (5) and the
    // rank (9).
    let mut w = Vec::new();
    room(&mut w, body.len() + 24)?;
    // KVEventBatch is array_like: [ts, events, data_parallel_rank]. The rank
    // is always there, nil for None: vLLM's and SGLang's publishers never
    // leave it off, and consumers that read the batch as a 3-tuple (Rust
    // routers with serde) refuse a 2-element array.
    mp::write_array_len(&mut w, 3)?;
    mp::write_f64(&mut w, ts)?;
    mp::write_array_len(&mut w, count)?;
    w.extend_from_slice(&body);
    match dp_rank {
        Some(r) => {
            mp::write_sint(&mut w, r)?;
        }
        None => mp::write_nil(&mut w)?,
    }
    Ok((w, tally))
}
