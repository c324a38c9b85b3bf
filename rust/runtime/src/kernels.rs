//! kwexport's own kernels, for fused chains torch has no CPU kernel for at these sizes. Each
//! runs on plain slices (contiguous float32 memory the caller checked); the plan gives a node
//! one only at `optimize="fast"`, where a pass fused the chain, and runs torch's op for the
//! node wherever the tensors don't qualify.

/// RMS normalization over rows of `n = w.len()` values: `w * (x * rsqrt(mean(x^2) + eps))`,
/// as the decomposed pattern computes it (the mean of squares, plus `eps`, its reciprocal
/// square root, times `x`, then the weight), in float32 with the sum of squares taken in
/// sixteen lanes (the order differs from torch's reduction by rounding: `docs/optimize.md`).
pub fn rms_norm_f32(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    if n == 0 {
        return;
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_normalizes_each_row() {
        let x: Vec<f32> = (0..70).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let w: Vec<f32> = (0..35).map(|i| 0.5 + i as f32 * 0.01).collect();
        let mut out = vec![0.0; 70];
        rms_norm_f32(&x, &w, 1e-6, &mut out);
        for r in 0..2 {
            let row = &x[r * 35..(r + 1) * 35];
            let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / 35.0;
            for i in 0..35 {
                let want = w[i] as f64 * row[i] as f64 / (ms + 1e-6).sqrt();
                assert!((out[r * 35 + i] as f64 - want).abs() <= 1e-6 * want.abs().max(1.0), "{r} {i}");
            }
        }
    }
}
