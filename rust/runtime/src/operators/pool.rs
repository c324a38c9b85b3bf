//! Pooling on channels-last tensors.

use super::Operators;
use crate::abi::{CError, Raw, Tensor};
use crate::kernels;

impl Operators<'_> {
    /// `adaptive_avg_pool2d(x, [1, 1])` for a float32 CPU `[N, C, H, W]` tensor laid out
    /// channels-last (`kernels::mean_pixels_f32`): a new channels-last `[N, C, 1, 1]` tensor,
    /// as torch's kernel returns. `None` for any other tensor.
    ///
    /// # Safety
    /// `x` must be a live handle.
    pub unsafe fn global_avg_pool(&self, x: Raw) -> Option<Result<Tensor, CError>> {
        // SAFETY: the caller's live handle.
        unsafe { self.pixel_means(x, |[n, c]| self.empty_channels_last([n, c, 1, 1])) }
    }

    /// `x.mean([2, 3], keepdim)` (or `[-2, -1]`) for the same tensors: the same means, in a
    /// new contiguous `[N, C, 1, 1]` (`keepdim`) or `[N, C]` tensor, as torch's reduction
    /// lays them out (a squeeze-excite block's pooling, GhostNet's). `None` for any other
    /// tensor.
    ///
    /// # Safety
    /// `x` must be a live handle.
    pub unsafe fn mean_pixels(&self, x: Raw, keepdim: bool) -> Option<Result<Tensor, CError>> {
        let shims = self.0.shims.as_ref()?;
        let new = |[n, c]: [usize; 2]| {
            let (n, c) = (n as i64, c as i64);
            self.owned(if keepdim { shims.empty_f32(&[n, c, 1, 1]) } else { shims.empty_f32(&[n, c]) })
        };
        // SAFETY: the caller's live handle.
        unsafe { self.pixel_means(x, new) }
    }

    /// Each channel's mean over its pixels for `x`, a float32 CPU `[N, C, H, W]` tensor laid
    /// out channels-last, written to `new([N, C])`: a tensor of `N · C` elements, channels
    /// innermost. `None` for any other `x`.
    ///
    /// # Safety
    /// `x` must be a live handle.
    unsafe fn pixel_means(
        &self,
        x: Raw,
        new: impl FnOnce([usize; 2]) -> Result<Tensor, CError>,
    ) -> Option<Result<Tensor, CError>> {
        // SAFETY: a live handle.
        let (xs, [batch, h, w], c) = unsafe {
            if self.0.shims.as_ref()?.dim(x)? != 4 {
                return None;
            }
            let c = usize::try_from(self.0.size(x, 1)?).ok()?;
            let (xs, dims) = self.channels_last_f32(x, c)?;
            (xs, dims, c)
        };
        let mut out = match new([batch, c]) {
            Ok(out) => out,
            Err(e) => return Some(Err(e)),
        };
        // SAFETY: the new output of that many elements.
        let os = unsafe { self.floats_mut(&mut out, batch * c) }?;
        for (image, o) in xs.chunks_exact(h * w * c).zip(os.chunks_exact_mut(c)) {
            kernels::mean_pixels_f32(image, h * w, o);
        }
        Some(Ok(out))
    }

    /// kwexport's max pooling (`kernels::max_pool_f32`) of `x`, a float32 CPU `[N, C, H, W]`
    /// tensor laid out channels-last: a new channels-last tensor, or `None` where `x` doesn't
    /// qualify (the caller runs torch's op, which also says why a window doesn't fit).
    ///
    /// # Safety
    /// `x` must be a live handle.
    pub unsafe fn max_pool(&self, x: Raw, pool: &kernels::MaxPool) -> Option<Result<Tensor, CError>> {
        // SAFETY: a live handle.
        let (xs, [batch, h, w], c) = unsafe {
            if self.0.shims.as_ref()?.dim(x)? != 4 {
                return None;
            }
            let c = usize::try_from(self.0.size(x, 1)?).ok()?;
            let (xs, dims) = self.channels_last_f32(x, c)?;
            (xs, dims, c)
        };
        let [ho, wo] = pool.output(h, w)?;
        let mut out = match self.empty_channels_last([batch, c, ho, wo]) {
            Ok(out) => out,
            Err(e) => return Some(Err(e)),
        };
        // SAFETY: the new output of that many elements.
        let os = unsafe { self.floats_mut(&mut out, batch * ho * wo * c) }?;
        kernels::max_pool_f32(xs, [batch, h, w, c], pool, os).ok().map(|()| Ok(out))
    }
}
