//! Python exception classes, the exhaustive PoolError -> exception mapping,
//! and the `Error` type binding methods return so that `?` converts both.

use kvpool_core::PoolError;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyMemoryError, PySystemError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

create_exception!(
    kvpool,
    KVPoolError,
    PyException,
    "Base class of every kvpool error."
);
create_exception!(
    kvpool,
    PoolExhaustedError,
    KVPoolError,
    "Not enough free pages for the call; the message says needed vs free."
);
create_exception!(
    kvpool,
    InvalidHandleError,
    KVPoolError,
    "Unknown, closed or stale request handle."
);
create_exception!(
    kvpool,
    TooManyRequestsError,
    KVPoolError,
    "open() would exceed max_requests open requests."
);
create_exception!(
    kvpool,
    ContextTooLongError,
    KVPoolError,
    "A request would grow past max_context_len tokens."
);
create_exception!(
    kvpool,
    RollbackUnavailableError,
    KVPoolError,
    "truncate of a grouped pool to a length a group cannot restore: a sliding window \
     released the pages it needs and they are no longer cached, or a state group keeps no \
     checkpoint there."
);
create_exception!(
    kvpool,
    InvariantError,
    KVPoolError,
    "check() found a violated invariant (a bug in kvpool)."
);
// A KVPoolError, not an InvalidHandleError: the handle is alive and still
// owns its pages (on the host), so code that drops a request on an invalid
// handle must not catch this one.
create_exception!(
    kvpool,
    RequestSwappedOutError,
    KVPoolError,
    "The request is swapped out (swap_out): extend, truncate, fork, cache and its slots, pages or page table need it on the device; swap_in first. Its handle stays valid."
);

/// InvalidArgumentError subclasses both KVPoolError and ValueError; a class
/// with two exception bases cannot be declared with create_exception!, so it
/// is built with builtins.type at module init and kept here.
static INVALID_ARGUMENT: PyOnceLock<Py<PyType>> = PyOnceLock::new();

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("KVPoolError", py.get_type::<KVPoolError>())?;
    m.add("PoolExhaustedError", py.get_type::<PoolExhaustedError>())?;
    m.add("InvalidHandleError", py.get_type::<InvalidHandleError>())?;
    m.add(
        "TooManyRequestsError",
        py.get_type::<TooManyRequestsError>(),
    )?;
    m.add("ContextTooLongError", py.get_type::<ContextTooLongError>())?;
    m.add("InvariantError", py.get_type::<InvariantError>())?;
    m.add(
        "RequestSwappedOutError",
        py.get_type::<RequestSwappedOutError>(),
    )?;
    m.add(
        "RollbackUnavailableError",
        py.get_type::<RollbackUnavailableError>(),
    )?;
    let cls = INVALID_ARGUMENT.get_or_try_init(py, || -> PyResult<Py<PyType>> {
        let bases = PyTuple::new(
            py,
            [py.get_type::<KVPoolError>(), py.get_type::<PyValueError>()],
        )?;
        let ns = PyDict::new(py);
        ns.set_item("__module__", "kvpool")?;
        ns.set_item(
            "__doc__",
            "Bad argument: negative count, mismatched lengths, wrong dtype or \
             dimensionality, duplicate handle, ... Also a ValueError.",
        )?;
        let t =
            py.import("builtins")?
                .getattr("type")?
                .call1(("InvalidArgumentError", bases, ns))?;
        Ok(t.cast_into::<PyType>()?.unbind())
    })?;
    m.add("InvalidArgumentError", cls.bind(py))?;
    Ok(())
}

/// An InvalidArgumentError with `msg`. The class is made at module init, so
/// it is always there; if it ever is not, that is a bug worth a loud
/// SystemError, not a quiet ValueError that `except InvalidArgumentError` misses.
pub fn invalid_argument(py: Python<'_>, msg: impl Into<String>) -> PyErr {
    let msg = msg.into();
    match INVALID_ARGUMENT.get(py) {
        Some(t) => PyErr::from_type(t.bind(py).clone(), msg),
        None => PySystemError::new_err(format!(
            "kvpool._core.InvalidArgumentError is missing (module init did not run); \
             the InvalidArgumentError was: {msg}"
        )),
    }
}

/// `err` unless it is an interrupt, not a conversion failure: a conversion that
/// runs Python code (an `__index__`, `__float__`, `__array__`) and fails with an
/// exception that is not an `Exception` (`KeyboardInterrupt` from Ctrl-C or a
/// signal handler, `SystemExit`, a task's cancellation) or with a `MemoryError`
/// returns that exception, which must reach the caller as it is; anything else
/// it may raise is the argument's fault, and `refuse` names it (a typed error).
pub fn refuse_unless_interrupt(
    py: Python<'_>,
    err: PyErr,
    refuse: impl FnOnce() -> PyErr,
) -> PyErr {
    if !err.is_instance_of::<PyException>(py) || err.is_instance_of::<PyMemoryError>(py) {
        return err;
    }
    refuse()
}

/// What a binding method can fail with: a core error, mapped to its own
/// exception class on the way out, or a Python exception raised while
/// converting arguments. `?` converts either.
pub enum Error {
    Core(PoolError),
    Py(PyErr),
}

pub type Result<T> = std::result::Result<T, Error>;

impl From<PoolError> for Error {
    fn from(e: PoolError) -> Self {
        Error::Core(e)
    }
}

impl From<PyErr> for Error {
    fn from(e: PyErr) -> Self {
        Error::Py(e)
    }
}

impl From<Error> for PyErr {
    fn from(e: Error) -> Self {
        match e {
            Error::Py(e) => e,
            // Called by PyO3 with the GIL held: attach only fetches the token.
            Error::Core(e) => Python::attach(|py| to_pyerr(py, e)),
        }
    }
}

/// Maps every PoolError variant to its own exception class (exhaustive match:
/// a new variant fails to compile until it is mapped).
pub fn to_pyerr(py: Python<'_>, e: PoolError) -> PyErr {
    let msg = e.to_string();
    match e {
        PoolError::Exhausted { .. } => PoolExhaustedError::new_err(msg),
        PoolError::GroupExhausted(_) => PoolExhaustedError::new_err(msg),
        PoolError::RollbackUnavailable(_) => RollbackUnavailableError::new_err(msg),
        PoolError::InvalidHandle { .. } => InvalidHandleError::new_err(msg),
        PoolError::TooManyRequests { .. } => TooManyRequestsError::new_err(msg),
        PoolError::ContextTooLong { .. } => ContextTooLongError::new_err(msg),
        PoolError::InvalidArgument(m) => invalid_argument(py, m),
        PoolError::Invariant(_) => InvariantError::new_err(msg),
        PoolError::RequestSwappedOut { .. } => RequestSwappedOutError::new_err(msg),
        PoolError::HostExhausted { .. } => PoolExhaustedError::new_err(msg),
    }
}
