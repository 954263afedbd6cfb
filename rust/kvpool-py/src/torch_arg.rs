//! Integer arguments given as CPU torch tensors (handles, counts and token
//! ids straight from an engine's tensors), read in place. `numpy.asarray`
//! costs ~1.6 us a tensor (torch's `__array__` wrapper, then a new array);
//! this path costs a few hundred ns.
//!
//! Nothing Python code can override is trusted with a pointer. Tensor
//! methods and properties (`numel()`, `is_contiguous()`, `data_ptr()`,
//! `dtype`, ...) go through `__torch_function__`, so a `TorchFunctionMode`
//! or a monkeypatch can make them lie, and a lie about a length or a
//! layout would turn into a read outside the tensor. Instead:
//! - the layout (data pointer, length, stride, dtype, device) comes from
//!   torch's DLPack export, called in C: the C exchange API's
//!   `dltensor_from_py_object_no_sync` (a borrowed view, no allocation) or,
//!   on a torch without it, `torch._C._to_dlpack` (a capsule that holds a
//!   reference to the tensor until it is dropped);
//! - DLPack has no negative bit (a `_neg_view` exports its stored,
//!   unnegated values), so the tensor's dispatch keys, read by
//!   `torch._C._dispatch_keys` (also C), must be a subset of a plain CPU
//!   tensor's: no Negative, Conjugate, Functionalize, Python, sparse or
//!   meta key.
//!
//! These C functions are looked up once, when the first tensor arrives,
//! and kept only if they are torch's builtins (not Python replacements).
//! Anything else (a subclass, another device or dtype, a 0-d or 2-D
//! tensor, an extra dispatch key, an export that fails) takes the numpy
//! path, which reads it or names what is wrong.
//!
//! As with any buffer lent to native code, another thread must not resize
//! the tensor's storage during the call.

use std::ffi::{c_int, c_void};

use dlpark::ffi::{
    DLDataTypeCode, DLDeviceType, DLManagedTensor, DLPackExchangeAPI, DLTensor,
    DLPACK_MAJOR_VERSION,
};
use pyo3::exceptions::{PyException, PyMemoryError, PyTypeError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

use crate::widen::widen;

type ViewFn = unsafe extern "C" fn(*mut c_void, *mut DLTensor) -> c_int;

/// How a tensor's DLPack description is obtained.
enum Export {
    /// torch's C exchange API (a borrowed view of the live tensor).
    View(ViewFn),
    /// `torch._C._to_dlpack` (an owning capsule).
    Capsule(Py<PyAny>),
}

struct Torch {
    tensor_type: Py<PyType>,
    export: Export,
    /// `torch._C._dispatch_keys`.
    dispatch_keys: Py<PyAny>,
    /// `torch._C.DispatchKeySet.raw_repr`, called on the key set.
    raw_repr: Py<PyAny>,
    /// The bits of a plain CPU tensor's key set (an inference tensor's
    /// keys are a subset).
    plain_keys: u64,
}

impl Torch {
    /// Whether `t`'s dispatch keys are a subset of a plain CPU tensor's.
    fn is_plain(&self, py: Python<'_>, t: &Bound<'_, PyAny>) -> PyResult<bool> {
        let keys = self.dispatch_keys.bind(py).call1((t,))?;
        let raw = self.raw_repr.bind(py).call1((keys,))?.extract::<u64>()?;
        Ok(raw & !self.plain_keys == 0)
    }
}

/// torch's functions, or None when this torch lacks them (or they are not
/// torch's own): then every tensor takes the numpy path.
static TORCH: PyOnceLock<Option<Torch>> = PyOnceLock::new();

/// `obj` if it is a builtin (C) function, else a TypeError.
fn builtin<'py>(obj: Bound<'py, PyAny>, what: &str) -> PyResult<Bound<'py, PyAny>> {
    // SAFETY: `obj` is a live object.
    if unsafe { ffi::PyCFunction_Check(obj.as_ptr()) } == 0 {
        return Err(PyTypeError::new_err(format!(
            "{what} is not torch's C function"
        )));
    }
    Ok(obj)
}

fn load(py: Python<'_>) -> PyResult<Torch> {
    let torch = py.import("torch")?;
    let c = torch.getattr("_C")?;
    let tensor_type = torch.getattr("Tensor")?.cast_into::<PyType>()?.unbind();
    let dispatch_keys = builtin(c.getattr("_dispatch_keys")?, "_dispatch_keys")?;
    let key_set = c.getattr("DispatchKeySet")?;
    // A pybind11 method: an instancemethod around the C function.
    let raw_repr = builtin(
        key_set.getattr("raw_repr")?.getattr("__func__")?,
        "raw_repr",
    )?;
    let key = c.getattr("DispatchKey")?;
    let mut plain_keys = 0u64;
    for name in ["CPU", "ADInplaceOrView", "AutogradCPU", "AutocastCPU"] {
        let set = key_set.call1((key.getattr(name)?,))?;
        plain_keys |= raw_repr.call1((set,))?.extract::<u64>()?;
    }
    let export = match exchange_view(&c) {
        Some(view) => Export::View(view),
        None => Export::Capsule(builtin(c.getattr("_to_dlpack")?, "_to_dlpack")?.unbind()),
    };
    Ok(Torch {
        tensor_type,
        export,
        dispatch_keys: dispatch_keys.unbind(),
        raw_repr: raw_repr.unbind(),
        plain_keys,
    })
}

/// The C exchange API's view function, if this torch has one (from
/// `torch._C._dlpack_exchange_api()`, not from the overridable class
/// attribute `Tensor.__dlpack_c_exchange_api__`).
fn exchange_view(c: &Bound<'_, PyAny>) -> Option<ViewFn> {
    let get = builtin(c.getattr("_dlpack_exchange_api").ok()?, "").ok()?;
    let capsule = get.call0().ok()?;
    // SAFETY: `capsule` is a live object; a capsule of another name (or not
    // a capsule) gives null with an exception set, cleared below.
    let api =
        unsafe { ffi::PyCapsule_GetPointer(capsule.as_ptr(), c"dlpack_exchange_api".as_ptr()) }
            as *const DLPackExchangeAPI;
    if api.is_null() {
        let _ = PyErr::take(capsule.py());
        return None;
    }
    // SAFETY: a "dlpack_exchange_api" capsule holds a static table that
    // lives as long as the process (the DLPack spec); its header is
    // read first, and the rest only if its major version is this layout's.
    let api = unsafe { &*api };
    if api.header.version.major != DLPACK_MAJOR_VERSION {
        return None;
    }
    api.dltensor_from_py_object_no_sync
}

/// torch's functions if `obj` is exactly a torch.Tensor, else None.
fn torch_for<'a>(py: Python<'a>, obj: &Bound<'_, PyAny>) -> Option<&'a Torch> {
    let ty = obj.get_type();
    let torch = match TORCH.get(py) {
        Some(t) => t.as_ref()?,
        None => {
            // Nothing is imported until an object that looks like a tensor
            // arrives (a caller that passes one has imported torch). The
            // name is only a cheap filter; identity with torch's own class
            // decides below.
            let named = ty.name().is_ok_and(|n| n == "Tensor")
                && ty
                    .module()
                    .is_ok_and(|m| m == "torch" || m == "torch._tensor");
            if !named {
                return None;
            }
            TORCH.get_or_init(py, || load(py).ok()).as_ref()?
        }
    };
    // Exactly torch.Tensor: subclasses (parameters, fake and wrapper
    // tensors) take the numpy path.
    ty.is(torch.tensor_type.bind(py)).then_some(torch)
}

/// The tensor's values as i64, or None to leave it to the numpy path
/// (which names what is wrong). A tensor's own errors (an export that
/// raises) fall through to that path too; MemoryError and interrupts
/// (KeyboardInterrupt is no Exception) are the caller's and propagate.
pub fn read_tensor(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<Option<Vec<i64>>> {
    let Some(torch) = torch_for(py, obj) else {
        return Ok(None);
    };
    match read_plain(py, torch, obj) {
        Err(e) if e.is_instance_of::<PyException>(py) && !e.is_instance_of::<PyMemoryError>(py) => {
            Ok(None)
        }
        other => other,
    }
}

fn read_plain(py: Python<'_>, torch: &Torch, t: &Bound<'_, PyAny>) -> PyResult<Option<Vec<i64>>> {
    if !torch.is_plain(py, t)? {
        return Ok(None);
    }
    match &torch.export {
        Export::View(view) => {
            let mut dl = DLTensor::default();
            // SAFETY: `t` is exactly a torch.Tensor, the type the exchange
            // API was taken from; `dl` is a valid place for the view. On
            // failure the function sets a Python exception.
            if unsafe { view(t.as_ptr().cast(), &mut dl) } != 0 {
                return Err(PyErr::fetch(py));
            }
            // SAFETY: the view describes `t`'s own memory, which stays
            // valid while `t` lives (the caller's argument) and no Python
            // code runs: none does until the copy is made.
            unsafe { copy_out(&dl) }
        }
        Export::Capsule(to_dlpack) => {
            let capsule = to_dlpack.bind(py).call1((t,))?;
            // SAFETY: `capsule` is a live object; a wrong name gives null
            // with an exception set.
            let managed =
                unsafe { ffi::PyCapsule_GetPointer(capsule.as_ptr(), c"dltensor".as_ptr()) }
                    as *const DLManagedTensor;
            if managed.is_null() {
                return Err(PyErr::fetch(py));
            }
            // SAFETY: an unconsumed "dltensor" capsule owns its managed
            // tensor, and that holds a reference to the tensor's storage,
            // until the capsule is destroyed (its destructor calls the
            // deleter, since the name is left as it is): `capsule` lives
            // past the copy, and no Python code runs before it.
            let r = unsafe { copy_out(&(*managed).dl_tensor) };
            drop(capsule);
            r
        }
    }
}

/// The values of a 1-D CPU integer DLPack tensor, or None for any other.
///
/// # Safety
/// `dl` must describe memory that stays valid and unchanged for the call.
unsafe fn copy_out(dl: &DLTensor) -> PyResult<Option<Vec<i64>>> {
    if dl.device.device_type != DLDeviceType::CPU || dl.ndim != 1 || dl.dtype.lanes != 1 {
        return Ok(None);
    }
    let kind = match (dl.dtype.code, dl.dtype.bits) {
        (DLDataTypeCode::INT, 8 | 16 | 32 | 64) => b'i',
        (DLDataTypeCode::UINT, 8 | 16 | 32) => b'u',
        _ => return Ok(None),
    };
    let size = usize::from(dl.dtype.bits / 8);
    if dl.shape.is_null() {
        return Ok(None);
    }
    let Ok(len) = usize::try_from(*dl.shape) else {
        return Ok(None);
    };
    if len == 0 {
        return Ok(Some(Vec::new()));
    }
    // Strides may be null before DLPack 1.2: compact.
    let stride = if dl.strides.is_null() { 1 } else { *dl.strides };
    let Some(step) = isize::try_from(stride)
        .ok()
        .and_then(|s| s.checked_mul(size as isize))
    else {
        return Ok(None);
    };
    let extent_ok = (len - 1)
        .checked_mul(step.unsigned_abs())
        .is_some_and(|e| e <= isize::MAX as usize);
    let Ok(offset) = usize::try_from(dl.byte_offset) else {
        return Ok(None);
    };
    let data = (dl.data as *const u8).wrapping_add(offset);
    if dl.data.is_null() || data as usize % size != 0 || !extent_ok {
        return Ok(None);
    }
    // SAFETY: torch's own description of the tensor: `len` items of this
    // integer type, `step` bytes apart from `data`, aligned (checked) and
    // inside the tensor's storage, valid for the call (the caller's
    // contract).
    widen(data, len, step, (kind, size)).map(Some)
}

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

/// `obj`'s memory if it is exactly a plain, C-contiguous (size-1 dimensions
/// aside), at least 1-D CPU torch.Tensor, through torch's borrowed C view;
/// None for anything else (the caller then takes torch's own path). The
/// pointer is valid while `obj` lives and its storage is not resized, the
/// contract of any buffer lent to native code.
pub fn dense_view(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<Option<Dense>> {
    let Some(torch) = torch_for(py, obj) else {
        return Ok(None);
    };
    // Only the borrowed view: an owning capsule would have to outlive the
    // copy, and a torch that lacks the view takes torch's path.
    let Export::View(view) = &torch.export else {
        return Ok(None);
    };
    if !torch.is_plain(py, obj)? {
        return Ok(None);
    }
    let mut dl = DLTensor::default();
    // SAFETY: `obj` is exactly a torch.Tensor, the type the exchange API
    // was taken from; `dl` is a valid place for the view. On failure the
    // function sets a Python exception.
    if unsafe { view(obj.as_ptr().cast(), &mut dl) } != 0 {
        let _ = PyErr::take(py);
        return Ok(None);
    }
    // SAFETY: the view describes `obj`'s live memory and its shape and
    // strides arrays, read here before any Python code runs.
    Ok(unsafe { dense_of(&dl) })
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
