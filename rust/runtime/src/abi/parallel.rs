//! torch's intra-op thread pool, through the stable ABI (`torch_parallel_for`,
//! `torch_get_num_threads`), installed as the kernels' pool (`kernels::parallel`): kwexport's
//! kernels split their work on the threads torch's own would use, under the same
//! `torch.set_num_threads` and `OMP_NUM_THREADS`, inside torch's parallel regions (nested
//! ones run inline, as torch's do).

use std::ffi::c_void;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::Mutex;

use libloading::os::unix::Library;

use super::{sym, Status};
use crate::kernels::parallel::{self, Body, Pool};

type ParallelFor =
    unsafe extern "C" fn(i64, i64, i64, unsafe extern "C" fn(i64, i64, *mut c_void), *mut c_void) -> Status;
type NumThreads = unsafe extern "C" fn(*mut u32) -> Status;

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

/// Installs torch's pool as the kernels' pool where the running torch exports both symbols;
/// kernels stay on the calling thread otherwise.
///
/// # Safety
/// `lib` must be torch's `libtorch_cpu.so`, whose symbols have the declared signatures.
pub(super) unsafe fn install(lib: &Library, hidden: &[String]) {
    // SAFETY: the caller's library; the types are those of torch's `shim.h`.
    let (Some(parallel_for), Some(num_threads)) = (unsafe {
        (sym::<ParallelFor>(lib, hidden, "torch_parallel_for"), sym::<NumThreads>(lib, hidden, "torch_get_num_threads"))
    }) else {
        return;
    };
    parallel::install(Pool {
        threads: Box::new(move || {
            let mut n = 1u32;
            // SAFETY: an out-pointer; the count is the calling thread's (torch's is per thread).
            if unsafe { num_threads(&mut n) } == 0 {
                n as usize
            } else {
                1
            }
        }),
        run: Box::new(move |n, threads, body| {
            let job = Job { body, panic: Mutex::new(None) };
            // torch makes at most `ceil(n / grain)` chunks (and no more than its threads): a
            // grain of `ceil(n / threads)` keeps a job to the threads the kernel found worth it.
            let grain = n.div_ceil(threads.max(1)) as i64;
            // SAFETY: `chunk` reads `job` only while this call runs.
            let status = unsafe { parallel_for(0, n as i64, grain, chunk, &job as *const Job<'_> as *mut c_void) };
            if let Some(payload) = job.panic.into_inner().unwrap_or_else(|e| e.into_inner()) {
                resume_unwind(payload);
            }
            if status != 0 {
                // torch could not run the region (it raised): run it here instead.
                body(0, n);
            }
        }),
    });
}
