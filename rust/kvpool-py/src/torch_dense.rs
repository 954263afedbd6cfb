//! Caches and rows given as CPU torch tensors (`scatter_rows`), read and
//! written in place through torch's borrowed DLPack view, after the same
//! checks as `torch_arg` (exactly torch.Tensor, plain dispatch keys) and
//! inside the storage's bounds (see `torch_arg`'s notes).

use dlpark::ffi::{DLDeviceType, DLTensor};
use pyo3::exceptions::{PyException, PyMemoryError};
use pyo3::prelude::*;

use crate::torch_arg::{torch_for, within, Export};

/// A C-contiguous CPU tensor's memory, as torch's DLPack view describes it:
/// the rows of its first dimension, each `row_bytes` long.
pub struct Dense {
    pub data: *mut u8,
    pub rows: usize,
    pub row_bytes: usize,
    /// DLPack's (code, bits, lanes) and the shape after the first dimension:
    /// two tensors whose rows may be copied into each other agree on both.
    pub dtype: (u8, u8, u16),
    pub row_shape: Vec<i64>,
}

impl Dense {
    pub fn bytes(&self) -> usize {
        self.rows * self.row_bytes
    }
}

/// A tensor's storage object and its bytes `[start, end)`.
pub type Pinned<'py> = (Bound<'py, PyAny>, (usize, usize));

/// The storage of `obj` and its bounds if it is exactly a plain
/// torch.Tensor that torch can lend a borrowed C view of, for
/// [`dense_view`]; None for anything else (the caller then takes torch's
/// own path). Runs Python code: every tensor of a call is checked before any
/// view is taken. The caller holds the storage for as long as it uses the
/// view: another thread that points the tensor elsewhere (`set_`) while the
/// GIL is released then cannot free the memory under the copy.
pub fn plain_span<'py>(py: Python<'py>, obj: &Bound<'py, PyAny>) -> PyResult<Option<Pinned<'py>>> {
    let Some(torch) = torch_for(py, obj) else {
        return Ok(None);
    };
    // Only the borrowed view: an owning capsule would have to outlive the
    // copy, and a torch that lacks the view takes torch's path.
    if !matches!(torch.export, Export::View(_)) || !torch.is_plain(py, obj)? {
        return Ok(None);
    }
    // A storage torch will not describe (an exception) is torch's to report,
    // on its own path; MemoryError and interrupts are the caller's.
    match torch.storage_of(py, obj) {
        Err(e) if e.is_instance_of::<PyException>(py) && !e.is_instance_of::<PyMemoryError>(py) => {
            Ok(None)
        }
        r => r.map(Some),
    }
}

/// `obj`'s memory if it is a plain, C-contiguous (size-1 dimensions aside),
/// at least 1-D CPU torch.Tensor lying inside `span` (from [`plain_span`] on
/// `obj`, with no Python code run since), through torch's borrowed C view;
/// None for anything else (a storage resized below the shape included:
/// torch's own path then refuses it). Runs no Python code. The pointer is
/// valid while the storage from [`plain_span`] is held and not resized (the
/// contract of any buffer lent to native code: a resize reallocates the
/// storage's memory in place, which no reference prevents).
pub fn dense_view(py: Python<'_>, obj: &Bound<'_, PyAny>, span: (usize, usize)) -> Option<Dense> {
    let torch = torch_for(py, obj)?;
    let Export::View(view) = &torch.export else {
        return None;
    };
    let mut dl = DLTensor::default();
    // SAFETY: `obj` is exactly a torch.Tensor, the type the exchange API
    // was taken from; `dl` is a valid place for the view. On failure the
    // function sets a Python exception.
    if unsafe { view(obj.as_ptr().cast(), &mut dl) } != 0 {
        let _ = PyErr::take(py);
        return None;
    }
    // SAFETY: the view describes `obj`'s live memory and its shape and
    // strides arrays, read here before any Python code runs.
    let d = unsafe { dense_of(&dl) }?;
    let lo = d.data as usize;
    within(span, lo, lo.checked_add(d.bytes())?).then_some(d)
}

/// # Safety
/// `dl`'s shape and strides arrays must be readable for the call.
unsafe fn dense_of(dl: &DLTensor) -> Option<Dense> {
    if dl.device.device_type != DLDeviceType::CPU || dl.ndim < 1 || dl.shape.is_null() {
        return None;
    }
    if dl.dtype.bits % 8 != 0 || dl.dtype.lanes == 0 {
        return None;
    }
    let ndim = usize::try_from(dl.ndim).ok()?;
    let shape = std::slice::from_raw_parts(dl.shape, ndim);
    let strides = (!dl.strides.is_null()).then(|| std::slice::from_raw_parts(dl.strides, ndim));
    // Elements of a C-contiguous tensor: each dimension's stride is the
    // product of the sizes after it (a size-1 dimension's stride is free).
    let mut expect: i64 = 1;
    for d in (0..ndim).rev() {
        if shape[d] < 0 {
            return None;
        }
        if let Some(st) = strides {
            if shape[d] != 1 && st[d] != expect {
                return None;
            }
        }
        expect = expect.checked_mul(shape[d])?;
    }
    let item = usize::from(dl.dtype.bits / 8) * usize::from(dl.dtype.lanes);
    let rows = usize::try_from(shape[0]).ok()?;
    let row_items = shape[1..]
        .iter()
        .try_fold(1usize, |a, &s| a.checked_mul(usize::try_from(s).ok()?))?;
    let row_bytes = row_items.checked_mul(item)?;
    if rows.checked_mul(row_bytes)? > isize::MAX as usize {
        return None;
    }
    let offset = usize::try_from(dl.byte_offset).ok()?;
    if dl.data.is_null() && rows * row_bytes != 0 {
        return None;
    }
    Some(Dense {
        data: (dl.data as *mut u8).wrapping_add(offset),
        rows,
        row_bytes,
        dtype: (dl.dtype.code.0, dl.dtype.bits, dl.dtype.lanes),
        row_shape: shape[1..].to_vec(),
    })
}
