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
//! DLPack describes the tensor's shape, not its storage: a storage resized
//! below the shape (`t.untyped_storage().resize_(n)`) still exports the
//! old shape, and reading or writing by it would leave the allocation
//! (torch's own ops refuse such a tensor). So the storage's bounds are read
//! first (`untyped_storage()`, `data_ptr()`, `nbytes()`: the C method
//! descriptors of `torch._C.TensorBase` / `StorageBase`, called directly,
//! so that no override answers), before the view, and
//! the view must lie inside them; between that read and the copy no Python
//! code runs.
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

/// A plain CPU tensor's dispatch keys (an inference tensor's keys are a
/// subset), and how a tensor's key set is compared with them.
enum PlainKeys {
    /// `torch._C.DispatchKeySet.raw_repr` (called on the key set) and the
    /// bits of the plain key set.
    Raw(Py<PyAny>, u64),
    /// A torch without `raw_repr` (2.4): `DispatchKeySet.__or__` and
    /// `__repr__` (C functions, like `raw_repr`), the plain key set and its
    /// repr: the keys are a subset when `keys | plain` reprs as `plain`
    /// (the set has no `==`, and `-` drops backend bits such as Meta's).
    Sets([Py<PyAny>; 2], Py<PyAny>, String),
}

/// How a tensor's DLPack description is obtained.
pub(crate) enum Export {
    /// torch's C exchange API (a borrowed view of the live tensor).
    View(ViewFn),
    /// `torch._C._to_dlpack` (an owning capsule).
    Capsule(Py<PyAny>),
}

pub(crate) struct Torch {
    tensor_type: Py<PyType>,
    pub(crate) export: Export,
    /// `torch._C._dispatch_keys`.
    dispatch_keys: Py<PyAny>,
    /// How a key set is compared with a plain CPU tensor's.
    keys: PlainKeys,
    /// `TensorBase.untyped_storage`, `StorageBase.data_ptr` and
    /// `StorageBase.nbytes` (C method descriptors).
    storage: [Py<PyAny>; 3],
}

impl Torch {
    /// Whether `t`'s dispatch keys are a subset of a plain CPU tensor's.
    pub(crate) fn is_plain(&self, py: Python<'_>, t: &Bound<'_, PyAny>) -> PyResult<bool> {
        let keys = self.dispatch_keys.bind(py).call1((t,))?;
        match &self.keys {
            PlainKeys::Raw(raw_repr, plain) => {
                let raw = raw_repr.bind(py).call1((keys,))?.extract::<u64>()?;
                Ok(raw & !plain == 0)
            }
            PlainKeys::Sets([or, repr], plain, plain_repr) => {
                let union = or.bind(py).call1((keys, plain.bind(py)))?;
                Ok(repr.bind(py).call1((union,))?.extract::<String>()? == *plain_repr)
            }
        }
    }
}

impl Torch {
    /// The byte range `[start, end)` of `t`'s storage. Calls into torch
    /// (which allocates, so the GC may run Python code): read before the
    /// DLPack view, never between it and its use.
    pub(crate) fn storage_span(
        &self,
        py: Python<'_>,
        t: &Bound<'_, PyAny>,
    ) -> PyResult<(usize, usize)> {
        self.storage_of(py, t).map(|(_, span)| span)
    }

    /// [`Self::storage_span`] with the storage object itself: a reference
    /// to the tensor's storage, which keeps its memory allocated while it
    /// is held even if the tensor is pointed elsewhere meanwhile (`set_`,
    /// `.data =`, the tensor dropped).
    pub(crate) fn storage_of<'py>(
        &self,
        py: Python<'py>,
        t: &Bound<'py, PyAny>,
    ) -> PyResult<(Bound<'py, PyAny>, (usize, usize))> {
        let [untyped, data_ptr, nbytes] = &self.storage;
        let s = untyped.bind(py).call1((t,))?;
        let start = data_ptr.bind(py).call1((&s,))?.extract::<usize>()?;
        let len = nbytes.bind(py).call1((&s,))?.extract::<usize>()?;
        Ok((s, (start, start.saturating_add(len))))
    }
}

/// Whether the bytes `[lo, hi)` lie inside `span` (nothing is always inside).
pub(crate) fn within(span: (usize, usize), lo: usize, hi: usize) -> bool {
    lo == hi || (span.0 <= lo && hi <= span.1)
}

/// A tensor whose shape reaches past its storage.
const OUTSIDE: &str = "the tensor's shape and strides reach past its storage (was the \
                       storage resized?); torch itself refuses to use such a tensor";

/// torch's functions, or None when this torch lacks them (or they are not
/// torch's own): then every tensor takes the numpy path.
static TORCH: PyOnceLock<Option<Torch>> = PyOnceLock::new();

/// `class.name` if it is a C method descriptor, else a TypeError.
fn c_method<'py>(class: &Bound<'py, PyAny>, name: &str) -> PyResult<Bound<'py, PyAny>> {
    let m = class.getattr(name)?;
    // SAFETY: `m` is a live object; the type object is a static of the
    // interpreter, only its address is taken.
    let is_descr =
        unsafe { ffi::Py_TYPE(m.as_ptr()) == std::ptr::addr_of_mut!(ffi::PyMethodDescr_Type) };
    if !is_descr {
        return Err(PyTypeError::new_err(format!(
            "{name} is not torch's C method"
        )));
    }
    Ok(m)
}

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
    let method = |name: &str| -> PyResult<Bound<'_, PyAny>> {
        builtin(key_set.getattr(name)?.getattr("__func__")?, name)
    };
    let key = c.getattr("DispatchKey")?;
    let sets = ["CPU", "ADInplaceOrView", "AutogradCPU", "AutocastCPU"]
        .map(|name| key_set.call1((key.getattr(name)?,)));
    let keys = if key_set.hasattr("raw_repr")? {
        let raw_repr = method("raw_repr")?;
        let mut plain_keys = 0u64;
        for set in sets {
            plain_keys |= raw_repr.call1((set?,))?.extract::<u64>()?;
        }
        PlainKeys::Raw(raw_repr.unbind(), plain_keys)
    } else {
        let or = method("__or__")?;
        let [first, rest @ ..] = sets;
        let mut plain = first?;
        for set in rest {
            plain = or.call1((plain, set?))?;
        }
        let repr = method("__repr__")?;
        let plain_repr = repr.call1((&plain,))?.extract::<String>()?;
        PlainKeys::Sets([or.unbind(), repr.unbind()], plain.unbind(), plain_repr)
    };
    let export = match exchange_view(&c) {
        Some(view) => Export::View(view),
        None => Export::Capsule(builtin(c.getattr("_to_dlpack")?, "_to_dlpack")?.unbind()),
    };
    let (tb, sb) = (c.getattr("TensorBase")?, c.getattr("StorageBase")?);
    let storage = [
        c_method(&tb, "untyped_storage")?.unbind(),
        c_method(&sb, "data_ptr")?.unbind(),
        c_method(&sb, "nbytes")?.unbind(),
    ];
    Ok(Torch {
        storage,
        tensor_type,
        export,
        dispatch_keys: dispatch_keys.unbind(),
        keys,
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
pub(crate) fn torch_for<'a>(py: Python<'a>, obj: &Bound<'_, PyAny>) -> Option<&'a Torch> {
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
///
/// A tensor whose shape reaches past its storage is an InvalidArgumentError
/// naming `what` (numpy's path would read past the storage too: torch's
/// `__array__` does not check), or None without a `what`.
pub fn read_tensor(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    what: Option<&str>,
) -> PyResult<Option<Vec<i64>>> {
    let Some(torch) = torch_for(py, obj) else {
        return Ok(None);
    };
    match read_plain(py, torch, obj) {
        Err(e) if e.is_instance_of::<PyException>(py) && !e.is_instance_of::<PyMemoryError>(py) => {
            Ok(None)
        }
        Ok(Err(Outside)) => match what {
            Some(w) => Err(crate::errors::invalid_argument(
                py,
                format!("{w}: {OUTSIDE}"),
            )),
            None => Ok(None),
        },
        Ok(Ok(v)) => Ok(v),
        Err(e) => Err(e),
    }
}

/// A tensor's view reaches past its storage.
struct Outside;

type Read = Result<Option<Vec<i64>>, Outside>;

fn read_plain(py: Python<'_>, torch: &Torch, t: &Bound<'_, PyAny>) -> PyResult<Read> {
    if !torch.is_plain(py, t)? {
        return Ok(Ok(None));
    }
    let span = torch.storage_span(py, t)?;
    match &torch.export {
        Export::View(view) => {
            let mut dl = DLTensor::default();
            // SAFETY: `t` is exactly a torch.Tensor, the type the exchange
            // API was taken from; `dl` is a valid place for the view. On
            // failure the function sets a Python exception.
            if unsafe { view(t.as_ptr().cast(), &mut dl) } != 0 {
                return Err(PyErr::fetch(py));
            }
            // SAFETY: the view describes `t`'s own memory, checked against
            // its storage's bounds (read just before), which stays valid
            // while `t` lives (the caller's argument) and no Python code
            // runs: none does until the copy is made.
            unsafe { copy_out(&dl, span) }
        }
        Export::Capsule(to_dlpack) => {
            // torch < 2.5 (no exchange API) checks the storage in the export
            // itself: a tensor past its storage raises there, and falling back
            // to the numpy path would read past it (`__array__` does not check).
            let capsule = match to_dlpack.bind(py).call1((t,)) {
                Err(e) if e.to_string().contains("out of bounds for storage") => {
                    return Ok(Err(Outside))
                }
                r => r?,
            };
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
            // The capsule's creation ran no Python code after `span` was read.
            let r = unsafe { copy_out(&(*managed).dl_tensor, span) };
            drop(capsule);
            r
        }
    }
}

/// The values of a 1-D CPU integer DLPack tensor, or None for any other;
/// Outside when they do not lie within `span`, its storage's bytes.
///
/// # Safety
/// `dl` must describe memory that stays valid and unchanged for the call,
/// where it lies within `span`.
unsafe fn copy_out(dl: &DLTensor, span: (usize, usize)) -> PyResult<Read> {
    if dl.device.device_type != DLDeviceType::CPU || dl.ndim != 1 || dl.dtype.lanes != 1 {
        return Ok(Ok(None));
    }
    let kind = match (dl.dtype.code, dl.dtype.bits) {
        (DLDataTypeCode::INT, 8 | 16 | 32 | 64) => b'i',
        (DLDataTypeCode::UINT, 8 | 16 | 32) => b'u',
        _ => return Ok(Ok(None)),
    };
    let size = usize::from(dl.dtype.bits / 8);
    if dl.shape.is_null() {
        return Ok(Ok(None));
    }
    let Ok(len) = usize::try_from(*dl.shape) else {
        return Ok(Ok(None));
    };
    if len == 0 {
        return Ok(Ok(Some(Vec::new())));
    }
    // Strides may be null before DLPack 1.2: compact.
    let stride = if dl.strides.is_null() { 1 } else { *dl.strides };
    let Some(step) = isize::try_from(stride)
        .ok()
        .and_then(|s| s.checked_mul(size as isize))
    else {
        return Ok(Ok(None));
    };
    let extent_ok = (len - 1)
        .checked_mul(step.unsigned_abs())
        .is_some_and(|e| e <= isize::MAX as usize);
    let Ok(offset) = usize::try_from(dl.byte_offset) else {
        return Ok(Ok(None));
    };
    if dl.data.is_null() {
        // Items but no memory: a storage resized to nothing.
        return Ok(Err(Outside));
    }
    let data = (dl.data as *const u8).wrapping_add(offset);
    if data as usize % size != 0 || !extent_ok {
        return Ok(Ok(None));
    }
    // The bytes the items span (`extent_ok`: no overflow), lowest first.
    let reach = (len - 1) * step.unsigned_abs();
    let lo = if step < 0 {
        (data as usize).wrapping_sub(reach)
    } else {
        data as usize
    };
    if lo > data as usize || !within(span, lo, lo.saturating_add(reach + size)) {
        return Ok(Err(Outside));
    }
    // SAFETY: torch's own description of the tensor: `len` items of this
    // integer type, `step` bytes apart from `data`, aligned (checked) and
    // inside the tensor's storage (checked against `span`), valid for the
    // call (the caller's contract).
    widen(data, len, step, (kind, size)).map(|v| Ok(Some(v)))
}
