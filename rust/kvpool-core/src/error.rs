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
         but only {free_pages} are free ({free_slots} free slots; pinned cached pages are not \
         free); nothing was allocated"
    )]
    Exhausted {
        needed_pages: usize,
        free_pages: usize,
        page_size: usize,
        free_slots: usize,
    },

    #[error("invalid handle {handle}: {problem}")]
    InvalidHandle { handle: i64, problem: HandleProblem },

    #[error(
        "too many requests: {call} asks for {requested} new {} with {open} of \
         max_requests={max} already open; at most {} more can open now (close requests \
         first, or ask for fewer)",
        if *.requested == 1 { "request" } else { "requests" },
        .max.saturating_sub(*.open)
    )]
    TooManyRequests {
        /// The call refused, as the caller wrote it (`open`, `fork`, ...).
        call: &'static str,
        requested: usize,
        // u32: at most MAX_REQUESTS, and the variant stays five words with the call's name.
        open: u32,
        max: u32,
    },

    #[error(
        "context too long: {} would reach {length} tokens, \
         more than max_context_len={max}",
        request_name(*.handle)
    )]
    ContextTooLong {
        /// The request's handle, or -1 for a request the call would open.
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
    /// A grouped pool's group (or its token-only anchor chain) is short of
    /// pages or state slots; the other groups may have room. Python maps it
    /// to the same class as `Exhausted`. Boxed, so that `PoolError` (the
    /// error of every hot call) stays as small as it was.
    #[error("{0}")]
    GroupExhausted(Box<GroupShortage>),

    /// `truncate` (or `roll_back_extend`) into the past that a group cannot
    /// serve: a sliding group released the pages the new length's window
    /// needs and they are no longer cached, or a state group
    /// has no checkpoint at the new length (its state is overwritten each
    /// step, so only a checkpoint can restore it).
    #[error("{0}")]
    RollbackUnavailable(Box<Rollback>),

    #[error("allocator invariant violated (a bug in kvpool): {0}")]
    Invariant(String),
}

pub type Result<T> = std::result::Result<T, PoolError>;

/// The details of [`PoolError::GroupExhausted`].
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error(
    "{} exhausted: the call needs {needed_pages} of its {} but only \
     {free_pages} are free or evictable{}; nothing was allocated in any group{}",
    group_name(*.group, .kind),
    shortage_unit(.kind, *.page_size),
    held_back_note(*.held_back),
    anchor_hint(.kind)
)]
pub struct GroupShortage {
    /// The group (`len(groups)` for a token-only anchor chain).
    pub group: usize,
    /// `"full"`, `"sliding"`, `"state"` or `"anchor"`.
    pub kind: &'static str,
    /// Pages, or state slots for a state group.
    pub needed_pages: usize,
    pub free_pages: usize,
    pub page_size: usize,
    /// Evictable slots the call may not take, besides `free_pages`: the
    /// checkpoints its own prefix hits restore from (state groups; 0
    /// elsewhere). Named in the message, since `free_pages(group)` counts them.
    pub held_back: usize,
}

/// The details of [`PoolError::RollbackUnavailable`].
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error(
    "cannot truncate request {handle} to {length} tokens: group {group} ({kind}) {reason}; \
     nothing was changed"
)]
pub struct Rollback {
    pub handle: i64,
    pub length: usize,
    pub group: usize,
    pub kind: &'static str,
    pub reason: String,
}

/// How a shortage names its group: the token-only anchor chain has an index
/// past the groups that no per-group call takes, so it is named by what it is.
fn group_name(group: usize, kind: &str) -> String {
    if kind == "anchor" {
        format!("the token-only anchor chain (group {group}, past the layer groups)")
    } else {
        format!("group {group} ({kind})")
    }
}

/// What to change when the anchor chain runs short: its own size.
fn anchor_hint(kind: &str) -> &'static str {
    if kind == "anchor" {
        " (size the anchor with anchor_pages=, by default room for every request's longest \
         context twice)"
    } else {
        ""
    }
}

/// What a group's shortage counts: a state group holds one state slot per
/// request, not pages of token slots.
fn shortage_unit(kind: &str, page_size: usize) -> String {
    if kind == "state" {
        "state slots (one per request)".to_string()
    } else {
        format!("pages ({page_size} slots each)")
    }
}

/// Why a shortage is larger than the group's free count suggests.
fn held_back_note(held_back: usize) -> String {
    match held_back {
        0 => String::new(),
        1 => " (1 more is the checkpoint a prefix hit of this call restores from, \
              which the call cannot evict)"
            .to_string(),
        n => format!(
            " ({n} more are checkpoints prefix hits of this call restore from, \
             which the call cannot evict)"
        ),
    }
}

/// How an error names a request: by handle, or as the new request a
/// call would have opened (handle -1).
fn request_name(handle: i64) -> String {
    if handle < 0 {
        "a new request".to_string()
    } else {
        format!("request {handle}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every hot call returns `Result<_, PoolError>`: the group variants'
    /// details are boxed so that they do not widen it past the largest
    /// single-pool variant (`Exhausted`: four words and a tag).
    #[test]
    fn pool_error_stays_as_small_as_the_single_pool_variants() {
        assert!(
            std::mem::size_of::<PoolError>() <= 5 * std::mem::size_of::<usize>(),
            "PoolError is {} bytes",
            std::mem::size_of::<PoolError>()
        );
    }
}
