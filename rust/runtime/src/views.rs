//! View ops computed in Rust. A view is new sizes, strides and offset over its input's
//! memory; torch's dispatcher spends about a microsecond per view node on argument boxing and
//! lookup, where the geometry is a few integer operations. On calls with no autograd to
//! record, the run loop makes the view with `_reinterpret_tensor` over the input (the same
//! memory, so the same values at every level), and calls the op where anything is unusual
//! (an index out of range, new sizes with no view of the input): then torch raises or
//! decides as ever.

/// A view op kwexport computes, by its schema's name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ViewKind {
    /// `unsqueeze(self, dim)`
    Unsqueeze,
    /// `transpose.int(self, dim0, dim1)`
    Transpose,
    /// `slice.Tensor(self, dim=0, start=None, end=None, step=1)`
    Slice,
    /// `select.int(self, dim, index)`
    Select,
    /// `expand(self, size, *, implicit=False)`
    Expand,
    /// `view(self, size)`, `_unsafe_view(self, size)`, `reshape(self, shape)`: where the new
    /// sizes have a view of the input ([`view_strides`]; `reshape` copies otherwise).
    View,
    /// `permute(self, dims)`
    Permute,
    /// `movedim.int(self, source, destination)`: the permutation that moves one dimension (the
    /// int8 passes' channels-last views around a 1×1 convolution's GEMM).
    Movedim,
    /// `flatten.using_ints(self, start_dim, end_dim)`: a `view` of dimensions `start..=end`
    /// merged into one (`reshape`'s, so where none exists torch's op copies).
    Flatten,
    /// `alias(self)`, and `detach(self)`, which differs from it only in what autograd
    /// records (calls that record nothing compute views here).
    Alias,
}

impl ViewKind {
    /// The kind for an op's name and overload, as the dispatcher spells them.
    pub fn of(name: &str, overload: &str) -> Option<ViewKind> {
        Some(match (name, overload) {
            ("aten::unsqueeze", "") => ViewKind::Unsqueeze,
            ("aten::transpose", "int") => ViewKind::Transpose,
            ("aten::slice", "Tensor") => ViewKind::Slice,
            ("aten::select", "int") => ViewKind::Select,
            ("aten::expand", "") => ViewKind::Expand,
            ("aten::view" | "aten::_unsafe_view" | "aten::reshape", "") => ViewKind::View,
            ("aten::permute", "") => ViewKind::Permute,
            ("aten::movedim", "int") => ViewKind::Movedim,
            ("aten::flatten", "using_ints") => ViewKind::Flatten,
            ("aten::alias" | "aten::detach", "") => ViewKind::Alias,
            _ => return None,
        })
    }
}

/// A view's argument after `self`, read from its encoding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ViewArg {
    Int(i64),
    None,
    Ints(Vec<i64>),
    Bool(bool),
}

/// A view's geometry: sizes, strides and the offset from its input's first element.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Geometry {
    pub sizes: Vec<i64>,
    pub strides: Vec<i64>,
    pub offset: i64,
}

fn wrap(dim: i64, ndim: usize) -> Option<usize> {
    let n = ndim as i64;
    let d = if dim < 0 { dim + n } else { dim };
    (0..n).contains(&d).then_some(d as usize)
}

/// Whether a view of these sizes and strides is contiguous (strides of size-1 dimensions
/// don't matter, as in torch).
pub fn is_contiguous(sizes: &[i64], strides: &[i64]) -> bool {
    let mut expected = 1;
    for (size, stride) in sizes.iter().zip(strides).rev() {
        if *size != 1 && *stride != expected {
            return false;
        }
        expected *= size;
    }
    true
}

/// The number of elements of a view whose memory is dense: contiguous, channels-last, or any
/// other order of its dimensions (each stride, taken from the smallest, the product of the
/// sizes before it; size-1 dimensions don't matter), so that its elements are the first that
/// many from its data pointer. `None` for a view with gaps, overlaps or negative strides.
pub fn dense_len(sizes: &[i64], strides: &[i64]) -> Option<usize> {
    if sizes.contains(&0) {
        return Some(0);
    }
    let mut dims: Vec<(i64, i64)> = sizes.iter().zip(strides).filter(|(&n, _)| n != 1).map(|(&n, &s)| (s, n)).collect();
    dims.sort_unstable();
    let mut expected = 1i64;
    for (stride, size) in dims {
        if stride != expected || size < 0 {
            return None;
        }
        expected = expected.checked_mul(size)?;
    }
    usize::try_from(expected).ok()
}

/// The strides of a view of `new` sizes over a tensor of these nonzero-element `sizes` and
/// `strides`, where one exists (`None`: `view` raises and `reshape` copies), as torch's
/// `computeStride` finds them: the old dimensions fall into chunks of memory-contiguous
/// dimensions, and the new sizes must split each chunk exactly (a GPT-2's `split` of its
/// fused q, k and v, rows 3 × d apart, reshaped into heads).
pub fn view_strides(sizes: &[i64], strides: &[i64], new: &[i64]) -> Option<Vec<i64>> {
    let Some(&last) = strides.last() else { return Some(vec![1; new.len()]) };
    let mut new_strides = vec![0; new.len()];
    let mut view_d = new.len();
    let (mut base, mut chunk, mut view_numel) = (last, 1i64, 1i64);
    for d in (0..sizes.len()).rev() {
        chunk *= sizes[d];
        // A chunk ends where the dimension before isn't laid out right after it.
        if d == 0 || (sizes[d - 1] != 1 && strides[d - 1] != chunk * base) {
            while view_d > 0 && (view_numel < chunk || new[view_d - 1] == 1) {
                new_strides[view_d - 1] = view_numel * base;
                view_numel *= new[view_d - 1];
                view_d -= 1;
            }
            if view_numel != chunk {
                return None;
            }
            if d > 0 {
                (base, chunk, view_numel) = (strides[d - 1], 1, 1);
            }
        }
    }
    (view_d == 0).then_some(new_strides)
}

/// The strides of a contiguous tensor of these sizes, as torch computes them.
pub fn contiguous_strides(sizes: &[i64]) -> Vec<i64> {
    let mut strides = vec![1; sizes.len()];
    for i in (0..sizes.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * sizes[i + 1].max(1);
    }
    strides
}

/// The strides of a view of `new` sizes (as many elements) over a tensor of these sizes and
/// strides, where `view` finds one.
fn reshaped(sizes: &[i64], strides: &[i64], new: &[i64]) -> Option<Vec<i64>> {
    match sizes.iter().product::<i64>() {
        0 if is_contiguous(sizes, strides) => Some(contiguous_strides(new)),
        0 => None,
        _ => view_strides(sizes, strides, new),
    }
}

/// The view `kind` makes of a tensor of these sizes and strides, or `None` where torch's op
/// should decide (it raises, or does more than a view).
pub fn geometry(kind: ViewKind, sizes: &[i64], strides: &[i64], args: &[ViewArg]) -> Option<Geometry> {
    let (mut sizes, mut strides, mut offset) = (sizes.to_vec(), strides.to_vec(), 0);
    let ndim = sizes.len();
    match (kind, args) {
        (ViewKind::Alias, []) => {}
        (ViewKind::Unsqueeze, [ViewArg::Int(dim)]) => {
            let d = wrap(*dim, ndim + 1)?;
            let stride = if d >= ndim { 1 } else { sizes[d] * strides[d] };
            sizes.insert(d, 1);
            strides.insert(d, stride);
        }
        (ViewKind::Transpose, [ViewArg::Int(a), ViewArg::Int(b)]) => {
            let (a, b) = (wrap(*a, ndim)?, wrap(*b, ndim)?);
            sizes.swap(a, b);
            strides.swap(a, b);
        }
        (ViewKind::Slice, [ViewArg::Int(dim), start, end, ViewArg::Int(step)]) => {
            let d = wrap(*dim, ndim)?;
            if *step <= 0 {
                return None;
            }
            let size = sizes[d];
            let bound = |v: &ViewArg, default: i64| match v {
                ViewArg::None => Some(default),
                ViewArg::Int(i) => Some(if *i < 0 { i.saturating_add(size) } else { *i }.clamp(0, size)),
                _ => None,
            };
            let start = bound(start, 0)?;
            let end = bound(end, size)?.max(start);
            sizes[d] = (end - start + step - 1) / step;
            offset = start * strides[d];
            strides[d] *= step;
        }
        (ViewKind::Select, [ViewArg::Int(dim), ViewArg::Int(index)]) => {
            let d = wrap(*dim, ndim)?;
            let i = if *index < 0 { index + sizes[d] } else { *index };
            if !(0..sizes[d]).contains(&i) {
                return None;
            }
            offset = i * strides[d];
            sizes.remove(d);
            strides.remove(d);
        }
        (ViewKind::Expand, [ViewArg::Ints(target), ViewArg::Bool(_)] | [ViewArg::Ints(target)]) => {
            if target.len() < ndim {
                return None;
            }
            let lead = target.len() - ndim;
            let mut new_sizes = Vec::with_capacity(target.len());
            let mut new_strides = Vec::with_capacity(target.len());
            for (i, &t) in target.iter().enumerate() {
                if i < lead {
                    if t < 0 {
                        return None;
                    }
                    new_sizes.push(t);
                    new_strides.push(0);
                    continue;
                }
                let (s, st) = (sizes[i - lead], strides[i - lead]);
                match t {
                    -1 => (new_sizes.push(s), new_strides.push(st)),
                    t if t == s => (new_sizes.push(s), new_strides.push(st)),
                    t if s == 1 && t >= 0 => (new_sizes.push(t), new_strides.push(0)),
                    _ => return None,
                };
            }
            (sizes, strides) = (new_sizes, new_strides);
        }
        (ViewKind::View, [ViewArg::Ints(target)]) => {
            let numel: i64 = sizes.iter().product();
            let known: i64 = target.iter().filter(|&&t| t != -1).product();
            let mut new_sizes = target.clone();
            match target.iter().filter(|&&t| t == -1).count() {
                0 if known == numel => {}
                1 if known > 0 && numel % known == 0 => {
                    *new_sizes.iter_mut().find(|t| **t == -1)? = numel / known;
                }
                _ => return None,
            }
            if new_sizes.iter().any(|&s| s < 0) {
                return None;
            }
            strides = reshaped(&sizes, &strides, &new_sizes)?;
            sizes = new_sizes;
        }
        (ViewKind::Flatten, [ViewArg::Int(start), ViewArg::Int(end)]) => {
            // A scalar flattens to one element: torch's op decides.
            let (start, end) = (wrap(*start, ndim)?, wrap(*end, ndim)?);
            if start > end {
                return None;
            }
            let mut new_sizes = sizes[..start].to_vec();
            new_sizes.push(sizes[start..=end].iter().product());
            new_sizes.extend_from_slice(&sizes[end + 1..]);
            strides = reshaped(&sizes, &strides, &new_sizes)?;
            sizes = new_sizes;
        }
        (ViewKind::Permute, [ViewArg::Ints(dims)]) => {
            if dims.len() != ndim {
                return None;
            }
            let dims = dims.iter().map(|&d| wrap(d, ndim)).collect::<Option<Vec<_>>>()?;
            let mut seen = vec![false; ndim];
            for &d in &dims {
                if std::mem::replace(&mut seen[d], true) {
                    return None;
                }
            }
            (sizes, strides) = (dims.iter().map(|&d| sizes[d]).collect(), dims.iter().map(|&d| strides[d]).collect());
        }
        (ViewKind::Movedim, [ViewArg::Int(source), ViewArg::Int(destination)]) => {
            let (from, to) = (wrap(*source, ndim)?, wrap(*destination, ndim)?);
            let (size, stride) = (sizes.remove(from), strides.remove(from));
            sizes.insert(to, size);
            strides.insert(to, stride);
        }
        _ => return None,
    }
    Some(Geometry { sizes, strides, offset })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ViewArg::{Bool, Int, Ints, None as No};

    #[test]
    fn dense_len_takes_every_dimension_order_and_nothing_with_gaps() {
        assert_eq!(dense_len(&[2, 3, 4, 5], &[60, 20, 5, 1]), Some(120)); // contiguous
        assert_eq!(dense_len(&[2, 3, 4, 5], &[60, 1, 15, 3]), Some(120)); // channels-last
        assert_eq!(dense_len(&[2, 1, 4], &[4, 99, 1]), Some(8)); // a size-1 dimension's stride
        assert_eq!(dense_len(&[], &[]), Some(1));
        assert_eq!(dense_len(&[2, 0, 3], &[0, 3, 1]), Some(0));
        assert_eq!(dense_len(&[2, 3], &[6, 1]), None); // a gap after each row
        assert_eq!(dense_len(&[2, 3], &[1, 1]), None); // overlapping
        assert_eq!(dense_len(&[4], &[0]), None); // broadcast
        assert_eq!(dense_len(&[3], &[-1]), None);
    }

    fn g(kind: ViewKind, sizes: &[i64], strides: &[i64], args: &[ViewArg]) -> Option<(Vec<i64>, Vec<i64>, i64)> {
        geometry(kind, sizes, strides, args).map(|g| (g.sizes, g.strides, g.offset))
    }

    #[test]
    fn views_match_torchs_geometry() {
        // Expected values from torch: x = torch.empty(2, 3, 4); x.unsqueeze(1).stride(), ...
        let (s, st) = (&[2, 3, 4][..], &[12, 4, 1][..]);
        assert_eq!(g(ViewKind::Unsqueeze, s, st, &[Int(1)]), Some((vec![2, 1, 3, 4], vec![12, 12, 4, 1], 0)));
        assert_eq!(g(ViewKind::Unsqueeze, s, st, &[Int(-1)]), Some((vec![2, 3, 4, 1], vec![12, 4, 1, 1], 0)));
        assert_eq!(g(ViewKind::Transpose, s, st, &[Int(0), Int(-1)]), Some((vec![4, 3, 2], vec![1, 4, 12], 0)));
        assert_eq!(g(ViewKind::Slice, s, st, &[Int(2), Int(1), No, Int(2)]), Some((vec![2, 3, 2], vec![12, 4, 2], 1)));
        assert_eq!(
            g(ViewKind::Slice, s, st, &[Int(1), Int(-2), Int(99), Int(1)]),
            Some((vec![2, 2, 4], vec![12, 4, 1], 4))
        );
        assert_eq!(
            g(ViewKind::Slice, s, st, &[Int(1), Int(5), Int(1), Int(1)]),
            Some((vec![2, 0, 4], vec![12, 4, 1], 12))
        );
        assert_eq!(g(ViewKind::Select, s, st, &[Int(1), Int(-1)]), Some((vec![2, 4], vec![12, 1], 8)));
        assert_eq!(
            g(ViewKind::Expand, &[3, 1], &[1, 1], &[Ints(vec![2, 3, 5]), Bool(false)]),
            Some((vec![2, 3, 5], vec![0, 1, 0], 0))
        );
        assert_eq!(g(ViewKind::View, s, st, &[Ints(vec![6, -1])]), Some((vec![6, 4], vec![4, 1], 0)));
        assert_eq!(g(ViewKind::Permute, s, st, &[Ints(vec![2, 0, 1])]), Some((vec![4, 2, 3], vec![1, 12, 4], 0)));
        assert_eq!(g(ViewKind::Alias, s, st, &[]), Some((s.to_vec(), st.to_vec(), 0)));
        assert_eq!(g(ViewKind::Movedim, s, st, &[Int(0), Int(-1)]), Some((vec![3, 4, 2], vec![4, 1, 12], 0)));
        assert_eq!(g(ViewKind::Movedim, s, st, &[Int(-1), Int(0)]), Some((vec![4, 2, 3], vec![1, 12, 4], 0)));
        assert_eq!(g(ViewKind::Flatten, s, st, &[Int(1), Int(-1)]), Some((vec![2, 12], vec![12, 1], 0)));
        assert_eq!(g(ViewKind::Flatten, s, st, &[Int(1), Int(1)]), Some((s.to_vec(), st.to_vec(), 0)));
        // A classifier's pooled channels-last `[1, 512, 1, 1]`: torch gives strides `[512, 1]`.
        assert_eq!(
            g(ViewKind::Flatten, &[1, 512, 1, 1], &[512, 1, 512, 512], &[Int(1), Int(-1)]),
            Some((vec![1, 512], vec![512, 1], 0))
        );
        // The int8 passes' pair on a channels-last image: `[N, H, W, C]` rows, then back.
        let (s4, cl) = (&[2, 8, 5, 6][..], &[240, 1, 48, 8][..]);
        assert_eq!(g(ViewKind::Movedim, s4, cl, &[Int(-3), Int(-1)]), Some((vec![2, 5, 6, 8], vec![240, 48, 8, 1], 0)));
        assert_eq!(
            g(ViewKind::Movedim, &[2, 5, 6, 8], &[240, 48, 8, 1], &[Int(-1), Int(-3)]),
            Some((s4.to_vec(), cl.to_vec(), 0))
        );
    }

    /// `view`'s strides on inputs that aren't contiguous, as torch's `computeStride` gives
    /// them (each checked against torch 2.15: `x.view(...).stride()`).
    #[test]
    fn views_of_strided_inputs_take_torchs_strides() {
        // A third of a fused `[32, 768]` projection's columns (`split`), into 4 heads of 64.
        assert_eq!(view_strides(&[1, 32, 256], &[24576, 768, 1], &[1, 32, 4, 64]), Some(vec![24576, 768, 64, 1]));
        // A size-1 dimension takes the stride of the chunk it closes.
        assert_eq!(view_strides(&[4, 3], &[1, 4], &[4, 1, 3]), Some(vec![1, 12, 4]));
        // Merging the two dimensions of a transposed matrix has no view.
        assert_eq!(view_strides(&[4, 3], &[1, 4], &[12]), None);
        // Merging the rows of a column slice has none either; splitting a row does.
        assert_eq!(view_strides(&[2, 3], &[5, 1], &[6]), None);
        assert_eq!(view_strides(&[2, 4], &[10, 1], &[2, 2, 2]), Some(vec![10, 2, 1]));
        // A scalar's view: strides of 1.
        assert_eq!(view_strides(&[], &[], &[1, 1]), Some(vec![1, 1]));
        let (s, st) = (&[1, 32, 256][..], &[24576, 768, 1][..]);
        assert_eq!(
            g(ViewKind::View, s, st, &[Ints(vec![1, 32, -1, 64])]),
            Some((vec![1, 32, 4, 64], vec![24576, 768, 64, 1], 0))
        );
    }

    #[test]
    fn leaves_what_torch_must_decide_to_torch() {
        let (s, st) = (&[2, 3, 4][..], &[12, 4, 1][..]);
        assert_eq!(g(ViewKind::Select, s, st, &[Int(1), Int(3)]), None); // out of range: torch raises
        assert_eq!(g(ViewKind::Transpose, s, st, &[Int(0), Int(3)]), None);
        assert_eq!(g(ViewKind::Slice, s, st, &[Int(0), No, No, Int(0)]), None);
        assert_eq!(g(ViewKind::Expand, s, st, &[Ints(vec![2, 5, 4])]), None);
        assert_eq!(g(ViewKind::View, &[3, 2], &[1, 3], &[Ints(vec![6])]), None); // no view: reshape copies
        assert_eq!(g(ViewKind::View, s, st, &[Ints(vec![5, -1])]), None);
        assert_eq!(g(ViewKind::Permute, s, st, &[Ints(vec![0, 0, 1])]), None);
        assert_eq!(g(ViewKind::Movedim, s, st, &[Int(3), Int(0)]), None);
        assert_eq!(g(ViewKind::Flatten, s, st, &[Int(2), Int(1)]), None); // torch raises
        assert_eq!(g(ViewKind::Flatten, &[], &[], &[Int(0), Int(-1)]), None); // a scalar's: `[1]`
                                                                              // Merging dimensions that aren't laid out one after the other: reshape copies.
        assert_eq!(g(ViewKind::Flatten, &[2, 3, 4], &[1, 8, 2], &[Int(0), Int(1)]), None);
    }
}
