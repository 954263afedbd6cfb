//! The host tier's constructor argument (`host_policy=`), read into the
//! core's policy before the allocator is built.

use kvpool_core::HostPolicy;
use pyo3::prelude::*;

use crate::errors::invalid_argument;

/// The `host_policy=` argument: "write_back" (default) or "write_through".
pub(crate) fn policy_arg(py: Python<'_>, obj: Option<&Bound<'_, PyAny>>) -> PyResult<HostPolicy> {
    let Some(obj) = obj else {
        return Ok(HostPolicy::WriteBack);
    };
    match obj.extract::<String>().as_deref() {
        Ok("write_back") => Ok(HostPolicy::WriteBack),
        Ok("write_through") => Ok(HostPolicy::WriteThrough),
        _ => Err(invalid_argument(
            py,
            format!(
                "host_policy must be \"write_back\" or \"write_through\", got {}",
                obj.repr().map_or_else(|_| "?".into(), |r| r.to_string())
            ),
        )),
    }
}
