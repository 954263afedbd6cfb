//! Fork safety. Large calls run with the GIL released while they hold an
//! allocator's mutexes, so an `os.fork()` on another thread could copy a
//! locked mutex into a child where the thread that would unlock it does not
//! exist: the child's first call on the pool would wait forever. Python's
//! `os.register_at_fork` hooks (kvpool/_forksafe.py) call `_fork_prepare`
//! just before the fork, which waits until every live allocator's mutexes are
//! free and holds them across the fork, and `_fork_release` just after it, in
//! the parent and in the child, which unlocks them again. Nothing waits with
//! the GIL held: a drain holds its `undelivered` mutex while it needs the GIL.

use std::any::Any;
use std::cell::RefCell;
use std::sync::{Arc, Mutex, MutexGuard, TryLockError, Weak};

use pyo3::prelude::*;

type Kept = Mutex<Option<kvpool_core::Events>>;

trait Guarded: Send + Sync {
    fn alive(&self) -> bool;
    /// Both mutexes, held until the returned value drops (None: freed meanwhile).
    fn hold(&self, py: Python<'_>) -> Option<Box<dyn Any>>;
}

struct Entry<T: Send + 'static> {
    core: Weak<Mutex<T>>,
    kept: Weak<Kept>,
}

/// Held mutexes. The guards are declared before the Arcs, so they drop (unlock)
/// first, while the Arcs still keep the mutexes alive.
struct Held<T: 'static> {
    _core_guard: MutexGuard<'static, T>,
    _kept_guard: MutexGuard<'static, Option<kvpool_core::Events>>,
    _core: Arc<Mutex<T>>,
    _kept: Arc<Kept>,
}

/// Locks `m`, waiting with the GIL released. The guard's lifetime is widened to
/// 'static: the caller keeps the Arc that owns `m` alive for longer than the guard.
fn lock_static<T: Send>(py: Python<'_>, m: &Arc<Mutex<T>>) -> MutexGuard<'static, T> {
    let guard = loop {
        match m.try_lock() {
            Ok(g) => break g,
            Err(TryLockError::Poisoned(e)) => break e.into_inner(),
            Err(TryLockError::WouldBlock) => py.detach(|| drop(m.lock())),
        }
    };
    // SAFETY: the mutex lives in the Arc's heap allocation, which `Held` keeps
    // alive (declared after the guard, so dropped after it).
    unsafe { std::mem::transmute::<MutexGuard<'_, T>, MutexGuard<'static, T>>(guard) }
}

impl<T: Send + 'static> Guarded for Entry<T> {
    fn alive(&self) -> bool {
        self.core.strong_count() > 0
    }

    fn hold(&self, py: Python<'_>) -> Option<Box<dyn Any>> {
        let (core, kept) = (self.core.upgrade()?, self.kept.upgrade()?);
        // A drain takes `kept` before the core's mutex: the same order here.
        let kept_guard = lock_static(py, &kept);
        let core_guard = lock_static(py, &core);
        Some(Box::new(Held {
            _core_guard: core_guard,
            _kept_guard: kept_guard,
            _core: core,
            _kept: kept,
        }))
    }
}

static LIVE: Mutex<Vec<Arc<dyn Guarded>>> = Mutex::new(Vec::new());

thread_local! {
    // The hooks run on the forking thread, before and after the fork; in the
    // child that thread is the same one, with this same (copied) value.
    static HELD: RefCell<Vec<Box<dyn Any>>> = const { RefCell::new(Vec::new()) };
}

fn live() -> std::sync::MutexGuard<'static, Vec<Arc<dyn Guarded>>> {
    LIVE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Registers a new allocator's mutexes (called by its constructor).
pub(crate) fn track<T: Send + 'static>(core: &Arc<Mutex<T>>, kept: &Arc<Kept>) {
    let mut live = live();
    live.retain(|e| e.alive());
    live.push(Arc::new(Entry {
        core: Arc::downgrade(core),
        kept: Arc::downgrade(kept),
    }));
}

/// Before os.fork(): hold every live allocator's mutexes (not public API).
#[pyfunction]
pub fn _fork_prepare(py: Python<'_>) {
    // Snapshots: LIVE is not held while waiting, so a constructor on another
    // thread (which holds the GIL to push) never waits on this one. An
    // allocator built meanwhile (and maybe in a call by now) is in the next
    // snapshot: held too, until a snapshot brings none.
    // (`done` keeps the entries it names alive, so no new one takes an address in it)
    let mut done: Vec<Arc<dyn Guarded>> = Vec::new();
    let mut held: Vec<Box<dyn Any>> = Vec::new();
    loop {
        let new: Vec<Arc<dyn Guarded>> = live()
            .iter()
            .filter(|e| !done.iter().any(|d| Arc::ptr_eq(d, e)))
            .cloned()
            .collect();
        if new.is_empty() {
            break;
        }
        for e in new {
            held.extend(e.hold(py));
            done.push(e);
        }
    }
    HELD.with(|h| h.borrow_mut().extend(held));
}

/// After os.fork(), in the parent and in the child: unlock what `_fork_prepare` held.
#[pyfunction]
pub fn _fork_release() {
    let held = HELD.with(|h| std::mem::take(&mut *h.borrow_mut()));
    drop(held);
}
