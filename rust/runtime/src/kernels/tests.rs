use super::isa;
use super::reference;
use super::*;

/// Runs `f` once with each instruction set's kernels this CPU has, on the tests' pool of
/// threads (`parallel::tests`: work large enough splits): every variant, threaded, is checked
/// against the same reference.
pub(crate) fn each_isa(f: impl Fn()) {
    super::parallel::tests::install_test_pool();
    for family in isa::supported() {
        isa::with(family, &f);
    }
}

#[test]
fn add_i64_broadcasts_one_element() {
    let mut out = [0; 3];
    add_i64(&[1, 2, 3], &[10], &mut out);
    assert_eq!(out, [11, 12, 13]);
    add_i64(&[i64::MAX], &[1, 2, 3], &mut out);
    assert_eq!(out, [i64::MIN, i64::MIN + 1, i64::MIN + 2]);
}

/// Each packer writes exactly the elements its family's `pack_size` says, every one of them
/// (zeros past the weight's edge), and nothing after: the size the operators allocate and
/// check is the size the packer fills, for shapes drawn at random, in every family's strips.
#[test]
fn pack_size_is_what_each_packer_writes() {
    // Each family's strips (`gemm::Strips`) place the elements differently.
    each_isa(|| {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut draw = |most: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            1 + (seed % most as u64) as usize
        };
        const EXTRA: usize = 100;
        for _ in 0..50 {
            let (n, cin, kh, kw) = (draw(150), draw(20), draw(3), draw(3));
            let w: Vec<f32> = (0..n * cin * kh * kw).map(|i| 1.0 + i as f32).collect();
            let strides = [cin * kh * kw, kh * kw, kw, 1];
            let shape = [n, cin, kh, kw];

            let len: usize = gemm::pack_size(shape).iter().product();
            let mut panels = vec![f32::NAN; len + EXTRA];
            pack_conv_panels(&w, shape, strides, &mut panels);
            assert!(panels[..len].iter().all(|v| !v.is_nan()), "f32 {shape:?}: an element left unwritten");
            assert!(panels[len..].iter().all(|v| v.is_nan()), "f32 {shape:?}: written past pack_size");

            // The same weight as `groups` groups (of `n / groups` outputs each).
            let groups = draw(4).min(n);
            let grouped = [n - n % groups, cin, kh, kw];
            let len: usize = gemm::grouped_pack_size(grouped, groups).iter().product();
            let mut panels = vec![f32::NAN; len + EXTRA];
            gemm::pack_grouped_panels(&w, grouped, strides, groups, &mut panels);
            assert!(
                panels[..len].iter().all(|v| !v.is_nan()),
                "grouped {grouped:?}/{groups}: an element left unwritten"
            );
            assert!(panels[len..].iter().all(|v| v.is_nan()), "grouped {grouped:?}/{groups}: written past its size");

            let len: usize = bf16::pack_size(shape).iter().product();
            let mut pairs = vec![u32::MAX; len + EXTRA];
            bf16::pack_panels(&w, shape, strides, &mut pairs);
            assert!(pairs[..len].iter().all(|&v| v != u32::MAX), "bf16 {shape:?}: an element left unwritten");
            assert!(pairs[len..].iter().all(|&v| v == u32::MAX), "bf16 {shape:?}: written past pack_size");

            let w3: Vec<f32> = (0..n * cin * 9).map(|i| 1.0 + i as f32).collect();
            let len: usize = winograd::pack_size(cin, n).iter().product();
            let mut panels = vec![f32::NAN; len + EXTRA];
            winograd::pack_weights(&w3, [n, cin], [cin * 9, 9, 3, 1], &mut panels);
            assert!(panels[..len].iter().all(|v| !v.is_nan()), "winograd {shape:?}: an element left unwritten");
            assert!(panels[len..].iter().all(|v| v.is_nan()), "winograd {shape:?}: written past pack_size");
        }
    });
}

#[test]
fn linear_matches_a_double_precision_reference() {
    each_isa(|| {
        for (m, k, n) in [
            (1usize, 64usize, 128usize),
            (3, 100, 70),
            (4, 256, 256),
            (9, 17, 5),
            (2, 1, 1),
            (33, 40, 200),
            (50, 16, 16),
            (31, 24, 40),
            (101, 20, 130),
        ] {
            let x: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.01).sin()).collect();
            let wt: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.013).cos()).collect();
            let b: Vec<f32> = (0..n).map(|i| i as f32 * 0.001).collect();
            let mut panels = vec![f32::NAN; k * n.div_ceil(PANEL) * PANEL];
            pack_conv_panels(&wt, [n, k, 1, 1], [1, n, 0, 0], &mut panels);
            for bias in [Some(&b[..]), None] {
                let mut out = vec![f32::NAN; m * n];
                assert_eq!(linear_f32(&x, m, k, &panels, n, bias, &mut out), Ok(()));
                let want = reference::gemm(&x, [m, k, n], &wt, bias, None, Epilogue::None);
                for (i, (&got, want)) in out.iter().zip(want).enumerate() {
                    assert!((got as f64 - want).abs() < 1e-5 * (k as f64).sqrt(), "{m}x{k}x{n} [{i}]");
                }
            }
        }
    });
}

#[test]
fn max_pool_takes_each_windows_largest_inside_the_image() {
    each_isa(|| {
        for (pool, [h, w]) in [
            (MaxPool { kernel: [3, 3], stride: [2, 2], padding: [1, 1], ceil: false }, [8, 7]),
            (MaxPool { kernel: [2, 3], stride: [1, 2], padding: [0, 1], ceil: false }, [5, 6]),
            (MaxPool { kernel: [3, 3], stride: [3, 3], padding: [0, 0], ceil: false }, [3, 3]),
            // ceil_mode: the last windows hang past the input (SqueezeNet's 3×3 at stride 2).
            (MaxPool { kernel: [3, 3], stride: [2, 2], padding: [0, 0], ceil: true }, [8, 7]),
            (MaxPool { kernel: [2, 3], stride: [2, 2], padding: [1, 1], ceil: true }, [5, 6]),
        ] {
            // 70 channels: blocks of four vectors, then single ones, then a masked tail.
            for c in [19, 70] {
                let batch = 2;
                let mut x: Vec<f32> = (0..batch * h * w * c).map(|i| ((i * 7919) % 1013) as f32 - 500.0).collect();
                x[c + 3] = f32::NAN;
                x[2 * c + 37 % c] = f32::NAN;
                let [ho, wo] = pool.output(h, w).unwrap();
                let mut out = vec![0.0; batch * ho * wo * c];
                assert_eq!(max_pool_f32(&x, [batch, h, w, c], &pool, &mut out), Ok(()));
                let want = reference::max_pool(&x, [batch, h, w, c], &pool);
                for (i, (got, want)) in out.iter().zip(&want).enumerate() {
                    assert!(got.to_bits() == want.to_bits() || got.is_nan() && want.is_nan(), "{pool:?} {c} [{i}]");
                }
            }
        }
        let bad = MaxPool { kernel: [2, 2], stride: [1, 1], padding: [2, 2], ceil: false };
        assert_eq!(bad.output(4, 4), None, "padding over half the kernel");
        // torch's sizes: 8 rows and 7 columns under a 3×3 at stride 2 give 4×3 rounded up (3×3
        // down); a 2-wide window at stride 2 over 6 columns padded by 1 gives 4, not 5 (the
        // fifth would start in the right padding).
        let up = MaxPool { kernel: [3, 3], stride: [2, 2], padding: [0, 0], ceil: true };
        assert_eq!(up.output(8, 7), Some([4, 3]));
        let edge = MaxPool { kernel: [2, 2], stride: [2, 2], padding: [1, 1], ceil: true };
        assert_eq!(edge.output(6, 6), Some([4, 4]));
    });
}

#[test]
fn mean_pixels_matches_the_reference() {
    for (pixels, c) in [(49usize, 7usize), (1, 1), (196, 40)] {
        let x: Vec<f32> = (0..pixels * c).map(|i| (i as f32 * 0.37).sin() * 5.0).collect();
        let mut out = vec![f32::NAN; c];
        mean_pixels_f32(&x, pixels, &mut out);
        for (ch, (&got, want)) in out.iter().zip(reference::mean_pixels(&x, pixels, c)).enumerate() {
            assert!((got as f64 - want).abs() < 1e-6 * (pixels as f64).sqrt(), "{pixels}x{c} [{ch}]");
        }
    }
}

#[test]
fn layer_norm_matches_a_double_precision_reference() {
    for n in [1usize, 7, 16, 256, 771] {
        let rows = 3;
        // Rows far from zero: the variance is taken around the mean, not from E[x^2].
        let x: Vec<f32> = (0..rows * n).map(|i| 100.0 + (i as f32 * 0.37).sin() * 3.0).collect();
        let w: Vec<f32> = (0..n).map(|i| 1.0 + (i as f32 * 0.11).cos()).collect();
        let b: Vec<f32> = (0..n).map(|i| i as f32 * 0.01 - 0.5).collect();
        let mut out = vec![f32::NAN; rows * n];
        layer_norm_f32(&x, &w, &b, 1e-5, &mut out);
        for (i, (&got, want)) in out.iter().zip(reference::layer_norm(&x, &w, &b, 1e-5)).enumerate() {
            assert!((got as f64 - want).abs() < 2e-5, "n={n} [{i}]: {got} vs {want}");
        }
    }
}

#[test]
fn gemm_epilogues_match_torchs_definitions() {
    each_isa(|| {
        // 1x1-convolution shapes: many rows (pixels), few columns (channels), each tile width.
        for (m, k, n) in [(49usize, 24usize, 16usize), (23, 16, 40), (7, 9, 72), (196, 40, 240)] {
            let x: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
            let wt: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.11).cos()).collect();
            let b: Vec<f32> = (0..n).map(|i| i as f32 * 0.01 - 0.2).collect();
            let mut panels = vec![0.0; k * n.div_ceil(PANEL) * PANEL];
            pack_conv_panels(&wt, [n, k, 1, 1], [1, n, 0, 0], &mut panels);
            for epilogue in reference::EPILOGUES {
                let mut out = vec![f32::NAN; m * n];
                assert_eq!(gemm_f32(&x, m, k, &panels, n, Some(&b), None, epilogue, &mut out), Ok(()));
                // And the epilogue alone, in place over the plain product (torch's result).
                let mut plain = vec![f32::NAN; m * n];
                assert_eq!(gemm_f32(&x, m, k, &panels, n, Some(&b), None, Epilogue::None, &mut plain), Ok(()));
                assert_eq!(epilogue_f32(epilogue, &mut plain), Ok(()));
                // And with a residual added before the epilogue (`passes::conv_residual`).
                let res: Vec<f32> = (0..m * n).map(|i| (i as f32 * 0.23).cos()).collect();
                let mut added = vec![f32::NAN; m * n];
                assert_eq!(gemm_f32(&x, m, k, &panels, n, Some(&b), Some(&res), epilogue, &mut added), Ok(()));
                let want = reference::gemm(&x, [m, k, n], &wt, Some(&b), None, epilogue);
                let want_added = reference::gemm(&x, [m, k, n], &wt, Some(&b), Some(&res), epilogue);
                let close = |got: f32, want: f64| (got as f64 - want).abs() < 2e-6 * (k as f64).sqrt();
                for i in 0..m * n {
                    assert!(close(out[i], want[i]), "{epilogue:?} fused {m}x{k}x{n} [{i}]");
                    assert!(close(plain[i], want[i]), "{epilogue:?} after {m}x{k}x{n} [{i}]");
                    assert!(close(added[i], want_added[i]), "{epilogue:?} residual {m}x{k}x{n} [{i}]");
                }
            }
        }
    });
}

#[test]
fn depthwise_matches_the_reference() {
    each_isa(|| {
        // (c, kernel, stride, padding, h, w): mobilenet's shapes, odd sizes, a kernel larger
        // than the image with padding, channels that aren't a multiple of 16, 7×7 (ConvNeXt's),
        // rows wide enough for quads of pixels with every tap inside (two whole vectors at a
        // time, then the channels left), images of 1 MB and more (their next rows asked for
        // ahead, at stride 1 and 2).
        for (c, k, s, p, h, w) in [
            (48, 3, 1, 1, 12, 12),
            (40, 5, 2, 2, 20, 19),
            (32, 3, 2, 1, 17, 16),
            (24, 5, 1, 2, 13, 11),
            (16, 3, 2, 1, 9, 9),
            (24, 5, 1, 2, 7, 6),
            (5, 3, 1, 1, 4, 5),
            (40, 5, 2, 2, 3, 3),
            (24, 7, 1, 3, 9, 8),
            (19, 7, 2, 3, 10, 10),
            (64, 7, 1, 3, 28, 28),
            (96, 3, 2, 1, 56, 57),
            (144, 3, 1, 1, 48, 40),
        ] {
            let g = Depthwise::new([c as i64, k as i64, k as i64], [s as i64; 2], [p as i64; 2]).unwrap();
            let [ho, wo] = g.output(h, w).unwrap();
            let x: Vec<f32> = (0..2 * h * w * c).map(|i| (i as f32 * 0.29).sin()).collect();
            let taps: Vec<f32> = (0..k * k * c).map(|i| (i as f32 * 0.07).cos()).collect();
            let bias: Vec<f32> = (0..c).map(|i| i as f32 * 0.1).collect();
            let mut out = vec![f32::NAN; 2 * ho * wo * c];
            assert_eq!(depthwise_f32(&x, [2, h, w], &taps, &g, Some(&bias), Epilogue::Relu, &mut out), Ok(()));
            let want = reference::depthwise(&x, [2, h, w], &taps, &g, Some(&bias), Epilogue::Relu);
            for (i, (&got, want)) in out.iter().zip(want).enumerate() {
                assert!((got as f64 - want).abs() < 1e-5, "c{c} k{k} s{s} p{p} [{i}]");
            }
        }
        assert_eq!(Depthwise::new([4, 3, 3], [0, 1], [0, 0]), None);
        assert_eq!(Depthwise::new([4, 5, 5], [1, 1], [0, 0]).unwrap().output(3, 3), None);
    });
}

#[test]
fn direct_and_indirect_match_a_reference_convolution() {
    each_isa(|| {
        // (cin, cout, k, stride, padding, h, w): an RGB stem, odd sizes, 40 outputs (a masked
        // block), a kernel larger than the image with padding, a strided 1×1, 70 outputs
        // over 20 channels (two panels), many pixels.
        let cases = [
            (3, 16, 3, 2, 1, 11, 9),
            (3, 40, 3, 1, 1, 6, 7),
            (2, 8, 5, 2, 2, 3, 4),
            (6, 10, 1, 2, 0, 5, 5),
            (20, 70, 3, 1, 1, 5, 4),
            (1, 4, 3, 1, 1, 120, 100),
        ];
        for (ci, co, k, s, p, h, w) in cases {
            let g = Conv2d::new([co as i64, ci as i64, k as i64, k as i64], [s as i64; 2], [p as i64; 2]).unwrap();
            let [ho, wo] = g.output(h, w).unwrap();
            let x: Vec<f32> = (0..2 * ci * h * w).map(|i| (i as f32 * 0.31).sin()).collect();
            let wts: Vec<f32> = (0..co * ci * k * k).map(|i| (i as f32 * 0.05).cos()).collect(); // [co, ci, k, k]
            let taps: Vec<f32> = (0..ci * k * k * co).map(|t| wts[(t % co) * ci * k * k + t / co]).collect();
            let mut panels = vec![f32::NAN; g.taps() * co.div_ceil(PANEL) * PANEL];
            pack_conv_panels(&wts, [co, ci, k, k], [ci * k * k, k * k, k, 1], &mut panels);
            let bias: Vec<f32> = (0..co).map(|i| i as f32 * 0.1).collect();
            // NCHW, and the same values laid out channels-last.
            let nchw = [ci * h * w, h * w, w, 1];
            let nhwc: Vec<f32> = (0..2 * h * w * ci)
                .map(|i| {
                    let (b, y, xx, c) = (i / (h * w * ci), i / (w * ci) % h, i / ci % w, i % ci);
                    x[b * ci * h * w + c * h * w + y * w + xx]
                })
                .collect();
            type Run<'a> = (&'a str, &'a dyn Fn(&mut [f32]) -> Ran);
            let runs: [Run; 3] = [
                ("direct nchw", &|out| direct_f32(&x, [2, h, w], nchw, &taps, &g, Some(&bias), Epilogue::None, out)),
                ("direct nhwc", &|out| {
                    let cl = [h * w * ci, 1, w * ci, ci];
                    direct_f32(&nhwc, [2, h, w], cl, &taps, &g, Some(&bias), Epilogue::None, out)
                }),
                ("indirect", &|out| {
                    indirect_f32(&nhwc, [2, h, w], &panels, &g, Some(&bias), None, Epilogue::None, out)
                }),
            ];
            let want = reference::conv2d(&nhwc, [2, h, w], &wts, &g, (Some(&bias), None), Epilogue::None);
            for (name, run) in runs {
                let mut out = vec![f32::NAN; 2 * ho * wo * co];
                assert_eq!(run(&mut out), Ok(()));
                for (i, (&got, &want)) in out.iter().zip(&want).enumerate() {
                    let tolerance = 1e-6 * g.taps() as f64;
                    assert!(
                        (got as f64 - want).abs() < tolerance,
                        "{name} {ci}->{co} k{k} s{s} p{p} [{i}]: {got} {want}"
                    );
                }
            }
        }
    });
}

#[test]
fn grouped_convolutions_match_the_reference() {
    each_isa(|| {
        // (groups, channels per group in and out, kernel, stride, padding, h, w): RegNet's
        // groups of 8 at strides 1 and 2, ResNeXt's 4 in, more outputs than inputs over a
        // masked tile, groups wider than a panel, with a residual and ReLU.
        let cases = [
            (19, 8, 8, 3, 1, 1, 7, 6),
            (7, 8, 8, 3, 2, 1, 9, 9),
            (4, 4, 12, 3, 1, 1, 5, 5),
            (3, 5, 6, 1, 1, 0, 4, 3),
            (2, 3, 70, 3, 1, 1, 4, 4),
        ];
        for (groups, per_in, per_out, k, s, p, h, w) in cases {
            let (ci, co) = (groups * per_in, groups * per_out);
            let shape = [co as i64, per_in as i64, k as i64, k as i64];
            let g = Conv2d::grouped(shape, [s as i64; 2], [p as i64; 2], groups as i64).unwrap();
            assert_eq!((g.in_channels, g.out_channels, g.taps()), (ci, co, per_in * k * k));
            let [ho, wo] = g.output(h, w).unwrap();
            let x: Vec<f32> = (0..2 * h * w * ci).map(|i| (i as f32 * 0.31).sin()).collect();
            let wts: Vec<f32> = (0..co * per_in * k * k).map(|i| (i as f32 * 0.05).cos()).collect();
            let size: usize = gemm::grouped_pack_size([co, per_in, k, k], groups).iter().product();
            let mut panels = vec![f32::NAN; size];
            gemm::pack_grouped_panels(&wts, [co, per_in, k, k], [per_in * k * k, k * k, k, 1], groups, &mut panels);
            let bias: Vec<f32> = (0..co).map(|i| i as f32 * 0.1 - 1.0).collect();
            let residual: Vec<f32> = (0..2 * ho * wo * co).map(|i| (i as f32 * 0.13).cos()).collect();
            let mut out = vec![f32::NAN; 2 * ho * wo * co];
            let ran = indirect_f32(&x, [2, h, w], &panels, &g, Some(&bias), Some(&residual), Epilogue::Relu, &mut out);
            assert_eq!(ran, Ok(()));
            let want = reference::conv2d(&x, [2, h, w], &wts, &g, (Some(&bias), Some(&residual)), Epilogue::Relu);
            for (i, (&got, &want)) in out.iter().zip(&want).enumerate() {
                assert!(
                    (got as f64 - want).abs() < 1e-6 * g.taps() as f64,
                    "groups {groups} k{k} s{s} [{i}]: {got} {want}"
                );
            }
        }
        assert_eq!(Conv2d::grouped([10, 2, 3, 3], [1, 1], [1, 1], 4), None, "4 groups don't divide 10 outputs");
    });
}

#[test]
fn gelu_matches_a_double_precision_reference() {
    each_isa(|| {
        // Every 0.0007 over [-7, 7] (erf's fit ends at 5.6), then far out.
        let x: Vec<f32> = (0..=20_000)
            .map(|i| (i as f32 - 10_000.0) * 0.0007)
            .chain([-90.0, 90.0, 0.0, -1e30, 1e30, -5.9, 5.9])
            .collect();
        for tanh in [false, true] {
            let mut out = vec![f32::NAN; x.len()];
            assert_eq!(gelu_f32(&x, tanh, &mut out), Ok(()));
            for (&v, &got) in x.iter().zip(&out) {
                let (v, want) = (v as f64, reference::gelu(v as f64, tanh));
                let tolerance = if v < -5.0 { 1e-6 } else { 2e-7 * v.abs().max(1.0) };
                assert!((got as f64 - want).abs() <= tolerance, "tanh={tanh} x={v}: {got} vs {want}");
            }
        }
    });
}

#[test]
fn rms_norm_normalizes_each_row() {
    let x: Vec<f32> = (0..70).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
    let w: Vec<f32> = (0..35).map(|i| 0.5 + i as f32 * 0.01).collect();
    let mut out = vec![0.0; 70];
    rms_norm_f32(&x, &w, 1e-6, &mut out);
    for (i, (&got, want)) in out.iter().zip(reference::rms_norm(&x, &w, 1e-6)).enumerate() {
        assert!((got as f64 - want).abs() <= 1e-6 * want.abs().max(1.0), "[{i}]");
    }
}

mod attention {
    use super::*;

    /// `[batch, heads, rows, cols]` values of `f`, laid out `[batch, rows, heads, cols]` (the
    /// transposed view attention reads from a projection), and that layout's strides.
    fn transposed(g: &Attention, rows: usize, cols: usize, f: impl Fn(usize) -> f32) -> (Vec<f32>, [usize; 3]) {
        let data = (0..g.batch * rows * g.heads * cols).map(f).collect();
        (data, [rows * g.heads * cols, cols, g.heads * cols])
    }

    #[test]
    fn attention_matches_a_double_precision_reference() {
        each_isa(|| {
            for (batch, heads, l, s, e, ev) in [
                (1, 4, 32, 32, 64, 64),
                (2, 3, 5, 37, 24, 80),
                (1, 1, 1, 1, 1, 1),
                (2, 2, 9, 16, 16, 130),
                (1, 4, 64, 64, 64, 64),
                // Square and causal-sized: blocks of rows that end mid-vector and past it.
                (1, 2, 37, 37, 16, 40),
                (1, 1, 58, 58, 8, 8),
                // ViT-Tiny's, whose queries split in parts across the threads.
                (1, 3, 197, 197, 64, 64),
            ] {
                let g = Attention { batch, heads, l, s, e, ev, scale: 1.0 / (e as f32).sqrt() };
                let (q, qs) = transposed(&g, l, e, |i| (i as f32 * 0.37).sin());
                let (k, ks) = transposed(&g, s, e, |i| (i as f32 * 0.11).cos());
                let (v, vs) = transposed(&g, s, ev, |i| (i as f32 * 0.07).sin() * 3.0);
                // A padding-style bool mask over [batch, 1, 1, s] (zero strides where broadcast), a
                // float mask over [l, s] with some -inf, and the causal triangle.
                let keep: Vec<u8> = (0..batch * s).map(|i| u8::from(i % s == 0 || i % 3 != 1)).collect();
                let add: Vec<f32> = (0..l * s)
                    .map(|i| if i % s != 0 && i % 5 == 2 { f32::NEG_INFINITY } else { (i as f32).sin() })
                    .collect();
                // And masks that vary along the queries only (BERT's: keys at stride 0).
                let rows: Vec<u8> = (0..l).map(|i| u8::from(i % 4 != 3)).collect();
                let row_add: Vec<f32> = (0..l).map(|i| (i as f32).cos()).collect();
                type Case<'a> = (AttentionMask<'a>, &'a dyn Fn(usize, usize, usize, usize) -> Option<f64>);
                let cases: [Case; 6] = [
                    (AttentionMask::None, &|_, _, _, _| Some(0.0)),
                    (AttentionMask::Causal, &|_, _, i, j| (j <= i).then_some(0.0)),
                    (AttentionMask::Bool(&keep, [s, 0, 0, 1]), &|b, _, _, j| (keep[b * s + j] != 0).then_some(0.0)),
                    (AttentionMask::Float(&add, [0, 0, s, 1]), &|_, _, i, j| Some(add[i * s + j] as f64)),
                    (AttentionMask::Float(&row_add, [0, 0, 1, 0]), &|_, _, i, _| Some(row_add[i] as f64)),
                    (AttentionMask::Bool(&rows, [0, 0, 1, 0]), &|_, _, i, _| (rows[i] != 0).then_some(0.0)),
                ];
                for (mask, want_mask) in cases {
                    // The reference's layout, `[batch, l, heads, ev]`, then `[batch, heads, l, ev]`.
                    let mut out = vec![f32::NAN; batch * l * heads * ev];
                    let ok = attention_f32(
                        (&q, qs),
                        (&k, ks),
                        (&v, vs),
                        &g,
                        mask,
                        (&mut out, [l * heads * ev, ev, heads * ev]),
                    );
                    let want = reference::attention(&g, (&q, qs), (&k, ks), (&v, vs), want_mask);
                    assert_eq!(ok.is_ok(), want.is_some(), "{g:?} {mask:?}");
                    let Some(want) = want else { continue };
                    let scale = want.iter().fold(0.0f64, |m, x| m.max(x.abs()));
                    for (got, want) in out.iter().zip(&want) {
                        assert!((*got as f64 - want).abs() <= 1e-5 * scale, "{g:?} {mask:?}: {got} vs {want}");
                    }
                    let mut heads_first = vec![f32::NAN; out.len()];
                    let contiguous = [heads * l * ev, l * ev, ev];
                    assert_eq!(
                        attention_f32((&q, qs), (&k, ks), (&v, vs), &g, mask, (&mut heads_first, contiguous)),
                        Ok(())
                    );
                    for (i, got) in heads_first.iter().enumerate() {
                        let (b, h, r, c) = (i / (heads * l * ev), i / (l * ev) % heads, i / ev % l, i % ev);
                        assert_eq!(
                            *got,
                            out[((b * l + r) * heads + h) * ev + c],
                            "{g:?} {mask:?} [{b}, {h}, {r}, {c}]"
                        );
                    }
                }
            }
        });
    }

    /// A head's queries split in parts where whole heads don't share out evenly over the
    /// threads, and not where they do or the parts would be small.
    #[test]
    fn attention_splits_heads_whose_count_shares_out_unevenly() {
        use super::super::attention::parts;
        assert_eq!(parts(3, 2, 197), 2); // ViT-Tiny on two threads: 3 units each.
        assert_eq!(parts(6, 4, 128), 2);
        assert_eq!(parts(3, 4, 197), 4);
        assert_eq!(parts(12, 2, 128), 1);
        assert_eq!(parts(4, 1, 512), 1);
        assert_eq!(parts(1, 2, 8), 1); // Fewer than 16 queries a part.
    }

    /// A causal kernel skips the keys a block of rows can't see; a NaN or an infinity among
    /// the keys or values (even where no row sees it) is left to torch.
    #[test]
    fn a_causal_attention_with_a_nonfinite_key_or_value_is_left_to_torch() {
        each_isa(|| {
            let g = Attention { batch: 1, heads: 1, l: 40, s: 40, e: 8, ev: 8, scale: 0.3 };
            for (which, bad) in [(0, f32::NAN), (1, f32::INFINITY)] {
                let mut kv = [vec![0.5f32; 320], vec![0.25f32; 320]];
                kv[which][39 * 8 + 3] = bad;
                let (q, mut out) = (vec![0.1f32; 320], vec![0.0f32; 320]);
                let strides = [320, 320, 8];
                let ok = attention_f32(
                    (&q, strides),
                    (&kv[0], strides),
                    (&kv[1], strides),
                    &g,
                    AttentionMask::Causal,
                    (&mut out, strides),
                );
                assert_eq!(ok, Err(Declined::Values), "{which} {bad}");
            }
        });
    }

    #[test]
    fn a_query_with_no_key_is_left_to_torch() {
        each_isa(|| {
            let g = Attention { batch: 1, heads: 1, l: 2, s: 3, e: 2, ev: 2, scale: 1.0 };
            let x = [0.5f32; 6];
            let keep = [1u8, 1, 1, 0, 0, 0];
            let mut out = [0.0f32; 4];
            let ok = attention_f32(
                (&x[..4], [4, 4, 2]),
                (&x, [6, 6, 2]),
                (&x, [6, 6, 2]),
                &g,
                AttentionMask::Bool(&keep, [0, 0, 3, 1]),
                (&mut out, [4, 4, 2]),
            );
            assert_eq!(ok, Err(Declined::Values));
        });
    }

    /// An output whose elements would share places is declined, not raced over.
    #[test]
    fn an_overlapping_output_is_declined() {
        each_isa(|| {
            let g = Attention { batch: 1, heads: 2, l: 3, s: 3, e: 4, ev: 4, scale: 0.5 };
            let x = [0.25f32; 24];
            let strides = [24, 12, 4];
            let mut out = [0.0f32; 24];
            for (layout, want, why) in [
                ([24, 4, 4], Err(Declined::Shapes), "heads over rows"),
                ([24, 12, 2], Err(Declined::Shapes), "rows over a row"),
                (strides, Ok(()), "the inputs' layout"),
            ] {
                let ok = attention_f32(
                    (&x, strides),
                    (&x, strides),
                    (&x, strides),
                    &g,
                    AttentionMask::None,
                    (&mut out, layout),
                );
                assert_eq!(ok, want, "{why}");
            }
        });
    }
}

#[test]
fn a_span_is_the_last_elements_offset_plus_one() {
    assert_eq!(super::span(&[2, 3, 4], &[12, 4, 1]), 24);
    // Channels-last, and a slice of a wider tensor's channels.
    assert_eq!(super::span(&[1, 3, 2, 2], &[12, 1, 6, 3]), 12);
    assert_eq!(super::span(&[1, 3, 2, 2], &[20, 1, 10, 5]), 18);
    // Broadcast (stride 0), an empty tensor, and one too large for a slice.
    assert_eq!(super::span(&[5, 4], &[0, 1]), 4);
    assert_eq!(super::span(&[3, 0, 4], &[0, 4, 1]), 0);
    assert_eq!(super::span(&[3, usize::MAX], &[1, 2]), usize::MAX);
}
