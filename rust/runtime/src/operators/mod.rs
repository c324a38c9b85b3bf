//! kwexport's kernels as operators on torch's tensors, the layer between the plan and the
//! kernels: each operator checks that the handles qualify (dtype, device, layout, sizes),
//! allocates the output, packs weights, and runs the kernel on the tensors' memory; `None`
//! where the tensors don't qualify (the caller runs torch's op). The binding to torch's C ABI
//! is `abi`, which knows no kernel; the kernels know no tensor.

mod concat;
mod conv;
mod copy;
mod dense;
mod int8;
mod onednn;
mod pool;

use std::sync::OnceLock;

use crate::abi::{Abi, CError, Raw, StableIValue, Status, Tensor};
use crate::kernels;

pub use concat::Part;
pub use int8::{Int8Input, Int8Panels, Int8Weight};
pub use kernels::int8::Quant;
pub use kernels::patches::tiles as patches_tile;
pub use kernels::winograd::{pays as winograd_pays, MIN_PIXELS as WINOGRAD_MIN_PIXELS};
pub use kernels::{Conv2d, Depthwise, Epilogue, MaxPool};

/// The kernels' epilogue for oneDNN's post-op `attr` (the core's `passes::post_ops`), with
/// GELU's `algorithm` for a fused linear; `None` where no kernel applies it (`tanh`), and
/// for an unknown name. `"none"` is no activation.
pub fn epilogue_of(attr: &str, algorithm: Option<&str>) -> Option<Epilogue> {
    use kwexport_core::passes::post_ops::{self, Activation};
    if attr == "none" {
        return Some(Epilogue::None);
    }
    Some(match (post_ops::of_attr(attr)?, algorithm) {
        (Activation::Relu, _) => Epilogue::Relu,
        (Activation::Relu6, _) => Epilogue::Relu6,
        (Activation::Hardswish, _) => Epilogue::Hardswish,
        (Activation::Hardsigmoid, _) => Epilogue::Hardsigmoid,
        (Activation::Sigmoid, _) => Epilogue::Sigmoid,
        (Activation::Swish, _) => Epilogue::Swish,
        (Activation::Gelu, Some("none") | None) => Epilogue::Gelu,
        (Activation::Gelu, Some("tanh")) => Epilogue::GeluTanh,
        (Activation::Gelu, _) | (Activation::Tanh, _) => return None,
    })
}

/// Installs torch's intra-op pool (`abi::parallel`) as the kernels' pool, once per process:
/// the kernels then split their work on exactly the threads torch would use. Without it
/// they stay on the calling thread.
pub fn install_pool(abi: &'static Abi) {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        let Some(pool) = abi.pool.as_ref() else { return };
        kernels::parallel::install(kernels::parallel::Pool {
            threads: Box::new(|| pool.threads()),
            run: Box::new(|n, threads, body| pool.run(n, threads, body)),
        });
    });
}

/// How many threads kwexport's kernels may use on the calling thread (torch's intra-op count).
pub fn threads() -> usize {
    kernels::parallel::threads()
}

/// The keys [`Operators::attention`] takes: up to the first without measuring it against
/// torch's kernel (0 where kwexport's kernels don't run), up to the second at all.
pub fn attention_keys() -> (usize, usize) {
    (kernels::attention::unmeasured_keys(), kernels::attention::MAX_KEYS)
}

/// The operators, over one binding to torch.
#[derive(Clone, Copy)]
pub struct Operators<'a>(pub &'a Abi);

impl Operators<'_> {
    /// A tensor a shim made (`empty_strided`), owned here, or the error torch reported.
    fn owned(&self, made: Result<Raw, Status>) -> Result<Tensor, CError> {
        match made {
            Ok(raw) => Ok(self.0.adopt(raw as StableIValue)),
            Err(status) => Err(self.0.status(status).err().unwrap_or_else(|| CError::Internal("empty_strided".into()))),
        }
    }

    /// The number of elements of a float32 CPU tensor whose memory is dense (any order of
    /// its dimensions: `views::dense_len`), `None` for another tensor.
    ///
    /// # Safety
    /// `t` must be a live handle.
    unsafe fn dense_f32_len(&self, t: Raw) -> Option<usize> {
        // SAFETY: the caller's live handle.
        unsafe {
            if !self.0.shims.as_ref()?.is_cpu_f32(t) {
                return None;
            }
            let (sizes, strides) = self.0.sizes_strides(t)?;
            crate::views::dense_len(&sizes, &strides)
        }
    }

    /// A new float32 tensor of `sizes` that `pack` fills from the elements of `weight`, a
    /// float32 CPU tensor of `shape` at `strides` with no empty dimension (the elements its
    /// strides span); `None` for another tensor.
    fn packed(
        &self,
        weight: Raw,
        shape: [usize; 4],
        strides: [usize; 4],
        sizes: [usize; 3],
        pack: impl FnOnce(&[f32], &mut [f32]),
    ) -> Option<Tensor> {
        let shims = self.0.shims.as_ref()?;
        // SAFETY: a live handle.
        if !unsafe { shims.is_cpu_f32(weight) } || shape.contains(&0) {
            return None;
        }
        let span = kernels::span(&shape, &strides);
        let out = self.owned(shims.empty_f32(&sizes.map(|s| s as i64))).ok()?;
        // SAFETY: a float32 CPU tensor spanning `span` elements from its first (checked
        // above), and the fresh output, which aliases nothing.
        unsafe {
            let src = std::slice::from_raw_parts(shims.data_ptr(weight)? as *const f32, span);
            let dst = std::slice::from_raw_parts_mut(shims.data_ptr(out.raw())? as *mut f32, sizes.iter().product());
            pack(src, dst);
        }
        Some(out)
    }

    /// The elements and `[N, H, W]` of `x` where it is a float32 CPU `[N, c, H, W]` tensor
    /// laid out channels-last with no gaps (`[N, H, W, c]` in memory; a stride only matters
    /// where its dimension has more than one element) and no empty dimension.
    ///
    /// # Safety
    /// `x` must be a live handle, which nothing writes while the slice is used.
    unsafe fn channels_last_f32<'a>(&self, x: Raw, c: usize) -> Option<(&'a [f32], [usize; 3])> {
        // SAFETY: the caller's live handle.
        let (xs, dims, ld) = unsafe { self.channels_last_rows(x, c) }?;
        (ld == c).then_some((xs, dims))
    }

    /// [`Self::channels_last_f32`] for `x` that may be a slice of a wider tensor's channels:
    /// its pixels' `c` channels `ld` elements apart (`ld >= c`: `copy::row_stride`), and the
    /// elements from its first pixel's first to its last pixel's last.
    ///
    /// # Safety
    /// `x` must be a live handle, which nothing writes while the slice is used.
    unsafe fn channels_last_rows<'a>(&self, x: Raw, c: usize) -> Option<(&'a [f32], [usize; 3], usize)> {
        // SAFETY: the caller's live handle.
        let (sizes, strides) = unsafe {
            if !self.0.shims.as_ref()?.is_cpu_f32(x) {
                return None;
            }
            self.0.sizes_strides(x)?
        };
        let &[batch, channels, h, w] = sizes.as_slice() else { return None };
        if channels != c as i64 || batch * h * w == 0 {
            return None;
        }
        let ld = usize::try_from(copy::row_stride(&[0, 2, 3, 1], 3, &sizes, &strides)?).ok()?;
        let dims = [usize::try_from(batch).ok()?, usize::try_from(h).ok()?, usize::try_from(w).ok()?];
        let pixels = dims.iter().product::<usize>();
        // SAFETY: a float32 CPU tensor whose last pixel's channels end that many elements on.
        Some((unsafe { self.floats(x, (pixels - 1) * ld + c) }?, dims, ld))
    }

    /// The elements of `t` where it is a contiguous float32 CPU tensor of exactly `sizes`.
    ///
    /// # Safety
    /// `t` must be a live handle, which nothing writes while the slice is used.
    unsafe fn contiguous_f32<'a>(&self, t: Raw, sizes: &[i64]) -> Option<&'a [f32]> {
        // SAFETY: the caller's live handle.
        unsafe {
            if !self.0.shims.as_ref()?.is_cpu_f32(t) || self.0.contiguous_sizes(t)? != sizes {
                return None;
            }
            self.floats(t, usize::try_from(sizes.iter().product::<i64>()).ok()?)
        }
    }

    /// A bias of `n` elements: `Some(None)` without one, `None` where it isn't a contiguous
    /// float32 CPU `[n]` tensor.
    ///
    /// # Safety
    /// `bias` must be a live handle, which nothing writes while the slice is used.
    unsafe fn bias_f32<'a>(&self, bias: Option<Raw>, n: usize) -> Option<Option<&'a [f32]>> {
        match bias {
            None => Some(None),
            // SAFETY: the caller's live handle.
            Some(b) => unsafe { self.contiguous_f32(b, &[n as i64]) }.map(Some),
        }
    }

    /// `len` floats from a tensor's first element.
    ///
    /// # Safety
    /// `t` must be a live float32 CPU tensor with `len` elements from its first in its
    /// storage, which nothing writes while the slice is used.
    unsafe fn floats<'a>(&self, t: Raw, len: usize) -> Option<&'a [f32]> {
        // SAFETY: the caller's live handle, and `len` floats there.
        unsafe { Some(std::slice::from_raw_parts(self.0.shims.as_ref()?.data_ptr(t)? as *const f32, len)) }
    }

    /// A tensor this call made, as its `len` floats to write.
    ///
    /// # Safety
    /// `t` must be a new dense float32 CPU tensor of `len` elements that nothing else
    /// reads or writes while the slice is used.
    unsafe fn floats_mut<'a>(&self, t: &'a mut Tensor, len: usize) -> Option<&'a mut [f32]> {
        // SAFETY: the caller's new tensor of `len` floats.
        unsafe { Some(std::slice::from_raw_parts_mut(self.0.shims.as_ref()?.data_ptr(t.raw())? as *mut f32, len)) }
    }

    /// A new float32 CPU `[n, c, h, w]` tensor laid out channels-last.
    fn empty_channels_last(&self, [n, c, h, w]: [usize; 4]) -> Result<Tensor, CError> {
        let shims = self.0.shims.as_ref().ok_or_else(|| CError::Internal("no shims".into()))?;
        let [n, c, h, w] = [n, c, h, w].map(|v| v as i64);
        self.owned(shims.empty_f32_strided(&[n, c, h, w], &[h * w * c, 1, w * c, c]))
    }
}

/// Four sizes or strides as the kernels take them; `None` for another count or a negative.
fn four(v: &[i64]) -> Option<[usize; 4]> {
    let v: Vec<usize> = v.iter().map(|&d| usize::try_from(d).ok()).collect::<Option<_>>()?;
    v.try_into().ok()
}

/// A matrix weight packed into the GEMM's panels on its first use (`Operators::pack_matrix_panels`),
/// not at load: a load copies no weight, and a weight no call reaches is never packed. One
/// per weight, shared by the nodes that read it.
pub struct Panels {
    /// The weight, as a constant of the plan.
    weight: usize,
    transpose: bool,
    /// For the bfloat16 GEMM (`precision="bf16"`).
    pub bf16: bool,
    packed: std::sync::OnceLock<Option<Tensor>>,
}

impl Panels {
    /// Panels for constant `weight`: `[n, k]` (`transpose`) or `[k, n]`, in bfloat16 with
    /// `bf16`.
    pub fn new(weight: usize, transpose: bool, bf16: bool) -> Panels {
        Panels { weight, transpose, bf16, packed: std::sync::OnceLock::new() }
    }

    /// The packed panels, packed now if no call did yet; `None` where the weight can't be.
    pub fn get(&self, abi: &Abi, consts: &[Tensor]) -> Option<Raw> {
        let packed = self
            .packed
            .get_or_init(|| Operators(abi).pack_matrix_panels(consts.get(self.weight)?, self.transpose, self.bf16));
        packed.as_ref().map(Tensor::raw)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_post_op_has_its_epilogue() {
        assert_eq!(epilogue_of("swish", None), Some(Epilogue::Swish));
        assert_eq!(epilogue_of("hardtanh", None), Some(Epilogue::Relu6));
        assert_eq!(epilogue_of("tanh", None), None);
        assert_eq!(epilogue_of("none", None), Some(Epilogue::None));
        assert_eq!(epilogue_of("gelu", Some("tanh")), Some(Epilogue::GeluTanh));
        assert_eq!(epilogue_of("gelu", None), Some(Epilogue::Gelu));
        assert_eq!(epilogue_of("gelu", Some("sigmoid")), None);
        assert_eq!(epilogue_of("elu", None), None);
    }
}
