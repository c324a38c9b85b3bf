//! kwexport's errors: one variant per failure, each carrying what its message needs.
//!
//! Every variant belongs to one [`ErrorKind`], which says whose fault it is (the file's,
//! its version's, the call's binding or the call's values); the Python runtime maps each
//! kind to its exception class. Messages name the file entry (`weights.tensors["w"]`) or the
//! argument path (`cfg['shift'][0]`), what was expected and what came.

use crate::schema::{FormatVersion, ParamKind};

/// `Result` with kwexport's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Whose fault an error is; one Python exception class each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The file is malformed, corrupt, unsafe or unsupported (`ArtifactError`).
    Artifact,
    /// The file's format version is one this reader cannot read (`VersionError`).
    Version,
    /// A call cannot bind to the saved signature (`SignatureError`).
    Signature,
    /// A call binds, but its values don't match what was exported (`InputError`).
    Input,
}

/// Every failure kwexport reports.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    // ------------------------------------------------------------ container
    /// An empty file.
    #[error("file: truncated: 0 bytes")]
    EmptyFile,
    /// A file shorter than the magic and header length.
    #[error("file: truncated: {len} bytes, shorter than the 16-byte prefix (magic + header length)")]
    TooShort {
        /// The file's length.
        len: u64,
    },
    /// The file does not start with kwexport's magic.
    #[error("file: not a kwexport file: expected magic \"KWEXPORT\", got {found:?}")]
    NotKwexport {
        /// The first 8 bytes, lossily decoded.
        found: String,
    },
    /// A header length past the limit.
    #[error("file: header length {len} exceeds the {max}-byte limit")]
    HeaderTooLong {
        /// The length the file claims.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// A header length past the end of the file.
    #[error("file: truncated: header claims {claimed} bytes, only {remaining} remain")]
    HeaderTruncated {
        /// The length the file claims.
        claimed: u64,
        /// The bytes left after the prefix.
        remaining: u64,
    },
    /// Non-zero bytes between the header and the data section.
    #[error("file: padding after the header must be zero bytes")]
    NonZeroPadding,
    /// A byte range that leaves the data section.
    #[error("{entry}: bytes [{offset}, {offset}+{nbytes}) lie outside the {data_len}-byte data section")]
    OutsideData {
        /// The entry that names the range.
        entry: String,
        /// Its offset in the data section.
        offset: u64,
        /// Its length.
        nbytes: u64,
        /// The data section's length.
        data_len: u64,
    },

    // ------------------------------------------------------------ header
    /// The header is not JSON, or repeats a key.
    #[error("header: invalid JSON: {message}")]
    InvalidJson {
        /// serde_json's message.
        message: String,
    },
    /// The header is JSON but not of the schema's shape.
    #[error("header: {message}")]
    Schema {
        /// serde_json's message, naming the field.
        message: String,
    },

    // ------------------------------------------------------------ versions
    /// No `format_version` field.
    #[error("header: missing format_version")]
    MissingFormatVersion,
    /// A `format_version` that isn't `{major, minor}`.
    #[error("header.format_version: {message}")]
    InvalidFormatVersion {
        /// serde_json's message.
        message: String,
    },
    /// A major version newer than this reader.
    #[error("file format {found} is newer than this runtime, which reads {oldest} to {}.x: upgrade kwexport", current.major)]
    TooNew {
        /// The file's version.
        found: FormatVersion,
        /// The oldest version read here.
        oldest: FormatVersion,
        /// The current version.
        current: FormatVersion,
    },
    /// A version older than the oldest this reader upgrades.
    #[error("file format {found} is older than the oldest this runtime reads ({oldest})")]
    TooOld {
        /// The file's version.
        found: FormatVersion,
        /// The oldest version read here.
        oldest: FormatVersion,
    },
    /// An upgrader met a document it cannot bring forward.
    #[error("upgrader {upgrader}: {problem}")]
    Upgrade {
        /// The upgrader's name.
        upgrader: &'static str,
        /// What it found, naming the entry.
        problem: String,
    },

    // ------------------------------------------------------------ signature
    /// A signature parameter that breaks Python's rules.
    #[error("signature.params[{index}] ({name:?}): {problem}")]
    InvalidParam {
        /// The parameter's position.
        index: usize,
        /// Its name.
        name: String,
        /// The rule it breaks.
        problem: ParamProblem,
    },
    /// A call that cannot bind to the signature, worded as CPython words it.
    #[error("{function}() {problem}")]
    Bind {
        /// How the callable names itself, e.g. `MLP.forward`.
        function: String,
        /// Why the call does not bind.
        problem: BindProblem,
    },

    // ------------------------------------------------------------ trees and inputs
    /// A treespec nested past [`crate::treespec::MAX_DEPTH`].
    #[error("{entry}: nested deeper than {max} levels")]
    TooDeep {
        /// The spec (`inputs.spec`, `outputs`).
        entry: String,
        /// The limit.
        max: usize,
    },
    /// A dict spec that repeats a key.
    #[error("{entry}: duplicate dict key {key}")]
    DuplicateKey {
        /// The spec.
        entry: String,
        /// The key, as Python writes it.
        key: String,
    },
    /// A namedtuple spec whose fields and children differ in number.
    #[error("{entry}: namedtuple {name} has {fields} fields but {children} children")]
    NamedTupleArity {
        /// The spec.
        entry: String,
        /// The class name.
        name: String,
        /// Number of fields.
        fields: usize,
        /// Number of children.
        children: usize,
    },
    /// A namedtuple spec that repeats a field.
    #[error("{entry}: namedtuple {name} repeats field {field:?}")]
    NamedTupleField {
        /// The spec.
        entry: String,
        /// The class name.
        name: String,
        /// The repeated field.
        field: String,
    },
    /// A container spec whose keys and children differ in number.
    #[error("{entry}: {class} has {keys} keys but {children} children")]
    ContainerArity {
        /// The spec.
        entry: String,
        /// The class, `module.qualname`.
        class: String,
        /// Number of keys.
        keys: usize,
        /// Number of children.
        children: usize,
    },
    /// A container spec that repeats a key.
    #[error("{entry}: {class} repeats key {key}")]
    DuplicateChildKey {
        /// The spec.
        entry: String,
        /// The class.
        class: String,
        /// The key, as a path step.
        key: String,
    },
    /// A container spec whose keys don't fit its kind (a `ModelOutput` reached by attribute,
    /// a dataclass by item).
    #[error("{entry}: {class} is a {kind} but its key {key} is not a {expected}")]
    ContainerKeyKind {
        /// The spec.
        entry: String,
        /// The class.
        class: String,
        /// Its kind, as the file names it.
        kind: &'static str,
        /// The key, as a path step.
        key: String,
        /// What keys of that kind are.
        expected: &'static str,
    },
    /// A class name that isn't a dotted Python identifier.
    #[error("{entry}: invalid class name {module:?}.{qualname:?}")]
    ClassName {
        /// The spec.
        entry: String,
        /// Its module.
        module: String,
        /// Its qualified name.
        qualname: String,
    },
    /// A `defaultdict` factory outside [`crate::tables::DEFAULTDICT_FACTORIES`].
    #[error("{entry}: defaultdict factory {factory:?} is not one of {allowed}")]
    DefaultFactory {
        /// The spec.
        entry: String,
        /// The name in the file.
        factory: String,
        /// The allowed names.
        allowed: String,
    },
    /// The input spec and the leaf table disagree.
    #[error("inputs: the spec has {spec} leaves but inputs.leaves describes {described}")]
    InputLeafCount {
        /// Leaves of `inputs.spec`.
        spec: usize,
        /// Entries of `inputs.leaves`.
        described: usize,
    },
    /// The output spec and the graph's outputs disagree.
    #[error("outputs: the spec has {spec} leaves but the graph returns {returned}")]
    OutputLeafCount {
        /// Leaves of `outputs`.
        spec: usize,
        /// Entries of `graph.outputs`.
        returned: usize,
    },
    /// The input spec's root does not fit the signature.
    #[error("inputs.spec: {0}")]
    InputRoot(InputRootProblem),

    // ------------------------------------------------------------ shapes
    /// A symbol listed twice.
    #[error("symbols[{index}]: duplicate symbol {name:?}")]
    DuplicateSymbol {
        /// Its position.
        index: usize,
        /// Its name.
        name: String,
    },
    /// A symbol whose range is empty or negative.
    #[error("symbols[{index}] ({name}): invalid range [{min}, {max:?}]")]
    SymbolRange {
        /// Its position.
        index: usize,
        /// Its name.
        name: String,
        /// Lower bound.
        min: i64,
        /// Upper bound, `None` if unbounded.
        max: Option<i64>,
    },
    /// A static size below zero.
    #[error("{entry}.shape[{dim}]: negative size {size}")]
    NegativeSize {
        /// The input leaf.
        entry: String,
        /// The dimension.
        dim: usize,
        /// The size.
        size: i64,
    },
    /// A symbolic size naming no symbol.
    #[error("{entry}.shape[{dim}]: unknown symbol {symbol:?}")]
    UnknownSymbol {
        /// The input leaf.
        entry: String,
        /// The dimension.
        dim: usize,
        /// The name.
        symbol: String,
    },
    /// A symbolic size outside what kwexport checks.
    #[error("{entry}.shape[{dim}]: unsupported expression {coeff}*{symbol} + {offset}")]
    DimExpression {
        /// The input leaf.
        entry: String,
        /// The dimension.
        dim: usize,
        /// Multiplier.
        coeff: i64,
        /// Symbol.
        symbol: String,
        /// Offset.
        offset: i64,
    },
    /// A dtype outside [`crate::tables::DTYPES`].
    #[error("{entry}: unsupported dtype {dtype:?}")]
    UnsupportedDtype {
        /// The entry.
        entry: String,
        /// The name in the file.
        dtype: String,
    },
    /// A device string torch does not parse.
    #[error("{entry}: invalid device {device:?}")]
    InvalidDevice {
        /// The entry.
        entry: String,
        /// The string in the file.
        device: String,
    },

    // ------------------------------------------------------------ weights
    /// A storage that does not start on the alignment.
    #[error("weights.storages[{index}]: offset {offset} is not {align}-byte aligned")]
    UnalignedStorage {
        /// Its position.
        index: usize,
        /// Its offset.
        offset: u64,
        /// The alignment.
        align: u64,
    },
    /// Two storages that share bytes.
    #[error("weights.storages[{first}] and weights.storages[{second}] overlap")]
    OverlappingStorages {
        /// One.
        first: usize,
        /// The other.
        second: usize,
    },
    /// A weight naming a storage that doesn't exist.
    #[error("{entry}: storage {storage} does not exist ({count} storages)")]
    MissingStorage {
        /// The weight.
        entry: String,
        /// The index it names.
        storage: usize,
        /// How many there are.
        count: usize,
    },
    /// A weight whose shape and strides differ in length.
    #[error("{entry}: {shape} dims in shape but {strides} strides")]
    StrideRank {
        /// The weight.
        entry: String,
        /// Dims of the shape.
        shape: usize,
        /// Number of strides.
        strides: usize,
    },
    /// A storage whose length is not a whole number of the weight's elements.
    #[error("{entry}: storage {storage} of {nbytes} bytes is not a whole number of {dtype} elements")]
    StorageNotWhole {
        /// The weight.
        entry: String,
        /// The storage.
        storage: usize,
        /// Its length.
        nbytes: u64,
        /// The weight's dtype.
        dtype: &'static str,
    },
    /// A negative size, stride or offset.
    #[error("{entry}: negative size, stride or offset")]
    NegativeLayout {
        /// The weight.
        entry: String,
    },
    /// Sizes and strides whose extent overflows.
    #[error("{entry}: shape {shape:?} and strides {strides:?} overflow")]
    LayoutOverflow {
        /// The weight.
        entry: String,
        /// Its shape.
        shape: Vec<i64>,
        /// Its strides.
        strides: Vec<i64>,
    },
    /// A weight that reaches past its storage.
    #[error("{entry}: needs {needed} bytes of storage {storage} but it has {nbytes}")]
    StorageTooSmall {
        /// The weight.
        entry: String,
        /// Bytes it reaches.
        needed: u64,
        /// The storage.
        storage: usize,
        /// The storage's length.
        nbytes: u64,
    },

    // ------------------------------------------------------------ ops and graph
    /// An op listed twice in the op table.
    #[error("ops[{index}] ({name}): listed twice")]
    DuplicateOp {
        /// Its position.
        index: usize,
        /// Its name.
        name: String,
    },
    /// An op name that isn't `namespace::name[.overload]`.
    #[error("ops[{index}] ({name:?}): malformed op name")]
    MalformedOpName {
        /// Its position.
        index: usize,
        /// The name in the file.
        name: String,
    },
    /// A Python operator outside [`crate::tables::PY_OPERATORS`].
    #[error("{entry}: operator.{name} is not an allowed Python operator")]
    OperatorNotAllowed {
        /// The op table entry.
        entry: String,
        /// The operator's name.
        name: String,
    },
    /// A parameter's tensor default that doesn't check out.
    #[error("signature.params[{index}] ({name}): default_weight {weight:?} {problem}")]
    DefaultWeight {
        /// The parameter's index.
        index: usize,
        /// Its name.
        name: String,
        /// The weight it names.
        weight: String,
        /// What is wrong.
        problem: &'static str,
    },
    /// A `torch::` function outside [`crate::tables::SYM_FUNCTIONS`].
    #[error("{entry}: torch.{name} is not an allowed function of symbolic values")]
    SymFunctionNotAllowed {
        /// The op table entry.
        entry: String,
        /// The function's name.
        name: String,
    },
    /// A custom op namespace the caller didn't allow.
    #[error("{entry}: op namespace {namespace:?} is not allowed (pass allow_ops=[\"{namespace}::*\"] to load it, once its library is registered)")]
    NamespaceNotAllowed {
        /// The op table entry.
        entry: String,
        /// The namespace.
        namespace: String,
    },
    /// A torch op without an overload name.
    #[error("{entry}: a torch op needs an overload name, e.g. {op}.default")]
    MissingOverload {
        /// The op table entry.
        entry: String,
        /// The op.
        op: String,
    },
    /// An op the running torch doesn't have.
    #[error("{entry}: op not found in the running torch {torch} (custom ops must be registered before loading)")]
    OpNotFound {
        /// The op table entry.
        entry: String,
        /// The running torch's version.
        torch: String,
    },
    /// An op whose schema changed in a way no op upgrader handles.
    #[error("{entry}: the op's schema changed incompatibly and no op upgrader is registered: saved with torch {saved_torch} as `{recorded}`, the running torch {torch} has `{current}`")]
    OpSchemaChanged {
        /// The op table entry.
        entry: String,
        /// The torch that wrote the file.
        saved_torch: String,
        /// The schema it recorded.
        recorded: String,
        /// The running torch's version.
        torch: String,
        /// The running torch's schema.
        current: String,
    },
    /// An op upgrader that could not rewrite a node.
    #[error("{entry}: op upgrader {upgrader}: {problem}")]
    OpUpgrade {
        /// The op table entry.
        entry: String,
        /// The op upgrader.
        upgrader: &'static str,
        /// What it found.
        problem: String,
    },
    /// A graph that breaks a structural rule.
    #[error("{at}: {problem}")]
    Graph {
        /// The graph entry, e.g. `graph.nodes[3] (aten::add.Tensor)`.
        at: String,
        /// The rule it breaks.
        problem: GraphProblem,
    },
    /// A mutation that writes nothing it may, or a mutable weight nothing writes.
    #[error("graph.mutations: {0}")]
    Mutation(MutationProblem),
    /// A file without methods.
    #[error("methods: a file holds at least one method")]
    NoMethods,
    /// A method name that is not a public Python identifier.
    #[error("methods[{0:?}]: a method name is an ASCII Python identifier of at most 128 bytes, not starting with '_'")]
    MethodName(String),
    /// Methods exported on different devices.
    #[error("methods.{method}: its inputs are on {device}, but methods.{first}'s are on {first_device}; a file's methods share one device")]
    MethodDevices {
        /// The first method with tensor inputs.
        first: String,
        /// Its device.
        first_device: String,
        /// A method on another device.
        method: String,
        /// That device.
        device: String,
    },
    /// A failure inside one method's entries: the inner error names the entry within it.
    #[error("methods.{method}.{source}")]
    InMethod {
        /// The method's name.
        method: String,
        /// What is wrong in it.
        source: Box<Error>,
    },
    /// A higher-order op's node that doesn't fit its layout or its subgraphs.
    #[error("{at}: {problem}")]
    Hop {
        /// The node, or the subgraph.
        at: String,
        /// How.
        problem: HopProblem,
    },
    /// A node whose arguments don't fit its op's schema.
    #[error("{at}: {problem}")]
    NodeArgs {
        /// The node.
        at: String,
        /// How they don't fit.
        problem: NodeProblem,
    },
    /// A literal naming a layout or memory format torch doesn't have.
    #[error("{entry}: unknown {kind} {name:?}")]
    UnknownEnum {
        /// The node.
        entry: String,
        /// `layout` or `memory format`.
        kind: &'static str,
        /// The name in the file.
        name: String,
    },

    // ------------------------------------------------------------ extra files and identity
    /// An extra-file name that could escape a folder.
    #[error("{entry}: unsafe extra-file name")]
    UnsafeExtraName {
        /// The entry, `extra_files["name"]`.
        entry: String,
    },
    /// An extra file declared UTF-8 that isn't.
    #[error("{entry}: declared UTF-8 but is not")]
    NotUtf8 {
        /// The entry.
        entry: String,
    },
    /// A pickled program whose file changed since it was pickled.
    #[error("file: {path} changed since the program was pickled (sha256 {found}, expected {expected})")]
    FileChanged {
        /// The file.
        path: String,
        /// Its hash now.
        found: String,
        /// Its hash when pickled.
        expected: String,
    },

    // ------------------------------------------------------------ call values
    /// A value of the wrong kind, structure, dtype, device or constant value.
    #[error("{path}: expected {expected}, got {got}")]
    Mismatch {
        /// The argument path, e.g. `cfg['shift'][0]`.
        path: String,
        /// What was exported.
        expected: String,
        /// What came.
        got: String,
    },
    /// A tensor of the wrong shape.
    #[error("{path}: {problem}")]
    Shape {
        /// The argument path.
        path: String,
        /// How the shape differs (boxed: the largest problem, and only on the error path).
        problem: Box<ShapeProblem>,
    },
    /// `*args` of another length than at export.
    #[error("*{name}: expected {expected} extra positional argument(s), as exported, got {got}")]
    VarPositionalCount {
        /// The `*args` parameter.
        name: String,
        /// Items at export.
        expected: usize,
        /// Items now.
        got: usize,
    },
    /// A `**kwargs` entry that wasn't there at export, or one that's missing.
    #[error("{name}: {} keyword argument: at export **{var} held {}", if *.missing { "missing" } else { "unexpected" }, held_list(held))]
    VarKeywordEntry {
        /// The entry.
        name: String,
        /// Missing (`true`) or unexpected (`false`).
        missing: bool,
        /// The `**kwargs` parameter.
        var: String,
        /// The entries at export.
        held: Vec<String>,
    },
    /// A value that could not be read (its attribute access raised).
    #[error("{path}: {message}")]
    Unreadable {
        /// The argument path.
        path: String,
        /// What Python said.
        message: String,
    },
}

fn held_list(held: &[String]) -> String {
    if held.is_empty() {
        "nothing".to_owned()
    } else {
        held.iter().map(|n| format!("'{n}'")).collect::<Vec<_>>().join(", ")
    }
}

impl Error {
    /// Whose fault the error is: the Python class it becomes.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::TooNew { .. } | Error::TooOld { .. } => ErrorKind::Version,
            Error::InMethod { source, .. } => source.kind(),
            Error::Bind { .. } => ErrorKind::Signature,
            Error::Mismatch { .. }
            | Error::Shape { .. }
            | Error::VarPositionalCount { .. }
            | Error::VarKeywordEntry { .. }
            | Error::Unreadable { .. } => ErrorKind::Input,
            _ => ErrorKind::Artifact,
        }
    }
}

/// A Python rule a signature parameter breaks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParamProblem {
    /// Its name is not an identifier.
    #[error("not a Python identifier")]
    NotIdentifier,
    /// Another parameter has its name.
    #[error("duplicate parameter name")]
    DuplicateName,
    /// Kinds out of Python's order.
    #[error("a {kind:?} parameter cannot follow a {after:?} one")]
    Order {
        /// Its kind.
        kind: ParamKind,
        /// The kind before it.
        after: ParamKind,
    },
    /// A positional parameter without a default after one with a default.
    #[error("a parameter without a default follows one with a default")]
    DefaultOrder,
    /// `*args` or `**kwargs` with a default.
    #[error("a variadic parameter cannot have a default")]
    VariadicDefault,
    /// A second `*args` or `**kwargs`.
    #[error("a second {kind:?} parameter")]
    SecondVariadic {
        /// Which.
        kind: ParamKind,
    },
}

/// Why a call doesn't bind, in CPython's words.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BindProblem {
    /// More positional arguments than positional parameters, and no `*args`.
    #[error("takes {} but {} given", takes(*.required, *.max), given_text(*.given, *.keyword_only_given))]
    TooManyPositional {
        /// Positional parameters without defaults.
        required: usize,
        /// Positional parameters.
        max: usize,
        /// Positional arguments given.
        given: usize,
        /// Keyword-only arguments given alongside.
        keyword_only_given: usize,
    },
    /// A parameter given by position and by name.
    #[error("got multiple values for argument '{0}'")]
    MultipleValues(String),
    /// A keyword that names no parameter, and no `**kwargs`.
    #[error("got an unexpected keyword argument '{0}'")]
    UnexpectedKeyword(String),
    /// Positional-only parameters passed by name, and no `**kwargs`.
    #[error("got some positional-only arguments passed as keyword arguments: '{}'", .0.join(", "))]
    PositionalOnlyByName(Vec<String>),
    /// Required parameters not given.
    #[error("missing {} required {kind} argument{}: {}", .names.len(), if .names.len() == 1 { "" } else { "s" }, name_list(.names))]
    Missing {
        /// `positional` or `keyword-only`.
        kind: &'static str,
        /// Their names.
        names: Vec<String>,
    },
}

fn takes(required: usize, max: usize) -> String {
    if required < max {
        format!("from {required} to {max} positional arguments")
    } else {
        format!("{max} positional argument{}", if max == 1 { "" } else { "s" })
    }
}

fn given_text(given: usize, kw_only: usize) -> String {
    if kw_only > 0 {
        let p = if given == 1 { "" } else { "s" };
        let k = if kw_only == 1 { "" } else { "s" };
        format!("{given} positional argument{p} (and {kw_only} keyword-only argument{k}) were")
    } else if given == 1 {
        "1 was".to_owned()
    } else {
        format!("{given} were")
    }
}

fn name_list(names: &[String]) -> String {
    let quoted: Vec<String> = names.iter().map(|n| format!("'{n}'")).collect();
    match quoted.as_slice() {
        [] => String::new(),
        [one] => one.clone(),
        [a, b] => format!("{a} and {b}"),
        [init @ .., last] => format!("{}, and {last}", init.join(", ")),
    }
}

/// How the input spec's root fails to fit the signature.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InputRootProblem {
    /// Not `((args...), {kwargs...})`.
    #[error("the root must be a tuple of (a tuple of positional arguments, a dict of keyword arguments)")]
    Shape,
    /// Fewer positional entries than positional parameters.
    #[error("{entries} positional entries for {params} positional parameters")]
    TooFewPositional {
        /// Entries.
        entries: usize,
        /// Parameters.
        params: usize,
    },
    /// Extra positional entries without `*args`.
    #[error("extra positional entries but the signature has no *args")]
    ExtraPositional,
    /// A keyword-only parameter without an entry.
    #[error("keyword-only parameter {0:?} has no entry")]
    MissingKeyword(String),
    /// A keyword entry whose key is not a string.
    #[error("keyword entry {0} is not a string")]
    NonStringKeyword(String),
    /// A keyword entry for no parameter, and no `**kwargs`.
    #[error("keyword entry {0:?} matches no keyword-only parameter")]
    UnknownKeyword(String),
}

/// A structural rule of the graph.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GraphProblem {
    /// A graph input naming no weight.
    #[error("weight {0:?} is not in weights.tensors")]
    UnknownWeight(String),
    /// A graph input naming a user leaf past the input spec.
    #[error("user leaf {leaf} out of range (the input spec has {leaves})")]
    LeafOutOfRange {
        /// The index.
        leaf: usize,
        /// Leaves of the spec.
        leaves: usize,
    },
    /// Two graph inputs for one user leaf.
    #[error("user leaf {0} bound twice")]
    LeafBoundTwice(usize),
    /// A graph input name defined twice.
    #[error("value defined twice")]
    InputDefinedTwice,
    /// A node output name defined twice.
    #[error("value {0:?} defined twice")]
    DefinedTwice(String),
    /// A node naming an op past the op table.
    #[error("op {op} is not in the op table ({ops} ops)")]
    UnknownOp {
        /// The index.
        op: usize,
        /// Entries of the table.
        ops: usize,
    },
    /// A reference to a value not yet defined.
    #[error("value {0:?} is used before it is defined (or never defined)")]
    Undefined(String),
}

/// How the graph's mutations and the mutable weights disagree.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MutationProblem {
    /// A mutation of a weight that doesn't exist.
    #[error("weight {0:?} is not in weights.tensors")]
    UnknownWeight(String),
    /// A mutation of a weight not marked mutable.
    #[error("weight {0:?} is written but not marked mutable")]
    NotMutable(String),
    /// A weight marked mutable that no mutation writes.
    #[error("weight {0:?} is marked mutable but nothing writes it")]
    Unwritten(String),
    /// Two mutations of one target.
    #[error("{0} is written twice")]
    WrittenTwice(String),
    /// A mutation of a user leaf out of range, or not a tensor.
    #[error("user leaf {0} is not a tensor input")]
    NotATensorInput(usize),
}

/// How a higher-order op's node fails to fit its layout or its subgraphs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HopProblem {
    /// Arguments out of the op's layout.
    #[error("expected {0}")]
    Layout(&'static str),
    /// A subgraph name not in `subgraphs`.
    #[error("no subgraph {0:?}")]
    UnknownSubgraph(String),
    /// Operands that don't match the subgraph's inputs.
    #[error("subgraph {subgraph:?} takes {takes} inputs, given {given}")]
    OperandCount {
        /// The subgraph.
        subgraph: String,
        /// Its inputs.
        takes: usize,
        /// Operands given.
        given: usize,
    },
    /// A subgraph that returns other than its op's layout says.
    #[error("subgraph {subgraph:?} returns {returns} values, where the op needs {want}")]
    Returns {
        /// The subgraph.
        subgraph: String,
        /// Its outputs.
        returns: usize,
        /// What the layout needs.
        want: usize,
    },
    /// `cond`'s branches of different arity.
    #[error("cond's branches take or return different numbers of values")]
    BranchesDiffer,
    /// More outputs bound than the subgraph returns.
    #[error("binds more outputs than subgraph {subgraph:?} returns ({returns})")]
    Outputs {
        /// The subgraph.
        subgraph: String,
        /// Its outputs.
        returns: usize,
    },
    /// A subgraph that runs itself.
    #[error("the subgraph runs itself")]
    Recursive,
    /// A subgraph passed to an op that isn't a higher-order op.
    #[error("only higher-order ops take subgraphs")]
    NotHigherOrder,
    /// A higher-order op kwexport doesn't run.
    #[error("higher-order op {0:?} is not one kwexport runs (cond, wrap_with_set_grad_enabled, wrap_with_autocast)")]
    Unsupported(String),
}

/// How a node's arguments fail to fit its op's schema.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NodeProblem {
    /// More positional arguments than the op takes.
    #[error("{given} positional arguments, but the op takes {takes}")]
    TooManyPositional {
        /// Given.
        given: usize,
        /// Taken.
        takes: usize,
    },
    /// A keyword the op doesn't have.
    #[error("the op has no argument {0:?}")]
    NoSuchArgument(String),
    /// An argument given by position and by name.
    #[error("argument {0:?} given by position and by name")]
    GivenTwice(String),
    /// A required argument not given.
    #[error("required argument {0:?} is missing")]
    Missing(String),
    /// Outputs that don't match the op's returns.
    #[error("outputs do not match the op's {0} returns")]
    Returns(usize),
}

/// How a tensor's shape differs from the exported one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShapeProblem {
    /// Another number of dimensions.
    #[error("expected a tensor with {expected} dimension{}, got {} (shape {shape:?})", if *.expected == 1 { "" } else { "s" }, .shape.len())]
    Rank {
        /// Exported rank.
        expected: usize,
        /// The shape that came.
        shape: Vec<i64>,
    },
    /// A static dimension of another size.
    #[error("dimension {dim} must be {expected} (static at export), got {size} (shape {shape:?})")]
    Static {
        /// The dimension.
        dim: usize,
        /// Its exported size.
        expected: i64,
        /// The size that came.
        size: i64,
        /// The shape that came.
        shape: Vec<i64>,
    },
    /// A symbolic dimension inconsistent with an earlier one.
    #[error("dimension {dim} is {expr} = {want}, since {symbol} = {value} from {from_path} dimension {from_dim}, got {size}")]
    Inconsistent {
        /// The dimension.
        dim: usize,
        /// Its expression, e.g. `2*batch`.
        expr: String,
        /// The size it must have.
        want: i64,
        /// The symbol.
        symbol: String,
        /// The symbol's value.
        value: i64,
        /// Where the value was set.
        from_path: String,
        /// Which dimension there.
        from_dim: usize,
        /// The size that came.
        size: i64,
    },
    /// A size the expression can't take.
    #[error("dimension {dim} is {expr}, which cannot be {size}")]
    Unreachable {
        /// The dimension.
        dim: usize,
        /// Its expression.
        expr: String,
        /// The size that came.
        size: i64,
    },
    /// A symbol outside its range.
    #[error("dimension {dim} is {expr} with {symbol} in {range}, {got}")]
    OutOfRange {
        /// The dimension.
        dim: usize,
        /// Its expression.
        expr: String,
        /// The symbol.
        symbol: String,
        /// `[min, max]`.
        range: String,
        /// The size (and the symbol's value) that came.
        got: String,
    },
}
