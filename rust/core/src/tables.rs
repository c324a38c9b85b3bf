//! The format's tables: the one place each is written down. The Python package reads them
//! from `kwexport._rt` rather than repeating them.

/// The first 8 bytes of every kwexport file.
pub const MAGIC: &[u8; 8] = b"KWEXPORT";
/// The data section and every storage and extra file in it start on this boundary.
pub const ALIGN: u64 = 64;
/// The magic and the header length before the header.
pub const PREFIX_LEN: u64 = 16;
/// A header past this is not a model description but an attack or a corrupt length.
pub const MAX_HEADER_BYTES: u64 = 256 << 20;

/// A tensor element type a file may name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DType {
    /// The name in the file, which is also the attribute on the `torch` module.
    pub name: &'static str,
    /// Bytes per element.
    pub itemsize: u64,
}

/// Every element type a file may name; anything else is refused.
pub const DTYPES: &[DType] = &[
    DType { name: "float64", itemsize: 8 },
    DType { name: "float32", itemsize: 4 },
    DType { name: "float16", itemsize: 2 },
    DType { name: "bfloat16", itemsize: 2 },
    DType { name: "complex128", itemsize: 16 },
    DType { name: "complex64", itemsize: 8 },
    DType { name: "int64", itemsize: 8 },
    DType { name: "int32", itemsize: 4 },
    DType { name: "int16", itemsize: 2 },
    DType { name: "int8", itemsize: 1 },
    DType { name: "uint8", itemsize: 1 },
    DType { name: "bool", itemsize: 1 },
];

impl DType {
    /// The element type of this name, if a file may use it.
    pub fn parse(name: &str) -> Option<DType> {
        DTYPES.iter().copied().find(|d| d.name == name)
    }
}

/// Tensor layouts a literal may name, as attributes of `torch`.
pub const LAYOUTS: &[&str] =
    &["strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc", "_mkldnn", "jagged"];

/// Memory formats a literal may name, as attributes of `torch`.
pub const MEMORY_FORMATS: &[&str] = &["contiguous_format", "channels_last", "channels_last_3d", "preserve_format"];

/// Python operators graphs apply to symbolic sizes (`s0 * 4`), by their `operator` name;
/// a file names them `operator::<name>`.
pub const PY_OPERATORS: &[&str] = &[
    "add", "sub", "mul", "floordiv", "truediv", "mod", "pow", "neg", "pos", "abs", "eq", "ne", "lt", "le", "gt", "ge",
    "and_", "or_", "not_",
];

/// torch's functions of symbolic values that exported graphs call (`torch.sym_max(s0, 4)`,
/// `torch.sym_ite(pred, a, b)`), by name; a file names them `torch::<name>`.
pub const SYM_FUNCTIONS: &[&str] =
    &["sym_not", "sym_float", "sym_int", "sym_max", "sym_min", "sym_sqrt", "sym_ite", "sym_sum"];

/// The `default_factory` a saved `collections.defaultdict` may have: builtins, by name.
pub const DEFAULTDICT_FACTORIES: &[&str] = &["list", "dict", "set", "tuple", "int", "float", "str", "bool"];

/// Op namespaces a file may use without the caller's say-so.
pub const DEFAULT_NAMESPACES: &[&str] = &["aten", "prims"];

/// Ops outside those namespaces that a load-time pass may insert (a file may name them too:
/// they are torch's own kernels, or kwexport's, defined by its Python package): oneDNN's fused
/// convolution (`passes::conv_pointwise`), linear (`passes::linear_pointwise`), convolution
/// with a residual add (`passes::conv_residual`), and kwexport's int8 linear
/// (`passes::linear_int8`: the input's scale and zero point as literals, as tensors, or
/// chosen from the input) and convolution (the same pass: a static scale, or chosen; and
/// with a residual add, `passes::conv_residual`); and
/// kwexport's biased linear and `addmm` whose GEMM is chosen on the device
/// (`passes::linear_measured`: the exported op's arguments and values), the same with the
/// GELU that alone reads their result (`passes::linear_gelu`); and its fused elementwise ops
/// for CUDA (`passes::add_norm`, `passes::rotary`).
pub const PASS_OPS: &[&str] = &[
    "mkldnn::_convolution_pointwise.default",
    "mkldnn::_linear_pointwise.default",
    "mkldnn::_convolution_pointwise.binary",
    "kwexport::linear_int8.default",
    "kwexport::linear_int8.tensor",
    "kwexport::linear_int8.dynamic",
    "kwexport::linear_measured.default",
    "kwexport::linear_measured.addmm",
    "kwexport::add_norm.layer_norm",
    "kwexport::add_norm.rms_norm",
    "kwexport::rotary_embedding.default",
    "kwexport::conv_int8.default",
    "kwexport::conv_int8.dynamic",
    "kwexport::linear_measured.gelu",
    "kwexport::linear_measured.addmm_gelu",
    "kwexport::conv_int8.residual",
];

/// torch's quantize and dequantize ops (`torch.ao.quantization.fx._decomposed`; torchao's pt2e
/// writes the same), which a quantized program holds: known ops of the format, validated as
/// aten's are. The `quantized_ops` pass writes them out as aten arithmetic at load; a node it
/// can't runs as torch's op.
pub const QUANT_OPS: &[&str] = &[
    "quantized_decomposed::quantize_per_tensor.default",
    "quantized_decomposed::quantize_per_tensor.tensor",
    "quantized_decomposed::dequantize_per_tensor.default",
    "quantized_decomposed::dequantize_per_tensor.tensor",
    "quantized_decomposed::quantize_per_channel.default",
    "quantized_decomposed::dequantize_per_channel.default",
    "quantized_decomposed::choose_qparams.tensor",
];

/// The longest extra-file name, in bytes.
pub const MAX_EXTRA_NAME_BYTES: usize = 255;

/// Whether `name` may name an extra file: a relative path without empty, `.` or `..` parts,
/// backslashes or NULs, so that no reader that unpacks extra files can write outside a folder.
pub fn is_safe_extra_name(name: &str) -> bool {
    !(name.is_empty()
        || name.len() > MAX_EXTRA_NAME_BYTES
        || name.starts_with('/')
        || name.contains('\\')
        || name.contains('\0')
        || name.split('/').any(|part| part.is_empty() || part == "." || part == ".."))
}

/// The longest method name a file may hold, in bytes.
pub const MAX_METHOD_NAME_BYTES: usize = 128;

/// Whether `name` may name a method: an ASCII Python identifier that doesn't start with `_`
/// (so that `program.NAME` reaches it and never a private attribute).
pub fn is_method_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic())
        && name.len() <= MAX_METHOD_NAME_BYTES
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn method_names_are_public_identifiers() {
        for bad in ["", "_private", "9lives", "a-b", "a b", "é", &"x".repeat(129)] {
            assert!(!is_method_name(bad), "{bad:?} accepted");
        }
        for good in ["forward", "encode", "decode_step2", "A"] {
            assert!(is_method_name(good), "{good:?} refused");
        }
    }

    #[test]
    fn extra_file_names_must_be_plain() {
        for bad in ["", "/etc/passwd", "../x", "a/../../b", "a//b", "a\\b", "a\0b", "./a", &"x".repeat(256)] {
            assert!(!is_safe_extra_name(bad), "{bad:?} accepted");
        }
        for good in ["notes.txt", "meta/config.json", "..hidden"] {
            assert!(is_safe_extra_name(good), "{good:?} refused");
        }
    }

    #[test]
    fn dtypes_parse_by_name() {
        assert_eq!(DType::parse("bfloat16").map(|d| d.itemsize), Some(2));
        assert_eq!(DType::parse("float8_e4m3fn"), None);
    }
}
