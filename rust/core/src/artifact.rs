//! A whole file, opened: the container split, the header parsed and brought to the current
//! version, then every cross-field rule checked once. What comes out is an [`Artifact`]
//! that the runtime can trust without re-checking on the call path.

use std::collections::BTreeMap;

use crate::binder::Binder;
use crate::checks::{self, DimCheck, Symbol};
use crate::container::{self, Layout};
use crate::error::{Error, InputRootProblem, MutationProblem, Result};
use crate::graph::{self, OpName, SlotGraph};
use crate::schema::{
    self, DictEntry, Document, Encoding, FormatVersion, Key, LeafSpec, Method, MutationTarget, ParamKind, TreeSpec,
};
use crate::treespec;
use crate::upgrade;
use crate::weights::{self, CheckedWeight};

/// A file's header parsed and upgraded, not yet validated. The runtime stops here to let
/// op upgraders rewrite nodes for the running torch before validation.
#[derive(Debug, Clone)]
pub struct Parsed {
    /// Where the header and data sections lie.
    pub layout: Layout,
    /// The header, at the current format version.
    pub document: Document,
    /// The version the file was written in.
    pub file_format_version: FormatVersion,
    /// The upgraders that brought it to the current version, in order.
    pub upgraders: Vec<&'static str>,
}

/// A file that passed every check.
#[derive(Debug, Clone)]
pub struct Artifact {
    /// Where the header and data sections lie.
    pub layout: Layout,
    /// The header, at the current format version.
    pub document: Document,
    /// The version the file was written in.
    pub file_format_version: FormatVersion,
    /// The upgraders that brought it to the current version.
    pub upgraders: Vec<&'static str>,
    /// Every weight, checked against its storage.
    pub weights: BTreeMap<String, CheckedWeight>,
    /// Each method, checked, by name (as `document.methods`).
    pub methods: BTreeMap<String, CheckedMethod>,
}

/// One method that passed every check.
#[derive(Debug, Clone)]
pub struct CheckedMethod {
    /// The signature, ready to bind calls.
    pub binder: Binder,
    /// The symbol table.
    pub symbols: Vec<Symbol>,
    /// Each input leaf's path, as a caller would write it: `cfg['shift'][0]`.
    pub leaf_paths: Vec<String>,
    /// Each input leaf's shape checks; `None` for constant leaves.
    pub leaf_dims: Vec<Option<Vec<DimCheck>>>,
    /// The op table's names.
    pub ops: Vec<std::sync::Arc<OpName>>,
    /// The graph, in slots.
    pub graph: SlotGraph,
    /// The subgraphs higher-order ops run, in slots, by name.
    pub subgraphs: BTreeMap<String, SlotGraph>,
}

/// Parses a whole file's bytes: container, header JSON, upgraders, typed document.
pub fn parse(bytes: &[u8]) -> Result<Parsed> {
    let layout = container::parse_layout(bytes)?;
    let header = &bytes[layout.header.clone()];
    let invalid = |e: serde_json::Error| Error::InvalidJson { message: e.to_string() };
    // A file in the current format parses straight into the schema, which refuses a
    // repeated key wherever it reads one. Anything else (older formats, a document the schema
    // refuses) is checked for repeated keys anywhere and goes through the upgraders, which
    // also give the precise error.
    if let Ok(document) = serde_json::from_slice::<Document>(header) {
        if document.format_version == upgrade::CURRENT {
            return Ok(Parsed { layout, document, file_format_version: upgrade::CURRENT, upgraders: Vec::new() });
        }
    }
    schema::check_unique_keys(header).map_err(invalid)?;
    let header: serde_json::Value = serde_json::from_slice(header).map_err(invalid)?;
    let up = upgrade::upgrade(header)?;
    let document: Document =
        serde_json::from_value(up.document).map_err(|e| Error::Schema { message: e.to_string() })?;
    Ok(Parsed { layout, document, file_format_version: up.from, upgraders: up.applied })
}

impl Artifact {
    /// The device the program was exported on; see [`Document::home_device`].
    pub fn home_device(&self) -> &str {
        self.document.home_device()
    }
}

impl Method {
    /// The device of the method's first tensor input, if it has one.
    pub fn input_device(&self) -> Option<&str> {
        self.inputs.leaves.iter().find_map(|l| match l {
            LeafSpec::Tensor(t) => Some(t.device.as_str()),
            LeafSpec::Constant(_) => None,
        })
    }
}

impl Document {
    /// The device the program was exported on: its methods' tensor inputs' (validation
    /// checks they agree), or the CPU for a program without tensor inputs. Device literals of
    /// the graph on this device's type follow the device a program is loaded on.
    pub fn home_device(&self) -> &str {
        self.methods.values().find_map(Method::input_device).unwrap_or("cpu")
    }
}

/// Parses and validates a whole file's bytes.
pub fn open(bytes: &[u8]) -> Result<Artifact> {
    parse(bytes)?.validate(bytes)
}

impl Parsed {
    /// Checks every cross-field rule; `bytes` is the whole file (extra files are read from it).
    pub fn validate(self, bytes: &[u8]) -> Result<Artifact> {
        let Parsed { layout, document: doc, file_format_version, upgraders } = self;
        let weights = weights::validate(&doc.weights, &layout)?;
        if doc.methods.is_empty() {
            return Err(Error::NoMethods);
        }
        let mut first_device: Option<(&str, &str)> = None;
        for (name, m) in &doc.methods {
            if !crate::tables::is_method_name(name) {
                return Err(Error::MethodName(name.clone()));
            }
            match (first_device, m.input_device()) {
                (None, Some(device)) => first_device = Some((name, device)),
                (Some((first, first_device)), Some(device)) if device != first_device => {
                    return Err(Error::MethodDevices {
                        first: first.to_owned(),
                        first_device: first_device.to_owned(),
                        method: name.clone(),
                        device: device.to_owned(),
                    })
                }
                _ => {}
            }
        }
        let methods = doc
            .methods
            .iter()
            .map(|(name, m)| {
                let checked = validate_method(m, &doc, &weights)
                    .map_err(|e| Error::InMethod { method: name.clone(), source: Box::new(e) })?;
                Ok((name.clone(), checked))
            })
            .collect::<Result<BTreeMap<_, _>>>()?;
        for (name, t) in &doc.weights.tensors {
            let written = || doc.methods.values().flat_map(|m| &m.graph.mutations);
            if t.mutable && !written().any(|m| m.target == MutationTarget::Weight(name.clone())) {
                return Err(Error::Mutation(MutationProblem::Unwritten(name.clone())));
            }
        }
        for (name, f) in &doc.extra_files {
            let entry = format!("extra_files[{name:?}]");
            if !crate::tables::is_safe_extra_name(name) {
                return Err(Error::UnsafeExtraName { entry });
            }
            let range = container::data_range(&layout, f.offset, f.nbytes, &entry)?;
            if f.encoding == Encoding::Utf8 && std::str::from_utf8(&bytes[range]).is_err() {
                return Err(Error::NotUtf8 { entry });
            }
        }
        Ok(Artifact { layout, document: doc, file_format_version, upgraders, weights, methods })
    }
}

/// Checks one method against itself and the file's weights; errors name entries within it.
fn validate_method(m: &Method, doc: &Document, weights: &BTreeMap<String, CheckedWeight>) -> Result<CheckedMethod> {
    let binder = Binder::new(&m.signature)?;
    let n_leaves = treespec::validate(&m.inputs.spec, "inputs.spec")?;
    if n_leaves != m.inputs.leaves.len() {
        return Err(Error::InputLeafCount { spec: n_leaves, described: m.inputs.leaves.len() });
    }
    let n_out = treespec::validate(&m.outputs, "outputs")?;
    if n_out != m.graph.outputs.len() {
        return Err(Error::OutputLeafCount { spec: n_out, returned: m.graph.outputs.len() });
    }
    let leaf_paths = input_leaf_paths(&m.inputs.spec, &binder)?;
    let symbols = checks::symbols(&m.symbols)?;
    let leaf_dims = m
        .inputs
        .leaves
        .iter()
        .enumerate()
        .map(|(i, leaf)| match leaf {
            LeafSpec::Tensor(t) => {
                let what = format!("inputs.leaves[{i}]");
                if crate::tables::DType::parse(&t.dtype).is_none() {
                    return Err(Error::UnsupportedDtype { entry: what, dtype: t.dtype.clone() });
                }
                checks::dims(&t.shape, &symbols, &what).map(Some)
            }
            LeafSpec::Constant(_) => Ok(None),
        })
        .collect::<Result<Vec<_>>>()?;
    for (index, p) in m.signature.params.iter().enumerate() {
        if let Some(weight) = &p.default_weight {
            let problem = if p.default.is_some() {
                "given beside a default"
            } else if !weights.contains_key(weight) {
                "names no entry of weights.tensors"
            } else {
                continue;
            };
            return Err(Error::DefaultWeight { index, name: p.name.clone(), weight: weight.clone(), problem });
        }
    }
    let ops = graph::op_names(&m.ops)?;
    let graph = graph::validate(&m.graph, &ops, n_leaves, |w| weights.contains_key(w))?;
    let subgraphs = m
        .subgraphs
        .iter()
        .map(|(name, sub)| Ok((name.clone(), graph::validate_subgraph(sub, &ops, name)?)))
        .collect::<Result<BTreeMap<_, _>>>()?;
    crate::hops::check(&graph, &subgraphs)?;
    check_mutations(m, doc)?;
    Ok(CheckedMethod { binder, symbols, leaf_paths, leaf_dims, ops, graph, subgraphs })
}

/// Every mutation writes a weight marked mutable, or a tensor input, once. (That every weight
/// marked mutable is written by some method is a file-level rule.)
fn check_mutations(m: &Method, doc: &Document) -> Result<()> {
    let err = |p| Err(Error::Mutation(p));
    let mut written = std::collections::HashSet::new();
    for mutation in &m.graph.mutations {
        match &mutation.target {
            MutationTarget::Weight(name) => match doc.weights.tensors.get(name) {
                None => return err(MutationProblem::UnknownWeight(name.clone())),
                Some(t) if !t.mutable => return err(MutationProblem::NotMutable(name.clone())),
                Some(_) => {}
            },
            MutationTarget::User(leaf) => {
                if !matches!(m.inputs.leaves.get(*leaf), Some(LeafSpec::Tensor(_))) {
                    return err(MutationProblem::NotATensorInput(*leaf));
                }
            }
        }
        if !written.insert(&mutation.target) {
            let what = match &mutation.target {
                MutationTarget::Weight(name) => format!("weight {name:?}"),
                MutationTarget::User(leaf) => format!("user leaf {leaf}"),
            };
            return err(MutationProblem::WrittenTwice(what));
        }
    }
    Ok(())
}

/// The input spec's root: `(args, kwargs)` as `(a tuple of positional entries, a dict of
/// keyword entries)`.
pub fn split_root(spec: &TreeSpec) -> Result<(&[TreeSpec], &[DictEntry])> {
    if let TreeSpec::Tuple { children } = spec {
        if let [TreeSpec::Tuple { children: args }, TreeSpec::Dict { entries }] = children.as_slice() {
            return Ok((args, entries));
        }
    }
    Err(Error::InputRoot(InputRootProblem::Shape))
}

/// Checks the root `(args, kwargs)` against the signature and names every leaf's path.
fn input_leaf_paths(spec: &TreeSpec, binder: &Binder) -> Result<Vec<String>> {
    let bad = |p| Err(Error::InputRoot(p));
    let (args, kwargs) = split_root(spec)?;
    let mut paths = Vec::new();
    let n_pos = binder.n_positional();
    if args.len() < n_pos {
        return bad(InputRootProblem::TooFewPositional { entries: args.len(), params: n_pos });
    }
    if args.len() > n_pos && binder.var_positional().is_none() {
        return bad(InputRootProblem::ExtraPositional);
    }
    for (i, child) in args.iter().enumerate() {
        let root = match binder.var_positional() {
            Some(vp) if i >= n_pos => format!("{}[{}]", binder.params[vp].name, i - n_pos),
            _ => binder.params[i].name.clone(),
        };
        treespec::leaf_paths(child, &root, &mut paths);
    }
    for p in binder.params.iter().filter(|p| p.kind == ParamKind::KeywordOnly) {
        if !kwargs.iter().any(|e| e.key == Key::Str(p.name.clone())) {
            return bad(InputRootProblem::MissingKeyword(p.name.clone()));
        }
    }
    for e in kwargs {
        let Key::Str(name) = &e.key else {
            return bad(InputRootProblem::NonStringKeyword(e.key.to_string()));
        };
        let is_kw_only = binder.params.iter().any(|p| &p.name == name && p.kind == ParamKind::KeywordOnly);
        if !is_kw_only && binder.var_keyword().is_none() {
            return bad(InputRootProblem::UnknownKeyword(name.clone()));
        }
        treespec::leaf_paths(&e.value, name, &mut paths);
    }
    Ok(paths)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::json;

    /// A valid 4.0 file: `f(x, *, scale)` with one weight and one extra file.
    pub(crate) fn file(mutate: impl FnOnce(&mut serde_json::Value)) -> Vec<u8> {
        let mut header = json!({
            "format_version": {"major": 4, "minor": 0},
            "producer": {"kwexport": "0.1.0", "torch": "2.13.0", "python": "3.11.7"},
            "methods": {"forward": {
            "signature": {"name": "f", "params": [
                {"name": "x", "kind": "positional_or_keyword"},
                {"name": "scale", "kind": "keyword_only", "default": {"float": 0.5}}]},
            "inputs": {"spec": {"type": "tuple", "children": [
                            {"type": "tuple", "children": [{"type": "leaf"}]},
                            {"type": "dict", "entries": [{"key": {"str": "scale"}, "value": {"type": "leaf"}}]}]},
                       "leaves": [{"tensor": {"dtype": "float32", "device": "cpu",
                                              "shape": [{"symbolic": {"symbol": "s0", "coeff": 1, "offset": 0}}, {"static": 2}]}},
                                  {"constant": {"float": 0.5}}]},
            "outputs": {"type": "leaf"},
            "symbols": [{"name": "s0", "min": 2, "max": 8}],
            "ops": [{"name": "aten::mul.Tensor", "schema": null}],
            "graph": {"inputs": [{"name": "w", "source": {"weight": "w"}}, {"name": "x", "source": {"user": 0}}],
                      "nodes": [{"op": 0, "args": [{"ref": "x"}, {"ref": "w"}], "outputs": {"one": "y"}}],
                      "outputs": [{"ref": "y"}]}}},
            "weights": {"storages": [{"offset": 0, "nbytes": 8}],
                        "tensors": {"w": {"dtype": "float32", "shape": [2], "strides": [1], "storage": 0}}},
            "extra_files": {"notes.txt": {"offset": 64, "nbytes": 2, "encoding": "utf8"}}
        });
        mutate(&mut header);
        let blob = serde_json::to_vec(&header).unwrap();
        let mut f = crate::tables::MAGIC.to_vec();
        f.extend((blob.len() as u64).to_le_bytes());
        f.extend(blob);
        f.resize(f.len().div_ceil(64) * 64, 0);
        f.extend([0u8; 64]);
        f.extend(b"hi");
        f
    }

    #[test]
    fn opens_a_valid_file() {
        let a = open(&file(|_| {})).unwrap();
        assert_eq!(a.methods["forward"].leaf_paths, ["x", "scale"]);
        assert_eq!(a.methods["forward"].leaf_dims[0].as_ref().unwrap().len(), 2);
        assert!(a.methods["forward"].leaf_dims[1].is_none());
        assert_eq!(a.methods["forward"].graph.nodes.len(), 1);
        assert_eq!(a.weights["w"].shape, [2]);
    }

    #[test]
    fn tensor_defaults_name_a_weight() {
        let a =
            open(&file(|h| h["methods"]["forward"]["signature"]["params"][0]["default_weight"] = json!("w"))).unwrap();
        assert!(a.methods["forward"].binder.params[0].has_default());
        let err = |m: fn(&mut serde_json::Value)| open(&file(m)).unwrap_err().to_string();
        assert_eq!(
            err(|h| h["methods"]["forward"]["signature"]["params"][0]["default_weight"] = json!("ghost")),
            "methods.forward.signature.params[0] (x): default_weight \"ghost\" names no entry of weights.tensors"
        );
        assert_eq!(
            err(|h| h["methods"]["forward"]["signature"]["params"][1]["default_weight"] = json!("w")),
            "methods.forward.signature.params[1] (scale): default_weight \"w\" given beside a default"
        );
    }

    #[test]
    fn refuses_cross_field_errors() {
        let err = |m: fn(&mut serde_json::Value)| open(&file(m)).unwrap_err().to_string();
        assert_eq!(
            err(|h| h["methods"]["forward"]["inputs"]["leaves"]
                .as_array_mut()
                .unwrap()
                .push(json!({"constant": {"int": 1}}))),
            "methods.forward.inputs: the spec has 2 leaves but inputs.leaves describes 3"
        );
        assert_eq!(
            err(|h| {
                h["methods"]["forward"]["inputs"]["spec"]["children"][1]["entries"] = json!([]);
                h["methods"]["forward"]["inputs"]["leaves"].as_array_mut().unwrap().pop();
            }),
            "methods.forward.inputs.spec: keyword-only parameter \"scale\" has no entry"
        );
        assert_eq!(
            err(|h| h["methods"]["forward"]["inputs"]["leaves"][0]["tensor"]["dtype"] = json!("float8")),
            "methods.forward.inputs.leaves[0]: unsupported dtype \"float8\""
        );
        assert_eq!(
            err(|h| h["extra_files"]["../x"] = json!({"offset": 0, "nbytes": 1, "encoding": "bytes"})),
            "extra_files[\"../x\"]: unsafe extra-file name"
        );
        assert_eq!(
            err(|h| h["extra_files"]["notes.txt"]["nbytes"] = json!(9)),
            "extra_files[\"notes.txt\"]: bytes [64, 64+9) lie outside the 66-byte data section"
        );
        assert_eq!(
            err(|h| h["methods"]["forward"]["graph"]["outputs"] = json!([])),
            "methods.forward.outputs: the spec has 1 leaves but the graph returns 0"
        );
        assert_eq!(
            err(|h| h["methods"]["forward"]["inputs"]["spec"] = json!({"type": "list", "children": [{"type": "leaf"}, {"type": "leaf"}]})),
            "methods.forward.inputs.spec: the root must be a tuple of (a tuple of positional arguments, a dict of keyword arguments)"
        );
    }

    #[test]
    fn checks_mutations_against_mutable_weights() {
        let err = |m: fn(&mut serde_json::Value)| open(&file(m)).unwrap_err().to_string();
        let write_w = |h: &mut serde_json::Value| {
            h["methods"]["forward"]["graph"]["mutations"] = json!([{"target": {"weight": "w"}, "value": {"ref": "y"}}]);
        };
        assert_eq!(err(write_w), "methods.forward.graph.mutations: weight \"w\" is written but not marked mutable");
        assert_eq!(
            err(|h| h["weights"]["tensors"]["w"]["mutable"] = json!(true)),
            "graph.mutations: weight \"w\" is marked mutable but nothing writes it"
        );
        let ok = open(&file(|h| {
            h["weights"]["tensors"]["w"]["mutable"] = json!(true);
            h["methods"]["forward"]["graph"]["mutations"] = json!([{"target": {"weight": "w"}, "value": {"ref": "y"}}]);
        }))
        .unwrap();
        assert_eq!((ok.methods["forward"].graph.outputs.len(), ok.methods["forward"].graph.n_user_outputs), (2, 1));
        assert_eq!(
            err(|h| h["methods"]["forward"]["graph"]["mutations"] =
                json!([{"target": {"weight": "nope"}, "value": {"ref": "y"}}])),
            "methods.forward.graph.mutations: weight \"nope\" is not in weights.tensors"
        );
        assert_eq!(
            err(|h| h["methods"]["forward"]["graph"]["mutations"] =
                json!([{"target": {"user": 1}, "value": {"ref": "y"}}])),
            "methods.forward.graph.mutations: user leaf 1 is not a tensor input"
        );
        assert!(err(|h| h["methods"]["forward"]["graph"]["mutations"] =
            json!([{"target": {"user": 0}, "value": {"ref": "zz"}}]))
        .contains("used before it is defined"));
    }

    #[test]
    fn methods_share_the_weights_and_state() {
        // A second method reading `w`, and `w` as state that only `step` writes.
        let two = |h: &mut serde_json::Value| {
            let mut step = h["methods"]["forward"].clone();
            step["graph"]["mutations"] = json!([{"target": {"weight": "w"}, "value": {"ref": "y"}}]);
            h["methods"]["step"] = step;
            h["weights"]["tensors"]["w"]["mutable"] = json!(true);
        };
        let a = open(&file(two)).unwrap();
        assert_eq!(a.methods.keys().collect::<Vec<_>>(), ["forward", "step"]);
        assert_eq!(a.methods["step"].graph.n_user_outputs, 1);
        assert_eq!(a.weights.len(), 1);
    }

    #[test]
    fn refuses_bad_methods() {
        let err = |m: fn(&mut serde_json::Value)| open(&file(m)).unwrap_err().to_string();
        assert_eq!(err(|h| h["methods"] = json!({})), "methods: a file holds at least one method");
        assert_eq!(
            err(|h| h["methods"]["_hidden"] = h["methods"]["forward"].clone()),
            "methods[\"_hidden\"]: a method name is an ASCII Python identifier of at most 128 bytes, not starting with '_'"
        );
        assert_eq!(
            err(|h| {
                let mut other = h["methods"]["forward"].clone();
                other["inputs"]["leaves"][0]["tensor"]["device"] = json!("cuda:0");
                h["methods"]["step"] = other;
            }),
            "methods.step: its inputs are on cuda:0, but methods.forward's are on cpu; a file's methods share one device"
        );
        let e = open(&file(|h| h["methods"]["forward"]["inputs"]["leaves"][0]["tensor"]["dtype"] = json!("x")));
        assert_eq!(e.as_ref().unwrap_err().kind(), crate::ErrorKind::Artifact);
    }

    #[test]
    fn reports_json_and_schema_errors() {
        let mut f = file(|_| {});
        f[16] = b'!';
        assert!(open(&f).unwrap_err().to_string().starts_with("header: invalid JSON: "));
        let e = open(&file(|h| h["methods"]["forward"]["graph"]["nodes"][0]["op"] = json!("zero"))).unwrap_err();
        assert!(matches!(e, Error::Schema { .. }), "{e:?}");
    }
}
