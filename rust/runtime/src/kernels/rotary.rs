//! The rotary position embedding (`passes::rotary`'s node on the CPU): over rows of `d`
//! values, `y = x * cos + rotate(x) * sin` with `rotate(x) = cat([-x[split..], x[..split]])`
//! (transformers' `rotate_half` for `split = d / 2`). Each product is rounded, then the two
//! summed, as eager's `mul`, `neg`, `cat`, `mul` and `add` round them (no fused multiply-add):
//! the result is eager's bit for bit, NaN and infinities included. It replaces seven nodes
//! (five passes over memory) with one; the rows are too short for vectors to matter, so it is
//! plain Rust, the same on every instruction set.

use super::parallel::{self, Shared};
use super::{Declined, Ran};

/// The rows a call covers: `dims` (`[batch, heads, positions]`) rows of `d` contiguous
/// values, each operand's rows at its own strides (elements; 0 where it broadcasts).
#[derive(Debug, Clone, Copy)]
pub struct Rotary {
    pub dims: [usize; 3],
    pub d: usize,
    /// Where `x`'s second half starts (`0..=d`).
    pub split: usize,
}

/// Rows of `x` (or `cos`, `sin`, the output): the elements and the strides of its rows.
pub type Rows<'a> = (&'a [f32], [usize; 3]);

/// `y = x * cos + rotate(x) * sin` for every row (see the module), into `out` at `strides`,
/// which must lay its rows out apart from each other. Declines where a slice doesn't hold
/// its rows or the output's rows would overlap.
pub fn rotary_f32<'a>(
    g: &Rotary,
    x: Rows<'a>,
    cos: Rows<'a>,
    sin: Rows<'a>,
    (out, strides): (&mut [f32], [usize; 3]),
) -> Ran {
    let holds = |(xs, st): Rows<'_>| {
        g.d > 0 && super::span(&[g.dims[0], g.dims[1], g.dims[2], g.d], &[st[0], st[1], st[2], 1]) <= xs.len()
    };
    if g.split > g.d
        || ![x, cos, sin, (&*out, strides)].into_iter().all(holds)
        || !super::apart(g.d, [0, 1, 2].map(|i| (g.dims[i], strides[i])))
    {
        return Err(Declined::Shapes);
    }
    let rows = g.dims.iter().product::<usize>();
    let at = |r: usize, st: [usize; 3]| {
        let (p, rest) = (r % g.dims[2], r / g.dims[2]);
        rest / g.dims[1] * st[0] + rest % g.dims[1] * st[1] + p * st[2]
    };
    let o = Shared(out.as_mut_ptr());
    let threads = parallel::share(3 * g.d * rows, rows, parallel::threads());
    parallel::for_each(rows, threads, &|begin, end| {
        for r in begin..end {
            let row = |(xs, st): Rows<'a>| -> &'a [f32] { &xs[at(r, st)..at(r, st) + g.d] };
            // SAFETY: row `r` of the output, inside `out` (checked above) and apart from
            // every other row (`apart`), which only this iteration writes.
            let y = unsafe { std::slice::from_raw_parts_mut(o.at(at(r, strides)), g.d) };
            rotate_row(row(x), row(cos), row(sin), g.split, y);
        }
    });
    Ok(())
}

/// One row: the second half's values negated move to the front.
fn rotate_row(x: &[f32], c: &[f32], s: &[f32], split: usize, y: &mut [f32]) {
    let tail = x.len() - split;
    let (front, back) = y.split_at_mut(tail);
    for (j, v) in front.iter_mut().enumerate() {
        *v = x[j] * c[j] + -x[split + j] * s[j];
    }
    for (j, v) in back.iter_mut().enumerate() {
        let at = tail + j;
        *v = x[at] * c[at] + x[j] * s[at];
    }
}

#[cfg(test)]
mod tests {
    use super::super::parallel::tests::install_test_pool;
    use super::*;

    /// Eager's ops, one at a time, each rounded to float32.
    fn eager(x: &[f32], c: &[f32], s: &[f32], split: usize) -> Vec<f32> {
        let d = x.len();
        let rotated: Vec<f32> = x[split..].iter().map(|v| -v).chain(x[..split].iter().copied()).collect();
        (0..d).map(|j| (x[j] * c[j]) + (rotated[j] * s[j])).collect()
    }

    /// `len` values with a NaN, infinities and signed zeros among them.
    fn values(len: usize, seed: usize) -> Vec<f32> {
        let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -0.0, 0.0];
        (0..len)
            .map(|i| match (i * 7 + seed) % 53 {
                k if k < specials.len() => specials[k],
                _ => ((i * 31 + seed) as f32 * 0.37).sin() * 3.0,
            })
            .collect()
    }

    /// A query transposed as attention's is (`[batch, positions, heads, d]` in memory), the
    /// tables broadcast over heads, the output in the query's layout; every split, on one
    /// thread and on three: each row is eager's bit for bit (NaN where eager's is).
    #[test]
    fn every_row_is_eagers_bit_for_bit() {
        let ([b, h, p], d) = ([2usize, 3, 5], 8usize);
        let x = values(b * p * h * d, 1);
        let (c, s) = (values(b * p * d, 2), values(b * p * d, 3));
        let xs = [p * h * d, d, h * d];
        let table = [p * d, 0, d];
        for threads in [false, true] {
            if threads {
                install_test_pool();
            }
            for split in 0..=d {
                let g = Rotary { dims: [b, h, p], d, split };
                let mut out = vec![f32::NAN; x.len()];
                assert_eq!(rotary_f32(&g, (&x, xs), (&c, table), (&s, table), (&mut out, xs)), Ok(()));
                for (bi, hi, pi) in (0..b).flat_map(|bi| (0..h).flat_map(move |hi| (0..p).map(move |pi| (bi, hi, pi))))
                {
                    let at = |st: [usize; 3]| bi * st[0] + hi * st[1] + pi * st[2];
                    let row = |v: &[f32], st| v[at(st)..at(st) + d].to_vec();
                    let want = eager(&row(&x, xs), &row(&c, table), &row(&s, table), split);
                    let got = row(&out, xs);
                    assert_eq!(got.map_bits(), want.map_bits(), "split {split}, row {bi} {hi} {pi}");
                }
            }
        }
    }

    trait Bits {
        fn map_bits(&self) -> Vec<u32>;
    }
    impl Bits for Vec<f32> {
        /// The bits, every NaN as one (eager's NaN payloads are the hardware's).
        fn map_bits(&self) -> Vec<u32> {
            self.iter().map(|v| if v.is_nan() { f32::NAN.to_bits() } else { v.to_bits() }).collect()
        }
    }

    #[test]
    fn declines_overlapping_rows_short_slices_and_a_split_past_the_row() {
        let g = Rotary { dims: [1, 2, 3], d: 4, split: 2 };
        let x = vec![1.0; 24];
        let dense = [24, 12, 4];
        let mut out = vec![0.0; 24];
        let run =
            |g: &Rotary, x: &[f32], out: &mut [f32], st| rotary_f32(g, (x, dense), (x, dense), (x, dense), (out, st));
        assert_eq!(run(&g, &x, &mut out, dense), Ok(()));
        // Rows 2 apart overlap: each is 4 long.
        assert_eq!(run(&g, &x, &mut out, [24, 6, 2]), Err(Declined::Shapes));
        assert_eq!(run(&g, &x[..23], &mut out, dense), Err(Declined::Shapes));
        assert_eq!(run(&g, &x, &mut out[..20], dense), Err(Declined::Shapes));
        assert_eq!(run(&Rotary { split: 5, ..g }, &x, &mut out, dense), Err(Declined::Shapes));
    }
}
