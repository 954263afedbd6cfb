//! Scattering K/V rows into a cache by slot: the store behind a CPU pool's
//! `write`. torch's `index_copy_` walks a bf16 row element by element
//! (~110 µs for 64 rows of 8 x 128 on the 2-core VM); a row is contiguous
//! in both the cache and the source, so one `memcpy` a row does the same.
//!
//! Every slot is checked against every cache before any byte moves, so a
//! refused call leaves the caches exactly as they were (torch checks each
//! index as it copies).

use crate::error::{PoolError, Result};

/// One cache and the rows to store into it: `src` holds `slots.len()`
/// rows of `row_bytes`, `dst` a whole number of rows.
pub struct RowCopy<'a> {
    pub dst: &'a mut [u8],
    pub src: &'a [u8],
}

/// Copies row `i` of every `src` to row `slots[i]` of its `dst`; negative
/// slots are padding and skipped. Returns the rows stored per cache.
///
/// A repeated slot is stored once per occurrence, the last one winning, as
/// `index_copy_` does on the CPU.
pub fn scatter_rows(copies: &mut [RowCopy<'_>], row_bytes: usize, slots: &[i64]) -> Result<usize> {
    let lens: Vec<(usize, usize)> = copies.iter().map(|c| (c.dst.len(), c.src.len())).collect();
    let stored = check_scatter(&lens, row_bytes, slots)?;
    for c in copies.iter_mut() {
        for (row, &slot) in c.src.chunks_exact(row_bytes).zip(slots) {
            // In range: checked above (slot < rows <= dst.len() / row_bytes).
            if let Ok(s) = usize::try_from(slot) {
                let at = s * row_bytes;
                c.dst[at..at + row_bytes].copy_from_slice(row);
            }
        }
    }
    Ok(stored)
}

/// `scatter_rows`' checks alone, for `(dst bytes, src bytes)` of each cache:
/// the rows it would store per cache, or the error it would raise having
/// written nothing. After `Ok`, every non-negative slot `s` names a whole row
/// `[s * row_bytes, (s + 1) * row_bytes)` of every `dst`, and every `src`
/// holds `slots.len()` rows, so a caller that copies through raw pointers
/// (the bindings, which must not claim a whole cache that other threads
/// write at the same time as one `&mut [u8]`) needs no check of its own.
pub fn check_scatter(lens: &[(usize, usize)], row_bytes: usize, slots: &[i64]) -> Result<usize> {
    if row_bytes == 0 {
        return Err(PoolError::InvalidArgument(
            "scatter_rows: rows of 0 bytes".to_owned(),
        ));
    }
    let mut rows = usize::MAX;
    for (i, &(dst_len, src_len)) in lens.iter().enumerate() {
        if dst_len % row_bytes != 0 {
            return Err(PoolError::InvalidArgument(format!(
                "scatter_rows: cache {i} holds {dst_len} bytes, not a whole number of {row_bytes}-byte rows"
            )));
        }
        if Some(src_len) != slots.len().checked_mul(row_bytes) {
            return Err(PoolError::InvalidArgument(format!(
                "scatter_rows: source {i} holds {src_len} bytes; {} slots of {row_bytes}-byte rows need {}",
                slots.len(),
                slots.len().saturating_mul(row_bytes)
            )));
        }
        rows = rows.min(dst_len / row_bytes);
    }
    let mut stored = 0;
    for (i, &slot) in slots.iter().enumerate() {
        if slot < 0 {
            continue;
        }
        if usize::try_from(slot).map_or(true, |s| s >= rows) {
            return Err(PoolError::InvalidArgument(format!(
                "slot {slot} (index {i}) is out of range: valid slots are [0, {rows})"
            )));
        }
        stored += 1;
    }
    Ok(stored)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caches(rows: usize, row_bytes: usize) -> (Vec<u8>, Vec<u8>) {
        (vec![0u8; rows * row_bytes], vec![0u8; rows * row_bytes])
    }

    #[test]
    fn stores_each_row_at_its_slot_and_skips_padding() {
        let (mut k, mut v) = caches(6, 4);
        let ks: Vec<u8> = (1..=12).collect();
        let vs: Vec<u8> = (101..=112).collect();
        let slots = [4, -1, 1];
        let n = scatter_rows(
            &mut [
                RowCopy {
                    dst: &mut k,
                    src: &ks,
                },
                RowCopy {
                    dst: &mut v,
                    src: &vs,
                },
            ],
            4,
            &slots,
        )
        .unwrap();
        assert_eq!(n, 2);
        assert_eq!(&k[16..20], &ks[0..4]);
        assert_eq!(&k[4..8], &ks[8..12]);
        assert_eq!(&v[16..20], &vs[0..4]);
        assert_eq!(&v[4..8], &vs[8..12]);
        // Padding's row went nowhere: every other row is still zero.
        for r in [0usize, 2, 3, 5] {
            assert!(k[r * 4..r * 4 + 4].iter().all(|&b| b == 0));
            assert!(v[r * 4..r * 4 + 4].iter().all(|&b| b == 0));
        }
    }

    #[test]
    fn a_slot_out_of_range_writes_nothing() {
        let (mut k, mut v) = caches(4, 2);
        let src = [7u8; 6];
        for bad in [4i64, i64::MAX] {
            let err = scatter_rows(
                &mut [
                    RowCopy {
                        dst: &mut k,
                        src: &src,
                    },
                    RowCopy {
                        dst: &mut v,
                        src: &src,
                    },
                ],
                2,
                &[0, 1, bad],
            )
            .unwrap_err();
            assert!(
                matches!(&err, PoolError::InvalidArgument(m) if m.contains("[0, 4)")),
                "{err}"
            );
            assert!(k.iter().chain(&v).all(|&b| b == 0));
        }
    }

    #[test]
    fn refuses_mismatched_geometry() {
        let (mut k, _) = caches(4, 2);
        for (row_bytes, src_len) in [(0usize, 0usize), (3, 3), (2, 5)] {
            let src = vec![1u8; src_len];
            let r = scatter_rows(
                &mut [RowCopy {
                    dst: &mut k,
                    src: &src,
                }],
                row_bytes,
                &[0],
            );
            assert!(
                matches!(r, Err(PoolError::InvalidArgument(_))),
                "{row_bytes} {src_len}"
            );
        }
        assert!(k.iter().all(|&b| b == 0));
    }

    #[test]
    fn a_repeated_slot_keeps_the_last_row() {
        let (mut k, _) = caches(2, 1);
        scatter_rows(
            &mut [RowCopy {
                dst: &mut k,
                src: &[5, 6],
            }],
            1,
            &[1, 1],
        )
        .unwrap();
        assert_eq!(k, [0, 6]);
    }
}
