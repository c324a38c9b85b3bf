//! `CallLock`: the lock that serializes a stateful program's calls, made fork-safe.
//!
//! A `fork()` copies only the calling thread. A lock that another thread held at that moment
//! stays held in the child forever, with no thread left to release it: a fork-based
//! `multiprocessing` pool forked while a worker thread was inside a call deadlocked on its
//! first call. torch re-makes its own locks in the child with `pthread_atfork`; so does this
//! one, lazily: the child handler only bumps a generation counter (async-signal-safe), and a
//! lock made in an earlier generation is re-made, unlocked, on its next use.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, Once, TryLockError};

use pyo3::Python;

/// How many forks this process is from the one that loaded the extension.
static GENERATION: AtomicU64 = AtomicU64::new(0);
static AT_FORK: Once = Once::new();
/// A lock's generation while one thread re-makes it.
const REMAKING: u64 = u64::MAX;

extern "C" fn after_fork_in_child() {
    GENERATION.fetch_add(1, Ordering::SeqCst);
}

/// A mutex that a forked child finds unlocked, whoever held it in the parent.
pub struct CallLock {
    mutex: UnsafeCell<Mutex<()>>,
    generation: AtomicU64,
}

// SAFETY: the `UnsafeCell` is written only while re-making the lock after a fork, by the one
// thread that won the `REMAKING` exchange; every other use goes through the `Mutex`.
unsafe impl Sync for CallLock {}
unsafe impl Send for CallLock {}

impl Default for CallLock {
    fn default() -> Self {
        Self::new()
    }
}

impl CallLock {
    pub fn new() -> Self {
        AT_FORK.call_once(|| {
            // SAFETY: registers a handler that only touches an atomic.
            unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) };
        });
        CallLock {
            mutex: UnsafeCell::new(Mutex::new(())),
            generation: AtomicU64::new(GENERATION.load(Ordering::SeqCst)),
        }
    }

    /// The mutex of this process's generation, re-made first if it comes from before a fork.
    fn current(&self) -> &Mutex<()> {
        loop {
            let now = GENERATION.load(Ordering::SeqCst);
            match self.generation.load(Ordering::Acquire) {
                g if g == now => break,
                REMAKING => std::thread::yield_now(),
                g => {
                    if self.generation.compare_exchange(g, REMAKING, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                        // SAFETY: a fork left no thread that could hold or wait on the old
                        // mutex, and threads started since wait above until it is re-made.
                        unsafe { std::ptr::write(self.mutex.get(), Mutex::new(())) };
                        self.generation.store(now, Ordering::Release);
                    }
                }
            }
        }
        // SAFETY: only re-made above, under the exchange.
        unsafe { &*self.mutex.get() }
    }

    /// Takes the lock without ever blocking while holding the GIL: a call that holds it may
    /// release and re-take the GIL (long C segments do), so waiting for it with the GIL held
    /// would deadlock.
    pub fn lock(&self, py: Python<'_>) -> MutexGuard<'_, ()> {
        let mutex = self.current();
        loop {
            match mutex.try_lock() {
                Ok(guard) => return guard,
                // A call that failed midway leaves the state as its ops left it (documented);
                // the lock itself is still good.
                Err(TryLockError::Poisoned(p)) => return p.into_inner(),
                Err(TryLockError::WouldBlock) => py.detach(|| drop(mutex.lock())),
            }
        }
    }
}
