//! `cat` of float32 CPU tensors into kwexport's arena (`abi::arena`): torch's own kernel
//! writes a fresh allocation, which for GhostNet's megabyte outputs faulted in page by page
//! on every call.

use super::Operators;
use crate::abi::{CError, Raw, Tensor};
use crate::kernels;

impl Operators<'_> {
    /// `torch.cat(inputs, dim)` where every input is a float32 CPU tensor, dense in the memory
    /// order torch gives the result, of one rank and the same sizes but along `dim`, none
    /// empty: a new tensor laid out as torch's (channels-last where every input suggests it,
    /// as `cat_compute_output_memory_format` decides; contiguous otherwise). `None` for
    /// anything else, where torch's op runs (and raises what it raises).
    ///
    /// # Safety
    /// Each of `inputs` must be a live handle.
    pub unsafe fn cat(&self, inputs: &[Raw], dim: i64) -> Option<Result<Tensor, CError>> {
        let shims = self.0.shims.as_ref()?;
        if !kernels::available() || inputs.is_empty() {
            return None;
        }
        let mut geometry = Vec::with_capacity(inputs.len());
        for &t in inputs {
            // SAFETY: the caller's live handles.
            if !unsafe { shims.is_cpu_f32(t) } {
                return None;
            }
            geometry.push(unsafe { self.0.sizes_strides(t) }?);
        }
        let (first, _) = &geometry[0];
        let rank = first.len();
        let d = usize::try_from(if dim < 0 { dim + rank as i64 } else { dim }).ok().filter(|&d| d < rank)?;
        let same = geometry.iter().all(|(s, _)| {
            s.len() == rank && !s.contains(&0) && s.iter().zip(first).enumerate().all(|(i, (a, b))| i == d || a == b)
        });
        // Torch decides 5-d tensors' order by rules this doesn't repeat.
        if !same || rank == 5 {
            return None;
        }
        let channels_last = rank == 4 && geometry.iter().all(|(s, st)| suggests_channels_last(s, st));
        let order: Vec<usize> = if channels_last { vec![0, 2, 3, 1] } else { (0..rank).collect() };
        if !geometry.iter().all(|(s, st)| dense_in(&order, s, st)) {
            return None;
        }
        // Rows: the sizes laid out before `dim`; each input's row, the rest of its elements.
        let place = order.iter().position(|&o| o == d)?;
        let outer = usize::try_from(order[..place].iter().map(|&o| first[o]).product::<i64>()).ok()?;
        let mut slices = Vec::with_capacity(inputs.len());
        for (&t, (s, _)) in inputs.iter().zip(&geometry) {
            let len = usize::try_from(s.iter().product::<i64>()).ok()?;
            // SAFETY: a dense float32 CPU tensor of `len` elements from its first.
            slices.push(unsafe { self.floats(t, len) }?);
        }
        let mut sizes = first.clone();
        sizes[d] = geometry.iter().map(|(s, _)| s[d]).sum();
        let strides = strides_in(&order, &sizes);
        let mut out = match self.owned(shims.empty_f32_strided(&sizes, &strides)) {
            Ok(out) => out,
            Err(e) => return Some(Err(e)),
        };
        let total = slices.iter().map(|s| s.len()).sum();
        // SAFETY: the new output, of exactly the inputs' elements.
        let os = unsafe { self.floats_mut(&mut out, total) }?;
        kernels::concat::concat_rows(&slices, outer, os);
        Some(Ok(out))
    }
}

/// Whether torch takes a 4-d tensor of these sizes and strides as channels-last
/// (`c10::is_channels_last_strides_2d_s4`, ambiguous cases going to contiguous, as there).
fn suggests_channels_last(sizes: &[i64], strides: &[i64]) -> bool {
    if strides[1] == 0 {
        return false;
    }
    let mut min = 0;
    for d in [1, 3, 2, 0] {
        if sizes[d] == 0 || strides[d] < min || (d == 0 && min == strides[1]) {
            return false;
        }
        min = strides[d];
        if sizes[d] > 1 {
            min *= sizes[d];
        }
    }
    true
}

/// Strides of a dense tensor whose dimensions are laid out in `order`, outermost first.
fn strides_in(order: &[usize], sizes: &[i64]) -> Vec<i64> {
    let mut strides = vec![0; sizes.len()];
    let mut step = 1;
    for &d in order.iter().rev() {
        strides[d] = step;
        step *= sizes[d].max(1);
    }
    strides
}

/// Whether a tensor's elements are dense in `order` (a stride only matters where its
/// dimension has more than one element).
fn dense_in(order: &[usize], sizes: &[i64], strides: &[i64]) -> bool {
    let want = strides_in(order, sizes);
    sizes.iter().zip(strides).zip(want).all(|((&n, &s), w)| n <= 1 || s == w)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channels_last_as_torch_suggests_it() {
        // [N, C, H, W] channels-last and contiguous, and the ambiguous shapes torch's comment
        // lists, which go to contiguous.
        assert!(suggests_channels_last(&[2, 8, 4, 4], &[128, 1, 32, 8]));
        assert!(!suggests_channels_last(&[2, 8, 4, 4], &[128, 16, 4, 1]));
        assert!(suggests_channels_last(&[2, 8, 1, 1], &[8, 1, 8, 8]));
        assert!(!suggests_channels_last(&[2, 8, 1, 1], &[8, 1, 1, 1]));
        assert!(!suggests_channels_last(&[3, 1, 1, 1], &[1, 1, 1, 1]));
        assert!(!suggests_channels_last(&[3, 1, 5, 1], &[5, 5, 1, 1]));
    }

    #[test]
    fn strides_of_an_order() {
        assert_eq!(strides_in(&[0, 2, 3, 1], &[2, 8, 4, 5]), vec![160, 1, 40, 8]);
        assert_eq!(strides_in(&[0, 1, 2], &[2, 3, 4]), vec![12, 4, 1]);
        assert!(dense_in(&[0, 1, 2], &[2, 1, 4], &[4, 99, 1]));
        assert!(!dense_in(&[0, 1, 2], &[2, 3, 4], &[24, 4, 1]));
    }
}
