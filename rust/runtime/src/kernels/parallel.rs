//! How kernels split their work across threads: one pool, installed once per process by the
//! abi (torch's intra-op pool through the stable ABI's `torch_parallel_for` and
//! `torch_get_num_threads`), so that a kernel uses exactly the threads torch's own kernels
//! would on the calling thread (`torch.set_num_threads`, `OMP_NUM_THREADS`) and kwexport never
//! starts a pool of its own to oversubscribe the cores. Without one (a torch without those
//! symbols, the kernels' own tests) kernels run on the calling thread.

use std::sync::OnceLock;

/// A body run over a range of work items, `begin..end`.
pub type Body<'a> = &'a (dyn Fn(usize, usize) + Sync);

/// How a pool runs a body: over `0..n` (the first argument) on at most so many threads (the
/// second).
pub type Run = Box<dyn Fn(usize, usize, Body<'_>) + Send + Sync>;

/// The threads a kernel may use.
pub struct Pool {
    /// How many threads the calling thread's parallel regions use.
    pub threads: Box<dyn Fn() -> usize + Send + Sync>,
    /// Runs the body over chunks of `0..n` on at most the given number of the pool's threads
    /// (the calling one among them), returning once every chunk has run.
    pub run: Run,
}

static POOL: OnceLock<Pool> = OnceLock::new();

/// Installs the process's pool; the first one installed stays.
pub fn install(pool: Pool) {
    let _ = POOL.set(pool);
}

/// How many threads a kernel called on this thread may use (1 without a pool).
pub fn threads() -> usize {
    POOL.get().map_or(1, |p| (p.threads)().max(1))
}

/// The fewest floating-point operations a thread's share of a GEMM must hold for a second
/// thread to be woken. Set, not yet swept: whole `fast` calls of one linear at 2 threads
/// (BENCHMARKS.md, "Performance IV") took 0.87× their one-thread time at 4×256×256 (524k
/// flops), 0.83× at 8×256×256 and 0.81× at 16×1024×1024, but 1.01× at 1×512×512 and
/// 1×1024×1024, where one row's GEMM streams its weight and a second thread gained nothing.
pub const MIN_FLOPS_PER_THREAD: usize = 200_000;

/// How many of `threads` a job of `flops` (split into at most `items` pieces) should use.
pub fn share(flops: usize, items: usize, threads: usize) -> usize {
    (flops / MIN_FLOPS_PER_THREAD).min(items).min(threads).max(1)
}

/// Runs `body` over `0..n` in chunks on at most `threads` of the pool's threads where that is
/// more than one, else on this thread.
pub fn for_each(n: usize, threads: usize, body: Body<'_>) {
    match POOL.get() {
        Some(pool) if threads > 1 && n > 1 => (pool.run)(n, threads, body),
        _ => body(0, n),
    }
}

/// A pointer the threads of one call share: each writes its own elements through it
/// (`units`), or only offsets it (`gemm::tap_table`'s first row).
pub(super) struct Shared<T>(pub(super) *mut T);

impl<T> Clone for Shared<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Shared<T> {}

// SAFETY: the threads of one call write disjoint elements through it (`units`) or only offset
// it, and the call returns only once every thread has finished.
unsafe impl<T> Sync for Shared<T> {}

impl<T> Shared<T> {
    /// Element `i` (a method, so closures capture the whole `Sync` wrapper).
    pub(super) fn at(self, i: usize) -> *mut T {
        self.0.wrapping_add(i)
    }
}

/// `f` over `out` in blocks of whole units of `width` elements (rows, or vector-aligned
/// runs), each with the same range of `x` (`x` as long as `out`, or empty), split across
/// threads where each thread's share holds enough work (`work` floating-point operations per
/// unit).
pub fn blocks(x: &[f32], out: &mut [f32], width: usize, work: usize, f: &(dyn Fn(&[f32], &mut [f32]) + Sync)) {
    units(out, width, work, &|first, out| {
        let from = first * width;
        f(if x.is_empty() { x } else { &x[from..from + out.len()] }, out)
    });
}

/// [`blocks`] for a body that reads other than `out`'s range of one input: `f(first, out)`
/// with `first` the index of the block's first unit.
pub fn units<T>(out: &mut [T], width: usize, work: usize, f: &(dyn Fn(usize, &mut [T]) + Sync)) {
    let units = out.len().div_ceil(width.max(1));
    let threads = share(units * work, units, threads());
    if threads <= 1 {
        return f(0, out);
    }
    let (len, o) = (out.len(), Shared(out.as_mut_ptr()));
    for_each(units, threads, &|begin, end| {
        let (from, to) = (begin * width, (end * width).min(len));
        // SAFETY: `out`'s elements `from..to`, written by this chunk only, while `out` is
        // borrowed for the whole call.
        let out = unsafe { std::slice::from_raw_parts_mut(o.at(from), to - from) };
        f(begin, out);
    });
}

/// [`units`] of two independent jobs in one parallel region (one wake-up of the pool's
/// threads instead of two): each thread takes its share of each job's units, `fa(first, a)`
/// then `fb(first, b)`.
#[allow(clippy::type_complexity)]
pub fn units_pair<A, B>(
    (a, width_a, work_a, fa): (&mut [A], usize, usize, &(dyn Fn(usize, &mut [A]) + Sync)),
    (b, width_b, work_b, fb): (&mut [B], usize, usize, &(dyn Fn(usize, &mut [B]) + Sync)),
) {
    let (units_a, units_b) = (a.len().div_ceil(width_a.max(1)), b.len().div_ceil(width_b.max(1)));
    let threads = share(units_a * work_a + units_b * work_b, units_a.max(units_b), threads());
    if threads <= 1 {
        fa(0, a);
        return fb(0, b);
    }
    let (len_a, len_b, pa, pb) = (a.len(), b.len(), Shared(a.as_mut_ptr()), Shared(b.as_mut_ptr()));
    for_each(threads, threads, &|begin, end| {
        for t in begin..end {
            let (first_a, end_a) = (units_a * t / threads, units_a * (t + 1) / threads);
            let (from, to) = (first_a * width_a, (end_a * width_a).min(len_a));
            if from < to {
                // SAFETY: `a`'s elements `from..to`, this share's alone (the shares of
                // `0..threads` don't overlap), while `a` is borrowed for the whole call.
                fa(first_a, unsafe { std::slice::from_raw_parts_mut(pa.at(from), to - from) });
            }
            let (first_b, end_b) = (units_b * t / threads, units_b * (t + 1) / threads);
            let (from, to) = (first_b * width_b, (end_b * width_b).min(len_b));
            if from < to {
                // SAFETY: as for `a`.
                fb(first_b, unsafe { std::slice::from_raw_parts_mut(pb.at(from), to - from) });
            }
        }
    });
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A pool of scoped std threads, `THREADS` of them, for the kernels' tests: each chunk on
    /// a thread of its own, so a kernel that shares memory between chunks wrongly shows it.
    pub(crate) const THREADS: usize = 3;

    pub(crate) fn install_test_pool() {
        install(Pool {
            threads: Box::new(|| THREADS),
            run: Box::new(|n, threads, body| {
                let chunk = n.div_ceil(threads.min(THREADS));
                std::thread::scope(|s| {
                    for begin in (0..n).step_by(chunk) {
                        s.spawn(move || body(begin, (begin + chunk).min(n)));
                    }
                });
            }),
        });
    }

    /// The GEMM (dense, with every epilogue kind of pass, and indirect) on three threads, at
    /// shapes that split by column blocks (three full blocks; 25 blocks, the last partial),
    /// by rows, and both, against a double-precision reference: each thread writes only its
    /// own blocks and rows, and writes all of them.
    #[test]
    fn threaded_gemm_matches_the_reference() {
        use super::super::{gemm_f32, pack_conv_panels, Epilogue, PANEL};
        install_test_pool();
        assert_eq!(threads(), THREADS);
        super::super::tests::each_isa(|| {
            let shapes = [
                (4usize, 256usize, 640usize),
                (300, 64, 40),
                (97, 130, 200),
                (1, 512, 512),
                (50, 64, 192),
                (4, 64, 1580),
            ];
            for (m, k, n) in shapes {
                let x: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.017).sin()).collect();
                let wt: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.013).cos()).collect();
                let mut panels = vec![0.0; k * n.div_ceil(PANEL) * PANEL];
                pack_conv_panels(&wt, [n, k, 1, 1], [1, n, 0, 0], &mut panels);
                assert!(share(2 * m * k * n, 8, THREADS) > 1 || m == 1, "{m}x{k}x{n} must split");
                for epilogue in [Epilogue::Relu, Epilogue::Gelu] {
                    let mut out = vec![f32::NAN; m * n];
                    assert_eq!(gemm_f32(&x, m, k, &panels, n, None, None, epilogue, &mut out), Ok(()));
                    let want = super::super::reference::gemm(&x, [m, k, n], &wt, None, None, epilogue);
                    for (i, (&got, &want)) in out.iter().zip(&want).enumerate() {
                        assert!((got as f64 - want).abs() < 1e-5 * (k as f64).sqrt(), "{epilogue:?} {m}x{k}x{n} [{i}]");
                    }
                }
            }
        });
    }

    /// GELU, an epilogue and both norms over work large enough to split on three threads give
    /// the bits of the same kernels on one small piece at a time: every element written once,
    /// by the same arithmetic.
    #[test]
    fn threaded_activations_and_norms_match_piece_by_piece() {
        use super::super::{epilogue_f32, gelu_f32, layer_norm_f32, rms_norm_f32, Epilogue};
        super::super::tests::each_isa(|| {
            let (rows, n) = (300usize, 384usize);
            let x: Vec<f32> = (0..rows * n).map(|i| (i as f32 * 0.37).sin() * 4.0).collect();
            let (w, b): (Vec<f32>, Vec<f32>) = (0..n).map(|i| (1.0 + i as f32 * 0.01, i as f32 * 0.02)).unzip();
            assert!(share(rows * n * 30, rows * n / 1024, THREADS) > 1, "must split");
            type Run<'a> = &'a dyn Fn(&[f32], &mut [f32]);
            let gelu: Run = &|x, out| assert_eq!(gelu_f32(x, false, out), Ok(()));
            let epilogue: Run = &|x, out| {
                out.copy_from_slice(x);
                assert_eq!(epilogue_f32(Epilogue::Swish, out), Ok(()));
            };
            let layer: Run = &|x, out| layer_norm_f32(x, &w, &b, 1e-5, out);
            let rms: Run = &|x, out| rms_norm_f32(x, &w, 1e-6, out);
            for (name, run) in [("gelu", gelu), ("swish", epilogue), ("layer norm", layer), ("rms norm", rms)] {
                let mut whole = vec![f32::NAN; rows * n];
                run(&x, &mut whole);
                for (r, row) in x.chunks(n).enumerate() {
                    let mut piece = vec![f32::NAN; n];
                    run(row, &mut piece);
                    assert_eq!(&whole[r * n..(r + 1) * n], &piece[..], "{name}, row {r}");
                }
            }
        });
    }

    /// Two jobs of different unit widths and counts in one region: every element written
    /// once, by the share whose first unit the body was told.
    #[test]
    fn units_pair_writes_each_job_once() {
        install_test_pool();
        for (len_a, len_b) in [(10, 1000), (1000, 7), (0, 9), (3000, 3000)] {
            let (mut a, mut b) = (vec![usize::MAX; len_a * 3], vec![usize::MAX; len_b * 5 + 2]);
            let fa = |first: usize, out: &mut [usize]| {
                for (i, v) in out.iter_mut().enumerate() {
                    assert_eq!(*v, usize::MAX);
                    *v = first * 3 + i;
                }
            };
            let fb = |first: usize, out: &mut [usize]| {
                for (i, v) in out.iter_mut().enumerate() {
                    assert_eq!(*v, usize::MAX);
                    *v = first * 5 + i;
                }
            };
            units_pair((&mut a, 3, MIN_FLOPS_PER_THREAD, &fa), (&mut b, 5, MIN_FLOPS_PER_THREAD, &fb));
            assert!(a.iter().enumerate().all(|(i, &v)| v == i), "{len_a}");
            assert!(b.iter().enumerate().all(|(i, &v)| v == i), "{len_b}");
        }
    }

    #[test]
    fn small_work_stays_on_one_thread() {
        assert_eq!(share(MIN_FLOPS_PER_THREAD - 1, 8, 4), 1);
        assert_eq!(share(3 * MIN_FLOPS_PER_THREAD, 8, 4), 3);
        assert_eq!(share(100 * MIN_FLOPS_PER_THREAD, 2, 4), 2);
        assert_eq!(share(100 * MIN_FLOPS_PER_THREAD, 8, 1), 1);
    }
}
