//! `page_hashes`: the core's prefix chain hash for readers that hold no pool
//! (a KV-aware router computes a prompt's page hashes and looks them up in
//! what the pools' events told it).

use numpy::PyArray1;
use pyo3::prelude::*;

use crate::convert::int_arg;
use crate::convert::seed_arg;
use crate::errors::invalid_argument;
use crate::errors::Result;

/// page_hashes(tokens, page_size, hash_seed, salt=None) -> ndarray[uint64]
///
/// The chain hashes of the full pages of a prompt, as a pool built with
/// this hash_seed names them in its KV events and chain_hashes (the trailing
/// partial page has none). Holds no pool.
///
/// Args:
///     tokens: the prompt's token ids (ints in [0, 2^31)).
///     page_size: tokens per page (>= 1), the pool's page_size.
///     hash_seed: the pool's hash_seed.
///     salt: the request's salt as given to open_with_prefix (None: 0).
///
/// Returns:
///     uint64 [2n]: (hi, lo) of each full page's 128-bit hash, as
///     SlotAllocator.chain_hashes gives them.
///
/// Raises:
///     InvalidArgumentError: a token id out of range, page_size < 1, a seed
///         not in [0, 2**64), a salt that is not an int.
#[pyfunction]
#[pyo3(signature = (tokens, page_size, hash_seed, salt=None))]
pub fn page_hashes<'py>(
    py: Python<'py>,
    tokens: &Bound<'py, PyAny>,
    page_size: &Bound<'py, PyAny>,
    hash_seed: &Bound<'py, PyAny>,
    salt: Option<&Bound<'py, PyAny>>,
) -> Result<Bound<'py, PyArray1<u64>>> {
    let tokens = int_arg(py, tokens, "tokens")?.into_vec();
    let page_size = match crate::convert::int_scalar(py, page_size, "page_size")? {
        p if p >= 1 => p as usize,
        // (usize_arg's ">= 0" would send a caller to 0, which the core refuses next)
        p => return Err(invalid_argument(py, format!("page_size must be >= 1, got {p}")).into()),
    };
    let seed = seed_arg(py, hash_seed, "hash_seed")?;
    let salt = match salt {
        Some(s) => crate::convert::int_scalar(py, s, "salt")?,
        None => 0,
    };
    let hashes = py.detach(|| kvpool_core::page_hashes(seed, salt, page_size, &tokens))?;
    let words: Vec<u64> = hashes
        .iter()
        .flat_map(|&h| [(h >> 64) as u64, h as u64])
        .collect();
    Ok(PyArray1::from_vec(py, words))
}
