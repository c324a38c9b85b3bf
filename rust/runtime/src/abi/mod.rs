//! torch's stable C ABI (`torch/csrc/stable/c/shim.h`), resolved at run time from the
//! libtorch that the running `torch` module has already loaded: the last stage, which the
//! others build on. It depends on nothing of the runtime's, only on the core's tables.
//!
//! kwexport is not built against torch headers: the symbols are looked up by name in
//! `libtorch_cpu.so`, opened with `RTLD_NOLOAD` so that nothing new is ever loaded (the path
//! comes from the imported `torch` module, never from a file). If any symbol is missing (a
//! torch older than 2.13: 2.11 lacks `torch_new_stable_ivalue`), the ABI is unavailable and
//! every node runs through Python.
//!
//! - `arena`   the memory kwexport's kernels write their CPU outputs to
//! - `types`   the schema types the dispatcher converts
//! - `encode`  values on the C path: how arguments are encoded and returns decoded
//! - `shims`   per-op C entry points that take a `Scalar` as a `double`
//! - `parallel` torch's intra-op thread pool

pub mod arena;
pub mod encode;
pub mod parallel;
pub mod shims;
pub mod types;

use std::ffi::{c_char, c_void, CStr};
use std::sync::OnceLock;

use kwexport_core::tables::{DTYPES, LAYOUTS, MEMORY_FORMATS};
use libloading::os::unix::Library;
use pyo3::prelude::*;
use pyo3::types::PyList;

pub use shims::Shims;
pub use types::Ty;

/// A failure on the C path: torch's message, or a broken kwexport invariant. The run loop
/// adds the op's name.
#[derive(Debug)]
pub enum CError {
    /// torch raised; its message without the backtrace.
    Torch(String),
    /// A node's Python fallback raised: passed on as it is, as the Python path would.
    Python(PyErr),
    /// A value of the wrong kind reached a node: a bug in kwexport.
    Internal(String),
}

/// One slot of a dispatcher stack; what it holds depends on the schema type.
pub type StableIValue = u64;
pub(crate) type Raw = *mut c_void;
pub(crate) type Status = i32; // AOTITorchError: 0 is success

/// The functions kwexport calls, with the codes torch uses for enum-like arguments.
pub struct Abi {
    call_dispatcher: unsafe extern "C" fn(*const c_char, *const c_char, *mut StableIValue, u64) -> Status,
    new_tensor_handle: unsafe extern "C" fn(Raw, *mut Raw) -> Status,
    delete_tensor: unsafe extern "C" fn(Raw) -> Status,
    new_list: unsafe extern "C" fn(usize, *mut Raw) -> Status,
    list_push_back: unsafe extern "C" fn(Raw, StableIValue) -> Status,
    list_size: unsafe extern "C" fn(Raw, *mut usize) -> Status,
    list_get_item: unsafe extern "C" fn(Raw, usize, *mut StableIValue) -> Status,
    delete_list: unsafe extern "C" fn(Raw) -> Status,
    new_stable_ivalue: unsafe extern "C" fn(*mut *mut StableIValue) -> Status,
    delete_stable_ivalue: unsafe extern "C" fn(*mut StableIValue) -> Status,
    new_string: unsafe extern "C" fn(*const c_char, usize, *mut Raw) -> Status,
    delete_string: unsafe extern "C" fn(Raw) -> Status,
    parse_device: unsafe extern "C" fn(*const c_char, *mut u32, *mut i32) -> Status,
    exception_what: unsafe extern "C" fn() -> *const c_char,
    /// `(name, code)` for dtypes, layouts and memory formats, named as in `torch`.
    dtypes: Vec<(&'static str, i32)>,
    layouts: Vec<(&'static str, i32)>,
    memory_formats: Vec<(&'static str, i32)>,
    /// The running torch's `TORCH_ABI_VERSION`: stacks are built for its schemas.
    version: u64,
    /// The per-op shims for nodes with a `Scalar`; `None` without the tensor queries.
    pub shims: Option<Shims>,
    /// torch's intra-op thread pool, where the running torch exports it.
    pub pool: Option<parallel::TorchPool>,
    /// torch >= 2.14's C conversions between Python tensors and handles (GIL held), which
    /// save a Python call per tensor over `torch._C._aoti`'s below.
    from_pyobject: Option<unsafe extern "C" fn(Raw, *mut Raw) -> Status>,
    reinterpret: Option<unsafe extern "C" fn(Raw, i64, *const i64, *const i64, i64, *mut Raw) -> Status>,
    /// A tensor's sizes and strides, for views made with `reinterpret`.
    geometry: Option<Geometry>,
    /// A tensor's layout and storage, for the input checks.
    storage: Option<StorageQueries>,
    to_pyobject: Option<unsafe extern "C" fn(Raw, Raw, *mut Raw) -> Status>,
    /// `torch._C._aoti`'s conversions: a tensor to a new handle; handles to tensors.
    to_handle: Py<PyAny>,
    to_tensors: Py<PyAny>,
    _lib: Library,
}

static ABI: OnceLock<Option<Abi>> = OnceLock::new();

/// Queries of a tensor's shape in memory (borrowed arrays of its `dim` elements).
struct Geometry {
    sizes: unsafe extern "C" fn(Raw, *mut *mut i64) -> Status,
    strides: unsafe extern "C" fn(Raw, *mut *mut i64) -> Status,
}

/// Queries of where a tensor's elements live.
struct StorageQueries {
    layout: unsafe extern "C" fn(Raw, *mut i32) -> Status,
    /// torch's code for the strided layout.
    strided: i32,
    nbytes: unsafe extern "C" fn(Raw, *mut i64) -> Status,
    offset: unsafe extern "C" fn(Raw, *mut i64) -> Status,
}

/// Whether a tensor's elements are where its sizes and strides say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Storage {
    /// Strided, and its storage holds every element its view reads.
    Fits,
    /// Not strided (sparse, mkldnn, ...).
    NotStrided,
    /// Its view reaches past the end of its storage, which has this many bytes.
    TooSmall { needs: i64, has: i64 },
}

/// A symbol of torch's library, unless `hidden` names it.
///
/// # Safety
/// `T` must be the symbol's type as torch's headers declare it.
pub(crate) unsafe fn sym<T: Copy>(lib: &Library, hidden: &[String], name: &str) -> Option<T> {
    if hidden.iter().any(|h| h == name) {
        return None;
    }
    lib.get::<T>(name.as_bytes()).ok().map(|s| *s)
}

/// torch's codes for the floating and complex dtypes of the core's table.
fn floating_codes(dtypes: &[(&'static str, i32)]) -> Vec<i32> {
    dtypes
        .iter()
        .filter(|(n, _)| n.starts_with("float") || n.starts_with("bfloat") || n.starts_with("complex"))
        .map(|(_, c)| *c)
        .collect()
}

impl Abi {
    /// The ABI of the running torch, resolved on first use; `None` where it is unavailable.
    pub fn get(py: Python<'_>) -> Option<&'static Abi> {
        if let Some(abi) = ABI.get() {
            return abi.as_ref();
        }
        let abi = Abi::open(py).ok().flatten();
        ABI.get_or_init(|| abi).as_ref()
    }

    fn open(py: Python<'_>) -> PyResult<Option<Abi>> {
        let torch = py.import("torch")?;
        let dir: std::path::PathBuf =
            py.import("os.path")?.call_method1("dirname", (torch.getattr("__file__")?,))?.extract()?;
        let (major, minor): (u64, u64) = {
            let v = torch.getattr("__version__")?.str()?.to_string();
            let mut parts = v.split(['.', '+', 'a', 'b', 'r']).map(|p| p.parse::<u64>().ok());
            match (parts.next().flatten(), parts.next().flatten()) {
                (Some(a), Some(b)) => (a, b),
                _ => return Ok(None),
            }
        };
        let path = dir.join("lib").join("libtorch_cpu.so");
        // SAFETY: RTLD_NOLOAD only returns a library the process has already loaded (torch's
        // own), so no initialiser runs.
        let lib = match unsafe { Library::open(Some(&path), libc::RTLD_NOW | libc::RTLD_NOLOAD) } {
            Ok(lib) => lib,
            Err(_) => return Ok(None),
        };
        // Symbols to treat as missing, so tests can exercise each fallback on one torch.
        let hidden: Vec<String> = std::env::var("KWEXPORT_HIDE_SYMBOLS")
            .map(|v| v.split(',').map(str::to_owned).collect())
            .unwrap_or_default();
        let hidden = hidden.as_slice();
        let code = |name: String| -> Option<i32> {
            // SAFETY: `aoti_torch_<kind>_<name>()` takes nothing and returns the code.
            unsafe { sym::<unsafe extern "C" fn() -> i32>(&lib, hidden, &name).map(|f| f()) }
        };
        let dtypes = DTYPES
            .iter()
            .map(|d| Some((d.name, code(format!("aoti_torch_dtype_{}", d.name))?)))
            .collect::<Option<Vec<_>>>();
        let layouts =
            LAYOUTS.iter().map(|l| Some((*l, code(format!("aoti_torch_layout_{l}"))?))).collect::<Option<Vec<_>>>();
        let memory_formats = MEMORY_FORMATS
            .iter()
            .map(|m| Some((*m, code(format!("aoti_torch_memory_format_{m}"))?)))
            .collect::<Option<Vec<_>>>();
        let (Some(dtypes), Some(layouts), Some(memory_formats)) = (dtypes, layouts, memory_formats) else {
            return Ok(None);
        };
        // The conversions between Python tensors and handles must exist too.
        let Ok(aoti) = py.import("torch._C._aoti") else {
            return Ok(None);
        };
        let (Ok(to_handle), Ok(to_tensors)) = (
            aoti.getattr("unsafe_alloc_void_ptr_from_tensor"),
            aoti.getattr("alloc_tensors_by_stealing_from_void_ptrs"),
        ) else {
            return Ok(None);
        };
        if major < 2 || (major == 2 && minor < 10) {
            return Ok(None);
        }
        // SAFETY: as for `sym` above.
        Ok(unsafe {
            (|| {
                Some(Abi {
                    call_dispatcher: sym(&lib, hidden, "torch_call_dispatcher")?,
                    new_tensor_handle: sym(&lib, hidden, "aoti_torch_new_tensor_handle")?,
                    delete_tensor: sym(&lib, hidden, "aoti_torch_delete_tensor_object")?,
                    new_list: sym(&lib, hidden, "torch_new_list_reserve_size")?,
                    list_push_back: sym(&lib, hidden, "torch_list_push_back")?,
                    list_size: sym(&lib, hidden, "torch_list_size")?,
                    list_get_item: sym(&lib, hidden, "torch_list_get_item")?,
                    delete_list: sym(&lib, hidden, "torch_delete_list")?,
                    new_stable_ivalue: sym(&lib, hidden, "torch_new_stable_ivalue")?,
                    delete_stable_ivalue: sym(&lib, hidden, "torch_delete_stable_ivalue")?,
                    new_string: sym(&lib, hidden, "torch_new_string_handle")?,
                    delete_string: sym(&lib, hidden, "torch_delete_string")?,
                    parse_device: sym(&lib, hidden, "torch_parse_device_string")?,
                    exception_what: sym(&lib, hidden, "torch_exception_get_what_without_backtrace")?,
                    shims: Shims::open(&lib, hidden, floating_codes(&dtypes)),
                    pool: parallel::TorchPool::open(&lib, hidden),
                    from_pyobject: sym(&lib, hidden, "torch_tensor_from_pyobject"),
                    reinterpret: sym(&lib, hidden, "aoti_torch__reinterpret_tensor"),
                    geometry: (|| {
                        Some(Geometry {
                            sizes: sym(&lib, hidden, "aoti_torch_get_sizes")?,
                            strides: sym(&lib, hidden, "aoti_torch_get_strides")?,
                        })
                    })(),
                    storage: (|| {
                        Some(StorageQueries {
                            layout: sym(&lib, hidden, "aoti_torch_get_layout")?,
                            strided: layouts.iter().find(|(n, _)| *n == "strided")?.1,
                            nbytes: sym(&lib, hidden, "aoti_torch_get_storage_size")?,
                            offset: sym(&lib, hidden, "aoti_torch_get_storage_offset")?,
                        })
                    })(),
                    to_pyobject: sym(&lib, hidden, "torch_tensor_to_pyobject"),
                    dtypes,
                    layouts,
                    memory_formats,
                    version: (major << 56) | (minor << 48),
                    to_handle: to_handle.unbind(),
                    to_tensors: to_tensors.unbind(),
                    _lib: lib,
                })
            })()
        })
    }

    /// torch's code for a dtype of the core's table.
    pub fn dtype_code(&self, name: &str) -> Option<i32> {
        self.dtypes.iter().find(|(n, _)| *n == name).map(|(_, c)| *c)
    }

    /// torch's code for a layout of the core's table.
    pub fn layout_code(&self, name: &str) -> Option<i32> {
        self.layouts.iter().find(|(n, _)| *n == name).map(|(_, c)| *c)
    }

    /// torch's code for a memory format of the core's table.
    pub fn memory_format_code(&self, name: &str) -> Option<i32> {
        self.memory_formats.iter().find(|(n, _)| *n == name).map(|(_, c)| *c)
    }

    /// Whether `code` is one of torch's codes for the enum type `ty`.
    pub fn is_code(&self, ty: &Ty, code: i64) -> bool {
        let table = match ty {
            Ty::ScalarType => &self.dtypes,
            Ty::Layout => &self.layouts,
            Ty::MemoryFormat => &self.memory_formats,
            _ => return false,
        };
        table.iter().any(|(_, c)| i64::from(*c) == code)
    }

    /// A device string as torch's codes (type, index), as [`Abi::tensor_meta`] reads a
    /// tensor's: a CPU device's index is -1.
    pub fn device_code(&self, device: &str) -> Option<(i32, i32)> {
        let s = std::ffi::CString::new(device).ok()?;
        let (mut ty, mut index) = (0u32, 0i32);
        // SAFETY: valid C string and out-pointers.
        let status = unsafe { (self.parse_device)(s.as_ptr(), &mut ty, &mut index) };
        (status == 0).then_some((ty as i32, if ty == 0 { -1 } else { index.max(0) }))
    }

    /// A tensor's dtype code, device codes (as [`Abi::device_code`]) and sizes, through
    /// torch's C queries; `None` where one fails or this torch lacks them (a nested tensor's
    /// sizes, say): the caller then asks Python.
    pub fn tensor_meta(&self, t: &Tensor) -> Option<(i32, (i32, i32), Vec<i64>)> {
        let shims = self.shims.as_ref()?;
        let (dtype, device) = (shims.dtype(t.0)?, shims.device(t.0)?);
        // SAFETY: a live handle.
        let (sizes, _) = unsafe { self.sizes_strides(t.0) }?;
        Some((dtype, device, sizes))
    }

    /// A device string as the dispatcher's packed form: index in the low 32 bits, type above.
    pub fn device_bits(&self, device: &str) -> Option<StableIValue> {
        let s = std::ffi::CString::new(device).ok()?;
        let (mut ty, mut index) = (0u32, 0i32);
        // SAFETY: valid C string and out-pointers.
        let status = unsafe { (self.parse_device)(s.as_ptr(), &mut ty, &mut index) };
        (status == 0).then_some(((ty as u8 as i8 as i64 as u64) << 32) | (index as u32 as u64))
    }

    /// Calls `op`.`overload` (`""` for `default`) on `stack`, which holds the arguments on
    /// entry (their owned parts are consumed) and the returns on success.
    ///
    /// # Safety
    /// `stack` must hold one correctly encoded value per schema argument and have room for
    /// every return.
    pub unsafe fn call(&self, op: &CStr, overload: &CStr, stack: &mut [StableIValue]) -> Result<(), CError> {
        self.check((self.call_dispatcher)(op.as_ptr(), overload.as_ptr(), stack.as_mut_ptr(), self.version))
    }

    fn last_error(&self) -> CError {
        // SAFETY: a thread-local string owned by torch, valid until the next exception.
        let what = unsafe { (self.exception_what)() };
        CError::Torch(if what.is_null() {
            "torch reported an error with no message".to_owned()
        } else {
            // SAFETY: non-null, NUL-terminated.
            unsafe { CStr::from_ptr(what) }.to_string_lossy().into_owned()
        })
    }

    /// torch's error for a failed status.
    pub fn status(&self, status: Status) -> Result<(), CError> {
        self.check(status)
    }

    fn check(&self, status: Status) -> Result<(), CError> {
        if status == 0 {
            Ok(())
        } else {
            Err(self.last_error())
        }
    }

    /// A new owning handle to the same tensor (a reference-count bump).
    pub fn share(&self, t: &Tensor) -> Result<StableIValue, CError> {
        let mut out: Raw = std::ptr::null_mut();
        // SAFETY: `t` is a live handle.
        self.check(unsafe { (self.new_tensor_handle)(t.0, &mut out) })?;
        Ok(out as StableIValue)
    }

    /// Takes ownership of a tensor handle returned on a stack.
    pub fn adopt(&self, bits: StableIValue) -> Tensor {
        Tensor(bits as Raw, self.delete_tensor)
    }

    pub fn new_list(&self, items: &[StableIValue]) -> Result<StableIValue, CError> {
        let mut list: Raw = std::ptr::null_mut();
        // SAFETY: out-pointer; then pushes onto the list just made.
        unsafe {
            self.check((self.new_list)(items.len(), &mut list))?;
            for &item in items {
                if let Err(e) = self.check((self.list_push_back)(list, item)) {
                    (self.delete_list)(list);
                    return Err(e);
                }
            }
        }
        Ok(list as StableIValue)
    }

    /// The items of a list returned on a stack; the list itself is freed, its items are
    /// the caller's.
    ///
    /// # Safety
    /// `bits` must be an owned list handle.
    pub unsafe fn take_list(&self, bits: StableIValue) -> Result<Vec<StableIValue>, CError> {
        let list = bits as Raw;
        let mut n = 0usize;
        self.check((self.list_size)(list, &mut n))?;
        let mut items = vec![0; n];
        for (i, item) in items.iter_mut().enumerate() {
            self.check((self.list_get_item)(list, i, item))?;
        }
        self.check((self.delete_list)(list))?;
        Ok(items)
    }

    /// `Some(value)` for an optional argument: a heap cell the dispatcher frees.
    pub fn boxed(&self, value: StableIValue) -> Result<StableIValue, CError> {
        let mut cell: *mut StableIValue = std::ptr::null_mut();
        // SAFETY: out-pointer, then a write to the cell torch allocated.
        unsafe {
            self.check((self.new_stable_ivalue)(&mut cell))?;
            *cell = value;
        }
        Ok(cell as StableIValue)
    }

    pub fn new_string(&self, s: &str) -> Result<StableIValue, CError> {
        let mut out: Raw = std::ptr::null_mut();
        // SAFETY: pointer and length of a live byte slice.
        self.check(unsafe { (self.new_string)(s.as_ptr().cast(), s.len(), &mut out) })?;
        Ok(out as StableIValue)
    }

    /// Frees the owned parts of an encoded value that never reached the dispatcher.
    ///
    /// # Safety
    /// `bits` must have been encoded for `ty` and not yet consumed.
    pub unsafe fn release(&self, ty: &Ty, bits: StableIValue) {
        match ty {
            Ty::Tensor => {
                (self.delete_tensor)(bits as Raw);
            }
            Ty::Str => {
                (self.delete_string)(bits as Raw);
            }
            Ty::Optional(inner) if bits != 0 => {
                let cell = bits as *mut StableIValue;
                self.release(inner, *cell);
                (self.delete_stable_ivalue)(cell);
            }
            Ty::List(inner) => {
                if let Ok(items) = self.take_list(bits) {
                    for item in items {
                        self.release(inner, item);
                    }
                }
            }
            _ => {}
        }
    }

    /// Whether [`Abi::storage`] is available.
    pub fn can_query_storage(&self) -> bool {
        self.storage.is_some() && self.geometry.is_some()
    }

    /// Whether [`Abi::reinterpret`] is available.
    pub fn can_reinterpret(&self) -> bool {
        self.reinterpret.is_some()
    }

    /// A new tensor over `base`'s storage with these sizes and strides, starting `offset`
    /// elements after `base` starts (torch's shim header names it the storage offset, but it
    /// is added to `base`'s): not an autograd view of `base`, so it is a leaf of its own.
    pub fn reinterpret(&self, base: &Tensor, sizes: &[i64], strides: &[i64], offset: i64) -> Result<Tensor, CError> {
        // SAFETY: `base` is a live owning handle.
        unsafe { self.reinterpret_raw(base.0, sizes, strides, offset) }
    }

    /// [`Abi::reinterpret`] of a borrowed handle.
    ///
    /// # Safety
    /// `base` must be a live handle.
    pub(crate) unsafe fn reinterpret_raw(
        &self,
        base: Raw,
        sizes: &[i64],
        strides: &[i64],
        offset: i64,
    ) -> Result<Tensor, CError> {
        let f = self.reinterpret.ok_or_else(|| CError::Internal("no _reinterpret_tensor".into()))?;
        if sizes.len() != strides.len() {
            return Err(CError::Internal("sizes and strides differ in length".into()));
        }
        let mut out: Raw = std::ptr::null_mut();
        // SAFETY: a live handle, arrays of `sizes.len()` elements, an out-pointer.
        self.check(unsafe { f(base, sizes.len() as i64, sizes.as_ptr(), strides.as_ptr(), offset, &mut out) })?;
        Ok(Tensor(out, self.delete_tensor))
    }

    /// A contiguous tensor of at least 3 dimensions as the matrix `[product of the leading
    /// sizes, last size]` over the same memory, with its leading sizes: how `at::linear` and
    /// `at::matmul` fold such an input into one `mm`/`addmm`. `None` for other tensors, or
    /// where the running torch lacks the calls.
    ///
    /// # Safety
    /// `t` must be a live handle.
    pub unsafe fn fold_leading(&self, t: Raw) -> Option<(Tensor, Vec<i64>)> {
        // SAFETY: the caller's live handle.
        let sizes = unsafe { self.contiguous_sizes(t) }.filter(|s| s.len() >= 3)?;
        let (last, leading) = sizes.split_last()?;
        let rows: i64 = leading.iter().product();
        if rows == 0 || *last == 0 {
            return None;
        }
        // SAFETY: a live handle.
        let matrix = unsafe { self.reinterpret_raw(t, &[rows, *last], &[*last, 1], 0) }.ok()?;
        Some((matrix, leading.to_vec()))
    }

    /// A contiguous matrix `[rows, n]` as `[leading..., n]` over the same memory.
    pub fn unfold_leading(&self, t: &Tensor, leading: &[i64], n: i64) -> Result<Tensor, CError> {
        let mut sizes = leading.to_vec();
        sizes.push(n);
        self.reinterpret(t, &sizes, &crate::views::contiguous_strides(&sizes), 0)
    }

    /// A tensor's sizes and strides (`None` where the running torch lacks the queries).
    ///
    /// # Safety
    /// `t` must be a live handle.
    pub unsafe fn sizes_strides(&self, t: Raw) -> Option<(Vec<i64>, Vec<i64>)> {
        let (g, shims) = (self.geometry.as_ref()?, self.shims.as_ref()?);
        let n = usize::try_from(unsafe { shims.dim(t) }?).ok()?;
        if n == 0 {
            return Some((Vec::new(), Vec::new()));
        }
        let (mut sizes, mut strides) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: a live handle and out-pointers; the arrays are borrowed from the tensor and
        // have `n` elements.
        unsafe {
            if (g.sizes)(t, &mut sizes) != 0 || (g.strides)(t, &mut strides) != 0 {
                return None;
            }
            Some((std::slice::from_raw_parts(sizes, n).to_vec(), std::slice::from_raw_parts(strides, n).to_vec()))
        }
    }

    /// A contiguous tensor's sizes (`None` where it isn't contiguous, or the running torch
    /// lacks the queries).
    ///
    /// # Safety
    /// `t` must be a live handle.
    pub unsafe fn contiguous_sizes(&self, t: Raw) -> Option<Vec<i64>> {
        // SAFETY: the caller's live handle.
        let (sizes, strides) = unsafe { self.sizes_strides(t) }?;
        crate::views::is_contiguous(&sizes, &strides).then_some(sizes)
    }

    /// The size of dimension `d` of a tensor.
    ///
    /// # Safety
    /// `t` must be a live handle with more than `d` dimensions.
    pub unsafe fn size(&self, t: Raw, d: usize) -> Option<i64> {
        let g = self.geometry.as_ref()?;
        let mut sizes = std::ptr::null_mut();
        // SAFETY: a live handle; the array is borrowed from it and has more than `d` elements.
        unsafe { ((g.sizes)(t, &mut sizes) == 0).then(|| *sizes.add(d)) }
    }

    /// `t.t()` for a 2-D tensor, as a tensor of its own over the same memory: the view
    /// without a Python call or the dispatcher. `None` for another number of dimensions, or
    /// where the running torch lacks the calls (the shims' tensor queries included).
    pub fn transpose_2d(&self, t: &Tensor) -> Option<Tensor> {
        let (g, shims) = (self.geometry.as_ref()?, self.shims.as_ref()?);
        let (mut sizes, mut strides) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: a live handle and out-pointers; the arrays are borrowed from the tensor,
        // which outlives their use here, and have two elements.
        let (sizes, strides) = unsafe {
            let ok =
                shims.dim(t.0) == Some(2) && (g.sizes)(t.0, &mut sizes) == 0 && (g.strides)(t.0, &mut strides) == 0;
            if !ok {
                return None;
            }
            ([*sizes.add(1), *sizes], [*strides.add(1), *strides])
        };
        self.reinterpret(t, &sizes, &strides, 0).ok()
    }

    /// Where a tensor's elements live, checked against its view: a tensor whose storage was
    /// resized under it (`x.untyped_storage().resize_(0)`) would have kernels read and write
    /// past its end (eager crashes too). `None` where the running torch lacks the queries.
    pub fn storage(&self, t: &Tensor, sizes: &[i64], itemsize: i64) -> Option<Storage> {
        let (q, g) = (self.storage.as_ref()?, self.geometry.as_ref()?);
        let (mut layout, mut nbytes, mut offset) = (0, 0, 0);
        let mut strides = std::ptr::null_mut();
        // SAFETY: a live handle and out-pointers; `strides` is borrowed from the tensor, which
        // outlives its use here, and has as many elements as its sizes (`sizes`, read by the
        // caller from the same tensor).
        unsafe {
            if (q.layout)(t.0, &mut layout) != 0 {
                return None;
            }
            if layout != q.strided {
                return Some(Storage::NotStrided);
            }
            if sizes.contains(&0) {
                return Some(Storage::Fits);
            }
            let ok = (q.nbytes)(t.0, &mut nbytes) == 0
                && (q.offset)(t.0, &mut offset) == 0
                && (g.strides)(t.0, &mut strides) == 0;
            if !ok {
                return None;
            }
            let strides = if sizes.is_empty() { &[][..] } else { std::slice::from_raw_parts(strides, sizes.len()) };
            Some(storage_fits(sizes, strides, offset, itemsize, nbytes))
        }
    }

    /// An owning handle to a Python tensor.
    pub fn handle_of(&self, t: &Bound<'_, PyAny>) -> PyResult<Tensor> {
        if let Some(from_pyobject) = self.from_pyobject {
            let mut out: Raw = std::ptr::null_mut();
            // SAFETY: a live Python object, the GIL held; torch returns a new handle.
            let status = unsafe { from_pyobject(t.as_ptr().cast(), &mut out) };
            self.check(status).map_err(|e| to_pyerr(e, "converting a tensor for the C path"))?;
            return Ok(Tensor(out, self.delete_tensor));
        }
        let cap = self.to_handle.bind(t.py()).call1((t,))?;
        // SAFETY: torch's capsule is unnamed and holds a new `at::Tensor*`.
        let ptr = unsafe { pyo3::ffi::PyCapsule_GetPointer(cap.as_ptr(), std::ptr::null()) };
        if ptr.is_null() {
            return Err(PyErr::fetch(t.py()));
        }
        Ok(Tensor(ptr, self.delete_tensor))
    }

    /// Python tensors for handles, in one call; torch takes the handles over. A tensor that
    /// already has a Python object gets that same object back.
    pub fn tensors_of<'py>(&self, py: Python<'py>, handles: Vec<Tensor>) -> PyResult<Bound<'py, PyList>> {
        if let Some(to_pyobject) = self.to_pyobject {
            let list = PyList::empty(py);
            for h in handles {
                let mut obj: Raw = std::ptr::null_mut();
                // SAFETY: a live handle, the GIL held; torch returns a new reference (the
                // handle stays ours and is deleted when `h` drops).
                let status = unsafe { to_pyobject(h.0, std::ptr::null_mut(), &mut obj) };
                self.check(status).map_err(|e| to_pyerr(e, "converting a tensor to Python"))?;
                // SAFETY: a new, non-null reference.
                list.append(unsafe { Bound::from_owned_ptr(py, obj.cast()) })?;
            }
            return Ok(list);
        }
        let mut capsules = Vec::with_capacity(handles.len());
        for h in handles {
            // SAFETY: an unnamed capsule with no destructor, as torch expects; the handle's
            // ownership passes to torch's stealing call. (The list form deletes each handle
            // it reads; the one-tensor form in torch 2.13 copies and leaks it.)
            let cap = unsafe { pyo3::ffi::PyCapsule_New(h.into_raw(), std::ptr::null(), None) };
            capsules.push(unsafe { Bound::from_owned_ptr_or_err(py, cap)? });
        }
        Ok(self.to_tensors.bind(py).call1((capsules,))?.cast_into::<PyList>()?)
    }
}

/// Whether a strided view (`sizes`, `strides`, `offset` in elements of `itemsize` bytes)
/// stays inside a storage of `nbytes`: the same bound torch's `as_strided` checks.
pub fn storage_fits(sizes: &[i64], strides: &[i64], offset: i64, itemsize: i64, nbytes: i64) -> Storage {
    if sizes.contains(&0) {
        return Storage::Fits; // no element is read
    }
    let last = sizes.iter().zip(strides).try_fold(offset, |acc, (&n, &s)| {
        if n < 0 || s < 0 {
            return None;
        }
        (n - 1).checked_mul(s).and_then(|d| acc.checked_add(d))
    });
    let needs = last.and_then(|l| l.checked_add(1)).and_then(|n| n.checked_mul(itemsize));
    match needs {
        Some(needs) if offset >= 0 && needs <= nbytes => Storage::Fits,
        Some(needs) => Storage::TooSmall { needs, has: nbytes },
        None => Storage::TooSmall { needs: i64::MAX, has: nbytes },
    }
}

fn to_pyerr(e: CError, what: &str) -> PyErr {
    match e {
        CError::Python(e) => e,
        CError::Torch(m) | CError::Internal(m) => pyo3::exceptions::PyRuntimeError::new_err(format!("{what}: {m}")),
    }
}

/// An owning `AtenTensorHandle`, deleted on drop. Deleting needs no GIL.
pub struct Tensor(Raw, unsafe extern "C" fn(Raw) -> Status);

// SAFETY: an `at::Tensor*`; its reference count is atomic and kwexport never mutates
// through it, so sharing across threads is sound.
unsafe impl Send for Tensor {}
unsafe impl Sync for Tensor {}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor({:p})", self.0)
    }
}

impl Tensor {
    /// The handle, borrowed: for calls that don't take ownership.
    pub fn raw(&self) -> Raw {
        self.0
    }

    fn into_raw(self) -> Raw {
        let raw = self.0;
        std::mem::forget(self);
        raw
    }
}

impl Drop for Tensor {
    fn drop(&mut self) {
        // SAFETY: an owned handle, deleted once.
        unsafe { (self.1)(self.0) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storage_bounds() {
        assert_eq!(storage_fits(&[2, 4], &[4, 1], 0, 4, 32), Storage::Fits);
        assert_eq!(storage_fits(&[2, 4], &[4, 1], 0, 4, 0), Storage::TooSmall { needs: 32, has: 0 });
        assert_eq!(storage_fits(&[2, 4], &[1, 2], 0, 4, 32), Storage::Fits);
        assert_eq!(storage_fits(&[2, 4], &[1, 2], 1, 4, 32), Storage::TooSmall { needs: 36, has: 32 });
        assert_eq!(storage_fits(&[0, 4], &[4, 1], 0, 4, 0), Storage::Fits);
        assert_eq!(storage_fits(&[], &[], 3, 8, 32), Storage::Fits);
        assert_eq!(storage_fits(&[], &[], 4, 8, 32), Storage::TooSmall { needs: 40, has: 32 });
        assert_eq!(storage_fits(&[3], &[0], 0, 4, 4), Storage::Fits); // expanded
        assert_eq!(storage_fits(&[i64::MAX], &[i64::MAX], 0, 4, 4), Storage::TooSmall { needs: i64::MAX, has: 4 });
    }
}
