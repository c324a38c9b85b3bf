//! NaN and ±inf through every kernel: each result is NaN, +inf or -inf exactly where a
//! double-precision reference with torch's semantics has it (a NaN in a sum or a clamp stays
//! NaN, `inf - inf` and `0 * inf` are NaN), with the special values at pseudo-random
//! positions. Where torch's own kernels decide (attention over a NaN score, Winograd on a
//! non-finite input), the kernel must decline.

use super::reference::{self, EPILOGUES};
use super::*;

/// What a value is, for comparing masks: NaN, +inf, -inf or finite.
fn class(v: f64) -> &'static str {
    match v {
        v if v.is_nan() => "nan",
        f64::INFINITY => "+inf",
        f64::NEG_INFINITY => "-inf",
        _ => "finite",
    }
}

/// `len` values in [-1, 1) with NaN, +inf and -inf at pseudo-random positions (about one
/// value in `every`), from a fixed seed.
fn with_specials(len: usize, every: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let mut next = move || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state >> 33) as usize
    };
    (0..len)
        .map(|_| match next() % (3 * every) {
            0 => f32::NAN,
            1 => f32::INFINITY,
            2 => f32::NEG_INFINITY,
            r => (r % 2000) as f32 / 1000.0 - 1.0,
        })
        .collect()
}

#[test]
fn epilogues_keep_nan_and_map_infinities_as_torch_does() {
    super::tests::each_isa(|| {
        let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.5, -0.5, -100.0, 100.0];
        for epilogue in EPILOGUES {
            // Every lane position of a vector, and a masked tail.
            let x: Vec<f32> = (0..37).map(|i| specials[i % specials.len()]).collect();
            let mut got = x.clone();
            assert_eq!(epilogue_f32(epilogue, &mut got), Ok(()));
            for (v, g) in x.iter().zip(&got) {
                let want = reference::epilogue(epilogue, *v as f64);
                assert_eq!(class(*g as f64), class(want), "{epilogue:?}({v}) = {g}");
            }
        }
    });
}

#[test]
fn gemm_and_its_epilogues_give_the_references_nan_and_inf() {
    super::tests::each_isa(|| {
        for (m, k, n) in [(7usize, 9usize, 40usize), (30, 33, 70)] {
            let x = with_specials(m * k, 23, (m * k) as u64);
            let wt: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.13).cos()).collect();
            let residual = with_specials(m * n, 97, 5);
            let mut panels = vec![0.0; k * n.div_ceil(PANEL) * PANEL];
            pack_conv_panels(&wt, [n, k, 1, 1], [1, n, 0, 0], &mut panels);
            for epilogue in EPILOGUES {
                for res in [None, Some(&residual[..])] {
                    let mut out = vec![0.0; m * n];
                    assert_eq!(gemm_f32(&x, m, k, &panels, n, None, res, epilogue, &mut out), Ok(()));
                    let want = reference::gemm(&x, [m, k, n], &wt, None, res, epilogue);
                    for (i, (&got, &want)) in out.iter().zip(&want).enumerate() {
                        let residual = res.is_some();
                        assert_eq!(
                            class(got as f64),
                            class(want),
                            "{epilogue:?} {m}x{k}x{n} residual={residual} [{i}]"
                        );
                    }
                }
            }
        }
    });
}

#[test]
fn convolutions_give_the_references_nan_and_inf() {
    super::tests::each_isa(|| {
        // (cin, cout, k, stride, padding, h, w): a stem (the direct kernel), 3×3s, a strided 1×1.
        for (ci, co, k, s, p, h, w) in [(3, 16, 3, 2, 1, 11, 9), (8, 20, 3, 1, 1, 7, 6), (6, 10, 1, 2, 0, 5, 5)] {
            let g = Conv2d::new([co as i64, ci as i64, k as i64, k as i64], [s as i64; 2], [p as i64; 2]).unwrap();
            let [ho, wo] = g.output(h, w).unwrap();
            let x = with_specials(2 * h * w * ci, 61, (ci * h) as u64);
            let wts: Vec<f32> = (0..co * ci * k * k).map(|i| (i as f32 * 0.05).cos()).collect();
            let taps: Vec<f32> = (0..ci * k * k * co).map(|t| wts[(t % co) * ci * k * k + t / co]).collect();
            let mut panels = vec![0.0; g.taps() * co.div_ceil(PANEL) * PANEL];
            pack_conv_panels(&wts, [co, ci, k, k], [ci * k * k, k * k, k, 1], &mut panels);
            let cl = [h * w * ci, 1, w * ci, ci];
            for epilogue in [Epilogue::Relu, Epilogue::Relu6, Epilogue::Hardsigmoid, Epilogue::Swish] {
                let mut direct = vec![0.0; 2 * ho * wo * co];
                let mut indirect = vec![0.0; 2 * ho * wo * co];
                assert_eq!(direct_f32(&x, [2, h, w], cl, &taps, &g, None, epilogue, &mut direct), Ok(()));
                assert_eq!(indirect_f32(&x, [2, h, w], &panels, &g, None, None, epilogue, &mut indirect), Ok(()));
                let want = reference::conv2d(&x, [2, h, w], &wts, &g, (None, None), epilogue);
                for (at, &want) in want.iter().enumerate() {
                    let want = class(want);
                    assert_eq!(class(direct[at] as f64), want, "direct {epilogue:?} {ci}->{co} k{k} [{at}]");
                    assert_eq!(class(indirect[at] as f64), want, "indirect {epilogue:?} {ci}->{co} k{k} [{at}]");
                }
            }
        }
    });
}

#[test]
fn winograd_declines_a_non_finite_input_and_takes_a_finite_one() {
    super::tests::each_isa(|| {
        let g = Conv2d::new([16, 8, 3, 3], [1, 1], [1, 1]).unwrap();
        let wts: Vec<f32> = (0..16 * 8 * 9).map(|i| (i as f32 * 0.05).cos()).collect();
        let mut panels = vec![0.0; winograd::panels_len(8, 16)];
        winograd::pack_weights(&wts, [16, 8], [72, 9, 3, 1], &mut panels);
        let mut out = vec![0.0; 6 * 6 * 16];
        let finite: Vec<f32> = (0..6 * 6 * 8).map(|i| (i as f32 * 0.3).sin()).collect();
        assert_eq!(winograd::conv(&finite, [1, 6, 6], &panels, &g, None, None, Epilogue::Relu, &mut out), Ok(()));
        for special in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut x = finite.clone();
            x[3 * 8 * 6 + 17] = special;
            assert!(
                winograd::conv(&x, [1, 6, 6], &panels, &g, None, None, Epilogue::Relu, &mut out).is_err(),
                "{special}"
            );
        }
    });
}

#[test]
fn depthwise_gives_the_references_nan_and_inf() {
    super::tests::each_isa(|| {
        for (c, k, s, p, h, w) in [
            (16usize, 3usize, 2usize, 1usize, 9usize, 9usize),
            (24, 5, 1, 2, 7, 6),
            (20, 7, 1, 3, 9, 8),
            (48, 3, 1, 1, 12, 12),
        ] {
            let g = Depthwise::new([c as i64, k as i64, k as i64], [s as i64; 2], [p as i64; 2]).unwrap();
            let [ho, wo] = g.output(h, w).unwrap();
            let x = with_specials(2 * h * w * c, 41, (c * k) as u64);
            let taps: Vec<f32> = (0..k * k * c).map(|i| (i as f32 * 0.07).cos()).collect();
            let mut out = vec![0.0; 2 * ho * wo * c];
            assert_eq!(depthwise_f32(&x, [2, h, w], &taps, &g, None, Epilogue::Relu, &mut out), Ok(()));
            let want = reference::depthwise(&x, [2, h, w], &taps, &g, None, Epilogue::Relu);
            for (i, (&got, &want)) in out.iter().zip(&want).enumerate() {
                assert_eq!(class(got as f64), class(want), "c{c} k{k} [{i}]");
            }
        }
    });
}

#[test]
fn max_pool_keeps_nan_and_infinities() {
    // 21 channels: masked vectors only; 70: four whole vectors a time too, whose windows
    // with a NaN are taken again.
    super::tests::each_isa(|| {
        for c in [21, 70] {
            let pool = MaxPool { kernel: [3, 3], stride: [2, 2], padding: [1, 1], ceil: false };
            let (h, w) = (9, 8);
            let x = with_specials(h * w * c, 19, 3);
            let [ho, wo] = pool.output(h, w).unwrap();
            let mut out = vec![0.0; ho * wo * c];
            assert_eq!(max_pool_f32(&x, [1, h, w, c], &pool, &mut out), Ok(()));
            for (oy, ox, ch) in (0..ho).flat_map(|y| (0..wo).flat_map(move |x| (0..c).map(move |ch| (y, x, ch)))) {
                let window = (0..3).flat_map(|i| (0..3).map(move |j| (i, j))).filter_map(|(i, j)| {
                    let (y, xx) = ((oy * 2 + i) as isize - 1, (ox * 2 + j) as isize - 1);
                    ((0..h as isize).contains(&y) && (0..w as isize).contains(&xx))
                        .then(|| x[(y as usize * w + xx as usize) * c + ch] as f64)
                });
                // torch's max: NaN wins, else the largest (-inf where every value is).
                let want =
                    window.fold(f64::NEG_INFINITY, |m, v| if m.is_nan() || v.is_nan() { f64::NAN } else { m.max(v) });
                assert_eq!(class(out[(oy * wo + ox) * c + ch] as f64), class(want), "({oy},{ox},{ch})");
            }
        }
    });
}

#[test]
fn norms_spread_a_non_finite_value_as_their_formulas_do() {
    let n = 37;
    let x = with_specials(4 * n, 9, 11);
    let w: Vec<f32> = (0..n).map(|i| 1.0 + i as f32 * 0.01).collect();
    let b = vec![0.1; n];
    let (mut ln, mut rms) = (vec![0.0; 4 * n], vec![0.0; 4 * n]);
    layer_norm_f32(&x, &w, &b, 1e-5, &mut ln);
    rms_norm_f32(&x, &w, 1e-6, &mut rms);
    for (r, row) in x.chunks(n).enumerate() {
        let finite = row.iter().all(|v| v.is_finite());
        let squares: f64 = row.iter().map(|&v| v as f64 * v as f64).sum();
        for j in 0..n {
            // A row with any NaN or infinity is all NaN after layer norm (`inf - inf`).
            assert_eq!(class(ln[r * n + j] as f64), if finite { "finite" } else { "nan" }, "layer norm [{r}, {j}]");
            let want = row[j] as f64 * (1.0 / (squares / n as f64 + 1e-6).sqrt()) * w[j] as f64;
            assert_eq!(class(rms[r * n + j] as f64), class(want), "rms norm [{r}, {j}]");
        }
    }
}

#[test]
fn attention_declines_nan_scores_and_carries_infinite_values() {
    super::tests::each_isa(|| {
        let g = Attention { batch: 1, heads: 2, l: 5, s: 19, e: 8, ev: 8, scale: 0.3 };
        let strides = |rows: usize, cols: usize| [2 * rows * cols, rows * cols, cols];
        let clean = |len: usize| (0..len).map(|i| (i as f32 * 0.37).sin()).collect::<Vec<f32>>();
        let (q, k, v) = (clean(2 * 5 * 8), clean(2 * 19 * 8), clean(2 * 19 * 8));
        let mut out = vec![0.0; 2 * 5 * 8];
        let run = |q: &[f32], k: &[f32], v: &[f32], out: &mut [f32]| {
            let o = (out, [2 * 5 * 8, 8, 2 * 8]);
            attention_f32((q, strides(5, 8)), (k, strides(19, 8)), (v, strides(19, 8)), &g, AttentionMask::None, o)
        };
        assert_eq!(run(&q, &k, &v, &mut out), Ok(()));
        // A NaN query or key makes NaN scores, whose softmax torch's kernels decide.
        let mut bad_q = q.clone();
        bad_q[8 + 3] = f32::NAN;
        assert!(run(&bad_q, &k, &v, &mut out).is_err(), "NaN query");
        let mut bad_k = k.clone();
        bad_k[19 * 8 + 4 * 8 + 1] = f32::NAN;
        assert!(run(&q, &bad_k, &v, &mut out).is_err(), "NaN key");
        for special in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            // A non-finite value reaches every output of its head and column, as `p * v` does.
            let mut bad_v = v.clone();
            bad_v[19 * 8 + 2 * 8 + 5] = special; // head 1, key 2, column 5
            assert_eq!(run(&q, &k, &bad_v, &mut out), Ok(()));
            for i in 0..5 {
                for h in 0..2 {
                    for c in 0..8 {
                        let got = out[(i * 2 + h) * 8 + c] as f64;
                        let want = if (h, c) == (1, 5) { class(special as f64) } else { "finite" };
                        assert_eq!(class(got), want, "{special} value: query {i} head {h} column {c}");
                    }
                }
            }
        }
    });
}

#[test]
fn bf16_gemm_rounds_nan_and_infinities_to_themselves() {
    let (m, k, n) = (9usize, 21usize, 70usize);
    let x = with_specials(m * k, 13, 7);
    let wt: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.13).cos()).collect();
    let mut panels = vec![0u32; k.div_ceil(2) * n.div_ceil(PANEL) * PANEL];
    bf16::pack_panels(&wt, [n, k, 1, 1], [1, n, 0, 0], &mut panels);
    let mut out = vec![0.0; m * n];
    if bf16::gemm(&x, m, k, &panels, n, None, None, Epilogue::Relu, &mut out).is_err() {
        return; // no AVX512-BF16 here
    }
    for r in 0..m {
        for j in 0..n {
            let dot: f64 = (0..k).map(|t| x[r * k + t] as f64 * wt[t * n + j] as f64).sum();
            assert_eq!(class(out[r * n + j] as f64), class(reference::epilogue(Epilogue::Relu, dot)), "[{r}, {j}]");
        }
    }
}
