//! Matrix operators: linears (f32 and bf16 GEMM), norms, GELU, a fused activation on torch's
//! result, attention, the rotary embedding, and int64 addition.

use super::{four, Operators};
use crate::abi::{CError, Raw, Tensor};
use crate::kernels;

impl Operators<'_> {
    /// kwexport's RMS norm of `x` (`[..., n]`) with weight `w` (`[n]`), both contiguous
    /// float32 CPU tensors: a new tensor, or `None` where they don't qualify (the caller runs
    /// torch's op, which also raises for a size that isn't `n`).
    ///
    /// # Safety
    /// Both must be live handles.
    pub unsafe fn rms_norm(&self, x: Raw, w: Raw, eps: f64, normalized: i64) -> Option<Result<Tensor, CError>> {
        let shims = self.0.shims.as_ref()?;
        // SAFETY: live handles.
        let (xs, ws) = unsafe {
            if !shims.is_cpu_f32(x) || !shims.is_cpu_f32(w) {
                return None;
            }
            (self.0.contiguous_sizes(x)?, self.0.contiguous_sizes(w)?)
        };
        let (&n, [wn]) = (xs.last()?, ws.as_slice()) else { return None };
        if n != *wn || n != normalized || n == 0 {
            return None;
        }
        let len = usize::try_from(xs.iter().product::<i64>()).ok()?;
        let out = match self.owned(shims.empty_f32(&xs)) {
            Ok(out) => out,
            Err(e) => return Some(Err(e)),
        };
        // SAFETY: contiguous float32 CPU tensors of `len` and `n` elements (checked above), and
        // the fresh output of `len`; none aliases another (the output is new).
        unsafe {
            let (px, pw, po) = (shims.data_ptr(x)?, shims.data_ptr(w)?, shims.data_ptr(out.raw())?);
            let xs = std::slice::from_raw_parts(px as *const f32, len);
            let ws = std::slice::from_raw_parts(pw as *const f32, n as usize);
            let os = std::slice::from_raw_parts_mut(po as *mut f32, len);
            kernels::rms_norm_f32(xs, ws, eps as f32, os);
        }
        Some(Ok(out))
    }

    /// kwexport's layer norm of `x` (`[..., n]`) with weight `w` and bias `b` (`[n]`), all
    /// contiguous float32 CPU tensors: a new tensor, or `None` where they don't qualify (the
    /// caller runs torch's op, which also raises for a size that isn't `n`).
    ///
    /// # Safety
    /// All must be live handles.
    pub unsafe fn layer_norm(
        &self,
        x: Raw,
        w: Raw,
        b: Raw,
        eps: f64,
        normalized: i64,
    ) -> Option<Result<Tensor, CError>> {
        let shims = self.0.shims.as_ref()?;
        // SAFETY: live handles.
        let (sizes, ws, bs) = unsafe {
            let sizes = self.0.contiguous_sizes(x)?;
            let n = usize::try_from(*sizes.last()?).ok()?;
            if !shims.is_cpu_f32(x) || n == 0 || i64::try_from(n).ok()? != normalized {
                return None;
            }
            (sizes, self.contiguous_f32(w, &[normalized])?, self.contiguous_f32(b, &[normalized])?)
        };
        let len = usize::try_from(sizes.iter().product::<i64>()).ok()?;
        // SAFETY: a contiguous float32 CPU tensor of `len` elements (checked above).
        let xs = unsafe { self.floats(x, len) }?;
        let mut out = match self.owned(shims.empty_f32(&sizes)) {
            Ok(out) => out,
            Err(e) => return Some(Err(e)),
        };
        // SAFETY: the new output of `len` elements.
        let os = unsafe { self.floats_mut(&mut out, len) }?;
        kernels::layer_norm_f32(xs, ws, bs, eps as f32, os);
        Some(Ok(out))
    }

    /// kwexport's GELU of `x`, a contiguous float32 CPU tensor: a new tensor, or `None` where
    /// it doesn't qualify or the CPU lacks the kernel's instructions.
    ///
    /// # Safety
    /// `x` must be a live handle.
    pub unsafe fn gelu(&self, x: Raw, tanh: bool) -> Option<Result<Tensor, CError>> {
        let shims = self.0.shims.as_ref()?;
        // SAFETY: a live handle.
        let sizes = unsafe {
            if shims.is_cpu_f32(x) {
                self.0.contiguous_sizes(x)?
            } else {
                return None;
            }
        };
        let len = usize::try_from(sizes.iter().product::<i64>()).ok()?;
        let out = match self.owned(shims.empty_f32(&sizes)) {
            Ok(out) => out,
            Err(e) => return Some(Err(e)),
        };
        // SAFETY: a contiguous float32 CPU tensor of `len` elements (checked above) and the
        // fresh output of `len`, which aliases nothing.
        let done = unsafe {
            let (px, po) = (shims.data_ptr(x)?, shims.data_ptr(out.raw())?);
            let xs = std::slice::from_raw_parts(px as *const f32, len);
            let os = std::slice::from_raw_parts_mut(po as *mut f32, len);
            kernels::gelu_f32(xs, tanh, os)
        };
        done.ok().map(|()| Ok(out))
    }

    /// A matrix weight as the GEMM's panels (`[ceil(n / 64), k, 64]`, `kernels::PANEL`): a
    /// linear's `[n, k]` (`transpose`, also a 1×1 convolution's `[n, k, 1, 1]`) or an `addmm`'s
    /// `[k, n]` second matrix, float32 on the CPU at any strides. With `bf16`, the bfloat16
    /// GEMM's (`kernels::bf16::pack_panels`): `[ceil(n / 64), ceil(k / 2), 64]` pairs of
    /// bfloat16, each pair held in one float32 element's bytes. `None` for anything else.
    pub fn pack_matrix_panels(&self, weight: &Tensor, transpose: bool, bf16: bool) -> Option<Tensor> {
        // SAFETY: a live handle.
        let (sizes, strides) = unsafe { self.0.sizes_strides(weight.raw()) }?;
        // As the `[n, k, 1, 1]` weight of a 1×1 convolution, whose panels are the matrix's.
        let (shape, strides) = match (sizes.as_slice(), strides.as_slice(), transpose) {
            ([n, k], [s0, s1], true) => ([*n, *k, 1, 1], [*s0, *s1, 0, 0]),
            ([k, n], [s0, s1], false) => ([*n, *k, 1, 1], [*s1, *s0, 0, 0]),
            ([n, k, 1, 1], [s0, s1, ..], true) => ([*n, *k, 1, 1], [*s0, *s1, 0, 0]),
            _ => return None,
        };
        if bf16 {
            return self.pack_bf16_panels_of(weight.raw(), four(&shape)?, four(&strides)?);
        }
        self.pack_panels_of(weight.raw(), four(&shape)?, four(&strides)?)
    }

    /// kwexport's linear kernel on `x` (`[m, k]`), the weight's `panels` (`[ceil(n / 64), k,
    /// 64]`, `Operators::pack_matrix_panels`, or its bfloat16 panels with `bf16`) and `bias` (`[n]`),
    /// all contiguous float32 CPU tensors: a new `[m, n]` tensor, or `None` where they don't
    /// qualify or the CPU lacks the kernel's instructions.
    ///
    /// # Safety
    /// `x`, `panels` and `bias` must be live handles.
    pub unsafe fn linear(
        &self,
        x: Raw,
        panels: Raw,
        n: i64,
        bias: Option<Raw>,
        epilogue: kernels::Epilogue,
        bf16: bool,
    ) -> Option<Result<Tensor, CError>> {
        let shims = self.0.shims.as_ref()?;
        // SAFETY: live handles.
        let (xs, [m, k]) = unsafe {
            let &[m, k] = self.0.contiguous_sizes(x)?.as_slice() else { return None };
            (self.contiguous_f32(x, &[m, k])?, [usize::try_from(m).ok()?, usize::try_from(k).ok()?])
        };
        let n = usize::try_from(n).ok()?;
        let out = || self.output_of(self.owned(shims.empty_f32(&[m as i64, n as i64])), n);
        // SAFETY: the caller's live handles.
        unsafe { self.gemm((xs, k), [m, k, n], (panels, bf16), bias, None, epilogue, out) }
    }

    /// `epilogue` applied in place to `t`, a dense float32 CPU tensor torch's kernel just made
    /// (a fused linear's or convolution's activation, `kernels::epilogue_f32`).
    pub fn apply_epilogue(&self, t: &mut Tensor, epilogue: kernels::Epilogue) -> Result<(), CError> {
        if epilogue == kernels::Epilogue::None {
            return Ok(());
        }
        let fail = || CError::Internal("a fused activation on torch's result".into());
        // SAFETY: a live handle, then its dense float32 elements: a new tensor nothing else
        // holds.
        unsafe {
            let len = self.dense_f32_len(t.raw()).ok_or_else(fail)?;
            let xs = self.floats_mut(t, len).ok_or_else(fail)?;
            kernels::epilogue_f32(epilogue, xs).map_err(|_| fail())
        }
    }

    /// Whether every element of `t` is finite; `false` also where `t` isn't a dense float32
    /// CPU tensor (the caller then takes the path that is right for any values).
    ///
    /// # Safety
    /// `t` must be a live handle.
    pub unsafe fn all_finite(&self, t: Raw) -> bool {
        // SAFETY: the caller's live handle, then its dense elements.
        unsafe {
            let Some(len) = self.dense_f32_len(t) else { return false };
            self.floats(t, len).is_some_and(kernels::all_finite)
        }
    }

    /// kwexport's GEMM (`kernels::gemm_f32`) of `xs` (`m` rows of `k`) with the weight's
    /// `panels` (`[ceil(n / 64), k, 64]`; or, with `bf16`, `kernels::bf16::gemm` on its
    /// `[ceil(n / 64), ceil(k / 2), 64]` pairs), `bias` (`[n]`), `residual` (`m * n`) and
    /// `epilogue` into the output `out` makes (`m` rows of `n`, `ld` apart: a new tensor's, or
    /// a convolution's part of a concatenation, with no residual), once the weight and bias
    /// qualify; `None` where they don't or the CPU lacks the kernel.
    ///
    /// # Safety
    /// `panels` and `bias` must be live handles; `out` must make a float32 CPU output.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn gemm(
        &self,
        (xs, ld): (&[f32], usize),
        [m, k, n]: [usize; 3],
        (panels, bf16): (Raw, bool),
        bias: Option<Raw>,
        residual: Option<&[f32]>,
        epilogue: kernels::Epilogue,
        out: impl FnOnce() -> Option<Result<super::concat::Output, CError>>,
    ) -> Option<Result<Tensor, CError>> {
        // The bfloat16 GEMM converts dense rows only.
        if m == 0 || n == 0 || (bf16 && (!kernels::bf16::available() || ld != k)) {
            return None;
        }
        let shape = [n, k, 1, 1];
        let sizes = if bf16 { kernels::bf16::pack_size(shape) } else { kernels::gemm::pack_size(shape) };
        // SAFETY: the caller's live handles.
        let (ps, bs) = unsafe {
            let ps = self.contiguous_f32(panels, &sizes.map(|s| s as i64))?;
            (ps, self.bias_f32(bias, n)?)
        };
        let out = match out()? {
            Ok(out) => out,
            Err(e) => return Some(Err(e)),
        };
        // Rows `ldo` apart: a part of a concatenation (`super::concat`), which the input
        // mustn't share, and which only the float32 GEMM writes.
        let ldo = out.ld;
        if (bf16 && ldo != n) || out.overlaps(xs, m, n) {
            return None;
        }
        // SAFETY: the output's elements, of a new tensor or of this node's channels of a
        // concatenation's, which nothing else reads or writes while the kernel runs.
        let os = unsafe { std::slice::from_raw_parts_mut(out.ptr, out.span(m, n)) };
        let done = if bf16 {
            // The panels' float32 elements hold pairs of bfloat16 (`pack_bf16_panels_of`).
            // SAFETY: the same memory, read as the 4-byte words it is.
            let pairs = unsafe { std::slice::from_raw_parts(ps.as_ptr() as *const u32, ps.len()) };
            kernels::bf16::gemm(xs, m, k, pairs, n, bs, residual, epilogue, os)
        } else {
            kernels::gemm::gemm_f32_rows(xs, ld, [m, k, n], ps, (bs, residual), epilogue, (os, ldo))
        };
        done.ok().map(|()| Ok(out.tensor))
    }

    /// Scaled dot-product attention (`kernels::attention_f32`) over float32 CPU `[batch,
    /// heads, rows, cols]` queries, keys and values whose last dimension is contiguous, with
    /// `mask` (bool or float32, broadcast to `[batch, heads, l, s]`)
    /// or the causal triangle, and `scale` (`1 / sqrt(e)` where `None`, as torch computes it):
    /// a new `[batch, heads, l, ev]` tensor laid out densely in the query's order of
    /// dimensions, as torch's CPU flash kernel returns it. `None` where the tensors don't qualify, the keys are more than
    /// `kernels::attention::MAX_KEYS` (torch's blocked kernel is the faster there), a query has
    /// no key, or the CPU lacks the kernel. Whether it runs for more keys than the family
    /// always takes is the caller's choice (`exec::choice`).
    ///
    /// # Safety
    /// `q`, `k`, `v` and `mask` must be live handles.
    pub unsafe fn attention(
        &self,
        [q, k, v]: [Raw; 3],
        mask: Option<Raw>,
        causal: bool,
        scale: Option<f64>,
    ) -> Option<Result<Tensor, CError>> {
        use kernels::{Attention, AttentionMask};
        let shims = self.0.shims.as_ref()?;
        let dims = |t: Raw| -> Option<([usize; 4], [usize; 4])> {
            // SAFETY: the caller's live handles.
            let (sizes, strides) = unsafe { self.0.sizes_strides(t) }?;
            let (sizes, strides) = (four(&sizes)?, four(&strides)?);
            (strides[3] == 1 || sizes[3] == 1).then_some((sizes, strides))
        };
        // SAFETY: the caller's live handles.
        if !unsafe { shims.is_cpu_f32(q) && shims.is_cpu_f32(k) && shims.is_cpu_f32(v) } || (causal && mask.is_some()) {
            return None;
        }
        let ((qd, qs), (kd, ks), (vd, vs)) = (dims(q)?, dims(k)?, dims(v)?);
        let [batch, heads, l, e] = qd;
        let (s, ev) = (kd[2], e);
        // Values as wide as keys: torch's flash kernel then runs, whose output's strides the
        // kernel's match (torch's math kernel returns a contiguous one).
        if kd != [batch, heads, s, e] || vd != kd || s > kernels::attention::MAX_KEYS || qd.contains(&0) || s == 0 {
            return None;
        }
        let scale = scale.unwrap_or(1.0 / (e as f64).sqrt()) as f32;
        let g = Attention { batch, heads, l, s, e, ev, scale };
        let span = |d: [usize; 4], st: [usize; 4]| kernels::span(&d, &st);
        let three = |st: [usize; 4]| [st[0], st[1], st[2]];
        // SAFETY: float32 CPU tensors spanning that many elements from their first.
        let (qx, kx, vx) =
            unsafe { (self.floats(q, span(qd, qs))?, self.floats(k, span(kd, ks))?, self.floats(v, span(vd, vs))?) };
        let mask = match mask {
            None if causal => AttentionMask::Causal,
            None => AttentionMask::None,
            Some(m) => {
                let target = [batch, heads, l, s];
                // SAFETY: the caller's live handle.
                let st = unsafe { self.broadcast_strides(m, target) }?;
                let span = span(target, st);
                // SAFETY: the caller's live handle, of that dtype, spanning `span` elements.
                unsafe {
                    if shims.is_cpu_bool(m) {
                        let p = shims.data_ptr(m)? as *const u8;
                        AttentionMask::Bool(std::slice::from_raw_parts(p, span), st)
                    } else if shims.is_cpu_f32(m) {
                        AttentionMask::Float(self.floats(m, span)?, st)
                    } else {
                        return None;
                    }
                }
            }
        };
        // As torch's flash kernel returns it (`empty_like(q)`): the query's strides where it
        // is dense (those of its size-1 dimensions included), else dense in its order.
        let mut ostrides = dense_in_order(three(qd), three(qs), ev);
        if (qs[3] == 1 || e == 1) && (0..3).all(|d| qd[d] == 1 || qs[d] == ostrides[d]) {
            ostrides = three(qs);
        }
        let sizes = [batch, heads, l, ev].map(|d| d as i64);
        let strides = [ostrides[0], ostrides[1], ostrides[2], 1].map(|d| d as i64);
        let mut out = match self.owned(shims.empty_f32_strided(&sizes, &strides)) {
            Ok(out) => out,
            Err(e) => return Some(Err(e)),
        };
        // SAFETY: the new output of that many elements.
        let os = unsafe { self.floats_mut(&mut out, batch * l * heads * ev) }?;
        let out_ = (os, ostrides);
        kernels::attention_f32((qx, three(qs)), (kx, three(ks)), (vx, three(vs)), &g, mask, out_).ok().map(|()| Ok(out))
    }

    /// The rotary embedding (`kernels::rotary`) of float32 CPU `x` (`[batch, heads,
    /// positions, d]`, its last dimension contiguous) with `cos` and `sin` broadcast to it
    /// (size-1 dimensions, and missing leading ones, read at stride 0; their last dimension
    /// contiguous), the second half from `split`: a new tensor laid out as `x` is (eager's
    /// `mul` keeps its first operand's layout), bit for bit eager's. `None` for any other
    /// tensors.
    ///
    /// # Safety
    /// All three must be live handles.
    pub unsafe fn rotary(&self, x: Raw, cos: Raw, sin: Raw, split: i64) -> Option<Result<Tensor, CError>> {
        let shims = self.0.shims.as_ref()?;
        // SAFETY: the caller's live handles.
        if !unsafe { shims.is_cpu_f32(x) && shims.is_cpu_f32(cos) && shims.is_cpu_f32(sin) } {
            return None;
        }
        // SAFETY: as above.
        let (sizes, strides) = unsafe { self.0.sizes_strides(x) }?;
        let (sizes, xs) = (four(&sizes)?, four(&strides)?);
        let (d, split) = (sizes[3], usize::try_from(split).ok()?);
        if xs[3] != 1 || split > d || sizes.contains(&0) {
            return None;
        }
        // A table's row strides, broadcast to `x`'s sizes.
        let table = |t: Raw| -> Option<[usize; 3]> {
            // SAFETY: the caller's live handle.
            let st = unsafe { self.broadcast_strides(t, sizes) }?;
            (st[3] == 1 || d == 1).then_some([st[0], st[1], st[2]])
        };
        let (cs, ss) = (table(cos)?, table(sin)?);
        let g = kernels::rotary::Rotary { dims: [sizes[0], sizes[1], sizes[2]], d, split };
        // `x`'s rows in the order of their strides, densely: where `x` is dense, its own
        // strides.
        let os = dense_in_order([sizes[0], sizes[1], sizes[2]], [xs[0], xs[1], xs[2]], d);
        let inner = sizes.iter().product::<usize>();
        let span = |st: [usize; 3]| kernels::span(&sizes, &[st[0], st[1], st[2], 1]);
        // SAFETY: float32 CPU tensors spanning that many elements from their first.
        let (xv, cv, sv) = unsafe {
            (self.floats(x, span([xs[0], xs[1], xs[2]]))?, self.floats(cos, span(cs))?, self.floats(sin, span(ss))?)
        };
        let i64s = |v: [usize; 4]| v.map(|n| n as i64);
        let mut out = match self.owned(shims.empty_f32_strided(&i64s(sizes), &i64s([os[0], os[1], os[2], 1]))) {
            Ok(out) => out,
            Err(e) => return Some(Err(e)),
        };
        // SAFETY: the new output, dense: `inner` elements.
        let ov = unsafe { self.floats_mut(&mut out, inner) }?;
        let xr = [xs[0], xs[1], xs[2]];
        kernels::rotary::rotary_f32(&g, (xv, xr), (cv, cs), (sv, ss), (ov, os)).ok().map(|()| Ok(out))
    }

    /// The strides at which `t` reads as broadcast to the 4-d `target`: missing leading
    /// dimensions and size-1 ones at stride 0. `None` where a size neither matches nor is 1.
    ///
    /// # Safety
    /// `t` must be a live handle.
    unsafe fn broadcast_strides(&self, t: Raw, target: [usize; 4]) -> Option<[usize; 4]> {
        // SAFETY: the caller's live handle.
        let (sizes, strides) = unsafe { self.0.sizes_strides(t) }?;
        let pad = 4usize.checked_sub(sizes.len())?;
        let mut st = [0usize; 4];
        for (i, (&n, &stride)) in sizes.iter().zip(&strides).enumerate() {
            let (n, stride) = (usize::try_from(n).ok()?, usize::try_from(stride).ok()?);
            match n {
                _ if n == target[pad + i] && n > 1 => st[pad + i] = stride,
                1 => st[pad + i] = 0,
                _ => return None,
            }
        }
        Some(st)
    }

    /// `a + b` for int64 CPU tensors, contiguous, of one shape or one of them a single element
    /// (torch's broadcasting for these cases): kwexport's kernel, exact. `None` for anything
    /// else (the caller runs torch's op).
    ///
    /// # Safety
    /// Both must be live handles.
    pub unsafe fn add_i64(&self, a: Raw, b: Raw) -> Option<Result<Tensor, CError>> {
        let shims = self.0.shims.as_ref()?;
        // SAFETY: live handles.
        let (asz, bsz) = unsafe {
            if !shims.is_cpu_i64(a) || !shims.is_cpu_i64(b) {
                return None;
            }
            (self.0.contiguous_sizes(a)?, self.0.contiguous_sizes(b)?)
        };
        let (an, bn) = (asz.iter().product::<i64>(), bsz.iter().product::<i64>());
        // The broadcast shape where the shapes are equal or one side has one element: the
        // other side's, padded on the left with ones to the longer rank.
        if asz != bsz && an != 1 && bn != 1 {
            return None;
        }
        let (big, small) = if an == 1 { (&bsz, &asz) } else { (&asz, &bsz) };
        let mut sizes = big.clone();
        sizes.splice(0..0, std::iter::repeat_n(1, small.len().saturating_sub(big.len())));
        let n = usize::try_from(sizes.iter().product::<i64>()).ok()?;
        let (an, bn) = (usize::try_from(an).ok()?, usize::try_from(bn).ok()?);
        if n == 0 || (an != n && an != 1) || (bn != n && bn != 1) {
            return None;
        }
        let out = match self.owned(shims.empty_i64(&sizes)) {
            Ok(out) => out,
            Err(e) => return Some(Err(e)),
        };
        // SAFETY: contiguous int64 CPU tensors of `an`, `bn` and `n` elements; the output is new.
        unsafe {
            let xa = std::slice::from_raw_parts(shims.data_ptr(a)? as *const i64, an);
            let xb = std::slice::from_raw_parts(shims.data_ptr(b)? as *const i64, bn);
            let o = std::slice::from_raw_parts_mut(shims.data_ptr(out.raw())? as *mut i64, n);
            kernels::add_i64(xa, xb, o);
        }
        Some(Ok(out))
    }
}

/// The strides of the first three dimensions of a new tensor of `sizes` laid out densely in
/// the order of `strides` (outermost the largest; at a tie the earlier), its rows of `row`
/// values contiguous.
fn dense_in_order(sizes: [usize; 3], strides: [usize; 3], row: usize) -> [usize; 3] {
    let mut order = [0usize, 1, 2];
    order.sort_by_key(|&i| std::cmp::Reverse(strides[i]));
    let mut dense = [0usize; 3];
    let mut inner = row;
    for &i in order.iter().rev() {
        dense[i] = inner;
        inner *= sizes[i];
    }
    dense
}
