//! The prefix chain hash: `h_i = xxh3_128(seed, h_{i-1} || tokens of page i)`,
//! with `h_{-1}` derived from the request's salt, so requests with different
//! salts (LoRA, tenant, cache salt) never share a page.
//!
//! xxh3-128 is fast but not a cryptographic MAC: the index therefore never
//! trusts a hash alone. A hit is verified against the
//! page's stored token ids, its salt and its parent's registration (see
//! `index.rs`), so a collision, accidental or crafted, costs a cache miss and
//! never serves KV computed for other tokens.
//!
//! **Two kinds of chain.** The xxh3-128 chain is what leaves the pool: KV
//! events name pages by it, and routers recompute it from token ids
//! (`page_hashes`). Inside the pool a chain value is only a lookup key, and
//! a key is never trusted either. So a pool that records no events keys its
//! index with a cheaper chain ([`ChainKind::Internal`]): one folded 64-bit
//! multiply per page on the serial path, where xxh3-128 of the parent and
//! the page is several dependent multiplies. At page size 1 every token is
//! a page and that serial chain is most of a registration
//! (`benchmarks/results/history`). Chain hashes that leave such a pool
//! (`SlotAllocator::prefix_chain`, and the sent chain a receiver checks) are
//! computed from the token ids when asked for.

use xxhash_rust::xxh3::{xxh3_128_with_seed, Xxh3};

/// Root value of the chain of a request with `salt`.
#[inline]
pub(crate) fn root(salt: i64) -> u128 {
    // A fixed tag in the high half keeps roots apart from real hashes'
    // typical values; the salt fills the low half.
    (0x6b76_706f_6f6c_0001u128 << 64) | salt as u64 as u128
}

/// Tokens a page may have for its hash input to be built on the stack.
const STACK_PAGE: usize = 128;

/// Which chain an index keys its pages by (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ChainKind {
    /// The xxh3-128 chain hash, which events and routers read.
    Interop,
    /// A 64-bit chain of folded multiplies, seen by nothing outside the
    /// pool (the high half of each value is 0).
    Internal,
}

/// Hashes pages of a chain with a pool's seed.
#[derive(Debug, Clone)]
pub(crate) struct ChainHasher {
    seed: u64,
    kind: ChainKind,
    /// Keep only the low `weak_bits` bits (test-only collision forcing); 0 = all.
    mask: u128,
}

impl ChainHasher {
    pub(crate) fn new(seed: u64, weak_bits: u32, kind: ChainKind) -> Self {
        let mask = if weak_bits == 0 || weak_bits >= 128 {
            u128::MAX
        } else {
            (1u128 << weak_bits) - 1
        };
        ChainHasher { seed, kind, mask }
    }

    pub(crate) fn seed(&self) -> u64 {
        self.seed
    }

    pub(crate) fn kind(&self) -> ChainKind {
        self.kind
    }

    /// Chain value of the page with `tokens` whose parent's value is `parent`.
    #[inline(always)]
    pub(crate) fn page(&self, parent: u128, tokens: &[i32]) -> u128 {
        let h = match self.kind {
            ChainKind::Interop => interop_page(self.seed, parent, tokens),
            ChainKind::Internal => internal_page(self.seed, parent, tokens),
        };
        h & self.mask
    }

    /// `page` of a one-token page.
    #[inline(always)]
    pub(crate) fn token(&self, parent: u128, token: i32) -> u128 {
        let h = match self.kind {
            ChainKind::Interop => one_token(self.seed, parent, token),
            ChainKind::Internal => internal_page(self.seed, parent, std::slice::from_ref(&token)),
        };
        h & self.mask
    }

    /// The xxh3-128 chain hash of the page, whatever this index keys by
    /// (what `page_hashes` gives; unmasked unless the index keys by it).
    #[inline]
    pub(crate) fn interop(&self, parent: u128, tokens: &[i32]) -> u128 {
        match self.kind {
            ChainKind::Interop => self.page(parent, tokens),
            ChainKind::Internal => interop_page(self.seed, parent, tokens),
        }
    }
}

/// One page of the chain `page_hashes` computes: `h_i` from `h_{i-1}`
/// (`chain_root(salt)` before the first page) and the page's token ids, the
/// value KV events carry. For code that keeps its own chain page by page
/// (`examples/run_index_proto.rs`), with the same fast paths as the pool's.
#[inline]
pub fn chain_page_hash(seed: u64, parent: u128, tokens: &[i32]) -> u128 {
    interop_page(seed, parent, tokens)
}

/// The value a chain of `salt` starts from (the parent of its first page).
#[inline]
pub fn chain_root(salt: i64) -> u128 {
    root(salt)
}

/// `xxh3_128(seed, parent || tokens)`.
#[inline(always)]
fn interop_page(seed: u64, parent: u128, tokens: &[i32]) -> u128 {
    // The chain waits on each page's hash before the next can start, so
    // the copy into the buffer is on its critical path. At the common
    // page sizes the buffer is a stack array of known length and the
    // copies inline.
    match tokens.len() {
        1 => one_token(seed, parent, tokens[0]),
        16 => fixed::<16, 80>(seed, parent, tokens),
        32 => fixed::<32, 144>(seed, parent, tokens),
        64 => fixed::<64, 272>(seed, parent, tokens),
        _ => any_size(seed, parent, tokens),
    }
}

/// The internal chain: `fold(parent_folded ^ page(tokens), K)`, where
/// `fold` is the xor of a 64x64-bit product's halves (foldhash's mixer).
///
/// The page's own term does not depend on the parent, so the CPU computes
/// it ahead; the serial path from one page's value to the next is one xor,
/// one multiply and one xor. A page of one token contributes the token
/// spread by a multiply, a longer page its xxh3-64 (well mixed, and off the
/// serial path). The page term is seeded: keys are untrusted, but a table
/// whose keys a client could predict could be made to probe long runs.
#[inline(always)]
fn internal_page(seed: u64, parent: u128, tokens: &[i32]) -> u128 {
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    const T: u64 = 0xD6E8_FEB8_6659_FD93;
    let p = (parent as u64) ^ ((parent >> 64) as u64);
    let t = match tokens {
        [t] => fold((*t as u32 as u64) ^ seed, T),
        #[allow(clippy::needless_borrow)] // a Cow on big-endian targets
        _ => xxhash_rust::xxh3::xxh3_64_with_seed(&le_bytes(tokens), seed),
    };
    fold(p ^ t, K) as u128
}

/// The xor of the two halves of `a * b`.
#[inline(always)]
fn fold(a: u64, b: u64) -> u64 {
    let m = a as u128 * b as u128;
    (m as u64) ^ ((m >> 64) as u64)
}

/// `xxh3_128(seed, parent || tokens)` for the other page sizes, out of line
/// so the common sizes' path stays small enough to inline.
#[inline(never)]
fn any_size(seed: u64, parent: u128, tokens: &[i32]) -> u128 {
    if tokens.len() <= STACK_PAGE {
        let mut buf = [0u8; 16 + 4 * STACK_PAGE];
        let b = &mut buf[..16 + 4 * tokens.len()];
        b[..16].copy_from_slice(&parent.to_le_bytes());
        #[allow(clippy::needless_borrow)] // a Cow on big-endian targets
        b[16..].copy_from_slice(&le_bytes(tokens));
        return xxh3_128_with_seed(b, seed);
    }
    let mut x = Xxh3::with_seed(seed);
    x.update(&parent.to_le_bytes());
    #[allow(clippy::needless_borrow)] // a Cow on big-endian targets
    x.update(&le_bytes(tokens));
    x.digest128()
}

/// `xxh3_128(seed, parent || token)`, 20 bytes, computed from registers.
///
/// xxh3 reads a 17-to-128-byte input as 8-byte words from both ends, and at
/// 20 bytes one word straddles the parent hash and the token (bytes 12..20):
/// through a stack buffer that load spans two stores, and the CPU cannot
/// forward it, a stall on every page of a page-size-1 chain, where each hash
/// waits on the one before. This is xxh3's own arithmetic for that length
/// (`XXH3_len_17to128_128b` with one 32-byte mix), with the words taken from
/// the values; `tests` checks it against the crate, bit for bit.
#[inline(always)]
fn one_token(seed: u64, parent: u128, token: i32) -> u128 {
    // xxh3's default secret, bytes 0..32, as little-endian words.
    const S: [u64; 4] = [
        0xbe4b_a423_396c_feb8,
        0x1cad_21f7_2c81_017c,
        0xdb97_9083_e96d_d4de,
        0x1f67_b3b7_a4a4_4072,
    ];
    const P1: u64 = 0x9E37_79B1_85EB_CA87;
    const P2: u64 = 0xC2B2_AE3D_27D4_EB4F;
    const P4: u64 = 0x85EB_CA77_C2B2_AE63;
    const LEN: u64 = 20;
    let mix16 = |a: u64, b: u64, s0: u64, s1: u64| {
        let m = (a ^ s0.wrapping_add(seed)) as u128 * (b ^ s1.wrapping_sub(seed)) as u128;
        (m as u64) ^ ((m >> 64) as u64)
    };
    let avalanche = |mut v: u64| {
        v ^= v >> 37;
        v = v.wrapping_mul(0x1656_6791_9E37_79F9);
        v ^ (v >> 32)
    };
    // Words 0..16 (the parent) and 4..20 (its bytes 4..16 and the token).
    let (a0, a1) = (parent as u64, (parent >> 64) as u64);
    let (b0, b1) = (
        (parent >> 32) as u64,
        (parent >> 96) as u64 | ((token as u32 as u64) << 32),
    );
    let mut lo = LEN.wrapping_mul(P1);
    let mut hi = 0u64;
    lo = lo.wrapping_add(mix16(a0, a1, S[0], S[1]));
    lo ^= b0.wrapping_add(b1);
    hi = hi.wrapping_add(mix16(b0, b1, S[2], S[3]));
    hi ^= a0.wrapping_add(a1);
    let low = avalanche(lo.wrapping_add(hi));
    let high = 0u64.wrapping_sub(avalanche(
        lo.wrapping_mul(P1)
            .wrapping_add(hi.wrapping_mul(P4))
            .wrapping_add(LEN.wrapping_sub(seed).wrapping_mul(P2)),
    ));
    ((high as u128) << 64) | low as u128
}

/// `xxh3_128(seed, parent || tokens)` for pages of `N` tokens (`B` = 16 + 4N
/// bytes), the same bytes as the general path hashes.
#[inline(always)]
fn fixed<const N: usize, const B: usize>(seed: u64, parent: u128, tokens: &[i32]) -> u128 {
    debug_assert_eq!(B, 16 + 4 * N);
    let mut buf = [0u8; B];
    buf[..16].copy_from_slice(&parent.to_le_bytes());
    #[allow(clippy::needless_borrow)] // a Cow on big-endian targets
    buf[16..].copy_from_slice(&le_bytes(&tokens[..N]));
    xxh3_128_with_seed(&buf, seed)
}

/// The little-endian bytes of `tokens`: on little-endian targets the slice's
/// own memory (one memcpy instead of a per-token loop).
#[cfg(target_endian = "little")]
#[inline]
pub(crate) fn le_bytes(tokens: &[i32]) -> &[u8] {
    // SAFETY: i32 has no padding and every byte pattern is a valid u8; the
    // new slice covers exactly the same memory and borrows `tokens`.
    unsafe {
        std::slice::from_raw_parts(tokens.as_ptr() as *const u8, std::mem::size_of_val(tokens))
    }
}

#[cfg(not(target_endian = "little"))]
pub(crate) fn le_bytes(tokens: &[i32]) -> std::borrow::Cow<'_, [u8]> {
    tokens
        .iter()
        .flat_map(|t| t.to_le_bytes())
        .collect::<Vec<u8>>()
        .into()
}

/// Appends `tokens` to `out` as i32; true if every id was in [0, 2^31)
/// (else `check_token_ids` names the first bad one). One pass: the check
/// rides along the conversion instead of reading the ids twice.
#[inline]
pub(crate) fn push_token_ids(out: &mut Vec<i32>, tokens: &[i64]) -> bool {
    let mut high = 0u64;
    out.extend(tokens.iter().map(|&x| {
        high |= x as u64 >> 31;
        x as i32
    }));
    high == 0
}

/// Token ids must be in [0, 2^31): they are stored and hashed as i32.
pub(crate) fn check_token_ids(tokens: &[i64]) -> crate::error::Result<()> {
    // An id outside [0, 2^31) has a bit at or above 31 set; OR-ing them all
    // vectorizes, where a search for the first bad id would not.
    if tokens.iter().fold(0u64, |a, &x| a | (x as u64 >> 31)) == 0 {
        return Ok(());
    }
    match tokens
        .iter()
        .position(|&x| !(0..=i32::MAX as i64).contains(&x))
    {
        None => Ok(()),
        Some(j) => Err(crate::error::PoolError::InvalidArgument(format!(
            "tokens[{j}] = {} is not a token id; ids must be in [0, {}]",
            tokens[j],
            i32::MAX
        ))),
    }
}

/// The chain hashes of the full pages of a prompt of `tokens` under `salt`,
/// as a pool with `hash_seed = seed` files them (and names them in its
/// events). For readers that hold no pool, such as a KV-aware router.
///
/// Errors: `InvalidArgument` for a zero page size, a token id outside
/// [0, 2^31), or a prompt too long to allocate room for.
pub fn page_hashes(
    seed: u64,
    salt: i64,
    page_size: usize,
    tokens: &[i64],
) -> crate::error::Result<Vec<u128>> {
    if page_size == 0 {
        return Err(crate::error::PoolError::InvalidArgument(
            "page_size must be >= 1".into(),
        ));
    }
    check_token_ids(tokens)?;
    let n = tokens.len() / page_size;
    let mut ids = Vec::new();
    crate::memory::reserve(&mut ids, n * page_size, "prompt tokens")?;
    push_token_ids(&mut ids, &tokens[..n * page_size]);
    let mut out = Vec::new();
    crate::memory::reserve(&mut out, n, "chain hashes")?;
    let hasher = ChainHasher::new(seed, 0, ChainKind::Interop);
    let mut h = root(salt);
    for page in ids.chunks_exact(page_size) {
        h = hasher.page(h, page);
        out.push(h);
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
