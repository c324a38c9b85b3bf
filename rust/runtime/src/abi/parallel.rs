//! torch's intra-op thread pool, through the stable ABI (`torch_parallel_for`,
//! `torch_get_num_threads`): work split on the threads torch's own kernels would use, under
//! the same `torch.set_num_threads` and `OMP_NUM_THREADS`, inside torch's parallel regions
//! (nested ones run inline, as torch's do). The operator layer hands it to the kernels.

use std::ffi::c_void;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::Mutex;

use libloading::os::unix::Library;

use super::{sym, Status};

type ParallelFor =
    unsafe extern "C" fn(i64, i64, i64, unsafe extern "C" fn(i64, i64, *mut c_void), *mut c_void) -> Status;
type NumThreads = unsafe extern "C" fn(*mut u32) -> Status;

/// A body run over chunks `begin..end` of a range, from any of torch's threads.
pub type Body<'a> = &'a (dyn Fn(usize, usize) + Sync);

/// torch's pool, where the running torch exports both symbols.
pub struct TorchPool {
    parallel_for: ParallelFor,
    num_threads: NumThreads,
}

/// What one `torch_parallel_for` call's chunks share: the body, and the first panic a chunk
/// raised (resumed on the calling thread: a panic must not unwind into torch's C++).
struct Job<'a> {
    body: Body<'a>,
    panic: Mutex<Option<Box<dyn std::any::Any + Send>>>,
}

/// One chunk of a job, as torch calls it on one of its threads.
unsafe extern "C" fn chunk(begin: i64, end: i64, ctx: *mut c_void) {
    // SAFETY: `ctx` is the `Job` that `run` passed, alive until `torch_parallel_for` returns,
    // which it does only after every chunk has.
    let job = unsafe { &*(ctx as *const Job<'_>) };
    if let Err(payload) = catch_unwind(AssertUnwindSafe(|| (job.body)(begin as usize, end as usize))) {
        job.panic.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(payload);
    }
}

impl TorchPool {
    /// The pool's entry points, or `None` where the running torch lacks one.
    ///
    /// # Safety
    /// `lib` must be torch's `libtorch_cpu.so`, whose symbols have the declared signatures.
    pub(super) unsafe fn open(lib: &Library, hidden: &[String]) -> Option<TorchPool> {
        // SAFETY: the caller's library; the types are those of torch's `shim.h`.
        unsafe {
            Some(TorchPool {
                parallel_for: sym(lib, hidden, "torch_parallel_for")?,
                num_threads: sym(lib, hidden, "torch_get_num_threads")?,
            })
        }
    }

    /// How many threads the calling thread's parallel regions use (torch's count is per thread).
    pub fn threads(&self) -> usize {
        let mut n = 1u32;
        // SAFETY: an out-pointer.
        if unsafe { (self.num_threads)(&mut n) } == 0 {
            n as usize
        } else {
            1
        }
    }

    /// Runs `body` over chunks of `0..n` on at most `threads` of torch's threads (the calling
    /// one among them), returning once every chunk has; a chunk's panic is resumed here.
    pub fn run(&self, n: usize, threads: usize, body: Body<'_>) {
        let job = Job { body, panic: Mutex::new(None) };
        // torch makes at most `ceil(n / grain)` chunks (and no more than its threads): a grain
        // of `ceil(n / threads)` keeps a job to the threads the caller found worth it.
        let grain = n.div_ceil(threads.max(1)) as i64;
        // SAFETY: `chunk` reads `job` only while this call runs.
        let status = unsafe { (self.parallel_for)(0, n as i64, grain, chunk, &job as *const Job<'_> as *mut c_void) };
        if let Some(payload) = job.panic.into_inner().unwrap_or_else(|e| e.into_inner()) {
            resume_unwind(payload);
        }
        if status != 0 {
            // torch could not run the region (it raised): run it here instead.
            body(0, n);
        }
    }
}
