//! The kernels that write into a part of a concatenation (`plan::concat`): each, writing its
//! channels of a wider channels-last tensor (and the depthwise one also reading another part
//! of that tensor), gives exactly what it gives into a tensor of its own, and writes nothing
//! outside its channels. On every instruction set, on the tests' pool of threads.

use super::tests::each_isa;
use super::*;

/// A wider tensor's pixels, `total` channels each, marked so that a write shows.
const MARK: f32 = -12345.0;

/// `pixels` pixels of `total` channels, `MARK` everywhere.
fn marked(pixels: usize, total: usize) -> Vec<f32> {
    vec![MARK; pixels * total]
}

/// Checks that channels `offset .. offset + c` of each of `buffer`'s pixels hold `want`'s
/// (dense `[pixels, c]`) bit for bit, and every other channel still holds `MARK`, or
/// `others` where given.
fn holds(buffer: &[f32], total: usize, offset: usize, want: &[f32], c: usize, others: Option<&[f32]>, what: &str) {
    for (p, pixel) in buffer.chunks_exact(total).enumerate() {
        for (ch, &v) in pixel.iter().enumerate() {
            let expected = if (offset..offset + c).contains(&ch) {
                want[p * c + ch - offset]
            } else {
                others.map_or(MARK, |o| o[p * total + ch])
            };
            assert_eq!(v.to_bits(), expected.to_bits(), "{what}: pixel {p} channel {ch}");
        }
    }
}

fn values(n: usize, step: f32) -> Vec<f32> {
    (0..n).map(|i| (i as f32 * step).sin()).collect()
}

#[test]
fn the_gemm_writes_its_rows_into_a_part() {
    each_isa(|| {
        // (m, k, n, offset, total): one panel masked, two panels, GhostNet's 24 of 48, many rows.
        for (m, k, n, offset, total) in
            [(37, 16, 24, 0, 48), (50, 20, 70, 10, 90), (9, 8, 24, 24, 48), (700, 16, 64, 64, 128)]
        {
            let x = values(m * k, 0.37);
            let w = values(n * k, 0.11);
            let mut panels = vec![0.0; panels_len(k, n)];
            pack_conv_panels(&w, [n, k, 1, 1], [k, 1, 1, 1], &mut panels);
            let bias = values(n, 0.5);
            let mut dense = vec![0.0; m * n];
            gemm_f32(&x, m, k, &panels, n, Some(&bias), None, Epilogue::Relu, &mut dense).unwrap();
            let mut buffer = marked(m, total);
            let out = &mut buffer[offset..offset + (m - 1) * total + n];
            gemm::gemm_f32_rows(&x, k, [m, k, n], &panels, (Some(&bias), None), Epilogue::Relu, (out, total)).unwrap();
            holds(&buffer, total, offset, &dense, n, None, &format!("gemm {m}x{k}x{n} at {offset} of {total}"));
        }
    });
}

#[test]
fn convolutions_write_their_pixels_into_a_part() {
    each_isa(|| {
        // (cin, cout, h, w, offset, total): SqueezeNet's expand 3×3 (a second part), an odd
        // image, outputs of more than one panel.
        for (ci, co, h, w, offset, total) in [(16, 64, 9, 11, 64, 128), (5, 24, 7, 6, 0, 40), (12, 70, 6, 8, 3, 80)] {
            let g = Conv2d::new([co as i64, ci as i64, 3, 3], [1, 1], [1, 1]).unwrap();
            let [ho, wo] = g.output(h, w).unwrap();
            let pixels = 2 * ho * wo;
            let x = values(2 * h * w * ci, 0.31);
            let wts = values(co * ci * 9, 0.05);
            let bias = values(co, 0.7);
            let mut panels = vec![0.0; gemm::pack_size([co, ci, 3, 3]).iter().product()];
            pack_conv_panels(&wts, [co, ci, 3, 3], [ci * 9, 9, 3, 1], &mut panels);
            let mut dense = vec![0.0; pixels * co];
            indirect_f32(&x, [2, h, w], &panels, &g, Some(&bias), None, Epilogue::Relu, &mut dense).unwrap();
            let mut buffer = marked(pixels, total);
            let out = &mut buffer[offset..offset + (pixels - 1) * total + co];
            indirect_f32_strided(&x, [2, h, w], &panels, &g, (Some(&bias), None), Epilogue::Relu, (out, total))
                .unwrap();
            holds(&buffer, total, offset, &dense, co, None, &format!("indirect {ci}->{co} at {offset} of {total}"));

            let mut wpanels = vec![0.0; winograd::panels_len(ci, co)];
            winograd::pack_weights(&wts, [co, ci], [ci * 9, 9, 3, 1], &mut wpanels);
            let mut dense = vec![0.0; pixels * co];
            winograd::conv(&x, [2, h, w], &wpanels, &g, Some(&bias), None, Epilogue::Relu, &mut dense).unwrap();
            let mut buffer = marked(pixels, total);
            let out = &mut buffer[offset..offset + (pixels - 1) * total + co];
            winograd::conv_strided(&x, [2, h, w], &wpanels, &g, (Some(&bias), None), Epilogue::Relu, (out, total))
                .unwrap();
            holds(&buffer, total, offset, &dense, co, None, &format!("winograd {ci}->{co} at {offset} of {total}"));
        }
    });
}

/// GhostNet's module: a depthwise convolution reading the first part of a concatenation
/// and writing the second, in one buffer.
#[test]
fn the_depthwise_kernel_reads_one_part_and_writes_another() {
    each_isa(|| {
        // (c, kernel, stride, padding, h, w): GhostNet's 3×3, channels that aren't a multiple
        // of 16, a 5×5 at stride 2 (its output is smaller than its input: a part of another
        // buffer).
        for (c, k, s, p, h, w) in [(24, 3, 1, 1, 14, 13), (8, 3, 1, 1, 9, 9), (40, 5, 1, 2, 6, 7), (19, 5, 2, 2, 9, 8)]
        {
            let g = Depthwise::new([c as i64, k as i64, k as i64], [s as i64; 2], [p as i64; 2]).unwrap();
            let [ho, wo] = g.output(h, w).unwrap();
            let taps = values(k * k * c, 0.07);
            let bias = values(c, 0.3);
            let x = values(2 * h * w * c, 0.29);
            let mut dense = vec![0.0; 2 * ho * wo * c];
            depthwise_f32(&x, [2, h, w], &taps, &g, Some(&bias), Epilogue::Relu, &mut dense).unwrap();
            let total = 2 * c + 3;
            if s == 1 {
                // The input in channels 0 .. c of the buffer, the output into c .. 2c.
                let mut buffer = marked(2 * h * w, total);
                for (pixel, xs) in buffer.chunks_exact_mut(total).zip(x.chunks_exact(c)) {
                    pixel[..c].copy_from_slice(xs);
                }
                let before = buffer.clone();
                let base = buffer.as_mut_ptr();
                // SAFETY: the input's channels 0 .. c and the output's c .. 2c of the same
                // buffer's pixels, which it holds.
                unsafe {
                    let ran = depthwise_f32_strided(
                        (base, total),
                        [2, h, w],
                        &taps,
                        &g,
                        Some(&bias),
                        Epilogue::Relu,
                        (base.add(c), total),
                    );
                    assert_eq!(ran, Ok(()));
                }
                holds(&buffer, total, c, &dense, c, Some(&before), &format!("depthwise c{c} k{k} in one buffer"));
            }
            // The input a part of one buffer, the output a part of another.
            let mut input = marked(2 * h * w, total);
            for (pixel, xs) in input.chunks_exact_mut(total).zip(x.chunks_exact(c)) {
                pixel[1..1 + c].copy_from_slice(xs);
            }
            let mut buffer = marked(2 * ho * wo, total);
            // SAFETY: the two buffers' pixels, as the shapes say.
            unsafe {
                let x = (input.as_ptr().add(1), total);
                let out = (buffer.as_mut_ptr().add(2), total);
                assert_eq!(depthwise_f32_strided(x, [2, h, w], &taps, &g, Some(&bias), Epilogue::Relu, out), Ok(()));
            }
            holds(&buffer, total, 2, &dense, c, None, &format!("depthwise c{c} k{k} s{s} between buffers"));
        }
    });
}

#[test]
fn place_rows_copies_into_a_part() {
    each_isa(|| {
        for (outer, len, ld, offset, total) in [(5, 3, 3, 2, 7), (1000, 24, 40, 24, 48), (3, 64, 64, 0, 128)] {
            let x = values((outer - 1) * ld + len, 0.9);
            let mut buffer = marked(outer, total);
            let out = &mut buffer[offset..offset + (outer - 1) * total + len];
            copy::place_rows(copy::Strided { x: &x, len, ld }, outer, (out, total));
            let want: Vec<f32> = (0..outer).flat_map(|r| x[r * ld..r * ld + len].to_vec()).collect();
            holds(&buffer, total, offset, &want, len, None, &format!("place_rows {outer}x{len}"));
        }
    });
}
