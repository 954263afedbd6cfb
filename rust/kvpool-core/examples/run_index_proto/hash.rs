//! The interop chain hash, copied from `src/prefix/hashing.rs` (the example
//! may not reach the core's internals): `h_i = xxh3_128(seed, h_{i-1} as 16
//! little-endian bytes || the page's token ids as little-endian i32)`, with
//! `h_{-1}` the salt's root value. Same input layout, same fast paths (the
//! register-only 20-byte case at page 1, a stack buffer at page 16).

use xxhash_rust::xxh3::{xxh3_128_with_seed, Xxh3};

/// Root value of the chain of a request with `salt` (the core's `root`).
#[inline]
pub fn root(salt: i64) -> u128 {
    (0x6b76_706f_6f6c_0001u128 << 64) | salt as u64 as u128
}

/// `xxh3_128(seed, parent || tokens)`.
#[inline(always)]
pub fn page(seed: u64, parent: u128, tokens: &[i32]) -> u128 {
    match tokens.len() {
        1 => one_token(seed, parent, tokens[0]),
        16 => fixed::<16, 80>(seed, parent, tokens),
        _ => any_size(seed, parent, tokens),
    }
}

/// The plain definition, for the self-test to check `page` against.
pub fn reference(seed: u64, parent: u128, tokens: &[i32]) -> u128 {
    let mut b = parent.to_le_bytes().to_vec();
    for t in tokens {
        b.extend_from_slice(&t.to_le_bytes());
    }
    xxh3_128_with_seed(&b, seed)
}

#[inline(never)]
fn any_size(seed: u64, parent: u128, tokens: &[i32]) -> u128 {
    let mut x = Xxh3::with_seed(seed);
    x.update(&parent.to_le_bytes());
    x.update(le_bytes(tokens));
    x.digest128()
}

/// xxh3's own arithmetic for a 20-byte input, from registers (see the
/// core's `one_token` for why: a stack buffer stalls store forwarding).
#[inline(always)]
fn one_token(seed: u64, parent: u128, token: i32) -> u128 {
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

#[inline(always)]
fn fixed<const N: usize, const B: usize>(seed: u64, parent: u128, tokens: &[i32]) -> u128 {
    let mut buf = [0u8; B];
    buf[..16].copy_from_slice(&parent.to_le_bytes());
    buf[16..].copy_from_slice(le_bytes(&tokens[..N]));
    xxh3_128_with_seed(&buf, seed)
}

/// The little-endian bytes of `tokens` (this prototype assumes a
/// little-endian host; the build fails elsewhere).
#[inline]
fn le_bytes(tokens: &[i32]) -> &[u8] {
    // SAFETY: i32 has no padding and every byte pattern is a valid u8; the
    // new slice covers the same memory and borrows `tokens`.
    unsafe {
        std::slice::from_raw_parts(tokens.as_ptr() as *const u8, std::mem::size_of_val(tokens))
    }
}
