//! The pool's clock, which retention priorities end by: the system's
//! monotonic clock from the pool's construction, or a manual clock that
//! only moves when the caller sets it (tests, and tensor-parallel ranks,
//! which must all see the same time to evict the same pages).
//!
//! Time is in nanoseconds from the clock's start. The system clock is read
//! only where a priority's end could matter (a pending end, and a victim
//! sought or a duration given), never on a pool that gives no durations.

use std::time::Instant;

use crate::error::{PoolError, Result};

/// The longest duration, and the latest time a manual clock is set to, in
/// seconds (about 31 years): far past any use, far below u64 nanoseconds.
pub const MAX_SECONDS: f64 = 1e9;

#[derive(Debug, Clone)]
pub(crate) enum Clock {
    System(Instant),
    Manual(u64),
}

impl Clock {
    pub(crate) fn new(manual: bool) -> Self {
        if manual {
            Clock::Manual(0)
        } else {
            Clock::System(Instant::now())
        }
    }

    /// Nanoseconds since the clock's start.
    #[inline]
    pub(crate) fn now(&self) -> u64 {
        match self {
            Clock::System(t0) => t0.elapsed().as_nanos().min(u64::MAX as u128) as u64,
            Clock::Manual(t) => *t,
        }
    }

    /// The manual clock's time, else None.
    pub(crate) fn manual(&self) -> Option<u64> {
        match self {
            Clock::System(_) => None,
            Clock::Manual(t) => Some(*t),
        }
    }

    /// Sets a manual clock to `now_s` seconds. Errors (nothing changed):
    /// `InvalidArgument` for the system clock, a time that is not finite, is
    /// negative or past `MAX_SECONDS`, or earlier than the clock's.
    pub(crate) fn set(&mut self, now_s: f64) -> Result<()> {
        let Clock::Manual(t) = self else {
            return Err(PoolError::InvalidArgument(
                "this pool runs on the system clock; build it with manual_clock=True to set \
                 its time"
                    .into(),
            ));
        };
        if !(0.0..=MAX_SECONDS).contains(&now_s) {
            return Err(PoolError::InvalidArgument(format!(
                "the clock's time must be in [0, {MAX_SECONDS:e}] seconds, got {now_s}"
            )));
        }
        let ns = seconds_to_ns(now_s);
        if ns < *t {
            return Err(PoolError::InvalidArgument(format!(
                "the clock never goes back: it is at {} s, got {now_s}",
                *t as f64 / 1e9
            )));
        }
        *t = ns;
        Ok(())
    }
}

/// Seconds (checked to be in [0, MAX_SECONDS]) as nanoseconds, rounded to
/// the nearest.
pub(crate) fn seconds_to_ns(s: f64) -> u64 {
    (s * 1e9).round() as u64
}

/// A duration in seconds as nanoseconds, at least 1. Errors: `InvalidArgument`
/// unless it is finite, > 0 and at most `MAX_SECONDS`.
pub(crate) fn duration_ns(retain_s: f64) -> Result<u64> {
    if !(retain_s > 0.0 && retain_s <= MAX_SECONDS) {
        return Err(PoolError::InvalidArgument(format!(
            "retain_s must be a number of seconds in (0, {MAX_SECONDS:e}], got {retain_s}"
        )));
    }
    Ok(seconds_to_ns(retain_s).max(1))
}
