//! Concatenation as rows: each output row is one row of every input in turn. Any
//! concatenation of dense tensors that share a memory order is this, with `outer` the
//! product of the sizes laid out before the joined dimension. Plain copies (`memcpy`), so
//! one portable kernel serves every instruction set.

use super::parallel;

/// A pointer to the output the threads of one call share, each writing its own rows.
#[derive(Clone, Copy)]
struct Rows(*mut f32);

// SAFETY: the threads of one call write disjoint rows through it, and the call returns only
// once every thread has finished.
unsafe impl Sync for Rows {}

impl Rows {
    fn at(self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

/// Writes `out`'s `outer` rows: row `r` is row `r` of each of `inputs` in turn, input `i`'s
/// rows being `inputs[i].len() / outer` elements long. `out` must hold exactly the inputs'
/// elements. Split across threads by rows where each thread copies enough to be worth waking.
pub fn concat_rows(inputs: &[&[f32]], outer: usize, out: &mut [f32]) {
    let total: usize = inputs.iter().map(|x| x.len()).sum();
    assert!(outer > 0 && out.len() == total && inputs.iter().all(|x| x.len() % outer == 0));
    let row = total / outer;
    let rows = |begin: usize, end: usize, out: &mut [f32]| {
        let mut o = 0;
        for r in begin..end {
            for x in inputs {
                let len = x.len() / outer;
                copy(&x[r * len..(r + 1) * len], &mut out[o..o + len]);
                o += len;
            }
        }
    };
    let threads = parallel::share(total, outer, parallel::threads());
    if threads <= 1 {
        return rows(0, outer, out);
    }
    let shared = Rows(out.as_mut_ptr());
    parallel::for_each(outer, threads, &|begin, end| {
        // SAFETY: rows `begin..end` of `out`, written by this chunk only, while `out` is
        // borrowed for the whole call.
        let out = unsafe { std::slice::from_raw_parts_mut(shared.at(begin * row), (end - begin) * row) };
        rows(begin, end, out);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows of three inputs of different widths, on one thread and on the test pool's three,
    /// against indexing written out.
    #[test]
    fn rows_of_each_input_in_turn() {
        for (outer, widths) in [(1usize, [3usize, 1, 4]), (7, [2, 5, 1]), (4000, [16, 48, 16])] {
            let inputs: Vec<Vec<f32>> = widths
                .iter()
                .enumerate()
                .map(|(i, &w)| (0..outer * w).map(|j| (i * 1_000_000 + j) as f32).collect())
                .collect();
            let views: Vec<&[f32]> = inputs.iter().map(Vec::as_slice).collect();
            let row: usize = widths.iter().sum();
            let want: Vec<f32> = (0..outer)
                .flat_map(|r| {
                    widths
                        .iter()
                        .enumerate()
                        .flat_map(move |(i, &w)| (0..w).map(move |j| (i * 1_000_000 + r * w + j) as f32))
                })
                .collect();
            for threaded in [false, true] {
                if threaded {
                    parallel::tests::install_test_pool();
                }
                let mut out = vec![f32::NAN; outer * row];
                concat_rows(&views, outer, &mut out);
                assert_eq!(out, want, "outer {outer}, widths {widths:?}");
            }
        }
    }
}
