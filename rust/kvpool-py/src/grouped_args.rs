//! What `GroupedAllocator`'s calls read and return: group dicts as core
//! specs (and back), `tables=` checked, per-group slot lists as arrays.

use kvpool_core::{GroupKind, GroupSpec, SlotTable};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::convert::int_scalar;
use crate::errors::invalid_argument;
use crate::output::{filled, new_uninit, to_numpy, Arr, OutBuf};
use crate::table::Table;

/// `tables=`: None, or one int32 table (or None) per group, none of them
/// over another's memory.
pub(crate) fn tables_arg(
    py: Python<'_>,
    tables: Option<&Bound<'_, PyAny>>,
    specs: &[GroupSpec],
    max_requests: usize,
    max_context_len: usize,
) -> PyResult<Vec<Option<Table>>> {
    let Some(tables) = tables else {
        return Ok(Vec::new());
    };
    let list: Vec<Bound<'_, PyAny>> = tables
        .try_iter()
        .map_err(|_| {
            invalid_argument(
                py,
                "tables must be a list with one int32 table (or None) per group",
            )
        })?
        .collect::<PyResult<_>>()?;
    if list.len() != specs.len() {
        return Err(invalid_argument(
            py,
            format!(
                "tables has {} entries but the pool has {} groups",
                list.len(),
                specs.len()
            ),
        ));
    }
    let mut out: Vec<Option<Table>> = Vec::with_capacity(list.len());
    for (g, t) in list.iter().enumerate() {
        if t.is_none() {
            out.push(None);
            continue;
        }
        let slots = specs[g].num_pages * specs[g].page_size;
        let t = Table::from_arg(py, t, max_requests, max_context_len, slots)?;
        let (lo, hi) = t.byte_range();
        if out.iter().flatten().any(|u| {
            let (a, b) = u.byte_range();
            lo < b && a < hi
        }) {
            return Err(invalid_argument(
                py,
                format!("tables[{g}] overlaps another group's table"),
            ));
        }
        out.push(Some(t));
    }
    Ok(out)
}

/// One group dict as a core spec.
pub(crate) fn group_spec(py: Python<'_>, g: usize, d: &Bound<'_, PyAny>) -> PyResult<GroupSpec> {
    let d = d
        .cast::<PyDict>()
        .map_err(|_| invalid_argument(py, format!("groups[{g}] must be a dict, e.g. {{\"kind\": \"full\", \"num_pages\": 1024, \"page_size\": 16}}")))?;
    let get = |k: &str| -> PyResult<Option<usize>> {
        // A negative value is told the key's own least value, not usize's 0: told ">= 0",
        // a caller who tries 0 is only refused again.
        let least = match k {
            "num_pages" | "num_slots" => 2,
            "page_size" | "window" => 1,
            _ => 0,
        };
        d.get_item(k)?
            .map(|v| {
                let what = format!("groups[{g}][{k:?}]");
                let n = int_scalar(py, &v, &what)?;
                usize::try_from(n).map_err(|_| {
                    invalid_argument(py, format!("{what} must be >= {least}, got {n}"))
                })
            })
            .transpose()
    };
    let kind: String = match d.get_item("kind")? {
        Some(k) => k
            .extract()
            .map_err(|_| invalid_argument(py, format!("groups[{g}][\"kind\"] must be a str")))?,
        None => return Err(invalid_argument(py, format!("groups[{g}] has no \"kind\""))),
    };
    let allowed: &[&str] = match kind.as_str() {
        "full" => &["kind", "num_pages", "page_size"],
        "sliding" => &["kind", "num_pages", "page_size", "window"],
        "state" => &["kind", "num_slots", "checkpoint_every"],
        k => {
            return Err(invalid_argument(
                py,
                format!("groups[{g}][\"kind\"] = {k:?}; use \"full\", \"sliding\" or \"state\""),
            ))
        }
    };
    for k in d.keys() {
        let k: String = k.extract().unwrap_or_default();
        if !allowed.contains(&k.as_str()) {
            return Err(invalid_argument(
                py,
                format!("groups[{g}] has key {k:?}, which a {kind:?} group does not take (it takes {allowed:?})"),
            ));
        }
    }
    let need = |k: &str, v: Option<usize>| {
        v.ok_or_else(|| invalid_argument(py, format!("groups[{g}] (a {kind:?} group) needs {k:?}")))
    };
    Ok(match kind.as_str() {
        "full" => GroupSpec::full(
            need("num_pages", get("num_pages")?)?,
            get("page_size")?.unwrap_or(1),
        ),
        "sliding" => GroupSpec::sliding(
            need("num_pages", get("num_pages")?)?,
            get("page_size")?.unwrap_or(1),
            need("window", get("window")?)?,
        ),
        _ => GroupSpec::state(
            need("num_slots", get("num_slots")?)?,
            get("checkpoint_every")?.unwrap_or(0),
        ),
    })
}

/// A group's spec as the dict the constructor takes.
pub(crate) fn spec_dict<'py>(py: Python<'py>, s: &GroupSpec) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("kind", s.kind.name())?;
    match s.kind {
        GroupKind::State { checkpoint_every } => {
            d.set_item("num_slots", s.num_pages)?;
            d.set_item("checkpoint_every", checkpoint_every)?;
        }
        GroupKind::Sliding { window } => {
            d.set_item("num_pages", s.num_pages)?;
            d.set_item("page_size", s.page_size)?;
            d.set_item("window", window)?;
        }
        GroupKind::Full => {
            d.set_item("num_pages", s.num_pages)?;
            d.set_item("page_size", s.page_size)?;
        }
    }
    Ok(d)
}

/// Each group's result array of an extend or admission, allocated before
/// the call changes the pool (see `output::filled`): `total(g)` slots for
/// an attention group `g`, none for a state group.
pub(crate) fn slot_rooms<'py>(
    py: Python<'py>,
    specs: &[GroupSpec],
    total: impl Fn(usize) -> usize,
) -> PyResult<Vec<(Arr<'py, i64>, OutBuf)>> {
    specs
        .iter()
        .enumerate()
        .map(|(g, s)| match s.kind {
            GroupKind::State { .. } => new_uninit::<i64>(py, 0),
            _ => new_uninit::<i64>(py, total(g)),
        })
        .collect()
}

/// Per-group slot Vecs as a list of int64 arrays, in the rooms made for
/// them before the call.
pub(crate) fn filled_lists<'py>(
    py: Python<'py>,
    rooms: Vec<(Arr<'py, i64>, OutBuf)>,
    outs: &[Vec<i64>],
) -> PyResult<Bound<'py, PyList>> {
    if rooms.len() != outs.len() {
        return slot_lists(py, outs);
    }
    let arrs = rooms
        .into_iter()
        .zip(outs)
        .map(|((arr, buf), v)| filled(py, arr, buf, v))
        .collect::<PyResult<Vec<_>>>()?;
    PyList::new(py, arrs)
}

/// Per-group slot Vecs as a list of int64 arrays.
pub(crate) fn slot_lists<'py>(py: Python<'py>, outs: &[Vec<i64>]) -> PyResult<Bound<'py, PyList>> {
    let arrs = outs
        .iter()
        .map(|v| to_numpy(py, v))
        .collect::<PyResult<Vec<_>>>()?;
    PyList::new(py, arrs)
}

/// The validated tables as the core's views.
///
/// # Safety
/// As `Table::view`: the arrays stay alive (each `Table` holds its own)
/// and do not overlap (`tables_arg` checked).
pub(crate) unsafe fn views(tables: &[Option<Table>]) -> Vec<Option<SlotTable<'_>>> {
    tables
        .iter()
        .map(|t| t.as_ref().map(|t| t.view()))
        .collect()
}
