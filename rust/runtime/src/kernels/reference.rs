//! Scalar references of every kernel, in double precision, written as the definitions read
//! (torch's semantics: a NaN stays NaN through a clamp or a max): what each instruction set's
//! variant is tested against (`tests.rs`, `nonfinite_tests.rs`, `winograd.rs`'s and
//! `parallel.rs`'s tests). Layouts are the kernels': images channels-last (`[batch, h, w, c]`),
//! weights as torch holds them.

use super::{Attention, Conv2d, Depthwise, Epilogue, MaxPool};

/// `clamp`, keeping NaN (Rust's `f64::clamp` does too; `max` would drop it).
fn clamp(v: f64, lo: f64, hi: f64) -> f64 {
    if v.is_nan() {
        v
    } else {
        v.clamp(lo, hi)
    }
}

/// erf in double: its Taylor series below 2.5, else 1 - erfc by erfc's continued fraction;
/// ±1 at ±inf, NaN at NaN.
pub fn erf(z: f64) -> f64 {
    if z.abs() >= 2.5 {
        let a = z.abs();
        let f = (1..80).rev().fold(a, |f, n| a + (n as f64 / 2.0) / f);
        return z.signum() * (1.0 - (-a * a).exp() / (std::f64::consts::PI.sqrt() * f));
    }
    let (mut term, mut sum) = (z, z);
    for n in 1..200 {
        term *= -z * z / n as f64;
        sum += term / (2 * n + 1) as f64;
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

/// GELU, exact (`0.5 x (1 + erf(x / sqrt 2))`) or its tanh approximation.
pub fn gelu(v: f64, tanh: bool) -> f64 {
    if tanh {
        0.5 * v * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v.powi(3))).tanh())
    } else {
        0.5 * v * (1.0 + erf(v / std::f64::consts::SQRT_2))
    }
}

/// The activation `e` of `v`, as torch defines it. At +inf, torch's vectorized erf GELU gives
/// NaN in its AVX-512 variant (all but one-element tensors), and kwexport's follows whichever
/// torch runs.
pub fn epilogue(e: Epilogue, v: f64) -> f64 {
    match e {
        Epilogue::None => v,
        Epilogue::Relu => clamp(v, 0.0, f64::INFINITY),
        Epilogue::Relu6 => clamp(v, 0.0, 6.0),
        Epilogue::Hardswish => v * clamp(v + 3.0, 0.0, 6.0) / 6.0,
        Epilogue::Hardsigmoid => clamp(v + 3.0, 0.0, 6.0) / 6.0,
        Epilogue::Sigmoid => 1.0 / (1.0 + (-v).exp()),
        Epilogue::Swish => v / (1.0 + (-v).exp()),
        Epilogue::Gelu if v == f64::INFINITY && super::isa::torch_uses_avx512() => f64::NAN,
        Epilogue::Gelu => gelu(v, false),
        Epilogue::GeluTanh => gelu(v, true),
    }
}

/// Every epilogue, for the tests that run each.
pub const EPILOGUES: [Epilogue; 9] = [
    Epilogue::None,
    Epilogue::Relu,
    Epilogue::Relu6,
    Epilogue::Hardswish,
    Epilogue::Hardsigmoid,
    Epilogue::Sigmoid,
    Epilogue::Swish,
    Epilogue::Gelu,
    Epilogue::GeluTanh,
];

/// `epilogue(bias[n] + x[m, k] @ w[k, n] + residual[m, n])`, row by row (`gemm_f32`,
/// `linear_f32`, a 1×1 convolution over pixels).
pub fn gemm(
    x: &[f32],
    [m, k, n]: [usize; 3],
    w: &[f32],
    bias: Option<&[f32]>,
    residual: Option<&[f32]>,
    e: Epilogue,
) -> Vec<f64> {
    let mut out = vec![0.0; m * n];
    for r in 0..m {
        for j in 0..n {
            let dot: f64 = (0..k).map(|t| x[r * k + t] as f64 * w[t * n + j] as f64).sum();
            let add = bias.map_or(0.0, |b| b[j] as f64) + residual.map_or(0.0, |res| res[r * n + j] as f64);
            out[r * n + j] = epilogue(e, dot + add);
        }
    }
    out
}

/// `epilogue(bias + dequantize(quantize(x)) @ (w * w_scale).T)` (`int8::linear`): `x`
/// (`[m, k]`) quantized per tensor by `quantize_per_tensor`'s definition (`clamp(round(x *
/// (1 / scale)) + zp, qmin, qmax)`, the product in float32 as torch takes it), dequantized
/// (`(q - zp) * scale`), times the int8 `[n, k]` weight dequantized per output channel.
pub fn linear_int8(
    x: &[f32],
    [m, k, n]: [usize; 3],
    q: &super::int8::Quant,
    w: &[i8],
    w_scale: &[f32],
    bias: Option<&[f32]>,
    e: Epilogue,
) -> Vec<f64> {
    let inv = (1.0 / q.scale) as f32;
    let quantized = |v: f32| {
        let level = ((v * inv) as f64).round_ties_even() + q.zero_point as f64;
        // A NaN, which torch's cast leaves undefined, to `qmin` (the kernel's choice).
        let level = if level.is_nan() { q.qmin as f64 } else { level.clamp(q.qmin as f64, q.qmax as f64) };
        (level - q.zero_point as f64) * q.scale
    };
    let xq: Vec<f64> = x.iter().map(|&v| quantized(v)).collect();
    let mut out = vec![0.0; m * n];
    for r in 0..m {
        for j in 0..n {
            let dot: f64 = (0..k).map(|t| xq[r * k + t] * (w[j * k + t] as f64 * w_scale[j] as f64)).sum();
            out[r * n + j] = epilogue(e, dot + bias.map_or(0.0, |b| b[j] as f64));
        }
    }
    out
}

/// A convolution of channels-last images `x` (`[batch, h, w, in]`) with a `[out, in, kh, kw]`
/// weight, plus `bias` and `residual` (channels-last, as the output), then `e`: the output
/// channels-last (`direct_f32`, `indirect_f32`, `winograd::conv`).
pub fn conv2d(
    x: &[f32],
    [batch, h, w]: [usize; 3],
    weight: &[f32],
    g: &Conv2d,
    (bias, residual): (Option<&[f32]>, Option<&[f32]>),
    e: Epilogue,
) -> Vec<f64> {
    let (ci, co, [kh, kw]) = (g.in_channels, g.out_channels, g.kernel);
    // Each output channel reads its group's input channels.
    let (per_in, per_out) = (ci / g.groups, co / g.groups);
    let [ho, wo] = g.output(h, w).expect("a valid geometry");
    let mut out = vec![0.0; batch * ho * wo * co];
    for (b, oy, ox) in (0..batch).flat_map(|b| (0..ho).flat_map(move |y| (0..wo).map(move |x| (b, y, x)))) {
        for o in 0..co {
            let mut acc = bias.map_or(0.0, |b| b[o] as f64);
            for (c, i, j) in (0..per_in).flat_map(|c| (0..kh).flat_map(move |i| (0..kw).map(move |j| (c, i, j)))) {
                let y = (oy * g.stride[0] + i) as isize - g.padding[0] as isize;
                let xx = (ox * g.stride[1] + j) as isize - g.padding[1] as isize;
                if (0..h as isize).contains(&y) && (0..w as isize).contains(&xx) {
                    let v = x[((b * h + y as usize) * w + xx as usize) * ci + o / per_out * per_in + c] as f64;
                    acc += v * weight[((o * per_in + c) * kh + i) * kw + j] as f64;
                }
            }
            let at = ((b * ho + oy) * wo + ox) * co + o;
            out[at] = epilogue(e, acc + residual.map_or(0.0, |r| r[at] as f64));
        }
    }
    out
}

/// A depthwise convolution of channels-last images with `taps` (`[kh * kw, c]`), plus `bias`,
/// then `e` (`depthwise_f32`).
pub fn depthwise(
    x: &[f32],
    [batch, h, w]: [usize; 3],
    taps: &[f32],
    g: &Depthwise,
    bias: Option<&[f32]>,
    e: Epilogue,
) -> Vec<f64> {
    let (c, [kh, kw]) = (g.channels, g.kernel);
    let [ho, wo] = g.output(h, w).expect("a valid geometry");
    let mut out = vec![0.0; batch * ho * wo * c];
    for (b, oy, ox) in (0..batch).flat_map(|b| (0..ho).flat_map(move |y| (0..wo).map(move |x| (b, y, x)))) {
        for ch in 0..c {
            let mut acc = bias.map_or(0.0, |b| b[ch] as f64);
            for (i, j) in (0..kh).flat_map(|i| (0..kw).map(move |j| (i, j))) {
                let y = (oy * g.stride[0] + i) as isize - g.padding[0] as isize;
                let xx = (ox * g.stride[1] + j) as isize - g.padding[1] as isize;
                if (0..h as isize).contains(&y) && (0..w as isize).contains(&xx) {
                    let v = x[((b * h + y as usize) * w + xx as usize) * c + ch] as f64;
                    acc += v * taps[(i * kw + j) * c + ch] as f64;
                }
            }
            out[((b * ho + oy) * wo + ox) * c + ch] = epilogue(e, acc);
        }
    }
    out
}

/// Each window's largest value inside the image, NaN where the window holds one
/// (`max_pool_f32`): exact, so `f32`.
pub fn max_pool(x: &[f32], [batch, h, w, c]: [usize; 4], pool: &MaxPool) -> Vec<f32> {
    let [ho, wo] = pool.output(h, w).expect("a valid geometry");
    let mut out = vec![f32::NEG_INFINITY; batch * ho * wo * c];
    for (b, oy, ox) in (0..batch).flat_map(|b| (0..ho).flat_map(move |y| (0..wo).map(move |x| (b, y, x)))) {
        for ch in 0..c {
            let o = &mut out[((b * ho + oy) * wo + ox) * c + ch];
            for (ky, kx) in (0..pool.kernel[0]).flat_map(|i| (0..pool.kernel[1]).map(move |j| (i, j))) {
                let iy = (oy * pool.stride[0] + ky) as isize - pool.padding[0] as isize;
                let ix = (ox * pool.stride[1] + kx) as isize - pool.padding[1] as isize;
                if (0..h as isize).contains(&iy) && (0..w as isize).contains(&ix) {
                    let v = x[((b * h + iy as usize) * w + ix as usize) * c + ch];
                    *o = if v.is_nan() || o.is_nan() { f32::NAN } else { o.max(v) };
                }
            }
        }
    }
    out
}

/// The mean of each channel over `pixels` channels-last pixels (`mean_pixels_f32`).
pub fn mean_pixels(x: &[f32], pixels: usize, c: usize) -> Vec<f64> {
    (0..c).map(|ch| (0..pixels).map(|p| x[p * c + ch] as f64).sum::<f64>() / pixels as f64).collect()
}

/// Layer norm of each row of `n` (`layer_norm_f32`): the variance around the mean.
pub fn layer_norm(x: &[f32], w: &[f32], b: &[f32], eps: f64) -> Vec<f64> {
    let n = w.len();
    x.chunks(n)
        .flat_map(|row| {
            let mean = row.iter().map(|&v| v as f64).sum::<f64>() / n as f64;
            let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n as f64;
            (0..n).map(move |j| (row[j] as f64 - mean) / (var + eps).sqrt() * w[j] as f64 + b[j] as f64)
        })
        .collect()
}

/// RMS norm of each row of `n` (`rms_norm_f32`).
pub fn rms_norm(x: &[f32], w: &[f32], eps: f64) -> Vec<f64> {
    let n = w.len();
    x.chunks(n)
        .flat_map(|row| {
            let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / n as f64;
            (0..n).map(move |j| w[j] as f64 * row[j] as f64 / (ms + eps).sqrt())
        })
        .collect()
}

/// Scaled dot-product attention (`attention_f32`) over queries, keys and values at
/// `[batch, head, row]` strides, with `mask(b, h, i, j)` the score's addend (`None`: masked
/// out); the output `[batch, l, heads, ev]`. `None` where a row has no key.
pub fn attention(
    g: &Attention,
    (q, qs): (&[f32], [usize; 3]),
    (k, ks): (&[f32], [usize; 3]),
    (v, vs): (&[f32], [usize; 3]),
    mask: &dyn Fn(usize, usize, usize, usize) -> Option<f64>,
) -> Option<Vec<f64>> {
    let mut out = vec![0.0; g.batch * g.l * g.heads * g.ev];
    for b in 0..g.batch {
        for h in 0..g.heads {
            for i in 0..g.l {
                let scores: Vec<Option<f64>> = (0..g.s)
                    .map(|j| {
                        let dot: f64 = (0..g.e)
                            .map(|c| {
                                q[b * qs[0] + h * qs[1] + i * qs[2] + c] as f64
                                    * k[b * ks[0] + h * ks[1] + j * ks[2] + c] as f64
                            })
                            .sum();
                        mask(b, h, i, j).map(|m| dot * g.scale as f64 + m).filter(|x| x.is_finite())
                    })
                    .collect();
                let max = scores.iter().flatten().cloned().fold(f64::NEG_INFINITY, f64::max);
                if max == f64::NEG_INFINITY {
                    return None;
                }
                let p: Vec<f64> = scores.iter().map(|s| s.map_or(0.0, |s| (s - max).exp())).collect();
                let sum: f64 = p.iter().sum();
                for c in 0..g.ev {
                    let acc: f64 = (0..g.s).map(|j| p[j] * v[b * vs[0] + h * vs[1] + j * vs[2] + c] as f64).sum();
                    out[((b * g.l + i) * g.heads + h) * g.ev + c] = acc / sum;
                }
            }
        }
    }
    Some(out)
}
