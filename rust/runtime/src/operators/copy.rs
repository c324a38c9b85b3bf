//! Copies on kwexport's kernels (`kernels::copy`), their outputs in kwexport's arena
//! (`abi::arena`): `cat`, where torch's kernel wrote a fresh allocation that for GhostNet's
//! megabyte outputs faulted in page by page on every call, and the `contiguous` of a
//! tensor with two axes swapped (ShuffleNet's channel shuffle), which torch's strided copy
//! ran at a third of the speed.

use super::Operators;
use crate::abi::{CError, Raw, Tensor};
use crate::kernels;

impl Operators<'_> {
    /// `torch.cat(inputs, dim)` where every input is a float32 CPU tensor, dense in the memory
    /// order torch gives the result (or a slice of such a tensor along the innermost
    /// dimension, where that is `dim`: `row_stride`), of one rank and the same sizes but along `dim`, none
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
        // Rows: the sizes laid out before `dim`; each input's row, the rest of its elements.
        let place = order.iter().position(|&o| o == d)?;
        let outer = usize::try_from(order[..place].iter().map(|&o| first[o]).product::<i64>()).ok()?;
        let mut rows = Vec::with_capacity(inputs.len());
        for (&t, (s, st)) in inputs.iter().zip(&geometry) {
            let len = usize::try_from(order[place..].iter().map(|&o| s[o]).product::<i64>()).ok()?;
            let ld = usize::try_from(row_stride(&order, place, s, st)?).ok()?;
            // SAFETY: a float32 CPU tensor whose `outer` rows of `len` elements, `ld` apart,
            // start at its first.
            let x = unsafe { self.floats(t, (outer - 1) * ld + len) }?;
            rows.push(kernels::copy::Strided { x, len, ld });
        }
        let mut sizes = first.clone();
        sizes[d] = geometry.iter().map(|(s, _)| s[d]).sum();
        let strides = strides_in(&order, &sizes);
        let mut out = match self.owned(shims.empty_f32_strided(&sizes, &strides)) {
            Ok(out) => out,
            Err(e) => return Some(Err(e)),
        };
        let total = outer * rows.iter().map(|r| r.len).sum::<usize>();
        // SAFETY: the new output, of exactly the inputs' elements.
        let os = unsafe { self.floats_mut(&mut out, total) }?;
        kernels::copy::concat_rows(&rows, outer, os);
        Some(Ok(out))
    }
}

impl Operators<'_> {
    /// `x.contiguous()` where `x` is a float32 CPU tensor whose elements are a dense tensor
    /// with two adjacent axes swapped (`[o, q, p, e]` in memory, `[o, p, q, e]` as indexed:
    /// `kernels::copy::swap_axes`): a new contiguous tensor. `None` for any other tensor, a
    /// contiguous one included (torch returns it as it is).
    ///
    /// # Safety
    /// `x` must be a live handle.
    pub unsafe fn contiguous(&self, x: Raw) -> Option<Result<Tensor, CError>> {
        let shims = self.0.shims.as_ref()?;
        // SAFETY: the caller's live handle.
        if !kernels::available() || !unsafe { shims.is_cpu_f32(x) } {
            return None;
        }
        // SAFETY: as above.
        let (sizes, strides) = unsafe { self.0.sizes_strides(x) }?;
        let shape = swapped(&sizes, &strides)?;
        let len = shape.iter().product::<usize>();
        // SAFETY: the dense elements `swapped` found, from the first.
        let xs = unsafe { self.floats(x, len) }?;
        let mut out = match self.owned(shims.empty_f32(&sizes)) {
            Ok(out) => out,
            Err(e) => return Some(Err(e)),
        };
        // SAFETY: the new output, of `len` elements.
        let os = unsafe { self.floats_mut(&mut out, len) }?;
        kernels::copy::swap_axes(xs, shape, os);
        Some(Ok(out))
    }
}

/// `[o, q, p, e]` where a view of these sizes and strides indexes a dense tensor laid out
/// `[o, q, p, e]` as `[o, p, q, e]` (size-1 dimensions ignored, neighbours that are one
/// axis in memory merged); `None` for any other view, a contiguous one included.
fn swapped(sizes: &[i64], strides: &[i64]) -> Option<[usize; 4]> {
    let mut dims: Vec<(usize, usize)> = Vec::new();
    for (&n, &s) in sizes.iter().zip(strides) {
        let (n, s) = (usize::try_from(n).ok()?, usize::try_from(s).ok()?);
        match (n, dims.last_mut()) {
            (0, _) => return None,
            (1, _) => {}
            (_, Some(last)) if last.1 == s * n => *last = (last.0 * n, s),
            _ => dims.push((n, s)),
        }
    }
    let e = match dims.last() {
        Some(&(n, 1)) => {
            dims.pop();
            n
        }
        _ => 1,
    };
    let (o, (p, sp), (q, sq)) = match dims[..] {
        [a, b] => ((1, 0), a, b),
        [o, a, b] => (o, a, b),
        _ => return None,
    };
    let outer_ok = o.0 == 1 || o.1 == q * p * e;
    (sp == e && sq == p * e && outer_ok).then_some([o.0, q, p, e])
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
pub(super) fn strides_in(order: &[usize], sizes: &[i64]) -> Vec<i64> {
    let mut strides = vec![0; sizes.len()];
    let mut step = 1;
    for &d in order.iter().rev() {
        strides[d] = step;
        step *= sizes[d].max(1);
    }
    strides
}

/// How far apart a tensor's rows are, a row being the elements from dimension `order[place]`
/// in (`order`: how its dimensions are laid out, outermost first): a row's elements where it
/// is dense in `order`; more where `place` is the innermost and the tensor a slice of a wider
/// one along it (ShuffleNet's `chunk` of channels-last channels); `None` where its rows aren't
/// evenly spaced runs. The one rule for every kernel that reads rows with a stride: a
/// concatenation's inputs, a 1×1 convolution's and an int8 linear's.
pub(super) fn row_stride(order: &[usize], place: usize, sizes: &[i64], strides: &[i64]) -> Option<i64> {
    let row = order[place..].iter().map(|&o| sizes[o]).product::<i64>();
    if dense_in(order, sizes, strides) {
        return Some(row);
    }
    let d = order[place];
    if place + 1 != order.len() || (sizes[d] > 1 && strides[d] != 1) {
        return None;
    }
    // Dense as a tensor `ld` long along `d` would be, `ld` the stride of the next dimension
    // out with more than one element.
    let ld = strides[*order[..place].iter().rev().find(|&&o| sizes[o] > 1)?];
    let mut wide = sizes.to_vec();
    wide[d] = ld;
    (ld >= sizes[d] && dense_in(order, &wide, strides)).then_some(ld)
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
    fn swapped_axes_found_in_views() {
        // ShuffleNet's: [1, 28, 28, 2, 58] transposed on its last two axes.
        assert_eq!(swapped(&[1, 28, 28, 58, 2], &[90944, 3248, 116, 1, 58]), Some([784, 2, 58, 1]));
        // An attention head's: [b, h, l, d] transposed to [b, l, h, d].
        assert_eq!(swapped(&[2, 10, 4, 8], &[320, 8, 80, 1]), Some([2, 4, 10, 8]));
        assert_eq!(swapped(&[10, 4], &[1, 10]), Some([1, 4, 10, 1]));
        // Contiguous, a gap, three axes permuted: not a swap.
        assert_eq!(swapped(&[2, 3, 4], &[12, 4, 1]), None);
        assert_eq!(swapped(&[4, 10], &[1, 8]), None);
        assert_eq!(swapped(&[2, 3, 4], &[1, 2, 6]), None);
        // Axes that merge into a swap: [2, 3·4] of a dense [3·4, 2].
        assert_eq!(swapped(&[2, 3, 4], &[1, 8, 2]), Some([1, 12, 2, 1]));
    }

    #[test]
    fn rows_of_slices_along_the_innermost_dimension() {
        let cl = [0, 2, 3, 1];
        // Dense: a row is the rest of the elements.
        assert_eq!(row_stride(&cl, 3, &[2, 8, 4, 5], &[160, 1, 40, 8]), Some(8));
        assert_eq!(row_stride(&cl, 1, &[2, 8, 4, 5], &[160, 1, 40, 8]), Some(160));
        // A chunk of 8 of 16 channels-last channels, joined along channels.
        assert_eq!(row_stride(&cl, 3, &[2, 8, 4, 5], &[320, 1, 80, 16]), Some(16));
        // ... but not along rows, nor a slice with a gap elsewhere.
        assert_eq!(row_stride(&cl, 1, &[2, 8, 4, 5], &[320, 1, 80, 16]), None);
        assert_eq!(row_stride(&cl, 3, &[2, 8, 4, 5], &[400, 1, 80, 16]), None);
        assert_eq!(row_stride(&[0, 1], 1, &[3, 4], &[10, 1]), Some(10));
    }

    #[test]
    fn strides_of_an_order() {
        assert_eq!(strides_in(&[0, 2, 3, 1], &[2, 8, 4, 5]), vec![160, 1, 40, 8]);
        assert_eq!(strides_in(&[0, 1, 2], &[2, 3, 4]), vec![12, 4, 1]);
        assert!(dense_in(&[0, 1, 2], &[2, 1, 4], &[4, 99, 1]));
        assert!(!dense_in(&[0, 1, 2], &[2, 3, 4], &[24, 4, 1]));
    }
}
