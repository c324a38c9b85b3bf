//! The artifact's JSON header, as serde types: the exact shape `docs/format.md` describes.
//!
//! These types are only the *parsed* form. Cross-field rules (values defined before use,
//! leaf counts, weight bounds, ...) are checked once by the validating constructors in the
//! other modules, which turn this into the runtime's own types. Unknown fields are ignored
//! so that a reader tolerates minor-version additions (see `upgrade.rs`).

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A JSON object as a map, refusing a repeated key (serde keeps the last one silently).
/// With serde's derive, which refuses a repeated struct field, the typed parse refuses a
/// repeated key wherever kwexport reads one, in the same pass.
fn unique_map<'de, D, V>(d: D) -> Result<BTreeMap<String, V>, D::Error>
where
    D: Deserializer<'de>,
    V: Deserialize<'de>,
{
    struct Visitor<V>(std::marker::PhantomData<V>);
    impl<'de, V: Deserialize<'de>> serde::de::Visitor<'de> for Visitor<V> {
        type Value = BTreeMap<String, V>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut out = BTreeMap::new();
            while let Some((key, value)) = map.next_entry::<String, V>()? {
                if out.contains_key(&key) {
                    return Err(serde::de::Error::custom(format!("duplicate key {key:?}")));
                }
                out.insert(key, value);
            }
            Ok(out)
        }
    }
    d.deserialize_map(Visitor(std::marker::PhantomData))
}

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
            // Most objects have a handful of keys: a linear scan over borrowed keys beats
            // hashing owned ones.
            let mut keys: Vec<Key<'de>> = Vec::new();
            while let Some(key) = map.next_key::<Key<'de>>()? {
                if keys.contains(&key) {
                    return Err(serde::de::Error::custom(format!("duplicate key {:?}", key.0)));
                }
                keys.push(key);
                map.next_value::<Unique>()?;
            }
            Ok(Unique)
        }
    }
    /// A key, borrowed from the input unless it has escapes.
    #[derive(PartialEq)]
    struct Key<'de>(std::borrow::Cow<'de, str>);
    impl<'de> Deserialize<'de> for Key<'de> {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct KeyVisitor;
            impl<'de> serde::de::Visitor<'de> for KeyVisitor {
                type Value = Key<'de>;
                fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                    f.write_str("a string key")
                }
                fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Key<'de>, E> {
                    Ok(Key(std::borrow::Cow::Borrowed(s)))
                }
                fn visit_str<E>(self, s: &str) -> Result<Key<'de>, E> {
                    Ok(Key(std::borrow::Cow::Owned(s.to_owned())))
                }
            }
            d.deserialize_str(KeyVisitor)
        }
    }
    serde_json::from_slice::<Unique>(bytes).map(|_| ())
}

/// A format version: a minor bump only adds fields older readers may ignore.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct FormatVersion {
    /// Bumped by changes older readers can't ignore.
    pub major: u32,
    /// Bumped by additions older readers may ignore.
    pub minor: u32,
}

impl std::fmt::Display for FormatVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// The whole header.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Document {
    /// The version this document is written in.
    pub format_version: FormatVersion,
    /// What wrote the file.
    pub producer: Producer,
    /// The file's callables, by name (format 4.0 on; older files hold one, `forward`). Every
    /// method reads the one weight table below, so weights two methods use are stored once
    /// and a weight one method writes is state every method sees.
    #[serde(deserialize_with = "unique_map")]
    pub methods: BTreeMap<String, Method>,
    /// The weight tensors and the storages they view.
    pub weights: Weights,
    /// Files the user saved alongside, by name.
    #[serde(default, deserialize_with = "unique_map")]
    pub extra_files: BTreeMap<String, ExtraFile>,
    /// The optimization level the graphs were rewritten at when the file was written
    /// (`kwexport optimize`, `kwexport.save(..., optimize=...)`); absent for `exact`.
    #[serde(default, skip_serializing_if = "crate::passes::Level::is_exact")]
    pub optimized: crate::passes::Level,
}

/// One callable of a file: its signature, how calls flatten, and its graph.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Method {
    /// The original Python signature.
    pub signature: Signature,
    /// How calls flatten to the graph's user leaves, and what each leaf must be.
    pub inputs: Inputs,
    /// How the graph's outputs rebuild into the returned value.
    pub outputs: TreeSpec,
    /// The symbolic sizes input shapes use, with their ranges.
    #[serde(default)]
    pub symbols: Vec<Symbol>,
    /// Every op the graph calls, once (format 2.0 on).
    pub ops: Vec<OpEntry>,
    /// The computation.
    pub graph: Graph,
    /// Graphs that higher-order ops run (`cond`'s branches, `wrap_with_set_grad_enabled`'s
    /// body), by name (format 3.0 on).
    #[serde(default, deserialize_with = "unique_map")]
    pub subgraphs: BTreeMap<String, Subgraph>,
}

/// The versions that wrote a file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Producer {
    /// kwexport's version.
    pub kwexport: String,
    /// torch's version.
    pub torch: String,
    /// Python's version (empty in files that predate it).
    #[serde(default)]
    pub python: String,
}

// ---------------------------------------------------------------- signature

/// A Python signature, as saved.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Signature {
    /// How the callable names itself in error messages, e.g. `kw_func` or `MLP.forward`.
    pub name: String,
    /// The parameters, in order.
    pub params: Vec<Param>,
}

/// One parameter of a [`Signature`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Param {
    /// Its name.
    pub name: String,
    /// How it binds.
    pub kind: ParamKind,
    /// Its default, if it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<Constant>,
    /// Since 3.1: a tensor default, as the name of an entry of `weights.tensors` (a reader
    /// older than 3.1 ignores it and takes the parameter as required).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_weight: Option<String>,
}

impl Param {
    /// Whether a call may leave it out.
    pub fn has_default(&self) -> bool {
        self.default.is_some() || self.default_weight.is_some()
    }
}

/// Python's parameter kinds (`inspect.Parameter.kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ParamKind {
    /// Before `/`.
    PositionalOnly,
    /// By position or by name.
    PositionalOrKeyword,
    /// `*args`.
    VarPositional,
    /// After `*` or `*args`.
    KeywordOnly,
    /// `**kwargs`.
    VarKeyword,
}

/// A Python value that JSON can carry: parameter defaults, specialized inputs, literals.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[allow(missing_docs)] // each variant is the Python type of its name
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
    /// One value: a tensor, or a constant.
    Leaf,
    /// `None`, which has no leaves.
    None,
    /// A tuple of these.
    Tuple {
        /// Its items' specs.
        children: Vec<TreeSpec>,
    },
    /// A list of these.
    List {
        /// Its items' specs.
        children: Vec<TreeSpec>,
    },
    /// A dict, matched by key.
    Dict {
        /// Its entries, in insertion order.
        entries: Vec<DictEntry>,
    },
    /// A `collections.OrderedDict`.
    OrderedDict {
        /// Its entries, in order.
        entries: Vec<DictEntry>,
    },
    /// A namedtuple class's instance.
    #[serde(rename = "namedtuple")]
    NamedTuple {
        /// The class's name.
        name: String,
        /// The module it was defined in (never imported).
        #[serde(default)]
        module: String,
        /// Its fields.
        fields: Vec<String>,
        /// One spec per field.
        children: Vec<TreeSpec>,
    },
    /// A `collections.defaultdict` (format 3.0 on).
    #[serde(rename = "defaultdict")]
    DefaultDict {
        /// Its `default_factory`: a name of [`crate::tables::DEFAULTDICT_FACTORIES`], or `None`.
        factory: Option<String>,
        /// Its entries, in insertion order.
        entries: Vec<DictEntry>,
    },
    /// An instance of a class registered with torch's pytree: a transformers `ModelOutput`,
    /// a dataclass, or any class whose flatten context is a [`Constant`] (format 3.0 on).
    Container {
        /// What kind of class it is; says how children are named.
        kind: ContainerKind,
        /// The module the class was defined in (never imported by a reader).
        module: String,
        /// The class's `__qualname__`.
        qualname: String,
        /// The context torch's pytree flatten returned, which its unflatten takes back.
        context: Constant,
        /// How each child is reached from the instance, one per child.
        keys: Vec<ChildKey>,
        /// One spec per child.
        children: Vec<TreeSpec>,
    },
}

/// The kind of a registered container class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ContainerKind {
    /// A transformers `ModelOutput` subclass: an ordered mapping of its set fields.
    ModelOutput,
    /// A dataclass registered with `torch.utils._pytree.register_dataclass`.
    Dataclass,
    /// Any other class registered with `register_pytree_node`.
    PytreeNode,
}

/// How a container's child is reached from the instance.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ChildKey {
    /// `obj.name`.
    Attr(String),
    /// `obj[key]`.
    Key(Key),
    /// `obj[i]`, or only by position.
    Index(usize),
}

impl std::fmt::Display for ChildKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ChildKey::Attr(a) => write!(f, ".{a}"),
            ChildKey::Key(k) => write!(f, "[{k}]"),
            ChildKey::Index(i) => write!(f, "[{i}]"),
        }
    }
}

/// One entry of a dict spec.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DictEntry {
    /// The key.
    pub key: Key,
    /// The value's spec.
    pub value: TreeSpec,
}

/// A dict key a file may hold.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Key {
    /// A `str` key.
    Str(String),
    /// An `int` key.
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

/// How calls flatten, and what each leaf must be.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Inputs {
    /// Structure of `(args, kwargs)` after binding to the signature with defaults applied:
    /// `args` holds every positional parameter and then `*args`' items, `kwargs` every
    /// keyword-only parameter and then `**kwargs`' entries.
    pub spec: TreeSpec,
    /// One entry per leaf of `spec`, in flattening order.
    pub leaves: Vec<LeafSpec>,
}

/// What one input leaf must be.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LeafSpec {
    /// A tensor of this dtype, device and shape.
    Tensor(TensorSpec),
    /// A non-tensor input torch.export specialized: calls must pass this exact value.
    Constant(Constant),
}

/// A tensor input's dtype, device and shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorSpec {
    /// A name of [`crate::tables::DTYPES`].
    pub dtype: String,
    /// A torch device string.
    pub device: String,
    /// One entry per dimension.
    pub shape: Vec<Dim>,
}

/// One dimension of an input's shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Dim {
    /// This size exactly.
    Static(i64),
    /// `coeff * symbol + offset`: a `Dim` or a derived dim such as `2 * d` or `d + 1`.
    Symbolic {
        /// The symbol's name.
        symbol: String,
        /// Its multiplier.
        coeff: i64,
        /// The offset added.
        offset: i64,
    },
}

/// A symbolic size and its range.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Symbol {
    /// Its name, as torch.export named it.
    pub name: String,
    /// Smallest value.
    pub min: i64,
    /// `None` is unbounded.
    #[serde(default)]
    pub max: Option<i64>,
}

// ---------------------------------------------------------------- graph

/// The computation: named values, defined once each.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Graph {
    /// Values that come from outside: weights and user leaves.
    pub inputs: Vec<GraphInput>,
    /// Op calls, in execution order.
    pub nodes: Vec<Node>,
    /// The flat outputs, rebuilt by `outputs`.
    pub outputs: Vec<Arg>,
    /// New values of weights (the program's state) and of user inputs, written back after
    /// each call (format 3.0 on).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mutations: Vec<Mutation>,
}

/// A value the graph writes back after a call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Mutation {
    /// What it writes.
    pub target: MutationTarget,
    /// The new value.
    pub value: Arg,
}

/// What a mutation writes.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MutationTarget {
    /// A weight marked `mutable`, by name: state the program owns.
    Weight(String),
    /// Leaf `i` of `inputs.spec`, a tensor: the caller's own tensor, written in place.
    User(usize),
}

/// A graph a higher-order op runs: positional inputs, then nodes as in the main graph.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Subgraph {
    /// The names its positional inputs are bound to, in order.
    pub inputs: Vec<String>,
    /// Op calls, in execution order.
    pub nodes: Vec<Node>,
    /// The values it returns.
    pub outputs: Vec<Arg>,
}

/// A value the graph reads from outside.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GraphInput {
    /// The value's name in the graph.
    pub name: String,
    /// Where it comes from.
    pub source: InputSource,
}

/// Where a graph input comes from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InputSource {
    /// A named entry of `weights.tensors`.
    Weight(String),
    /// Leaf `i` of `inputs.spec`.
    User(usize),
}

/// One op the graph calls.
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

/// One op call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Node {
    /// Index into `ops`.
    pub op: usize,
    /// Positional arguments.
    #[serde(default)]
    pub args: Vec<Arg>,
    /// Keyword arguments, by the op schema's names.
    #[serde(default, deserialize_with = "unique_map")]
    pub kwargs: BTreeMap<String, Arg>,
    /// The names it defines.
    pub outputs: Outputs,
}

/// The names a node's returns are bound to.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outputs {
    /// Nothing is bound.
    None(()),
    /// The one return.
    One(String),
    /// A tuple- or list-returning op: the name bound to each position, `null` if unused.
    Many(Vec<Option<String>>),
}

/// An op argument: a graph value, a literal, or a list of those.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[allow(missing_docs)] // literals are the Python or torch type of their name
pub enum Arg {
    /// A graph value, by name.
    Ref(String),
    /// A subgraph, by its name in `subgraphs`: only higher-order ops take one (3.0 on).
    Subgraph(String),
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

impl Outputs {
    /// The names the node binds, in order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        let (one, many): (Option<&String>, &[Option<String>]) = match self {
            Outputs::One(o) => (Some(o), &[]),
            Outputs::Many(os) => (None, os),
            Outputs::None(()) => (None, &[]),
        };
        one.into_iter().chain(many.iter().flatten()).map(String::as_str)
    }
}

impl Arg {
    /// Calls `f` with each value name the argument refers to, lists included.
    pub fn for_each_ref<'a>(&'a self, f: &mut impl FnMut(&'a str)) {
        match self {
            Arg::Ref(r) => f(r),
            Arg::List(items) => items.iter().for_each(|i| i.for_each_ref(f)),
            _ => {}
        }
    }

    /// Whether the argument refers to the value `name`.
    pub fn reads(&self, name: &str) -> bool {
        let mut found = false;
        self.for_each_ref(&mut |r| found |= r == name);
        found
    }
}

// ---------------------------------------------------------------- weights & extras

/// The weight table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Weights {
    /// Byte ranges of the data section.
    pub storages: Vec<Storage>,
    /// Tensors viewing them, by name.
    #[serde(deserialize_with = "unique_map")]
    pub tensors: BTreeMap<String, WeightTensor>,
}

/// A byte range of the data section. Offsets are relative to the data section's start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Storage {
    /// Start, relative to the data section; a multiple of [`crate::tables::ALIGN`].
    pub offset: u64,
    /// Length.
    pub nbytes: u64,
}

/// A weight: a strided view of one storage.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WeightTensor {
    /// A name of [`crate::tables::DTYPES`].
    pub dtype: String,
    /// Sizes.
    pub shape: Vec<i64>,
    /// Strides, in elements.
    pub strides: Vec<i64>,
    /// Index into `weights.storages`.
    pub storage: usize,
    /// In elements of `dtype`, as torch counts it.
    #[serde(default)]
    pub storage_offset: i64,
    /// The program writes this weight (format 3.0 on): a loaded program keeps its own copy,
    /// and the file is never written.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub mutable: bool,
}

/// A file saved alongside the program.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExtraFile {
    /// Start, relative to the data section.
    pub offset: u64,
    /// Length.
    pub nbytes: u64,
    /// How to read it back.
    pub encoding: Encoding,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
/// How an extra file's bytes are read back.
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
    fn the_typed_parse_refuses_repeated_keys_it_reads() {
        let node = |s: &str| serde_json::from_str::<Node>(s).map_err(|e| e.to_string());
        assert!(node(r#"{"op": 0, "kwargs": {"a": {"int": 1}, "b": {"int": 1}}, "outputs": {"one": "x"}}"#).is_ok());
        let err = node(r#"{"op": 0, "kwargs": {"a": {"int": 1}, "a": {"int": 2}}, "outputs": {"one": "x"}}"#);
        assert!(err.unwrap_err().contains("duplicate key \"a\""));
        let err = node(r#"{"op": 0, "op": 1, "outputs": {"one": "x"}}"#);
        assert!(err.unwrap_err().contains("duplicate field `op`"));
        assert!(node(r#"{"op": 0, "args": [{"int": 1, "int": 2}], "outputs": {"one": "x"}}"#).is_err());
        let w = r#"{"dtype": "float32", "shape": [1], "strides": [1], "storage": 0}"#;
        let weights = format!(r#"{{"storages": [], "tensors": {{"w": {w}, "w": {w}}}}}"#);
        assert!(serde_json::from_str::<Weights>(&weights).unwrap_err().to_string().contains("duplicate key \"w\""));
    }

    #[test]
    fn floats_carry_inf_and_nan() {
        let v: Vec<Float> = serde_json::from_str(r#"[1.5, "inf", "-inf", "nan"]"#).unwrap();
        assert_eq!(v[0].0, 1.5);
        assert!(v[1].0.is_infinite() && v[2].0 < 0.0 && v[3].0.is_nan());
        assert_eq!(serde_json::to_string(&v).unwrap(), r#"[1.5,"inf","-inf","nan"]"#);
        assert!(serde_json::from_str::<Float>(r#""1e999x""#).is_err());
    }

    #[test]
    fn floats_round_trip_exactly() {
        // torch.finfo(torch.float32).min, as transformers' attention masks use it: one ULP
        // more and torch refuses to convert it to float32.
        for text in ["-3.4028234663852886e+38", "0.1", "1e-300", "2.2250738585072014e-308", "0.30000000000000004"] {
            let f: Float = serde_json::from_str(text).unwrap();
            assert_eq!(f.0, text.parse::<f64>().unwrap(), "{text}");
        }
    }
}
