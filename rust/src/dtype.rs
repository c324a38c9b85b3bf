//! The tensor element types a file may name, with their sizes. Anything else is refused.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DType {
    /// The name in the file, which is also the attribute on the `torch` module.
    pub name: &'static str,
    pub itemsize: u64,
}

pub const ALL: &[DType] = &[
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
    pub fn parse(name: &str) -> Option<DType> {
        ALL.iter().copied().find(|d| d.name == name)
    }
}
