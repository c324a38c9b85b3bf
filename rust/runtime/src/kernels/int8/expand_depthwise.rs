//! An int8 program's inverted residual head in one kernel: the int8 1×1 expansion (pt2e's
//! quantized 1×1 convolution, `kwexport::linear_int8` over a channels-last image) and the
//! float32 depthwise convolution over its fake-quantized result, run over bands of rows as
//! the float32 head is (`super::super::expand_depthwise`). Apart, MobileNetV2's int8
//! expansion at 112×112 wrote 4.8 MB of float32 results that the depthwise convolution read
//! back; EfficientNet's, with its SiLU, took 715 µs of a 7.5 ms call on a Zen 4.
//!
//! Each band's input pixels are quantized into the thread's rows, then the int8 GEMM's own
//! block writes their expanded, requantized values into the band's scratch: the same values
//! as [`super::linear`] then the depthwise kernel.

use super::super::activation::Epilogue;
use super::super::conv::Depthwise;
use super::super::expand_depthwise::{banded, DepthwiseWeights};
use super::super::gemm::{Dense, Out, Rows, Source, PANEL};
use super::super::{Declined, Ran};
use super::{with_rows, Packed, Products, Quant};

/// `depthwise(fake_quantize(epilogue(linear_int8(x))))`: `x` is `batch` channels-last images
/// (`[batch, h, w, k]`, pixels `x.1` floats apart) quantized by `quant`, expanded to
/// `g.channels` channels by the int8 `weight` (`[n, k]`, [`super::Layout::pack`]'s, with its
/// per-channel `w_scale` and `bias`), the `epilogue` and the `output` quantization applied as
/// [`super::linear`] applies them, then convolved by `g`'s depthwise convolution into `out`
/// (`[batch, ho, wo, c]`, pixels `out.1` apart). Declines (writing nothing) where
/// [`super::linear`] would, or the depthwise weights don't fit.
///
/// # Safety
/// `x.0` must be readable for every input pixel's `k` channels and `out.0` writable for every
/// output pixel's `c`, the two apart; nothing else may write either while this runs.
#[allow(clippy::too_many_arguments)]
pub unsafe fn expand_depthwise(
    (x, lx): (*const f32, usize),
    [batch, h, w, k]: [usize; 4],
    quant: &Quant,
    weight: Packed<'_>,
    (w_scale, bias): (&[f32], Option<&[f32]>),
    (epilogue, output): (Epilogue, Option<&Quant>),
    g: &Depthwise,
    dw: DepthwiseWeights<'_>,
    (out, lo): (*mut f32, usize),
) -> Ran {
    let n = g.channels;
    g.output(h, w).ok_or(Declined::Shapes)?;
    let fits = lx >= k
        && lo >= n
        && weight.words.len() >= weight.layout.packed_len([n, k])
        && w_scale.len() >= n
        && bias.is_none_or(|b| b.len() >= n)
        && dw.taps.len() >= g.kernel[0] * g.kernel[1] * n
        && dw.bias.is_none_or(|b| b.len() >= n);
    let t = super::super::table_if(fits)?;
    let kernel = super::super::isa::int8(t, weight.layout).ok_or(Declined::Values)?;
    let products = Products { kernel, quant, weight, w_scale, bias, residual: None, post: (epilogue, output) };
    products.check(k)?;
    let words = k.div_ceil(kernel.layout.per_word());
    let panels_len = kernel.layout.panel_words(n, words);
    let factors = products.columns(n, |c| weight.words[panels_len + c]);
    let shape = products.shape([1, words, n, n], (&factors.0, &factors.1));
    let (panels, levels, x) = (&weight.words[..panels_len], quant.levels(), Dense { x, ld: lx });
    let expand = |first: usize, pixels: usize, out: *mut f32| {
        with_rows(pixels * words, |rows| {
            if pixels == 0 {
                return;
            }
            // SAFETY: the quantizer runs on this CPU; the input's pixels `first..first +
            // pixels` have `k` floats each, `x.ld` apart (`banded` asks for the image's pixels
            // only), and `rows` as many rows of `words` words.
            unsafe {
                let px = std::slice::from_raw_parts(x.at(first, 0), (pixels - 1) * x.ld + k);
                (kernel.quantize)(px, [k, x.ld], &levels, rows);
            }
            let rows = Source::Dense(Dense { x: rows.as_ptr(), ld: words });
            for j in (0..n).step_by(PANEL) {
                // SAFETY: `rows` holds `pixels` rows of `words` words, the panels and the
                // shape's column factors `n` columns, `out` `pixels` rows of `n` (`banded`'s).
                unsafe { (kernel.block)(rows, 0..pixels, &shape, panels, Out(out), j, words) };
            }
        });
    };
    // SAFETY: the caller's pointers reach what the shapes say; the weights were checked.
    unsafe { banded(t, [batch, h, w], k, g, dw, (out, lo), &expand) };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::super::conv::depthwise_f32_strided;
    use super::super::super::isa;
    use super::super::tests::fit;
    use super::super::Layout;
    use super::*;

    /// `(batch, k, c, kernel, stride, padding, h, w, input pixel stride, output pixel
    /// stride)`: a MobileNet head at stride 2 and one at stride 1 (several bands a thread),
    /// a 5×5 over odd sizes, channels no multiple of a word, the vector or the panel, a batch
    /// whose bands end at the images' edges, a slice of a wider input into a wider output.
    type Case = (usize, usize, usize, usize, usize, usize, usize, usize, usize, usize);
    const CASES: [Case; 5] = [
        (1, 16, 96, 3, 2, 1, 64, 64, 16, 96),
        (1, 24, 144, 3, 1, 1, 40, 40, 24, 144),
        (2, 7, 40, 5, 2, 2, 13, 11, 7, 40),
        (3, 13, 130, 3, 1, 1, 21, 9, 13, 130),
        (1, 12, 72, 3, 1, 1, 20, 20, 17, 80),
    ];

    /// The fused head gives the bits of the int8 linear (with its activation and output
    /// quantization) followed by the depthwise kernel, on every family and layout this CPU
    /// runs, threaded.
    #[test]
    fn int8_expand_depthwise_matches_the_two_kernels() {
        crate::kernels::parallel::tests::install_test_pool();
        let quant = Quant { scale: 0.021, zero_point: 120, qmin: 0, qmax: 255 };
        let output = Quant { scale: 0.0137, zero_point: 3, qmin: 0, qmax: 255 };
        for forced in isa::supported() {
            let _forced = isa::force(forced);
            let Some(t) = forced.table() else { continue };
            for layout in [Layout::Pairs, Layout::Quads] {
                let Some(kernel) = isa::int8(t, layout) else { continue };
                for (batch, k, c, kk, s, p, h, w, lx, lo) in CASES {
                    let g = Depthwise::new([c as i64, kk as i64, kk as i64], [s as i64; 2], [p as i64; 2]).unwrap();
                    let [ho, wo] = g.output(h, w).unwrap();
                    let m = batch * h * w;
                    let x: Vec<f32> = (0..m * lx).map(|i| (i as f32 * 0.37).sin() * 2.5).collect();
                    let wt = fit(kernel, (0..c * k).map(|i| ((i * 53 % 256) as i32 - 128) as i8).collect());
                    let mut words = vec![0u32; layout.packed_len([c, k])];
                    layout.pack(&wt, [c, k], [k, 1], &mut words);
                    let weight = Packed { words: &words, layout, peak: super::super::peak(wt.iter().copied()) };
                    let w_scale: Vec<f32> = (0..c).map(|i| 0.001 + i as f32 / 9000.0).collect();
                    let bias: Vec<f32> = (0..c).map(|i| i as f32 * 0.05 - 1.0).collect();
                    let taps: Vec<f32> = (0..kk * kk * c).map(|i| (i as f32 * 0.07).cos()).collect();
                    let dw_bias: Vec<f32> = (0..c).map(|i| 0.3 - i as f32 * 0.01).collect();
                    for (epilogue, out_q) in [(Epilogue::Relu6, Some(&output)), (Epilogue::Swish, None)] {
                        let dense: Vec<f32> = x.chunks(lx).flat_map(|r| r[..k].iter().copied()).collect();
                        let mut mid = vec![f32::NAN; m * c];
                        let post = (epilogue, out_q);
                        let linear = super::super::linear(
                            (&dense, k),
                            [m, k, c],
                            &quant,
                            weight,
                            &w_scale,
                            Some(&bias),
                            post,
                            &mut mid,
                        );
                        assert_eq!(linear, Ok(()));
                        let mut want = vec![f32::NAN; batch * ho * wo * lo];
                        let mut got = want.clone();
                        let dw = DepthwiseWeights { taps: &taps, bias: Some(&dw_bias), epilogue: Epilogue::Relu6 };
                        // SAFETY: the vectors hold every pixel at these strides.
                        unsafe {
                            let o = (want.as_mut_ptr(), lo);
                            let apart = depthwise_f32_strided(
                                (mid.as_ptr(), c),
                                [batch, h, w],
                                &taps,
                                &g,
                                Some(&dw_bias),
                                Epilogue::Relu6,
                                o,
                            );
                            assert_eq!(apart, Ok(()));
                            let fused = expand_depthwise(
                                (x.as_ptr(), lx),
                                [batch, h, w, k],
                                &quant,
                                weight,
                                (&w_scale, Some(&bias)),
                                post,
                                &g,
                                dw,
                                (got.as_mut_ptr(), lo),
                            );
                            assert_eq!(fused, Ok(()));
                        }
                        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                            assert!(i % lo >= c || !b.is_nan(), "[{i}] not written");
                            assert!(
                                a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                                "{forced:?} {layout:?} {batch}×{h}×{w}×{k}→{c} k{kk} s{s} {epilogue:?} [{i}]: {a} against {b}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Times the fused head against the int8 linear and the depthwise kernel apart, on
    /// MobileNetV2's and EfficientNet's heads, alternating (`cargo test --release -- --ignored
    /// int8_expand_depthwise_timing --nocapture`).
    #[test]
    #[ignore]
    fn int8_expand_depthwise_timing() {
        let quant = Quant { scale: 0.021, zero_point: 120, qmin: 0, qmax: 255 };
        let output = Quant { scale: 0.0137, zero_point: 3, qmin: 0, qmax: 255 };
        let layout = Layout::current().unwrap();
        let heads = [(16, 96, 2, 112), (24, 144, 1, 56), (24, 144, 2, 56), (32, 192, 1, 28), (40, 240, 1, 28)];
        for (k, c, s, h) in heads {
            for epilogue in [Epilogue::Relu6, Epilogue::Swish] {
                let g = Depthwise::new([c as i64, 3, 3], [s as i64; 2], [1; 2]).unwrap();
                let [ho, wo] = g.output(h, h).unwrap();
                let x: Vec<f32> = (0..h * h * k).map(|i| (i as f32 * 0.37).sin()).collect();
                let wt: Vec<i8> = (0..c * k).map(|i| ((i * 53 % 256) as i32 - 128) as i8 / 2).collect();
                let mut words = vec![0u32; layout.packed_len([c, k])];
                layout.pack(&wt, [c, k], [k, 1], &mut words);
                let weight = Packed { words: &words, layout, peak: super::super::peak(wt.iter().copied()) };
                let w_scale: Vec<f32> = (0..c).map(|i| 0.001 + i as f32 / 9000.0).collect();
                let taps: Vec<f32> = (0..9 * c).map(|i| (i as f32 * 0.07).cos()).collect();
                let (mut mid, mut out) = (vec![0.0; h * h * c], vec![0.0; ho * wo * c]);
                let post = (epilogue, Some(&output));
                let dw = DepthwiseWeights { taps: &taps, bias: None, epilogue };
                let (mut apart, mut fused) = (Vec::new(), Vec::new());
                for _ in 0..200 {
                    let t = std::time::Instant::now();
                    super::super::linear((&x, k), [h * h, k, c], &quant, weight, &w_scale, None, post, &mut mid)
                        .unwrap();
                    crate::kernels::depthwise_f32(&mid, [1, h, h], &taps, &g, None, epilogue, &mut out).unwrap();
                    apart.push(t.elapsed().as_secs_f64());
                    let t = std::time::Instant::now();
                    // SAFETY: the vectors hold every pixel.
                    unsafe {
                        let x = (x.as_ptr(), k);
                        let o = (out.as_mut_ptr(), c);
                        expand_depthwise(x, [1, h, h, k], &quant, weight, (&w_scale, None), post, &g, dw, o).unwrap()
                    };
                    fused.push(t.elapsed().as_secs_f64());
                }
                let mut ratios: Vec<f64> = fused.iter().zip(&apart).map(|(f, a)| f / a).collect();
                ratios.sort_by(f64::total_cmp);
                apart.sort_by(f64::total_cmp);
                fused.sort_by(f64::total_cmp);
                println!(
                    "{k}->{c} s{s} at {h}² {epilogue:?}: apart p10 {:.0} µs, fused p10 {:.0} µs, median pair ratio {:.3}",
                    apart[20] * 1e6,
                    fused[20] * 1e6,
                    ratios[100]
                );
            }
        }
    }
}
