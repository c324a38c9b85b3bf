//! Copies that rearrange elements: concatenation ([`concat_rows`]) and the swap of two axes
//! ([`swap_axes`]: a channel shuffle's or an attention head's `contiguous`). Plain loads and
//! stores, which the compiler vectorizes, so one portable kernel serves every instruction
//! set.

use super::parallel;

/// One input of [`concat_rows`]: rows of `len` elements, `ld` apart (`len` where dense; more
/// for a slice of a channels-last tensor's channels), the last ending `x`.
#[derive(Clone, Copy)]
pub struct Strided<'a> {
    pub x: &'a [f32],
    pub len: usize,
    pub ld: usize,
}

/// Concatenation as rows: any concatenation of dense tensors that share a memory order is
/// this, with `outer` the product of the sizes laid out before the joined dimension.
///
/// Writes `out`'s `outer` rows: row `r` is row `r` of each of `inputs` in turn. `out` must
/// hold exactly the inputs' rows. Split across threads by rows where each thread copies
/// enough to be worth waking.
pub fn concat_rows(inputs: &[Strided<'_>], outer: usize, out: &mut [f32]) {
    let row: usize = inputs.iter().map(|x| x.len).sum();
    let spans = |x: &Strided<'_>| x.ld >= x.len && x.x.len() == (outer - 1) * x.ld + x.len;
    assert!(outer > 0 && out.len() == outer * row && inputs.iter().all(spans));
    if row == 0 {
        return;
    }
    // A copy moves an element where a GEMM does a flop: the same threshold for threads.
    parallel::units(out, row, row, &|first, out| {
        let mut o = 0;
        for r in first..first + out.len() / row {
            for x in inputs {
                copy(&x.x[r * x.ld..r * x.ld + x.len], &mut out[o..o + x.len]);
                o += x.len;
            }
        }
    });
}

/// Writes `x`'s `outer` rows into rows of `out.0` that are `out.1` apart (`>= x.len`): one
/// input of a concatenation copied into its place in the result where the others are
/// there already (`plan::concat`). `out.0` spans the rows, from the first's first element
/// to the last's last. Split across threads by rows as [`concat_rows`] is.
pub fn place_rows(x: Strided<'_>, outer: usize, (out, ldo): (&mut [f32], usize)) {
    let spans = |len: usize, ld: usize| outer > 0 && ld >= x.len && len == (outer - 1) * ld + x.len;
    assert!(spans(x.x.len(), x.ld) && spans(out.len(), ldo));
    if x.len == 0 {
        return;
    }
    parallel::units(out, ldo, x.len, &|first, out| {
        // The rows that start in this share (the last one may end in the next's gap).
        for (i, r) in (first..outer).take(out.len().div_ceil(ldo)).enumerate() {
            copy(&x.x[r * x.ld..r * x.ld + x.len], &mut out[i * ldo..i * ldo + x.len]);
        }
    });
}

/// `dst.copy_from_slice(src)`, inline for the short runs a channels-last concatenation along
/// channels copies (GhostNet's: 8 to 80 floats, 12544 rows), where a `memcpy` call per run
/// cost more than the copy.
#[inline(always)]
fn copy(src: &[f32], dst: &mut [f32]) {
    const BLOCK: usize = 16;
    if src.len() > 256 {
        return dst.copy_from_slice(src);
    }
    let (src_blocks, src_tail) = src.as_chunks::<BLOCK>();
    let (dst_blocks, dst_tail) = dst.as_chunks_mut::<BLOCK>();
    for (d, s) in dst_blocks.iter_mut().zip(src_blocks) {
        *d = *s;
    }
    for (d, s) in dst_tail.iter_mut().zip(src_tail) {
        *d = *s;
    }
}

/// `out[o, i, j, e] = x[o, j, i, e]` for `[outer, q, p, e]` = `shape`: each of `outer` dense
/// `[q, p]` matrices of `e`-element blocks, transposed. `x` and `out` hold the shape's
/// elements. A channel shuffle is `e = 1` with `q` its groups, interleaving `q` rows (a
/// constant `q` of 2 to 4 lets the compiler vectorize the interleave); an attention head's
/// transpose is `e` its width, a block copy each. Split across threads by `outer` where each
/// thread copies enough.
pub fn swap_axes(x: &[f32], shape: [usize; 4], out: &mut [f32]) {
    let [outer, q, p, e] = shape;
    let block = q * p * e;
    assert!(x.len() == outer * block && out.len() == x.len() && block > 0);
    let one = |src: &[f32], dst: &mut [f32]| match (e, q) {
        (1, 2) => interleave::<2>(src, dst),
        (1, 3) => interleave::<3>(src, dst),
        (1, 4) => interleave::<4>(src, dst),
        (1, _) => transpose(src, [q, p], dst),
        _ => {
            for (i, row) in dst.chunks_exact_mut(q * e).enumerate() {
                for (j, d) in row.chunks_exact_mut(e).enumerate() {
                    copy(&src[(j * p + i) * e..(j * p + i + 1) * e], d);
                }
            }
        }
    };
    parallel::blocks(x, out, block, block, &|x, out| {
        for (src, dst) in x.chunks_exact(block).zip(out.chunks_exact_mut(block)) {
            one(src, dst);
        }
    });
}

/// `dst[i * q + j] = src[j * p + i]`: a `[q, p]` matrix transposed (an NCHW image's `q`
/// channels as channels-last pixels), 16 columns of `src` at a time, so that a block's `16 *
/// q` results stay in cache while every row writes its column of them. (A copy per element
/// cost a call to `memcpy` each: an int8 convolution of a 64-channel NCHW input spent 40% of
/// its time there.)
fn transpose(src: &[f32], [q, p]: [usize; 2], dst: &mut [f32]) {
    const COLUMNS: usize = 16;
    for i0 in (0..p).step_by(COLUMNS) {
        let block = &mut dst[i0 * q..(i0 + COLUMNS).min(p) * q];
        for (j, row) in src.chunks_exact(p).take(q).enumerate() {
            for (at, &v) in block[j..].iter_mut().step_by(q).zip(&row[i0..]) {
                *at = v;
            }
        }
    }
}

/// `dst[i * Q + j] = src[j * p + i]`: `Q` rows of `p` elements, interleaved. Written as
/// fixed-size groups without bounds checks in the loop, which the compiler turns into
/// vector loads and shuffles.
#[inline(always)]
fn interleave<const Q: usize>(src: &[f32], dst: &mut [f32]) {
    let p = src.len() / Q;
    let rows: [&[f32]; Q] = std::array::from_fn(|j| &src[j * p..(j + 1) * p]);
    let (groups, _) = dst.as_chunks_mut::<Q>();
    for (i, d) in groups[..p].iter_mut().enumerate() {
        *d = std::array::from_fn(|j| rows[j][i]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kind of swap (interleaves of 2 to 4 rows, a wider one, blocks), on one thread
    /// and on the test pool's three, against indexing written out.
    #[test]
    fn swapped_axes_as_indexing_says() {
        for shape in [
            [3usize, 2, 5, 1],
            [784, 2, 58, 1],
            [7, 3, 9, 1],
            [5, 4, 17, 1],
            [4, 6, 10, 1],
            // An image's channels made channels-last: columns past one block and a part one.
            [2, 64, 37, 1],
            [1, 5, 16, 1],
            [2, 4, 32, 64],
            [3, 2, 5, 3],
        ] {
            let [outer, q, p, e] = shape;
            let x: Vec<f32> = (0..outer * q * p * e).map(|i| i as f32).collect();
            let mut want = vec![0.0; x.len()];
            for o in 0..outer {
                for i in 0..p {
                    for j in 0..q {
                        for k in 0..e {
                            want[((o * p + i) * q + j) * e + k] = x[((o * q + j) * p + i) * e + k];
                        }
                    }
                }
            }
            for threaded in [false, true] {
                if threaded {
                    parallel::tests::install_test_pool();
                }
                let mut out = vec![f32::NAN; x.len()];
                swap_axes(&x, shape, &mut out);
                assert_eq!(out, want, "{shape:?}");
            }
        }
    }

    /// Rows of three inputs of different widths, one of them strided, on one thread and on
    /// the test pool's three, against indexing written out.
    #[test]
    fn rows_of_each_input_in_turn() {
        for (outer, widths) in [(1usize, [3usize, 1, 4]), (7, [2, 5, 1]), (4000, [16, 48, 16])] {
            // Input 1's rows sit 3 elements apart more than their length.
            let ld = |i: usize| widths[i] + if i == 1 { 3 } else { 0 };
            let value = |i: usize, r: usize, j: usize| (i * 1_000_000 + r * 100 + j) as f32;
            let inputs: Vec<Vec<f32>> = (0..3)
                .map(|i| {
                    let mut x = vec![f32::NAN; (outer - 1) * ld(i) + widths[i]];
                    for r in 0..outer {
                        for j in 0..widths[i] {
                            x[r * ld(i) + j] = value(i, r, j);
                        }
                    }
                    x
                })
                .collect();
            let views: Vec<Strided<'_>> =
                inputs.iter().enumerate().map(|(i, x)| Strided { x, len: widths[i], ld: ld(i) }).collect();
            let want: Vec<f32> = (0..outer)
                .flat_map(|r| (0..3).flat_map(move |i| (0..widths[i]).map(move |j| value(i, r, j))))
                .collect();
            for threaded in [false, true] {
                if threaded {
                    parallel::tests::install_test_pool();
                }
                let mut out = vec![f32::NAN; want.len()];
                concat_rows(&views, outer, &mut out);
                assert_eq!(out, want, "outer {outer}, widths {widths:?}");
            }
        }
    }
}
