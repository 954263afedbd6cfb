//! `copy`, `deepcopy` and `pickle` of the allocators, refused with messages that name them.
//!
//! Without these, all three fell through to copyreg's "cannot pickle
//! 'kvpool._core.SlotAllocator' object": a message about pickling for a
//! `copy.copy`, and the same untyped `TypeError` the Python objects over a pool
//! (`KVPool`, `KVPoolCache`, ...) replaced with `CopyRefusedError` (python/kvpool/_nopickle.py).
//! An allocator is one pool's bookkeeping (handles, page records, the prefix
//! index): a copy would hand out the same pages twice, so none is made.

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use crate::allocator::PySlotAllocator;
use crate::grouped::PyGroupedAllocator;

const COPY_INSTEAD: &str = "a copy would hand out the same pages as the original; \
     pass this allocator itself where it is needed, fork() a request inside it \
     (pages shared, copy-on-write), or build another allocator with the same arguments";

const SEND_INSTEAD: &str = "it holds this process's pool state; send plain results \
     (handles, page tables, stats(), take_events()) to another process, or build the \
     allocator there";

/// `kvpool.CopyRefusedError` (a `KVPoolError` and a `TypeError`, defined in
/// Python); a plain `TypeError` with the same message if that module cannot load.
fn copy_refused(py: Python<'_>, name: &str) -> PyErr {
    let msg = format!("cannot copy a {name}: {COPY_INSTEAD}");
    match py
        .import("kvpool.errors")
        .and_then(|m| m.getattr("CopyRefusedError"))
    {
        Ok(cls) => PyErr::from_value(match cls.call1((msg.clone(),)) {
            Ok(e) => e,
            Err(_) => return PyTypeError::new_err(msg),
        }),
        Err(_) => PyTypeError::new_err(msg),
    }
}

fn pickle_refused(name: &str) -> PyErr {
    PyTypeError::new_err(format!("cannot pickle a {name}: {SEND_INSTEAD}"))
}

/// `__copy__`, `__deepcopy__`, `__replace__` (Python 3.13's `copy.replace()`:
/// a modified copy, refused as a copy is) and `__reduce_ex__` for one class.
macro_rules! refuse_copies {
    ($class:ty, $name:literal) => {
        #[pymethods]
        impl $class {
            fn __copy__(&self, py: Python<'_>) -> PyResult<()> {
                Err(copy_refused(py, $name))
            }

            fn __deepcopy__(&self, py: Python<'_>, _memo: &Bound<'_, PyAny>) -> PyResult<()> {
                Err(copy_refused(py, $name))
            }

            #[pyo3(signature = (**_changes))]
            fn __replace__(
                &self,
                py: Python<'_>,
                _changes: Option<&Bound<'_, pyo3::types::PyDict>>,
            ) -> PyResult<()> {
                Err(copy_refused(py, $name))
            }

            fn __reduce_ex__(&self, _protocol: &Bound<'_, PyAny>) -> PyResult<()> {
                Err(pickle_refused($name))
            }
        }
    };
}

refuse_copies!(PySlotAllocator, "SlotAllocator");
refuse_copies!(PyGroupedAllocator, "GroupedAllocator");
