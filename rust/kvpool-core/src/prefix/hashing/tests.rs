use super::*;
use proptest::prelude::*;

proptest! {
    // The register-only page-size-1 hash is xxh3's, for any parent,
    // token and seed.
    #[test]
    fn one_token_is_xxh3(parent in any::<u128>(), token in any::<i32>(), seed in any::<u64>()) {
        let mut bytes = parent.to_le_bytes().to_vec();
        bytes.extend_from_slice(&token.to_le_bytes());
        prop_assert_eq!(one_token(seed, parent, token), xxh3_128_with_seed(&bytes, seed));
    }

    // A page size 1 index hashes a page by its token (`page_hash`):
    // the same value as the page's slice, for both chains and a mask.
    #[test]
    fn token_is_the_page_of_one_token(parent in any::<u128>(), token in any::<i32>(), seed in any::<u64>()) {
        for kind in [ChainKind::Interop, ChainKind::Internal] {
            for weak_bits in [0, 12] {
                let h = ChainHasher::new(seed, weak_bits, kind);
                prop_assert_eq!(h.token(parent, token), h.page(parent, &[token]));
            }
        }
    }
}

/// Every page size, fixed-buffer or not, hashes exactly
/// `xxh3_128(seed, parent || tokens)`.
#[test]
fn page_hash_is_xxh3_of_parent_and_tokens() {
    for ps in [1usize, 2, 15, 16, 17, 32, 64, 65, 128, 129, 300] {
        let tokens: Vec<i32> = (0..ps as i32).map(|i| i * 7919 + 3).collect();
        let parent = 0x0123_4567_89ab_cdef_fedc_ba98_7654_3210u128 ^ ps as u128;
        let mut bytes = parent.to_le_bytes().to_vec();
        for t in &tokens {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        let h = ChainHasher::new(42, 0, ChainKind::Interop);
        assert_eq!(
            h.page(parent, &tokens),
            xxh3_128_with_seed(&bytes, 42),
            "ps {ps}"
        );
        let weak = ChainHasher::new(42, 12, ChainKind::Interop);
        assert_eq!(
            weak.page(parent, &tokens),
            xxh3_128_with_seed(&bytes, 42) & 0xfff
        );
    }
}

/// The public per-page functions chain to what `page_hashes` returns.
#[test]
fn chain_page_hash_from_chain_root_is_page_hashes() {
    for ps in [1usize, 3, 16] {
        let tokens: Vec<i64> = (0..5 * ps as i64).map(|i| i * 7919 % 32000).collect();
        let want = page_hashes(9, -4, ps, &tokens).unwrap();
        let mut h = chain_root(-4);
        for (k, page) in tokens.chunks_exact(ps).enumerate() {
            let ids: Vec<i32> = page.iter().map(|&t| t as i32).collect();
            h = chain_page_hash(9, h, &ids);
            assert_eq!(h, want[k], "ps {ps}, page {k}");
        }
    }
}

/// The internal chain is another chain (64-bit values), seeded, and
/// distinct per token; `interop` under it is still xxh3's.
#[test]
fn internal_chain_is_its_own_and_interop_stays_xxh3() {
    for ps in [1usize, 2, 16, 17] {
        let tokens: Vec<i32> = (0..ps as i32).map(|i| i * 31 + 1).collect();
        let parent = root(5);
        let int = ChainHasher::new(42, 0, ChainKind::Internal);
        let ext = ChainHasher::new(42, 0, ChainKind::Interop);
        let h = int.page(parent, &tokens);
        assert_eq!(h >> 64, 0, "ps {ps}: a 64-bit value");
        assert_ne!(h, ext.page(parent, &tokens));
        assert_eq!(int.interop(parent, &tokens), ext.page(parent, &tokens));
        let other_seed = ChainHasher::new(43, 0, ChainKind::Internal);
        assert_ne!(h, other_seed.page(parent, &tokens), "ps {ps}: seeded");
        let mut next = tokens.clone();
        next[ps - 1] += 1;
        assert_ne!(h, int.page(parent, &next), "ps {ps}: the last token counts");
        assert_ne!(h, int.page(root(6), &tokens), "ps {ps}: the parent counts");
    }
    // No two of the first 2^16 tokens under one parent share a value.
    let int = ChainHasher::new(1, 0, ChainKind::Internal);
    let mut seen: Vec<u128> = (0..1 << 16).map(|t| int.page(root(0), &[t])).collect();
    seen.sort_unstable();
    seen.dedup();
    assert_eq!(seen.len(), 1 << 16);
}
