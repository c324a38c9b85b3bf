//! Pooling over channels-last images: max pooling (split across threads by output rows) and
//! the global mean.

use super::conv::{inside, output_size};
use super::simd::Simd;
use super::{Declined, Ran};

/// A max pooling's window: `[kh, kw]` taps at `stride`, the input padded by `padding` (which
/// takes no part: torch pads with -inf), no dilation, output sizes rounded down, or up with
/// `ceil` (torch's `ceil_mode`: SqueezeNet's, GoogLeNet's), the last window then hanging past
/// the input, its taps outside taking no part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaxPool {
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub ceil: bool,
}

impl MaxPool {
    /// The output's height and width for an input's; `None` where torch would refuse the
    /// window (padding over half the kernel, an empty output).
    pub fn output(&self, h: usize, w: usize) -> Option<[usize; 2]> {
        let half = |k: usize, p: usize| 2 * p <= k;
        if !half(self.kernel[0], self.padding[0]) || !half(self.kernel[1], self.padding[1]) {
            return None;
        }
        let floor = output_size([h, w], self.kernel, self.stride, self.padding)?;
        let out = if self.ceil {
            // torch's pooling_output_shape: rounded up, but a last window must start inside
            // the input or its left padding.
            let up = |d: usize, size: usize| {
                let (k, s, p) = (self.kernel[d], self.stride[d], self.padding[d]);
                let n = (size + 2 * p - k).div_ceil(s) + 1;
                if (n - 1) * s >= size + p {
                    n - 1
                } else {
                    n
                }
            };
            [up(0, h), up(1, w)]
        } else {
            floor
        };
        Some(out).filter(|o| o[0] > 0 && o[1] > 0)
    }
}

/// [`max_pool_f32`]'s operands as the kernel table's entry takes them.
pub(super) struct Operands {
    x: *const f32,
    /// Batch, height, width and channels of the input.
    dims: [usize; 4],
    pool: MaxPool,
    /// The output's height and width.
    hw: [usize; 2],
    out: *mut f32,
}

// SAFETY: the input is read only and kept alive by the caller for the whole call; the
// threads of one call write disjoint output rows.
unsafe impl Sync for Operands {}

/// Max pooling of `x` (channels-last `[batch, h, w, c]`) into `out` (channels-last `[batch,
/// ho, wo, c]`): each output the largest of its window's inputs inside the image, NaN where
/// any is (as torch's kernel). Returns `false` where the slices don't fit the sizes or
/// kwexport's kernels don't run on this CPU.
pub fn max_pool_f32(x: &[f32], dims: [usize; 4], pool: &MaxPool, out: &mut [f32]) -> Ran {
    let [batch, h, w, c] = dims;
    let Some([ho, wo]) = pool.output(h, w) else { return Err(Declined::Shapes) };
    let fits = x.len() >= batch * h * w * c && out.len() >= batch * ho * wo * c;
    let t = super::table_if(fits)?;
    let ops = Operands { x: x.as_ptr(), dims, pool: *pool, hw: [ho, wo], out: out.as_mut_ptr() };
    let (rows, work) = (batch * ho, batch * ho * wo * c * pool.kernel[0] * pool.kernel[1]);
    let threads = super::parallel::share(work, rows, super::parallel::threads());
    // SAFETY: the table's functions run on this CPU; both slices hold what the sizes say
    // (checked), and each chunk writes its own output rows.
    super::parallel::for_each(rows, threads, &|begin, end| unsafe { (t.max_pool)(&ops, begin..end) });
    Ok(())
}

/// Output rows `range` (counted across the batch) of [`max_pool_f32`]: the kernel table's
/// entry.
///
/// # Safety
/// `S`'s features must be enabled; the operands hold what the sizes say.
#[inline(always)]
pub(super) unsafe fn max_pool_rows<S: Simd>(ops: &Operands, range: std::ops::Range<usize>) {
    let ([_, h, w, c], [ho, wo], pool) = (ops.dims, ops.hw, &ops.pool);
    let [sy, sx] = pool.stride;
    // SAFETY (all below): every pixel read is inside the image (`inside`), every lane past
    // `c` masked.
    unsafe {
        let neg_inf = S::splat(f32::NEG_INFINITY);
        for row in range {
            let (b, oy) = (row / ho, row % ho);
            let image = ops.x.add(b * h * w * c);
            let (y0, ky0, ky1) = inside(oy, sy, pool.padding[0], pool.kernel[0], h);
            for ox in 0..wo {
                let (x0, kx0, kx1) = inside(ox, sx, pool.padding[1], pool.kernel[1], w);
                let o = ops.out.add(((b * ho + oy) * wo + ox) * c);
                let mut ch = 0;
                // Four vectors of channels at a time: four independent chains of comparisons
                // through the window (one chain waits on each comparison's latency). `max`
                // keeps the earlier of equal values, as torch's `v > m`, but drops a NaN: the
                // window's NaNs are noted on the side, and a window that has one (rare) is
                // taken again the exact way, which keeps the NaN torch keeps.
                while ch + 4 * S::LANES <= c {
                    let mut m = [neg_inf; 4];
                    let mut nan = S::first(0);
                    for ky in ky0..ky1 {
                        let line = image.add((y0 + ky as isize) as usize * w * c);
                        for kx in kx0..kx1 {
                            let p = line.add((x0 + kx as isize) as usize * c + ch);
                            for (j, m) in m.iter_mut().enumerate() {
                                let v = S::load(p.add(j * S::LANES));
                                *m = S::max(v, *m);
                                nan = S::or(nan, S::nan(v));
                            }
                        }
                    }
                    if S::any(nan) {
                        for (j, m) in m.iter_mut().enumerate() {
                            *m = neg_inf;
                            for ky in ky0..ky1 {
                                let line = image.add((y0 + ky as isize) as usize * w * c);
                                for kx in kx0..kx1 {
                                    let v = S::load(line.add((x0 + kx as isize) as usize * c + ch + j * S::LANES));
                                    *m = S::select(S::or(S::gt(v, *m), S::nan(v)), v, *m);
                                }
                            }
                        }
                    }
                    for (j, m) in m.into_iter().enumerate() {
                        S::store(o.add(ch + j * S::LANES), m);
                    }
                    ch += 4 * S::LANES;
                }
                while ch < c {
                    let mask = S::first(c - ch);
                    let mut m = neg_inf;
                    for ky in ky0..ky1 {
                        let line = image.add((y0 + ky as isize) as usize * w * c);
                        for kx in kx0..kx1 {
                            let v = S::load_masked(mask, line.add((x0 + kx as isize) as usize * c + ch));
                            // NaN wins, as in torch's comparison (`v > m || isnan(v)`).
                            m = S::select(S::or(S::gt(v, m), S::nan(v)), v, m);
                        }
                    }
                    S::store_masked(o.add(ch), mask, m);
                    ch += S::LANES;
                }
            }
        }
    }
}

/// The mean of each of `out.len()` channels over `pixels` channels-last pixels (`x`: `[pixels,
/// c]`): summed pixel by pixel from zero, then divided by the count. torch's `mean` sums in a
/// cascade of partial sums past 16 pixels, so the two differ by float32 rounding there.
pub fn mean_pixels_f32(x: &[f32], pixels: usize, out: &mut [f32]) {
    let c = out.len();
    out.fill(0.0);
    if c == 0 {
        return;
    }
    for pixel in x.chunks_exact(c).take(pixels) {
        for (o, v) in out.iter_mut().zip(pixel) {
            *o += v;
        }
    }
    let n = pixels as f32;
    out.iter_mut().for_each(|o| *o /= n);
}
