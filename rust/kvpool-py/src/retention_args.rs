//! The retention arguments of cache and close (priority, retain_s), read
//! into plain values before the core call.

use kvpool_core::Counts;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyFloat, PyInt};

use crate::convert::{counts_of, int_arg, type_name, IntArg};
use crate::errors::{invalid_argument, refuse_unless_interrupt};

/// The priority (one, or one per request) and duration a cache or close
/// call gives.
pub(crate) struct Retention {
    priority: IntArg,
    pub(crate) retain_s: Option<f64>,
}

impl Retention {
    /// None when neither is given; retain_s alone is refused.
    pub(crate) fn of(
        py: Python<'_>,
        priority: Option<&Bound<'_, PyAny>>,
        retain_s: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<Self>> {
        let retain_s = retain_s
            .map(|r| seconds_arg(py, r, "retain_s"))
            .transpose()?;
        match priority {
            None if retain_s.is_some() => Err(invalid_argument(
                py,
                "retain_s says how long a priority lasts: pass a priority with it",
            )),
            None => Ok(None),
            Some(p) => Ok(Some(Retention {
                priority: int_arg(py, p, "priority")?,
                retain_s,
            })),
        }
    }

    pub(crate) fn counts(&self) -> Counts<'_> {
        counts_of(&self.priority)
    }
}

/// A number of seconds: an int or a float (numpy's too), not a bool. Its
/// range is the core's to check.
pub(crate) fn seconds_arg(py: Python<'_>, obj: &Bound<'_, PyAny>, what: &str) -> PyResult<f64> {
    if is_bool_like(obj) {
        return Err(invalid_argument(
            py,
            format!(
                "{what} must be a number of seconds, got a bool ({}); pass an int or a float",
                obj.repr().map(|r| r.to_string()).unwrap_or_default()
            ),
        ));
    }
    obj.extract::<f64>().map_err(|e| {
        refuse_unless_interrupt(py, e, || {
            invalid_argument(
                py,
                format!(
                    "{what} must be a number of seconds, got {} {}",
                    type_name(obj),
                    obj.repr().map(|r| r.to_string()).unwrap_or_default()
                ),
            )
        })
    })
}

/// A Python bool, or a numpy or torch bool (a scalar, or a 0-d array or
/// tensor): each converts to a float, so `extract::<f64>` alone takes them.
fn is_bool_like(obj: &Bound<'_, PyAny>) -> bool {
    if obj.is_exact_instance_of::<PyFloat>() || obj.is_exact_instance_of::<PyInt>() {
        return false; // the common case, without the failed attribute lookup below
    }
    if obj.is_instance_of::<PyBool>() {
        return true;
    }
    // numpy's bool scalar and arrays (dtype "bool"), torch's tensors ("torch.bool").
    obj.getattr("dtype")
        .and_then(|d| d.str().map(|s| s.to_string()))
        .is_ok_and(|d| d == "bool" || d == "torch.bool")
}
