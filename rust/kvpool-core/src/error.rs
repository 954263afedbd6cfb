//! Typed errors of the allocator. Every failing call leaves the allocator
//! exactly as it was, so an error is always safe to catch and retry.

use thiserror::Error;

/// Why a handle was rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandleProblem {
    /// Negative, or its row is not below `max_requests`, or generation 0.
    Unknown,
    /// The row holds no open request (it was closed, or never opened).
    Closed,
    /// The row was reopened since: the handle's generation is old.
    Stale,
}

impl std::fmt::Display for HandleProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            HandleProblem::Unknown => "not a handle of this allocator",
            HandleProblem::Closed => "the request was closed (or never opened)",
            HandleProblem::Stale => "stale: its row was closed and reopened by a newer request",
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PoolError {
    #[error(
        "pool exhausted: the call needs {needed_pages} free pages ({page_size} slots each) \
         but only {free_pages} are free ({free_slots} free slots); nothing was allocated"
    )]
    Exhausted {
        needed_pages: usize,
        free_pages: usize,
        page_size: usize,
        free_slots: usize,
    },

    #[error("invalid handle {handle}: {problem}")]
    InvalidHandle { handle: i64, problem: HandleProblem },

    #[error("too many requests: open({requested}) with {open} of max_requests={max} already open")]
    TooManyRequests {
        requested: usize,
        open: usize,
        max: usize,
    },

    #[error(
        "context too long: request {handle} would reach {length} tokens, \
         more than max_context_len={max}"
    )]
    ContextTooLong {
        handle: i64,
        length: u64,
        max: usize,
    },

    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    #[error(
        "request {handle} is swapped out (swap_out): extend, truncate, fork, cache and its \
         slots, pages or page table need it on the device; call swap_in first"
    )]
    RequestSwappedOut { handle: i64 },

    #[error(
        "host tier exhausted: the call needs {needed_pages} host pages but only {free_pages} \
         are free or evictable; nothing was moved"
    )]
    HostExhausted {
        needed_pages: usize,
        free_pages: usize,
    },

    #[error("allocator invariant violated (a bug in kvpool): {0}")]
    Invariant(String),
}

pub type Result<T> = std::result::Result<T, PoolError>;
