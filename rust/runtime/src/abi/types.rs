//! The schema types the dispatcher converts, parsed from torch's schema strings.

/// A schema type the dispatcher can convert (`torch/csrc/shim_common.cpp`, `to_ivalue`).
/// Anything else (`Scalar`, `Generator`, ...) keeps a node on the Python path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ty {
    Tensor,
    Int,
    Float,
    Bool,
    Str,
    ScalarType,
    Layout,
    MemoryFormat,
    Device,
    Optional(Box<Ty>),
    List(Box<Ty>),
}

impl Ty {
    /// Parses a schema type as `str(argument.real_type)` prints it: `Tensor`,
    /// `Optional[ScalarType]`, `List[Optional[Tensor]]`, ...
    pub fn parse(s: &str) -> Option<Ty> {
        if let Some(inner) = s.strip_prefix("Optional[").and_then(|r| r.strip_suffix(']')) {
            return Some(Ty::Optional(Box::new(Ty::parse(inner)?)));
        }
        if let Some(inner) = s.strip_prefix("List[").and_then(|r| r.strip_suffix(']')) {
            return Some(Ty::List(Box::new(Ty::parse(inner)?)));
        }
        Some(match s {
            "Tensor" => Ty::Tensor,
            "int" | "SymInt" => Ty::Int,
            "float" => Ty::Float,
            "bool" => Ty::Bool,
            "str" => Ty::Str,
            "ScalarType" => Ty::ScalarType,
            "Layout" => Ty::Layout,
            "MemoryFormat" => Ty::MemoryFormat,
            "Device" => Ty::Device,
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::Ty;

    #[test]
    fn parses_schema_types() {
        assert_eq!(Ty::parse("Tensor"), Some(Ty::Tensor));
        assert_eq!(Ty::parse("Optional[ScalarType]"), Some(Ty::Optional(Box::new(Ty::ScalarType))));
        assert_eq!(Ty::parse("List[Optional[Tensor]]"), Some(Ty::List(Box::new(Ty::Optional(Box::new(Ty::Tensor))))));
        assert_eq!(Ty::parse("SymInt"), Some(Ty::Int));
        for unsupported in ["number", "Generator", "Optional[number]", "List[number]", "Optional[", "Dimname"] {
            assert_eq!(Ty::parse(unsupported), None, "{unsupported}");
        }
    }
}
