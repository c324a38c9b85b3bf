//! The artifact's JSON header, as serde types: the exact shape `docs/format.md` describes.
//!
//! These types are only the *parsed* form. Cross-field rules (values defined before use,
//! leaf counts, weight bounds, ...) are checked once by the validating constructors in the
//! other modules, which turn this into the runtime's own types. Unknown fields are ignored
//! so that a reader tolerates minor-version additions (see `upgrade.rs`).

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Checks that no JSON object in `bytes` repeats a key. serde_json keeps the last of two
/// equal keys silently, so a file could show one reader one entry and another the other;
/// kwexport refuses such files. One pass, no allocation beyond each object's key set.
pub fn check_unique_keys(bytes: &[u8]) -> Result<(), serde_json::Error> {
    struct Unique;
    impl<'de> Deserialize<'de> for Unique {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            d.deserialize_any(UniqueVisitor)
        }
    }
    struct UniqueVisitor;
    impl<'de> serde::de::Visitor<'de> for UniqueVisitor {
        type Value = Unique;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("any JSON value")
        }
        fn visit_bool<E>(self, _: bool) -> Result<Unique, E> {
            Ok(Unique)
        }
        fn visit_i64<E>(self, _: i64) -> Result<Unique, E> {
            Ok(Unique)
        }
        fn visit_u64<E>(self, _: u64) -> Result<Unique, E> {
            Ok(Unique)
        }
        fn visit_f64<E>(self, _: f64) -> Result<Unique, E> {
            Ok(Unique)
        }
        fn visit_str<E>(self, _: &str) -> Result<Unique, E> {
            Ok(Unique)
        }
        fn visit_unit<E>(self) -> Result<Unique, E> {
            Ok(Unique)
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Unique, A::Error> {
            while seq.next_element::<Unique>()?.is_some() {}
            Ok(Unique)
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Unique, A::Error> {
            let mut keys = std::collections::HashSet::new();
            while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                if !keys.insert(key.clone()) {
                    return Err(serde::de::Error::custom(format!("duplicate key {key:?}")));
                }
                map.next_value::<Unique>()?;
            }
            Ok(Unique)
        }
    }
    serde_json::from_slice::<Unique>(bytes).map(|_| ())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct FormatVersion {
    pub major: u32,
    pub minor: u32,
}

impl std::fmt::Display for FormatVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Document {
    pub format_version: FormatVersion,
    pub producer: Producer,
    pub signature: Signature,
    pub inputs: Inputs,
    pub outputs: TreeSpec,
    #[serde(default)]
    pub symbols: Vec<Symbol>,
    /// Every op the graph calls, once (format 2.0 on).
    pub ops: Vec<OpEntry>,
    pub graph: Graph,
    pub weights: Weights,
    #[serde(default)]
    pub extra_files: BTreeMap<String, ExtraFile>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Producer {
    pub kwexport: String,
    pub torch: String,
    #[serde(default)]
    pub python: String,
}

// ---------------------------------------------------------------- signature

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Signature {
    /// How the callable names itself in error messages, e.g. `kw_func` or `MLP.forward`.
    pub name: String,
    pub params: Vec<Param>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Param {
    pub name: String,
    pub kind: ParamKind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<Constant>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ParamKind {
    PositionalOnly,
    PositionalOrKeyword,
    VarPositional,
    KeywordOnly,
    VarKeyword,
}

/// A Python value that JSON can carry: parameter defaults, specialized inputs, literals.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Constant {
    None(()),
    Bool(bool),
    Int(i64),
    Float(Float),
    Str(String),
    Tuple(Vec<Constant>),
    List(Vec<Constant>),
}

/// An f64 that also carries inf and nan, which JSON numbers cannot: those are written
/// as the strings `"inf"`, `"-inf"` and `"nan"`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Float(pub f64);

impl Serialize for Float {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let v = self.0;
        if v.is_nan() {
            s.serialize_str("nan")
        } else if v.is_infinite() {
            s.serialize_str(if v > 0.0 { "inf" } else { "-inf" })
        } else {
            s.serialize_f64(v)
        }
    }
}

impl<'de> Deserialize<'de> for Float {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Repr {
            Num(f64),
            Text(String),
        }
        match Repr::deserialize(d)? {
            Repr::Num(v) => Ok(Float(v)),
            Repr::Text(t) => match t.as_str() {
                "inf" => Ok(Float(f64::INFINITY)),
                "-inf" => Ok(Float(f64::NEG_INFINITY)),
                "nan" => Ok(Float(f64::NAN)),
                other => Err(serde::de::Error::custom(format!(
                    "expected a number, \"inf\", \"-inf\" or \"nan\", got {other:?}"
                ))),
            },
        }
    }
}

// ---------------------------------------------------------------- trees

/// A pytree structure: how a nested Python value flattens to leaves.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum TreeSpec {
    Leaf,
    None,
    Tuple {
        children: Vec<TreeSpec>,
    },
    List {
        children: Vec<TreeSpec>,
    },
    Dict {
        entries: Vec<DictEntry>,
    },
    OrderedDict {
        entries: Vec<DictEntry>,
    },
    #[serde(rename = "namedtuple")]
    NamedTuple {
        name: String,
        #[serde(default)]
        module: String,
        fields: Vec<String>,
        children: Vec<TreeSpec>,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DictEntry {
    pub key: Key,
    pub value: TreeSpec,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Key {
    Str(String),
    Int(i64),
}

impl std::fmt::Display for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Key::Str(s) => write!(f, "'{s}'"),
            Key::Int(i) => write!(f, "{i}"),
        }
    }
}

// ---------------------------------------------------------------- inputs

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Inputs {
    /// Structure of `(args, kwargs)` after binding to the signature with defaults applied:
    /// `args` holds every positional parameter and then `*args`' items, `kwargs` every
    /// keyword-only parameter and then `**kwargs`' entries.
    pub spec: TreeSpec,
    /// One entry per leaf of `spec`, in flattening order.
    pub leaves: Vec<LeafSpec>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LeafSpec {
    Tensor(TensorSpec),
    /// A non-tensor input torch.export specialized: calls must pass this exact value.
    Constant(Constant),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorSpec {
    pub dtype: String,
    pub device: String,
    pub shape: Vec<Dim>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Dim {
    Static(i64),
    /// `coeff * symbol + offset`: a `Dim` or a derived dim such as `2 * d` or `d + 1`.
    Symbolic {
        symbol: String,
        coeff: i64,
        offset: i64,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Symbol {
    pub name: String,
    pub min: i64,
    /// `None` is unbounded.
    #[serde(default)]
    pub max: Option<i64>,
}

// ---------------------------------------------------------------- graph

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Graph {
    pub inputs: Vec<GraphInput>,
    pub nodes: Vec<Node>,
    pub outputs: Vec<Arg>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GraphInput {
    pub name: String,
    pub source: InputSource,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InputSource {
    /// A named entry of `weights.tensors`.
    Weight(String),
    /// Leaf `i` of `inputs.spec`.
    User(usize),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OpEntry {
    /// Qualified op name, `namespace::name.overload`, e.g. `aten::add.Tensor`, or
    /// `operator::mul` for the Python operators graphs apply to symbolic sizes.
    pub name: String,
    /// The op's schema in the torch that wrote the file (`str(op._schema)`); `None` when
    /// unknown (files upgraded from format 1.0) or for Python operators.
    #[serde(default)]
    pub schema: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Node {
    /// Index into `ops`.
    pub op: usize,
    #[serde(default)]
    pub args: Vec<Arg>,
    #[serde(default)]
    pub kwargs: BTreeMap<String, Arg>,
    pub outputs: Outputs,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outputs {
    None(()),
    One(String),
    /// A tuple- or list-returning op: the name bound to each position, `null` if unused.
    Many(Vec<Option<String>>),
}

/// An op argument: a graph value, a literal, or a list of those.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Arg {
    Ref(String),
    None(()),
    Bool(bool),
    Int(i64),
    Float(Float),
    Str(String),
    List(Vec<Arg>),
    Dtype(String),
    Device(String),
    Layout(String),
    MemoryFormat(String),
}

// ---------------------------------------------------------------- weights & extras

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Weights {
    pub storages: Vec<Storage>,
    pub tensors: BTreeMap<String, WeightTensor>,
}

/// A byte range of the data section. Offsets are relative to the data section's start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Storage {
    pub offset: u64,
    pub nbytes: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WeightTensor {
    pub dtype: String,
    pub shape: Vec<i64>,
    pub strides: Vec<i64>,
    pub storage: usize,
    /// In elements of `dtype`, as torch counts it.
    #[serde(default)]
    pub storage_offset: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExtraFile {
    pub offset: u64,
    pub nbytes: u64,
    pub encoding: Encoding,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Encoding {
    /// Saved from `bytes`; read back as `bytes`.
    Bytes,
    /// Saved from `str`; read back as `str`.
    Utf8,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duplicate_keys_are_refused_at_any_depth() {
        assert!(check_unique_keys(br#"{"a": [{"b": 1, "c": {"d": 2}}], "e": "x"}"#).is_ok());
        let err = check_unique_keys(br#"{"a": [{"b": 1, "b": 2}]}"#).unwrap_err().to_string();
        assert!(err.contains("duplicate key \"b\""), "{err}");
        assert!(check_unique_keys(br#"{"k\u0061": 1, "ka": 2}"#).is_err()); // escapes too
    }

    #[test]
    fn floats_carry_inf_and_nan() {
        let v: Vec<Float> = serde_json::from_str(r#"[1.5, "inf", "-inf", "nan"]"#).unwrap();
        assert_eq!(v[0].0, 1.5);
        assert!(v[1].0.is_infinite() && v[2].0 < 0.0 && v[3].0.is_nan());
        assert_eq!(serde_json::to_string(&v).unwrap(), r#"[1.5,"inf","-inf","nan"]"#);
        assert!(serde_json::from_str::<Float>(r#""1e999x""#).is_err());
    }
}
