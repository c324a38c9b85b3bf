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
        // SAFETY: a live handle.
        let (xs, [batch, h, w], c) = unsafe {
            if self.0.shims.as_ref()?.dim(x)? != 4 {
                return None;
            }
            let c = usize::try_from(self.0.size(x, 1)?).ok()?;
            let (xs, dims) = self.channels_last_f32(x, c)?;
            (xs, dims, c)
        };
        let mut out = match self.empty_channels_last([batch, c, 1, 1]) {
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
