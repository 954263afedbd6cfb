//! The `SlotAllocator` Python class: converts arguments, releases the GIL
//! around batch work, and returns numpy arrays built from Vecs (no per-element
//! Python objects). One Mutex guards the core, so the object can be shared by
//! threads; code holding the Mutex never needs the GIL, so no deadlock.

use std::sync::{Mutex, MutexGuard, TryLockError};

use kvpool_core::{Counts, SlotAllocator as Core};
use numpy::{PyArray1, PyUntypedArray};
use pyo3::prelude::*;

use crate::convert::{int_arg, int_scalar, IntArg};
use crate::errors::{invalid_argument, to_pyerr};
use crate::output::{extend_total, new_i64};
use crate::table::Table;

type Arr<'py, T> = Bound<'py, PyArray1<T>>;

#[pyclass(name = "SlotAllocator", module = "kvpool._core", frozen)]
pub struct SlotAllocator {
    inner: Mutex<Core>,
    /// (max_requests, max_context_len, num_slots): fixed at construction, so
    /// extend reads them without taking the lock.
    dims: (usize, usize, usize),
}

impl SlotAllocator {
    fn lock(&self) -> MutexGuard<'_, Core> {
        // The core never panics on caller input; if a bug ever poisoned the
        // lock, keep serving so that check() can report what is wrong.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs a short query. Uncontended, it takes the lock with the GIL held
    /// (cheapest); if another thread holds the lock (maybe for a long batch),
    /// it waits with the GIL released so other Python threads keep running.
    fn query<R: Send>(&self, py: Python<'_>, f: impl FnOnce(&Core) -> R + Send) -> R {
        match self.inner.try_lock() {
            Ok(guard) => f(&guard),
            Err(TryLockError::Poisoned(e)) => f(&e.into_inner()),
            Err(TryLockError::WouldBlock) => py.detach(|| f(&self.lock())),
        }
    }

    fn stat(&self, py: Python<'_>, f: fn(&Core) -> usize) -> usize {
        self.query(py, f)
    }
}

/// A numpy array owning a copy of `v`. Copying (a memcpy) beats handing the
/// Vec over (`from_vec`): that wraps it in a GC-tracked container object,
/// and the extra GC traffic costs more than the copy on the hot path.
fn to_numpy<'py, T: numpy::Element>(py: Python<'py>, v: &[T]) -> Arr<'py, T> {
    PyArray1::from_slice(py, v)
}

fn counts_of(arg: &IntArg) -> Counts<'_> {
    match arg {
        IntArg::Scalar(c) => Counts::Each(*c),
        IntArg::Many(v) => Counts::PerRequest(v),
    }
}

fn usize_arg(py: Python<'_>, v: i64, what: &str) -> PyResult<usize> {
    usize::try_from(v).map_err(|_| invalid_argument(py, format!("{what} must be >= 0, got {v}")))
}

#[pymethods]
impl SlotAllocator {
    #[new]
    #[pyo3(signature = (num_pages, page_size=1, max_requests=256, max_context_len=4096))]
    fn new(
        py: Python<'_>,
        num_pages: i64,
        page_size: i64,
        max_requests: i64,
        max_context_len: i64,
    ) -> PyResult<Self> {
        let num_pages = usize_arg(py, num_pages, "num_pages")?;
        let page_size = usize_arg(py, page_size, "page_size")?;
        let max_requests = usize_arg(py, max_requests, "max_requests")?;
        let max_context_len = usize_arg(py, max_context_len, "max_context_len")?;
        let core = py
            .detach(|| Core::new(num_pages, page_size, max_requests, max_context_len))
            .map_err(|e| to_pyerr(py, e))?;
        let dims = (
            core.max_requests(),
            core.max_context_len(),
            core.num_slots(),
        );
        Ok(Self {
            inner: Mutex::new(core),
            dims,
        })
    }

    #[getter]
    fn page_size(&self, py: Python<'_>) -> usize {
        self.stat(py, Core::page_size)
    }
    #[getter]
    fn num_pages(&self, py: Python<'_>) -> usize {
        self.stat(py, Core::num_pages)
    }
    #[getter]
    fn num_slots(&self, py: Python<'_>) -> usize {
        self.stat(py, Core::num_slots)
    }
    #[getter]
    fn max_requests(&self, py: Python<'_>) -> usize {
        self.stat(py, Core::max_requests)
    }
    #[getter]
    fn max_context_len(&self, py: Python<'_>) -> usize {
        self.stat(py, Core::max_context_len)
    }
    #[getter]
    fn free_pages(&self, py: Python<'_>) -> usize {
        self.stat(py, Core::free_pages)
    }
    #[getter]
    fn used_pages(&self, py: Python<'_>) -> usize {
        self.stat(py, Core::used_pages)
    }
    #[getter]
    fn capacity_pages(&self, py: Python<'_>) -> usize {
        self.stat(py, Core::capacity_pages)
    }
    #[getter]
    fn free_slots(&self, py: Python<'_>) -> usize {
        self.stat(py, Core::free_slots)
    }
    #[getter]
    fn used_slots(&self, py: Python<'_>) -> usize {
        self.stat(py, Core::used_slots)
    }
    #[getter]
    fn capacity_slots(&self, py: Python<'_>) -> usize {
        self.stat(py, Core::capacity_slots)
    }
    #[getter]
    fn open_requests(&self, py: Python<'_>) -> usize {
        self.stat(py, Core::open_requests)
    }
    #[getter]
    fn admissible_tokens(&self, py: Python<'_>) -> usize {
        self.stat(py, Core::admissible_tokens)
    }
    #[getter]
    fn metadata_bytes(&self, py: Python<'_>) -> usize {
        self.stat(py, Core::metadata_bytes)
    }

    #[pyo3(signature = (n=1))]
    fn open<'py>(&self, py: Python<'py>, n: i64) -> PyResult<Arr<'py, i64>> {
        let n = usize_arg(py, n, "n")?;
        let v = py
            .detach(|| self.lock().open(n))
            .map_err(|e| to_pyerr(py, e))?;
        Ok(to_numpy(py, &v))
    }

    #[pyo3(signature = (handles, counts, table=None))]
    fn extend<'py>(
        &self,
        py: Python<'py>,
        handles: &Bound<'py, PyAny>,
        counts: &Bound<'py, PyAny>,
        table: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Arr<'py, i64>> {
        let h = int_arg(py, handles, "handles")?.into_vec();
        let c = int_arg(py, counts, "counts")?;
        let (rows, cols, num_slots) = self.dims;
        // Validate the table fully before any change; keep `table` alive
        // (it is borrowed from the caller) while its buffer is written.
        let t = match table {
            None => None,
            Some(table) => {
                let arr = table.cast::<PyUntypedArray>().map_err(|_| {
                    invalid_argument(
                        py,
                        "table must be a numpy int32 2-D array (e.g. tensor.numpy())",
                    )
                })?;
                Some(Table::validate(py, arr, rows, cols, num_slots)?)
            }
        };
        let (arr, mut out) = new_i64(py, extend_total(h.len(), &c, num_slots))?;
        py.detach(|| {
            // SAFETY: `arr` is alive and not yet shared (see OutBuf).
            let dst = unsafe { out.slice() };
            self.lock()
                .extend_into(&h, counts_of(&c), None, dst, |g| {
                    if let Some(t) = &t {
                        // SAFETY: validated above (int32, C-contiguous, writeable,
                        // big enough); the caller's array object is referenced by
                        // `table` for the whole call, so its buffer stays alive.
                        unsafe { t.write_grown(g) }
                    }
                })
        })
        .map_err(|e| to_pyerr(py, e))?;
        Ok(arr)
    }

    fn extend_with_starts<'py>(
        &self,
        py: Python<'py>,
        handles: &Bound<'py, PyAny>,
        counts: &Bound<'py, PyAny>,
    ) -> PyResult<(Arr<'py, i64>, Arr<'py, i64>)> {
        let h = int_arg(py, handles, "handles")?.into_vec();
        let c = int_arg(py, counts, "counts")?;
        let (arr, mut out) = new_i64(py, extend_total(h.len(), &c, self.dims.2))?;
        let (starts_arr, mut starts) = new_i64(py, h.len())?;
        py.detach(|| {
            // SAFETY: both arrays are alive and not yet shared (see OutBuf).
            let (dst, st) = unsafe { (out.slice(), starts.slice()) };
            self.lock()
                .extend_into(&h, counts_of(&c), None, dst, |g| {
                    // i < handles.len() == st.len(); get_mut keeps it panic-free.
                    if let Some(s) = st.get_mut(g.index) {
                        *s = g.start as i64;
                    }
                })
        })
        .map_err(|e| to_pyerr(py, e))?;
        Ok((arr, starts_arr))
    }

    fn truncate(
        &self,
        py: Python<'_>,
        handles: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let h = int_arg(py, handles, "handles")?.into_vec();
        let l = int_arg(py, lengths, "lengths")?;
        py.detach(|| self.lock().truncate(&h, counts_of(&l)))
            .map_err(|e| to_pyerr(py, e))
    }

    fn close(&self, py: Python<'_>, handles: &Bound<'_, PyAny>) -> PyResult<()> {
        let h = int_arg(py, handles, "handles")?.into_vec();
        py.detach(|| self.lock().close(&h, false))
            .map_err(|e| to_pyerr(py, e))
    }

    fn length(&self, py: Python<'_>, handle: &Bound<'_, PyAny>) -> PyResult<usize> {
        let h = int_scalar(py, handle, "handle")?;
        self.query(py, |a| a.length(h)).map_err(|e| to_pyerr(py, e))
    }

    fn lengths<'py>(
        &self,
        py: Python<'py>,
        handles: &Bound<'py, PyAny>,
    ) -> PyResult<Arr<'py, i64>> {
        let h = int_arg(py, handles, "handles")?.into_vec();
        let v = py
            .detach(|| self.lock().lengths(&h))
            .map_err(|e| to_pyerr(py, e))?;
        Ok(to_numpy(py, &v))
    }

    fn slots<'py>(&self, py: Python<'py>, handle: &Bound<'py, PyAny>) -> PyResult<Arr<'py, i64>> {
        let h = int_scalar(py, handle, "handle")?;
        let v = py
            .detach(|| self.lock().slots(h))
            .map_err(|e| to_pyerr(py, e))?;
        Ok(to_numpy(py, &v))
    }

    fn pages<'py>(&self, py: Python<'py>, handle: &Bound<'py, PyAny>) -> PyResult<Arr<'py, i32>> {
        let h = int_scalar(py, handle, "handle")?;
        let v = py
            .detach(|| self.lock().pages(h))
            .map_err(|e| to_pyerr(py, e))?;
        Ok(to_numpy(py, &v))
    }

    fn page_table<'py>(
        &self,
        py: Python<'py>,
        handles: &Bound<'py, PyAny>,
    ) -> PyResult<(Arr<'py, i32>, Arr<'py, i32>, Arr<'py, i32>)> {
        let h = int_arg(py, handles, "handles")?.into_vec();
        let t = py
            .detach(|| self.lock().page_table(&h))
            .map_err(|e| to_pyerr(py, e))?;
        Ok((
            to_numpy(py, &t.indptr),
            to_numpy(py, &t.indices),
            to_numpy(py, &t.last_page_len),
        ))
    }

    fn rows<'py>(&self, py: Python<'py>, handles: &Bound<'py, PyAny>) -> PyResult<Arr<'py, i64>> {
        let h = int_arg(py, handles, "handles")?.into_vec();
        let v = py
            .detach(|| self.lock().rows(&h))
            .map_err(|e| to_pyerr(py, e))?;
        Ok(to_numpy(py, &v))
    }

    fn is_open(&self, py: Python<'_>, handle: &Bound<'_, PyAny>) -> PyResult<bool> {
        let h = int_scalar(py, handle, "handle")?;
        Ok(self.query(py, |a| a.is_open(h)))
    }

    fn check(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.lock().check())
            .map_err(|e| to_pyerr(py, e))
    }

    fn reset(&self, py: Python<'_>) {
        py.detach(|| self.lock().reset())
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        self.query(py, |a| {
            format!(
                "SlotAllocator(num_pages={}, page_size={}, max_requests={}, max_context_len={}; \
             free_pages={}, open_requests={})",
                a.num_pages(),
                a.page_size(),
                a.max_requests(),
                a.max_context_len(),
                a.free_pages(),
                a.open_requests()
            )
        })
    }
}
