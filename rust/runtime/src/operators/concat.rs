//! Concatenations made in place (`plan::concat`): convolutions on kwexport's kernels write
//! their outputs straight into their channels of the concatenation's result, which the
//! `cat` then returns without copying them (GhostNet's 32 concatenations, SqueezeNet's 8:
//! memory-bound copies that a second thread didn't speed up).

use super::Operators;
use crate::abi::{CError, Raw, Tensor};
use crate::kernels;

/// Where a convolution's output goes in a concatenation along channels: channels `offset`
/// on of `buffer`, the float32 channels-last `[N, C, H, W]` tensor the `cat` will return.
#[derive(Clone, Copy)]
pub struct Part {
    pub buffer: Raw,
    pub offset: usize,
}

/// A convolution's output: the tensor the node returns, where its first pixel's channels
/// start, and how far apart its pixels are (its channels where it is a tensor of its own,
/// the concatenation's where it is a part of one).
pub(super) struct Output {
    pub tensor: Tensor,
    pub ptr: *mut f32,
    pub ld: usize,
}

impl Output {
    /// The elements from the first pixel's first channel to the last pixel's last, of
    /// `pixels` pixels of `c` channels.
    pub fn span(&self, pixels: usize, c: usize) -> usize {
        if pixels == 0 {
            0
        } else {
            (pixels - 1) * self.ld + c
        }
    }

    /// Whether the output's elements (`pixels` of `c` channels) and `x` share memory (a
    /// convolution reading a part of the concatenation it writes into: only the depthwise
    /// kernel takes that).
    pub fn overlaps(&self, x: &[f32], pixels: usize, c: usize) -> bool {
        let (a, b) = (self.ptr as usize, self.ptr as usize + 4 * self.span(pixels, c));
        let (xa, xb) = (x.as_ptr() as usize, x.as_ptr() as usize + 4 * x.len());
        a < xb && xa < b
    }
}

/// Whether `c` channels of pixels `lx` apart from `x` and of pixels `lo` apart from `out`
/// share no element, where the two overlap: parts of one concatenation (one stride), at
/// channels that don't meet.
pub(super) fn apart(x: *const f32, lx: usize, out: *const f32, lo: usize, c: usize) -> bool {
    let d = (out as usize).abs_diff(x as usize) / 4;
    lx == lo && (out as usize).abs_diff(x as usize).is_multiple_of(4) && (c..=lo.saturating_sub(c)).contains(&(d % lo))
}

impl Operators<'_> {
    /// The output of a convolution of `[n, c, h, w]`: channels `part.offset ..` of
    /// `part.buffer` where it is a float32 CPU channels-last `[n, C, h, w]` tensor with room
    /// for them, as a tensor over them (not an autograd view: these kernels run on calls
    /// with nothing to record); a new channels-last tensor otherwise.
    ///
    /// # Safety
    /// `part.buffer` must be a live handle.
    pub(super) unsafe fn conv_output(&self, dims: [usize; 4], part: Option<Part>) -> Option<Result<Output, CError>> {
        let [n, c, h, w] = dims;
        // SAFETY: the caller's live handle.
        if let Some((part, total)) = part.and_then(|p| unsafe { self.room(p, dims) }.map(|total| (p, total))) {
            let [n, c, h, w, total] = [n, c, h, w, total].map(|v| v as i64);
            let strides = [h * w * total, 1, w * total, total];
            let shims = self.0.shims.as_ref()?;
            // SAFETY: a live handle; the view lies inside the buffer (`room`).
            let view = unsafe { self.0.reinterpret_raw(part.buffer, &[n, c, h, w], &strides, part.offset as i64) };
            return Some(view.and_then(|tensor| {
                // SAFETY: the view just made, a live handle.
                let ptr = unsafe { shims.data_ptr(tensor.raw()) }.ok_or_else(|| CError::Internal("a view".into()))?;
                Ok(Output { tensor, ptr: ptr as *mut f32, ld: total as usize })
            }));
        }
        self.output_of(self.empty_channels_last(dims), c)
    }

    /// A new tensor (or the error making it) as an output whose rows are `ld` apart.
    pub(super) fn output_of(&self, made: Result<Tensor, CError>, ld: usize) -> Option<Result<Output, CError>> {
        let shims = self.0.shims.as_ref()?;
        Some(made.and_then(|tensor| {
            // SAFETY: the new tensor, a live handle.
            let ptr = unsafe { shims.data_ptr(tensor.raw()) }.ok_or_else(|| CError::Internal("a new tensor".into()))?;
            Ok(Output { tensor, ptr: ptr as *mut f32, ld })
        }))
    }

    /// A new float32 CPU channels-last `[n, c, h, w]` tensor for a concatenation made in
    /// place (`plan::concat`) to write its parts into.
    pub fn concat_buffer(&self, dims: [usize; 4]) -> Result<Tensor, CError> {
        self.empty_channels_last(dims)
    }

    /// The buffer's channels where `part` has room for an output of `[n, c, h, w]` from its
    /// offset: a float32 CPU channels-last `[n, C, h, w]` tensor with no gaps, `offset + c
    /// <= C`.
    ///
    /// # Safety
    /// `part.buffer` must be a live handle.
    unsafe fn room(&self, part: Part, [n, c, h, w]: [usize; 4]) -> Option<usize> {
        // SAFETY: the caller's live handle.
        let (sizes, strides) = unsafe {
            if !self.0.shims.as_ref()?.is_cpu_f32(part.buffer) {
                return None;
            }
            self.0.sizes_strides(part.buffer)?
        };
        let &[bn, total, bh, bw] = sizes.as_slice() else { return None };
        let total = usize::try_from(total).ok()?;
        let fits = [bn, bh, bw] == [n, h, w].map(|v| v as i64) && part.offset + c <= total && n * h * w > 0;
        let dense = super::copy::strides_in(&[0, 2, 3, 1], &sizes);
        let dense = sizes.iter().zip(&strides).zip(dense).all(|((&d, &s), want)| d <= 1 || s == want);
        (fits && dense).then_some(total)
    }

    /// `torch.cat(inputs, 1)` into `buffer`, the float32 CPU channels-last `[N, C, H, W]`
    /// tensor the convolutions of a concatenation made in place wrote into (`plan::concat`):
    /// an input already in its place (a part a convolution wrote) is left as it is, another
    /// (a convolution that ran on oneDNN, or declined the part) copied into its channels;
    /// the buffer is the result. `None`, copying nothing, where an input isn't a float32 CPU
    /// `[N, c, H, W]` tensor laid out channels-last (its channels may be a slice) outside
    /// the buffer, or the channels don't add up to `C`: the caller's `cat` runs.
    ///
    /// # Safety
    /// `inputs` and `buffer` must be live handles.
    pub unsafe fn cat_into(&self, inputs: &[Raw], buffer: &Tensor) -> Option<Result<Tensor, CError>> {
        let shims = self.0.shims.as_ref()?;
        // SAFETY: the caller's live handles.
        let (sizes, _) = unsafe { self.0.sizes_strides(buffer.raw()) }?;
        let &[n, total, h, w] = sizes.as_slice() else { return None };
        let dims = [n, total, h, w].map(|v| usize::try_from(v).ok());
        let [Some(n), Some(total), Some(h), Some(w)] = dims else { return None };
        let pixels = n * h * w;
        // SAFETY: a live handle.
        let base = unsafe { shims.data_ptr(buffer.raw()) }? as *mut f32;
        let (mut offset, mut copies) = (0, Vec::new());
        for &x in inputs {
            // SAFETY: the caller's live handles.
            let c = usize::try_from(unsafe { self.0.size(x, 1) }?).ok()?;
            let part = Part { buffer: buffer.raw(), offset };
            // SAFETY: as above.
            unsafe { self.room(part, [n, c, h, w]) }.filter(|&t| t == total)?;
            // SAFETY: as above.
            let (xs, dims, ld) = unsafe { self.channels_last_rows(x, c) }?;
            if dims != [n, h, w] {
                return None;
            }
            // The elements this input's channels of the buffer span.
            let span = (pixels - 1) * total + c;
            // SAFETY: `offset + c <= total` (`room`): inside the buffer.
            let at = unsafe { base.add(offset) };
            let in_place = std::ptr::eq(xs.as_ptr(), at) && ld == total;
            let (xa, xb) = (xs.as_ptr() as usize, xs.as_ptr() as usize + 4 * xs.len());
            let (ba, bb) = (base as usize, base as usize + 4 * (pixels * total));
            if !in_place {
                if xa < bb && ba < xb {
                    return None;
                }
                copies.push((xs, ld, c, at, span));
            }
            offset += c;
        }
        if offset != total {
            return None;
        }
        for (xs, ld, c, at, span) in copies {
            // SAFETY: the buffer's elements of this input's channels (inside it, `room`),
            // which no input read here shares (checked) and nothing else touches during the
            // copy.
            let out = unsafe { std::slice::from_raw_parts_mut(at, span) };
            kernels::copy::place_rows(kernels::copy::Strided { x: xs, len: c, ld }, pixels, (out, total));
        }
        Some(self.0.share(buffer).map(|bits| self.0.adopt(bits)))
    }
}
