//! The fused expansion and depthwise convolution (`super::expand_depthwise`) against the two
//! kernels run one after the other, on every family, threaded.

use super::expand_depthwise::{expand_depthwise_f32, DepthwiseWeights, Expansion};
use super::tests::each_isa;
use super::*;

/// `(batch, k, c, kernel, stride, padding, h, w, input pixel stride, output pixel stride)`:
/// MobileNetV2's two large heads (several bands a thread, rows kept across bands), a 5×5 at
/// stride 2 over odd sizes, channels no multiple of the vector or the panel, a batch of
/// images whose bands end at the images' edges, a slice of a wider input and an output
/// into a wider tensor, an image one row high, a band wider than the image.
type Case = (usize, usize, usize, usize, usize, usize, usize, usize, usize, usize);
const CASES: [Case; 8] = [
    (1, 16, 96, 3, 2, 1, 112, 112, 16, 96),
    (1, 24, 144, 3, 1, 1, 56, 56, 24, 144),
    (2, 7, 40, 5, 2, 2, 13, 11, 7, 40),
    (3, 8, 72, 3, 1, 1, 30, 9, 8, 72),
    (2, 12, 130, 3, 2, 1, 19, 21, 12, 130),
    (1, 5, 24, 3, 1, 1, 20, 20, 9, 30),
    (2, 4, 16, 3, 1, 1, 1, 7, 4, 16),
    (1, 6, 20, 5, 1, 2, 4, 3, 6, 20),
];

#[test]
fn expand_depthwise_matches_the_two_kernels() {
    each_isa(|| {
        for (batch, k, c, kk, s, p, h, w, lx, lo) in CASES {
            let g = Depthwise::new([c as i64, kk as i64, kk as i64], [s as i64; 2], [p as i64; 2]).unwrap();
            let [ho, wo] = g.output(h, w).unwrap();
            let x: Vec<f32> = (0..batch * h * w * lx).map(|i| (i as f32 * 0.37).sin()).collect();
            let wts: Vec<f32> = (0..c * k).map(|i| (i as f32 * 0.11).cos() * 0.5).collect();
            let mut panels = vec![f32::NAN; panels_len(k, c)];
            pack_conv_panels(&wts, [c, k, 1, 1], [k, 1, 1, 1], &mut panels);
            let bias1: Vec<f32> = (0..c).map(|i| i as f32 * 0.05 - 1.0).collect();
            let taps: Vec<f32> = (0..kk * kk * c).map(|i| (i as f32 * 0.07).cos()).collect();
            let bias2: Vec<f32> = (0..c).map(|i| 0.3 - i as f32 * 0.01).collect();
            let mut mid = vec![f32::NAN; batch * h * w * c];
            let rows = (&x[..], lx);
            let addends = (Some(&bias1[..]), None);
            let m = batch * h * w;
            assert_eq!(
                gemm::gemm_f32_rows(rows.0, lx, [m, k, c], &panels, addends, Epilogue::Relu6, (&mut mid, c)),
                Ok(())
            );
            let mut want = vec![f32::NAN; batch * ho * wo * lo];
            let mut got = want.clone();
            // SAFETY: the vectors hold every pixel at these strides.
            unsafe {
                let o = (want.as_mut_ptr(), lo);
                let ran = depthwise_f32_strided(
                    (mid.as_ptr(), c),
                    [batch, h, w],
                    &taps,
                    &g,
                    Some(&bias2),
                    Epilogue::Relu6,
                    o,
                );
                assert_eq!(ran, Ok(()));
                let expansion = Expansion { panels: &panels, bias: Some(&bias1), epilogue: Epilogue::Relu6 };
                let dw = DepthwiseWeights { taps: &taps, bias: Some(&bias2), epilogue: Epilogue::Relu6 };
                let ran =
                    expand_depthwise_f32((x.as_ptr(), lx), [batch, h, w, k], expansion, &g, dw, (got.as_mut_ptr(), lo));
                assert_eq!(ran, Ok(()));
            }
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!(
                    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                    "{batch}×{h}×{w}×{k}→{c} k{kk} s{s} [{i}]: {a} against {b}"
                );
            }
        }
    });
}

/// Times the fused kernel against the two kernels apart on MobileNetV2's heads, alternating
/// (`cargo test --release -- --ignored expand_depthwise_timing --nocapture`).
#[test]
#[ignore]
fn expand_depthwise_timing() {
    for (k, c, s, h) in [(16, 96, 2, 112), (24, 144, 1, 56), (32, 192, 2, 56), (32, 192, 1, 28)] {
        let g = Depthwise::new([c as i64, 3, 3], [s as i64; 2], [1; 2]).unwrap();
        let [ho, wo] = g.output(h, h).unwrap();
        let x: Vec<f32> = (0..h * h * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let wts: Vec<f32> = (0..c * k).map(|i| (i as f32 * 0.11).cos() * 0.5).collect();
        let mut panels = vec![0.0; panels_len(k, c)];
        pack_conv_panels(&wts, [c, k, 1, 1], [k, 1, 1, 1], &mut panels);
        let taps: Vec<f32> = (0..9 * c).map(|i| (i as f32 * 0.07).cos()).collect();
        let mut mid = vec![0.0; h * h * c];
        let mut out = vec![0.0; ho * wo * c];
        let (mut apart, mut fused) = (Vec::new(), Vec::new());
        for _ in 0..200 {
            let t = std::time::Instant::now();
            gemm::gemm_f32_rows(&x, k, [h * h, k, c], &panels, (None, None), Epilogue::Relu6, (&mut mid, c)).unwrap();
            depthwise_f32(&mid, [1, h, h], &taps, &g, None, Epilogue::Relu6, &mut out).unwrap();
            apart.push(t.elapsed().as_secs_f64());
            let t = std::time::Instant::now();
            let expansion = Expansion { panels: &panels, bias: None, epilogue: Epilogue::Relu6 };
            let dw = DepthwiseWeights { taps: &taps, bias: None, epilogue: Epilogue::Relu6 };
            // SAFETY: the vectors hold every pixel.
            unsafe {
                expand_depthwise_f32((x.as_ptr(), k), [1, h, h, k], expansion, &g, dw, (out.as_mut_ptr(), c)).unwrap()
            };
            fused.push(t.elapsed().as_secs_f64());
        }
        let mut ratios: Vec<f64> = fused.iter().zip(&apart).map(|(f, a)| f / a).collect();
        ratios.sort_by(f64::total_cmp);
        apart.sort_by(f64::total_cmp);
        fused.sort_by(f64::total_cmp);
        println!(
            "{k}->{c} s{s} at {h}²: apart p10 {:.0} µs, fused p10 {:.0} µs, median pair ratio {:.3}",
            apart[20] * 1e6,
            fused[20] * 1e6,
            ratios[100]
        );
    }
}
