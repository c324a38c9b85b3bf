//! kwexport's own kernels, for fused chains torch has no CPU kernel for at these sizes. Each
//! runs on plain slices (contiguous float32 memory the caller checked); the plan gives a node
//! one only at `optimize="fast"`, where a pass fused the chain, and runs torch's op for the
//! node wherever the tensors don't qualify.
//!
//! Kernel families, one module each (`gemm`, `int8`, `conv`, `winograd`, `attention`, `pool`,
//! `activation`, `bf16`), are written once over [`simd::Simd`] and instantiated per
//! instruction set (`simd::avx512`, `simd::avx2`, `simd::portable`); [`isa`] is the one place
//! that picks which instantiation runs, and `parallel` splits each kernel's work on torch's
//! intra-op threads. `expand_depthwise` composes two families' table entries (the GEMM's
//! block and the depthwise rows) into one kernel over bands of rows.

pub mod activation;
pub mod attention;
pub mod bf16;
pub mod conv;
pub mod copy;
pub mod expand_depthwise;
pub mod gemm;
pub mod int8;
pub mod isa;
pub mod parallel;
pub mod patches;
pub mod pool;
pub mod rotary;
pub mod simd;
pub mod winograd;

#[cfg(test)]
mod expand_depthwise_tests;
#[cfg(test)]
mod nonfinite_tests;
#[cfg(test)]
mod parts_tests;
#[cfg(test)]
mod reference;
#[cfg(test)]
mod tests;

pub use activation::{epilogue_f32, gelu_f32, Epilogue};
pub use attention::{attention_f32, Attention, AttentionMask};
pub use conv::{depthwise_f32, depthwise_f32_strided, direct_f32, Conv2d, Depthwise};
pub use gemm::{gemm_f32, indirect_f32, indirect_f32_strided, linear_f32, pack_conv_panels, panels_len, PANEL};
pub use patches::{pack_patch_panels, patches_f32};
pub use pool::{max_pool_f32, mean_pixels_f32, MaxPool};

/// RMS normalization over rows of `n = w.len()` values: `w * (x * rsqrt(mean(x^2) + eps))`,
/// as the decomposed pattern computes it (the mean of squares, plus `eps`, its reciprocal
/// square root, times `x`, then the weight), in float32 with the sum of squares taken in
/// sixteen lanes (the order differs from torch's reduction by rounding: `docs/optimize.md`).
pub fn rms_norm_f32(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    if n == 0 {
        return;
    }
    let rows = x.len().min(out.len()) / n * n;
    parallel::blocks(&x[..rows], &mut out[..rows], n, 4 * n, &|x, out| rms_norm_rows(x, w, eps, out));
}

/// [`rms_norm_f32`] on one thread.
fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    for (row, dst) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let mut lanes = [0f32; 16];
        let mut chunks = row.chunks_exact(16);
        for c in &mut chunks {
            for (l, v) in lanes.iter_mut().zip(c) {
                *l += v * v;
            }
        }
        let tail: f32 = chunks.remainder().iter().map(|v| v * v).sum();
        let sum = lanes.iter().sum::<f32>() + tail;
        let scale = 1.0 / (sum / n as f32 + eps).sqrt();
        for ((d, &v), &g) in dst.iter_mut().zip(row).zip(w) {
            *d = g * (v * scale);
        }
    }
}

/// Layer normalization over rows of `n = w.len()` values: `(x - mean) / sqrt(var + eps) * w +
/// b`, the biased variance taken around the mean in a second pass (as torch's CPU kernel's
/// moments are exact to rounding), sums in sixteen lanes.
pub fn layer_norm_f32(x: &[f32], w: &[f32], b: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    if n == 0 || b.len() != n {
        return;
    }
    let rows = x.len().min(out.len()) / n * n;
    parallel::blocks(&x[..rows], &mut out[..rows], n, 8 * n, &|x, out| layer_norm_rows(x, w, b, eps, out));
}

/// [`layer_norm_f32`] on one thread.
fn layer_norm_rows(x: &[f32], w: &[f32], b: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    let lanes_sum = |row: &[f32], f: &dyn Fn(f32) -> f32| {
        let mut lanes = [0f32; 16];
        let mut chunks = row.chunks_exact(16);
        for c in &mut chunks {
            for (l, &v) in lanes.iter_mut().zip(c) {
                *l += f(v);
            }
        }
        lanes.iter().sum::<f32>() + chunks.remainder().iter().map(|&v| f(v)).sum::<f32>()
    };
    for (row, dst) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let mean = lanes_sum(row, &|v| v) / n as f32;
        let var = lanes_sum(row, &|v| (v - mean) * (v - mean)) / n as f32;
        let rstd = 1.0 / (var + eps).sqrt();
        for (((d, &v), &g), &c) in dst.iter_mut().zip(row).zip(w).zip(b) {
            *d = (v - mean) * rstd * g + c;
        }
    }
}

/// Asks for the cache line at `p` in L2, ahead of its use (the GEMM's next strip of a panel,
/// a depthwise convolution's next input rows).
#[inline(always)]
fn prefetch_l2<T>(p: *const T) {
    // SAFETY: a prefetch is a hint: it reads nothing the program sees and never faults, at
    // any address (past the panels, after the last strip, past the image's last row).
    #[cfg(target_arch = "x86_64")]
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Whether every element of `x` is finite (neither NaN nor infinite): `v * 0` is 0 for a
/// finite `v` and NaN otherwise, summed in sixteen independent lanes so that the loop
/// vectorizes without reassociating.
pub fn all_finite(x: &[f32]) -> bool {
    let mut lanes = [0f32; 16];
    let mut chunks = x.chunks_exact(16);
    for c in &mut chunks {
        for (l, v) in lanes.iter_mut().zip(c) {
            *l += v * 0.0;
        }
    }
    lanes.iter().chain(chunks.remainder()).all(|v| v.is_finite())
}

/// The elements a tensor of `sizes` at `strides` spans from its first: its last element's
/// offset plus one, 0 where a size is 0, and `usize::MAX` past `usize` (no slice that long).
pub fn span(sizes: &[usize], strides: &[usize]) -> usize {
    if sizes.contains(&0) {
        return 0;
    }
    sizes
        .iter()
        .zip(strides)
        .try_fold(1usize, |acc, (n, s)| acc.checked_add((n - 1).checked_mul(*s)?))
        .unwrap_or(usize::MAX)
}

/// Whether rows of `row` contiguous values at `(size, stride)` dimensions never share an
/// element: in the order of their strides, each dimension of more than one row steps past
/// everything the ones inside it span.
pub(crate) fn apart<const N: usize>(row: usize, mut dims: [(usize, usize); N]) -> bool {
    dims.sort_by_key(|&(_, s)| s);
    let mut spanned = row;
    for (n, s) in dims.into_iter().filter(|&(n, _)| n > 1) {
        if s < spanned {
            return false;
        }
        spanned = spanned.saturating_add(s.saturating_mul(n - 1));
    }
    true
}

/// Why a kernel wrote nothing (or nothing the caller may use), for the caller to run another
/// kernel (torch's): a `Result` it can't ignore.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Declined {
    /// The slices don't hold what the shapes say, or the shapes are outside the kernel's.
    Shapes,
    /// kwexport's kernels don't run on this CPU (or not this one's instructions: bfloat16).
    NoKernels,
    /// An input's values (NaN or infinities) give results that depend on how torch's kernel
    /// computes them: the output may be partly written, and torch's must run.
    Values,
}

/// What a kernel returns: it ran, or it declined.
pub type Ran = Result<(), Declined>;

/// The kernel table of this CPU's family, where the operands `fit`.
fn table_if(fit: bool) -> Result<&'static isa::Table, Declined> {
    match isa::kernels() {
        None => Err(Declined::NoKernels),
        Some(_) if !fit => Err(Declined::Shapes),
        Some(t) => Ok(t),
    }
}

/// Whether kwexport's kernels run on this CPU (`isa::kernels`), so that a plan may lower
/// onto them.
pub fn available() -> bool {
    isa::kernels().is_some()
}

/// `a + b` over int64 values, where each operand has `out.len()` elements or one (broadcast):
/// integer addition, exact, wrapping on overflow as torch's kernel does.
pub fn add_i64(a: &[i64], b: &[i64], out: &mut [i64]) {
    let at = |x: &[i64], i: usize| if x.len() == 1 { x[0] } else { x[i] };
    for (i, o) in out.iter_mut().enumerate() {
        *o = at(a, i).wrapping_add(at(b, i));
    }
}
