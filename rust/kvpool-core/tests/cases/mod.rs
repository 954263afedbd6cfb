//! How many cases a proptest file runs.
//!
//! `ProptestConfig::with_cases(n)` overwrites the count that proptest reads
//! from `PROPTEST_CASES`, so with a fixed `n` a longer campaign
//! (`PROPTEST_CASES=20000 cargo test --release --test model`) silently ran
//! the CI count. Each file keeps its own default; the variable overrides it.

pub fn from_env(default: u32) -> u32 {
    match std::env::var("PROPTEST_CASES") {
        Err(_) => default,
        // Zero would pass every property without running one.
        Ok(v) => match v.trim().parse::<u32>() {
            Ok(n) if n > 0 => n,
            _ => panic!(
                "PROPTEST_CASES={v:?} is not a case count; give a positive integer such as 5000"
            ),
        },
    }
}
