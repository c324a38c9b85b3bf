//! Patch embeddings (a vision transformer's 16×16 convolution at stride 16): a convolution
//! whose kernel tiles the image, so that each output pixel's patch is its own run of input
//! values and im2col is only a copy. The patches are gathered into dense rows in the weight's
//! own order (channel, kernel row, column: from an NCHW image, runs of `kw` contiguous
//! values) and multiplied on the GEMM, where the direct kernel for stems
//! ([`super::direct_f32`]) broadcasts each of 768 values a patch against the output channels
//! and oneDNN runs ViT-Tiny's at ~60 G multiply-adds a second.

use super::activation::Epilogue;
use super::conv::Conv2d;
use super::gemm::{gemm_f32, pack_conv_panels, panels_len};
use super::{Declined, Ran};

/// The fewest values a patch holds for the GEMM to be a candidate: below that (ConvNeXt's
/// 4×4 stem over 3 channels, 48) the direct kernel keeps it.
pub const MIN_PATCH: usize = 256;

/// Whether `g` is a patch embedding this module runs: one group, the stride equal to the
/// kernel, no padding, and at least [`MIN_PATCH`] values a patch.
pub fn tiles(g: &Conv2d) -> bool {
    g.groups == 1 && g.stride == g.kernel && g.padding == [0, 0] && g.taps() >= MIN_PATCH
}

/// The panels [`patches_f32`] multiplies by: the `[out, in, kh, kw]` weight (at element
/// `strides`) as the GEMM's `[in * kh * kw, out]` matrix whose row `(c * kh + i) * kw + j`
/// holds input channel `c` at tap `(i, j)`, the order a patch is gathered in.
/// `panels` holds [`panels_len`]`(in * kh * kw, out)` elements.
pub fn pack_patch_panels(w: &[f32], [n, cin, kh, kw]: [usize; 4], strides: [usize; 4], panels: &mut [f32]) {
    // `pack_conv_panels` orders rows (tap row, tap column, channel), the last fastest: as
    // (channel, row, column) with the dimensions named so.
    pack_conv_panels(w, [n, kw, cin, kh], [strides[0], strides[3], strides[1], strides[2]], panels);
}

/// A patch embedding ([`tiles`]) of `x` (`[batch, cin, h, w]` at element `strides`: any
/// layout, the user's NCHW image), with the weight's `panels` ([`pack_patch_panels`]), the
/// bias and `epilogue`, into `out` (channels-last `[batch, ho, wo, out]`). Declines (writing
/// nothing) where the geometry isn't one, the slices don't fit the shapes or kwexport's
/// kernels don't run on this CPU.
#[allow(clippy::too_many_arguments)]
pub fn patches_f32(
    x: &[f32],
    [batch, h, w]: [usize; 3],
    strides: [usize; 4],
    panels: &[f32],
    g: &Conv2d,
    bias: Option<&[f32]>,
    epilogue: Epilogue,
    out: &mut [f32],
) -> Ran {
    let (Some([ho, wo]), true) = (g.output(h, w), tiles(g)) else { return Err(Declined::Shapes) };
    let ([kh, kw], cin, k) = (g.kernel, g.in_channels, g.taps());
    if batch == 0
        || x.len() < super::span(&[batch, cin, h, w], &strides)
        || panels.len() < panels_len(k, g.out_channels)
    {
        return Err(Declined::Shapes);
    }
    super::table_if(true)?;
    let m = batch * ho * wo;
    let mut rows = vec![0f32; m * k];
    for (p, row) in rows.chunks_exact_mut(k).enumerate() {
        let (b, oy, ox) = (p / (ho * wo), p / wo % ho, p % wo);
        for (run, dst) in row.chunks_exact_mut(kw).enumerate() {
            let (c, i) = (run / kh, run % kh);
            let at = b * strides[0] + c * strides[1] + (oy * kh + i) * strides[2] + ox * kw * strides[3];
            match strides[3] {
                1 => dst.copy_from_slice(&x[at..at + kw]),
                s => dst.iter_mut().enumerate().for_each(|(j, v)| *v = x[at + j * s]),
            }
        }
    }
    gemm_f32(&rows, m, k, panels, g.out_channels, bias, None, epilogue, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::reference;

    #[test]
    fn a_patch_embedding_matches_the_reference_convolution_in_any_layout() {
        if crate::kernels::isa::kernels().is_none() {
            return;
        }
        // 3 → 20 channels, 16×16 patches (768 values), batch 2, over 2×3 and 1×1 patches.
        for [h, w] in [[32usize, 48usize], [16, 16]] {
            let (batch, cin, n, k) = (2, 3, 20, 16);
            let g = Conv2d::new([n as i64, cin as i64, k as i64, k as i64], [k as i64; 2], [0, 0]).unwrap();
            assert!(tiles(&g));
            let nchw: Vec<f32> = (0..batch * cin * h * w).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
            let mut nhwc = vec![0f32; nchw.len()];
            for (b, c, p) in (0..batch).flat_map(|b| (0..cin).flat_map(move |c| (0..h * w).map(move |p| (b, c, p)))) {
                nhwc[(b * h * w + p) * cin + c] = nchw[(b * cin + c) * h * w + p];
            }
            let wt: Vec<f32> = (0..n * g.taps()).map(|i| ((i * 53 % 97) as f32 - 48.0) / 97.0).collect();
            let bias: Vec<f32> = (0..n).map(|i| i as f32 / 10.0 - 1.0).collect();
            let mut panels = vec![0f32; panels_len(g.taps(), n)];
            pack_patch_panels(&wt, [n, cin, k, k], [g.taps(), k * k, k, 1], &mut panels);
            let [ho, wo] = g.output(h, w).unwrap();
            let want = reference::conv2d(&nhwc, [batch, h, w], &wt, &g, (Some(&bias), None), Epilogue::Relu);
            let layouts = [(&nchw, [cin * h * w, h * w, w, 1]), (&nhwc, [cin * h * w, 1, w * cin, cin])];
            for (xs, strides) in layouts {
                let mut out = vec![0f32; batch * ho * wo * n];
                patches_f32(xs, [batch, h, w], strides, &panels, &g, Some(&bias), Epilogue::Relu, &mut out).unwrap();
                for (i, (&a, &b)) in out.iter().zip(&want).enumerate() {
                    assert!((a as f64 - b).abs() <= 1e-4 * (1.0 + b.abs()), "{i}: {a} against {b}");
                }
            }
        }
    }
}
