//! torch's per-op C shims (`torch/csrc/inductor/aoti_torch/generated/c_shim_*.h`): unboxed
//! entry points that AOTInductor's generated code calls, exported by `libtorch_cpu.so`. Unlike
//! the dispatcher's stack they take a `Scalar` as a `double`, which is how kwexport runs the
//! nodes that the stable ABI's dispatcher can't (`add.Tensor`'s `alpha`, `addmm`'s `beta`).
//!
//! A `double` is not the `Scalar` the node had: an integral `alpha` becomes a floating one,
//! which torch refuses for integer tensors, and a floating `Scalar` changes type promotion.
//! So a shim only runs where every tensor it reads is floating (or complex) and on the
//! device its family is for; [`Shims::admits`] checks that per call, and the node falls back
//! to its Python op otherwise. Every symbol is optional: a torch without one keeps that
//! op's nodes on Python.

use std::ffi::c_void;

use libloading::os::unix::Library;

use super::{arena, sym, Status};

type Raw = *mut c_void;

/// The unboxed signatures kwexport calls, by shape.
#[derive(Clone, Copy)]
pub enum ShimFn {
    /// `(Tensor self, Tensor other, double alpha) -> Tensor`: `add.Tensor`, `subtract.Tensor`.
    TensorTensorScalar(unsafe extern "C" fn(Raw, Raw, f64, *mut Raw) -> Status),
    /// `(Tensor self, double) -> Tensor`: `pow.Tensor_Scalar`.
    TensorScalar(unsafe extern "C" fn(Raw, f64, *mut Raw) -> Status),
    /// `(Tensor out, Tensor self, Tensor mat1, Tensor mat2, double beta, double alpha)`:
    /// `addmm.out`.
    AddmmOut(unsafe extern "C" fn(Raw, Raw, Raw, Raw, f64, f64) -> Status),
    /// `(Tensor self, Tensor other) -> Tensor`: `mul.Tensor`.
    TensorTensor(unsafe extern "C" fn(Raw, Raw, *mut Raw) -> Status),
    /// `(Tensor out, Tensor self, Tensor mat2)`: `mm.out`.
    MmOut(unsafe extern "C" fn(Raw, Raw, Raw) -> Status),
    /// `(Tensor input, Tensor weight, double eps)`: kwexport's own RMS norm
    /// (`kernels::rms_norm_f32`) for `rms_norm` on contiguous float32 CPU tensors.
    RmsNorm,
    /// `mkldnn::_convolution_pointwise`: oneDNN's convolution with a post-op.
    ConvPointwise(ConvPointwiseFn),
    /// `mkldnn::_convolution_pointwise.binary`: the same with a tensor added first.
    ConvPointwiseBinary(ConvPointwiseBinaryFn),
    /// `(Tensor input)`, with the approximation as a scalar (1 for tanh): kwexport's GELU
    /// (`kernels::gelu_f32`) on contiguous float32 CPU tensors.
    Gelu,
    /// `(Tensor input, Tensor weight, Tensor bias, double eps)`: kwexport's own layer norm
    /// (`kernels::layer_norm_f32`) on contiguous float32 CPU tensors.
    LayerNorm,
}

/// `aoti_torch_cpu_mkldnn__convolution_pointwise(X, W, B*, padding, len, stride, len,
/// dilation, len, groups, attr, scalars, len, algorithm*, out)`.
pub type ConvPointwiseFn = unsafe extern "C" fn(
    Raw,
    Raw,
    *mut Raw,
    *const i64,
    i64,
    *const i64,
    i64,
    *const i64,
    i64,
    i64,
    *const std::ffi::c_char,
    *const *const f64,
    i64,
    *const *const std::ffi::c_char,
    *mut Raw,
) -> Status;

/// The symbol of oneDNN's fused convolution, which `optimize="fast"` lowers convolutions
/// onto where torch exports it (`passes::conv_pointwise`).
pub const CONV_POINTWISE: &str = "aoti_torch_cpu_mkldnn__convolution_pointwise";

/// `aoti_torch_cpu_mkldnn__convolution_pointwise_binary(X, other, W, B*, padding, len, stride,
/// len, dilation, len, groups, binary_attr, alpha*, unary_attr*, unary_scalars, len,
/// unary_algorithm*, out)`.
pub type ConvPointwiseBinaryFn = unsafe extern "C" fn(
    Raw,
    Raw,
    Raw,
    *mut Raw,
    *const i64,
    i64,
    *const i64,
    i64,
    *const i64,
    i64,
    i64,
    *const std::ffi::c_char,
    *mut f64,
    *const *const std::ffi::c_char,
    *const *const f64,
    i64,
    *const *const std::ffi::c_char,
    *mut Raw,
) -> Status;

impl std::fmt::Debug for ShimFn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ShimFn::TensorTensorScalar(_) => "TensorTensorScalar",
            ShimFn::TensorScalar(_) => "TensorScalar",
            ShimFn::AddmmOut(_) => "AddmmOut",
            ShimFn::TensorTensor(_) => "TensorTensor",
            ShimFn::MmOut(_) => "MmOut",
            ShimFn::RmsNorm => "RmsNorm",
            ShimFn::ConvPointwise(_) => "ConvPointwise",
            ShimFn::ConvPointwiseBinary(_) => "ConvPointwiseBinary",
            ShimFn::Gelu => "Gelu",
            ShimFn::LayerNorm => "LayerNorm",
        })
    }
}

/// Which device a shim's kernels are for: the generated `cpu` family calls `at::cpu::*`
/// directly, so it must never see another device's tensor, and it skips what the dispatcher
/// adds (autograd, autocast): the run loop only uses it on calls where neither applies. The
/// `aten` family goes through the dispatcher.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Cpu,
    Aten,
}

/// The shims kwexport uses, each `None` where the running torch lacks it.
pub struct Shims {
    pub add_tensor: Option<ShimFn>,
    pub subtract_tensor: Option<ShimFn>,
    pub pow_tensor_scalar: Option<ShimFn>,
    pub addmm_out: Option<ShimFn>,
    pub mul_tensor: Option<ShimFn>,
    pub mm_out: Option<ShimFn>,
    /// kwexport's own kernels, where torch gives their data pointers.
    pub rms_norm: Option<ShimFn>,
    pub gelu: Option<ShimFn>,
    pub layer_norm: Option<ShimFn>,
    pub conv_pointwise: Option<ShimFn>,
    /// Its `binary` overload (`passes::conv_residual`).
    pub conv_pointwise_binary: Option<ShimFn>,
    get_data_ptr: Option<unsafe extern "C" fn(Raw, *mut *mut std::ffi::c_void) -> Status>,
    float32: Option<i32>,
    int64: Option<i32>,
    boolean: Option<i32>,
    get_dtype: unsafe extern "C" fn(Raw, *mut i32) -> Status,
    get_device_type: unsafe extern "C" fn(Raw, *mut i32) -> Status,
    get_device_index: unsafe extern "C" fn(Raw, *mut i32) -> Status,
    get_dim: unsafe extern "C" fn(Raw, *mut i64) -> Status,
    empty_strided: unsafe extern "C" fn(i64, *const i64, *const i64, i32, i32, i32, *mut Raw) -> Status,
    /// torch >= 2.11's `torch_from_blob` and the strided layout's code: outputs in
    /// [`arena`]'s blocks.
    from_blob: Option<(FromBlobFn, i32)>,
    copy: unsafe extern "C" fn(Raw, Raw, i32) -> Status,
    grad_mode_is_enabled: unsafe extern "C" fn() -> bool,
    /// The dtype codes a shim accepts: floating and complex.
    floating: Vec<i32>,
    cpu: i32,
}

/// Names of the symbols kwexport looks up, for the test that hides each in turn.
pub const SYMBOLS: [&str; 6] = [
    "aoti_torch_cpu_add_Tensor",
    "aoti_torch_aten_subtract_Tensor",
    "aoti_torch_cpu_pow_Tensor_Scalar",
    "aoti_torch_cpu_addmm_out",
    "aoti_torch_cpu_mul_Tensor",
    "aoti_torch_cpu_mm_out",
];

impl Shims {
    /// Resolves the shims from torch's library; `hidden` names symbols to treat as missing
    /// (`KWEXPORT_HIDE_SYMBOLS`, so tests can exercise each fallback). `None` if the tensor
    /// queries every shim needs are missing.
    ///
    /// # Safety
    /// `lib` must be torch's `libtorch_cpu.so`, whose symbols have the declared signatures.
    pub unsafe fn open(lib: &Library, hidden: &[String], floating: Vec<i32>) -> Option<Shims> {
        let cpu_code: unsafe extern "C" fn() -> i32 = sym(lib, hidden, "aoti_torch_device_type_cpu")?;
        Some(Shims {
            add_tensor: sym(lib, hidden, SYMBOLS[0]).map(ShimFn::TensorTensorScalar),
            subtract_tensor: sym(lib, hidden, SYMBOLS[1]).map(ShimFn::TensorTensorScalar),
            pow_tensor_scalar: sym(lib, hidden, SYMBOLS[2]).map(ShimFn::TensorScalar),
            addmm_out: sym(lib, hidden, SYMBOLS[3]).map(ShimFn::AddmmOut),
            mul_tensor: sym(lib, hidden, SYMBOLS[4]).map(ShimFn::TensorTensor),
            mm_out: sym(lib, hidden, SYMBOLS[5]).map(ShimFn::MmOut),
            rms_norm: sym::<unsafe extern "C" fn(Raw, *mut *mut std::ffi::c_void) -> Status>(
                lib,
                hidden,
                "aoti_torch_get_data_ptr",
            )
            .map(|_| ShimFn::RmsNorm),
            gelu: sym::<unsafe extern "C" fn(Raw, *mut *mut std::ffi::c_void) -> Status>(
                lib,
                hidden,
                "aoti_torch_get_data_ptr",
            )
            .map(|_| ShimFn::Gelu),
            layer_norm: sym::<unsafe extern "C" fn(Raw, *mut *mut std::ffi::c_void) -> Status>(
                lib,
                hidden,
                "aoti_torch_get_data_ptr",
            )
            .map(|_| ShimFn::LayerNorm),
            conv_pointwise: sym(lib, hidden, CONV_POINTWISE).map(ShimFn::ConvPointwise),
            conv_pointwise_binary: sym(lib, hidden, "aoti_torch_cpu_mkldnn__convolution_pointwise_binary")
                .map(ShimFn::ConvPointwiseBinary),
            get_data_ptr: sym(lib, hidden, "aoti_torch_get_data_ptr"),
            float32: sym::<unsafe extern "C" fn() -> i32>(lib, hidden, "aoti_torch_dtype_float32").map(|f| f()),
            int64: sym::<unsafe extern "C" fn() -> i32>(lib, hidden, "aoti_torch_dtype_int64").map(|f| f()),
            boolean: sym::<unsafe extern "C" fn() -> i32>(lib, hidden, "aoti_torch_dtype_bool").map(|f| f()),
            get_dtype: sym(lib, hidden, "aoti_torch_get_dtype")?,
            get_device_type: sym(lib, hidden, "aoti_torch_get_device_type")?,
            get_device_index: sym(lib, hidden, "aoti_torch_get_device_index")?,
            get_dim: sym(lib, hidden, "aoti_torch_get_dim")?,
            empty_strided: sym(lib, hidden, "aoti_torch_empty_strided")?,
            from_blob: sym::<FromBlobFn>(lib, hidden, "torch_from_blob")
                .zip(sym::<unsafe extern "C" fn() -> i32>(lib, hidden, "aoti_torch_layout_strided").map(|f| f()))
                .filter(|_| arena::limit() > 0),
            copy: sym(lib, hidden, "aoti_torch_copy_")?,
            grad_mode_is_enabled: sym(lib, hidden, "aoti_torch_grad_mode_is_enabled")?,
            floating,
            cpu: cpu_code(),
        })
    }

    /// Whether `t` is a float32 tensor.
    pub(crate) fn is_f32(&self, t: Raw) -> bool {
        self.float32.is_some() && self.dtype(t) == self.float32
    }

    /// `t`'s device as torch's codes: its type and index (-1 for a CPU tensor).
    pub(crate) fn device(&self, t: Raw) -> Option<(i32, i32)> {
        let (mut ty, mut index) = (0, 0);
        // SAFETY: a live handle and out-pointers.
        let ok = unsafe { (self.get_device_type)(t, &mut ty) == 0 && (self.get_device_index)(t, &mut index) == 0 };
        ok.then_some((ty, index))
    }

    pub(crate) fn dtype(&self, t: Raw) -> Option<i32> {
        let mut d = 0;
        // SAFETY: a live handle and an out-pointer.
        (unsafe { (self.get_dtype)(t, &mut d) } == 0).then_some(d)
    }

    /// Whether a shim of `family` may run on these tensors: on the CPU for the `cpu` family;
    /// with `floating`, all floating or complex (a `double` Scalar); with `same_dtype`, all
    /// of one dtype (in-place ops, where a promoted result would be cast back).
    ///
    /// # Safety
    /// Each of `tensors` must be a live handle.
    pub unsafe fn admits(&self, family: Family, tensors: &[Raw], floating: bool, same_dtype: bool) -> bool {
        let mut first = None;
        tensors.iter().all(|&t| {
            let mut device = 0;
            // SAFETY: a live handle and an out-pointer.
            let on_device = family == Family::Aten
                || (unsafe { (self.get_device_type)(t, &mut device) } == 0 && device == self.cpu);
            if !on_device {
                return false;
            }
            if !floating && !same_dtype {
                return true;
            }
            let Some(d) = self.dtype(t) else { return false };
            (!floating || self.floating.contains(&d)) && (!same_dtype || *first.get_or_insert(d) == d)
        })
    }

    /// The number of dimensions of `t`.
    ///
    /// # Safety
    /// `t` must be a live handle.
    pub unsafe fn dim(&self, t: Raw) -> Option<i64> {
        let mut d = 0;
        (unsafe { (self.get_dim)(t, &mut d) } == 0).then_some(d)
    }

    /// A new empty tensor with `like`'s dtype and device, for an `out=` shim to resize.
    ///
    /// # Safety
    /// `like` must be a live handle.
    pub unsafe fn empty_like(&self, like: Raw) -> Result<Raw, Status> {
        let dtype = self.dtype(like).ok_or(1)?;
        let (mut device, mut index) = (0, 0);
        let mut out: Raw = std::ptr::null_mut();
        let (size, stride) = ([0i64], [1i64]);
        // SAFETY: live handle, out-pointers, one-dimensional size and stride arrays.
        unsafe {
            check((self.get_device_type)(like, &mut device))?;
            check((self.get_device_index)(like, &mut index))?;
            check((self.empty_strided)(1, size.as_ptr(), stride.as_ptr(), dtype, device, index, &mut out))?;
        }
        Ok(out)
    }

    /// Whether autograd records ops on this thread.
    pub fn grad_mode(&self) -> bool {
        // SAFETY: reads a thread-local flag.
        unsafe { (self.grad_mode_is_enabled)() }
    }

    /// The address of a tensor's first element.
    ///
    /// # Safety
    /// `t` must be a live handle.
    pub unsafe fn data_ptr(&self, t: Raw) -> Option<*mut std::ffi::c_void> {
        let f = self.get_data_ptr?;
        let mut p = std::ptr::null_mut();
        (unsafe { f(t, &mut p) } == 0).then_some(p)
    }

    /// Whether `t` is a CPU tensor (of any dtype).
    ///
    /// # Safety
    /// `t` must be a live handle.
    pub unsafe fn is_cpu(&self, t: Raw) -> bool {
        let mut device = 0;
        // SAFETY: a live handle and an out-pointer.
        unsafe { (self.get_device_type)(t, &mut device) == 0 && device == self.cpu }
    }

    /// Whether `t` is a float32 CPU tensor.
    ///
    /// # Safety
    /// `t` must be a live handle.
    pub unsafe fn is_cpu_f32(&self, t: Raw) -> bool {
        // SAFETY: the caller's live handle.
        unsafe { self.is_cpu_of(t, self.float32) }
    }

    /// Whether `t` is an int64 CPU tensor.
    ///
    /// # Safety
    /// `t` must be a live handle.
    pub unsafe fn is_cpu_i64(&self, t: Raw) -> bool {
        // SAFETY: the caller's live handle.
        unsafe { self.is_cpu_of(t, self.int64) }
    }

    /// Whether `t` is a bool CPU tensor.
    ///
    /// # Safety
    /// `t` must be a live handle.
    pub unsafe fn is_cpu_bool(&self, t: Raw) -> bool {
        // SAFETY: the caller's live handle.
        unsafe { self.is_cpu_of(t, self.boolean) }
    }

    /// Whether `t` is a CPU tensor of dtype code `dtype` (`None`: a dtype torch lacks).
    ///
    /// # Safety
    /// `t` must be a live handle.
    unsafe fn is_cpu_of(&self, t: Raw, dtype: Option<i32>) -> bool {
        let mut device = 0;
        // SAFETY: a live handle and an out-pointer.
        let on_cpu = unsafe { (self.get_device_type)(t, &mut device) } == 0 && device == self.cpu;
        on_cpu && dtype.is_some() && self.dtype(t) == dtype
    }

    /// A new contiguous CPU float32 tensor of these sizes.
    pub fn empty_f32(&self, sizes: &[i64]) -> Result<Raw, Status> {
        self.empty_contiguous(sizes, self.float32.ok_or(1)?)
    }

    /// A new contiguous CPU int64 tensor of these sizes.
    pub fn empty_i64(&self, sizes: &[i64]) -> Result<Raw, Status> {
        self.empty_contiguous(sizes, self.int64.ok_or(1)?)
    }

    /// A new CPU float32 tensor of these sizes and strides (a channels-last output).
    pub fn empty_f32_strided(&self, sizes: &[i64], strides: &[i64]) -> Result<Raw, Status> {
        self.empty_cpu(sizes, strides, self.float32.ok_or(1)?, 4)
    }

    fn empty_contiguous(&self, sizes: &[i64], dtype: i32) -> Result<Raw, Status> {
        let width = if Some(dtype) == self.int64 { 8 } else { 4 };
        self.empty_cpu(sizes, &crate::views::contiguous_strides(sizes), dtype, width)
    }

    /// A new CPU tensor for a kernel's output (`width` bytes an element): over a block of
    /// kwexport's arena (`arena`) where it is large enough to be worth one and the arena has
    /// room, else from torch's allocator.
    fn empty_cpu(&self, sizes: &[i64], strides: &[i64], dtype: i32, width: usize) -> Result<Raw, Status> {
        if sizes.len() != strides.len() {
            return Err(1);
        }
        let mut out: Raw = std::ptr::null_mut();
        let bytes = storage_elements(sizes, strides).map(|e| e.saturating_mul(width));
        let block = match (self.from_blob, bytes) {
            (Some(f), Some(bytes)) if bytes >= arena::MIN_BYTES && arena::here() => arena::take(bytes).map(|b| (f, b)),
            _ => None,
        };
        if let Some(((from_blob, strided), (data, size))) = block {
            // SAFETY: `data` is a block of `size` >= the storage's bytes; arrays of
            // `sizes.len()` elements; the deleter frees the block once torch is done with the
            // storage, and only then.
            let status = unsafe {
                from_blob(
                    data,
                    sizes.len() as i64,
                    sizes.as_ptr(),
                    strides.as_ptr(),
                    0,
                    dtype,
                    self.cpu,
                    -1, // torch's CPU device has no index; `from_blob` checks it
                    &mut out,
                    strided,
                    std::ptr::null(),
                    0,
                    Some(arena::give_back),
                    size as *mut c_void,
                )
            };
            if status != 0 {
                // SAFETY: torch took no ownership of the block it refused.
                unsafe { arena::give_back(data, size as *mut c_void) };
                return Err(status);
            }
            return Ok(out);
        }
        // SAFETY: arrays of `sizes.len()` elements and an out-pointer.
        check(unsafe {
            (self.empty_strided)(sizes.len() as i64, sizes.as_ptr(), strides.as_ptr(), dtype, self.cpu, 0, &mut out)
        })?;
        Ok(out)
    }

    /// `dst.copy_(src)`.
    ///
    /// # Safety
    /// Both must be live handles.
    pub unsafe fn copy(&self, dst: Raw, src: Raw) -> Status {
        // SAFETY: two live handles.
        unsafe { (self.copy)(dst, src, 0) }
    }
}

/// `torch_from_blob(data, ndim, sizes, strides, storage_offset, dtype, device_type,
/// device_index, out, layout, opaque_metadata, opaque_metadata_size, deleter, deleter_ctx)`.
type FromBlobFn = unsafe extern "C" fn(
    Raw,
    i64,
    *const i64,
    *const i64,
    i64,
    i32,
    i32,
    i32,
    *mut Raw,
    i32,
    *const u8,
    i64,
    Option<unsafe extern "C" fn(Raw, Raw)>,
    Raw,
) -> Status;

/// The elements a dense-or-strided tensor's storage spans; `None` for an empty tensor or
/// a negative size or stride.
fn storage_elements(sizes: &[i64], strides: &[i64]) -> Option<usize> {
    let mut last = 0usize;
    for (&size, &stride) in sizes.iter().zip(strides) {
        let (size, stride) = (usize::try_from(size).ok()?, usize::try_from(stride).ok()?);
        last = last.checked_add(size.checked_sub(1)?.checked_mul(stride)?)?;
    }
    last.checked_add(1)
}

fn check(status: Status) -> Result<(), Status> {
    if status == 0 {
        Ok(())
    } else {
        Err(status)
    }
}
