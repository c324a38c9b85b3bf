//! What a file holds, for people: the description `kwexport inspect` prints (as text, or
//! as this JSON with `--json`).

use std::collections::BTreeMap;

use serde::{Serialize, Serializer};

use crate::artifact::{Artifact, CheckedMethod};
use crate::schema::{Constant, Dim, LeafSpec, Method, MutationTarget, ParamKind, Producer, Signature};
use crate::upgrade;

/// A validated file, described.
#[derive(Debug, Clone, Serialize)]
pub struct Description {
    /// The version the file is written in.
    pub format_version: [u32; 2],
    /// The version this reader writes.
    pub current_format_version: [u32; 2],
    /// Whether `kwexport upgrade` would rewrite it.
    pub needs_upgrade: bool,
    /// The upgraders that bring it to the current version.
    pub upgraders: Vec<&'static str>,
    /// What wrote it.
    pub producer: Producer,
    /// The device it was exported on, which loading places it on unless told otherwise.
    pub device: String,
    /// The level its graphs were optimized at when it was written: `"exact"` or `"fast"`.
    pub optimized: &'static str,
    /// Each method, by name.
    pub methods: BTreeMap<String, MethodDescription>,
    /// Weight tensors and their storages' bytes.
    pub weights: WeightSummary,
    /// Extra files and their sizes.
    pub extra_files: BTreeMap<String, u64>,
}

/// One method, described.
#[derive(Debug, Clone, Serialize)]
pub struct MethodDescription {
    /// The signature as Python prints it: `forward(x, *, mask=None)`.
    pub signature: String,
    /// Every input leaf.
    pub inputs: Vec<InputLeaf>,
    /// The symbolic sizes.
    pub symbols: Vec<crate::schema::Symbol>,
    /// How many nodes call each op, in op-table order.
    pub ops: OpCounts,
    /// Graph nodes, subgraphs' included.
    pub nodes: usize,
    /// The weights it writes (state), by name.
    pub writes: Vec<String>,
}

/// One input leaf, described.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum InputLeaf {
    /// A tensor input.
    Tensor {
        /// Its argument path.
        path: String,
        /// Its dtype.
        dtype: String,
        /// Its device.
        device: String,
        /// Each dimension: a size, or `expr (s in [min, max])`.
        shape: Vec<DimText>,
    },
    /// A specialized non-tensor input.
    Constant {
        /// Its argument path.
        path: String,
        /// The value calls must pass.
        value: ConstantJson,
    },
}

/// A dimension: a static size, or its expression and range.
#[derive(Debug, Clone, Serialize)]
#[serde(untagged)]
pub enum DimText {
    /// A static size.
    Static(i64),
    /// `2*s0 + 1 (s0 in [2, inf])`.
    Symbolic(String),
}

/// `{op: count}`, in op-table order.
#[derive(Debug, Clone)]
pub struct OpCounts(pub Vec<(String, usize)>);

impl Serialize for OpCounts {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.0.iter().map(|(k, v)| (k, v)))
    }
}

/// Weight totals.
#[derive(Debug, Clone, Serialize)]
pub struct WeightSummary {
    /// Tensors.
    pub tensors: usize,
    /// Bytes of storage.
    pub bytes: u64,
}

/// A constant as plain JSON: tuples as lists, non-finite floats as `"inf"`, `"-inf"`, `"nan"`.
#[derive(Debug, Clone)]
pub struct ConstantJson(pub Constant);

impl Serialize for ConstantJson {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match &self.0 {
            Constant::None(()) => s.serialize_none(),
            Constant::Bool(b) => s.serialize_bool(*b),
            Constant::Int(i) => s.serialize_i64(*i),
            Constant::Float(f) => f.serialize(s),
            Constant::Str(v) => s.serialize_str(v),
            Constant::Tuple(items) | Constant::List(items) => {
                s.collect_seq(items.iter().map(|c| ConstantJson(c.clone())))
            }
        }
    }
}

impl Artifact {
    /// Describes the file.
    pub fn describe(&self) -> Description {
        let doc = &self.document;
        let version = |v: crate::schema::FormatVersion| [v.major, v.minor];
        Description {
            format_version: version(self.file_format_version),
            current_format_version: version(upgrade::CURRENT),
            needs_upgrade: self.file_format_version != upgrade::CURRENT,
            upgraders: self.upgraders.clone(),
            producer: doc.producer.clone(),
            device: self.home_device().to_owned(),
            optimized: doc.optimized.name(),
            methods: doc
                .methods
                .iter()
                .map(|(name, m)| (name.clone(), describe_method(m, &self.methods[name])))
                .collect(),
            weights: WeightSummary {
                tensors: doc.weights.tensors.len(),
                bytes: doc.weights.storages.iter().map(|s| s.nbytes).sum(),
            },
            extra_files: doc.extra_files.iter().map(|(k, f)| (k.clone(), f.nbytes)).collect(),
        }
    }
}

fn describe_method(m: &Method, checked: &CheckedMethod) -> MethodDescription {
    let inputs = m
        .inputs
        .leaves
        .iter()
        .zip(&checked.leaf_paths)
        .map(|(leaf, path)| match leaf {
            LeafSpec::Tensor(t) => InputLeaf::Tensor {
                path: path.clone(),
                dtype: t.dtype.clone(),
                device: t.device.clone(),
                shape: t.shape.iter().map(|d| dim_text(d, &checked.symbols)).collect(),
            },
            LeafSpec::Constant(c) => InputLeaf::Constant { path: path.clone(), value: ConstantJson(c.clone()) },
        })
        .collect();
    let mut counts = vec![0; m.ops.len()];
    let all_nodes = || m.graph.nodes.iter().chain(m.subgraphs.values().flat_map(|s| &s.nodes));
    all_nodes().for_each(|n| counts[n.op] += 1);
    MethodDescription {
        signature: signature_text(&m.signature),
        inputs,
        symbols: m.symbols.clone(),
        ops: OpCounts(m.ops.iter().map(|o| o.name.clone()).zip(counts).collect()),
        nodes: all_nodes().count(),
        writes: m
            .graph
            .mutations
            .iter()
            .filter_map(|w| match &w.target {
                MutationTarget::Weight(name) => Some(name.clone()),
                MutationTarget::User(_) => None,
            })
            .collect(),
    }
}

fn dim_text(d: &Dim, symbols: &[crate::checks::Symbol]) -> DimText {
    match d {
        Dim::Static(n) => DimText::Static(*n),
        Dim::Symbolic { symbol, coeff, offset } => {
            let sym = symbols.iter().find(|s| &s.name == symbol).expect("validated");
            let max = sym.max.map_or("inf".to_owned(), |m| m.to_string());
            DimText::Symbolic(format!(
                "{} ({symbol} in [{}, {max}])",
                crate::checks::render(symbol, *coeff, *offset),
                sym.min
            ))
        }
    }
}

/// A signature as Python prints it, with `/` and `*` markers and defaults as `repr` gives them.
pub fn signature_text(sig: &Signature) -> String {
    let mut parts = Vec::new();
    let (mut star_done, mut slash_pending) = (false, false);
    for p in &sig.params {
        if p.kind != ParamKind::PositionalOnly && slash_pending {
            parts.push("/".to_owned());
            slash_pending = false;
        }
        if p.kind == ParamKind::PositionalOnly {
            slash_pending = true;
        }
        if p.kind == ParamKind::KeywordOnly && !star_done {
            parts.push("*".to_owned());
        }
        star_done |= matches!(p.kind, ParamKind::VarPositional | ParamKind::KeywordOnly);
        let prefix = match p.kind {
            ParamKind::VarPositional => "*",
            ParamKind::VarKeyword => "**",
            _ => "",
        };
        let mut text = format!("{prefix}{}", p.name);
        if let Some(d) = &p.default {
            text.push('=');
            text.push_str(&python_repr(d));
        } else if let Some(w) = &p.default_weight {
            text.push_str(&format!("=<tensor {w:?}>"));
        }
        parts.push(text);
    }
    if slash_pending {
        parts.push("/".to_owned());
    }
    format!("{}({})", sig.name, parts.join(", "))
}

/// `repr()` of the Python value a constant stands for.
pub fn python_repr(c: &Constant) -> String {
    match c {
        Constant::None(()) => "None".to_owned(),
        Constant::Bool(b) => if *b { "True" } else { "False" }.to_owned(),
        Constant::Int(i) => i.to_string(),
        Constant::Float(f) => float_repr(f.0),
        Constant::Str(s) => str_repr(s),
        Constant::Tuple(items) if items.len() == 1 => format!("({},)", python_repr(&items[0])),
        Constant::Tuple(items) => format!("({})", items.iter().map(python_repr).collect::<Vec<_>>().join(", ")),
        Constant::List(items) => format!("[{}]", items.iter().map(python_repr).collect::<Vec<_>>().join(", ")),
    }
}

/// Python's `repr(float)`: the shortest round-tripping digits, in exponent form below 1e-4
/// and from 1e16.
fn float_repr(v: f64) -> String {
    if v.is_nan() {
        return "nan".to_owned();
    }
    if v.is_infinite() {
        return if v > 0.0 { "inf" } else { "-inf" }.to_owned();
    }
    let sci = format!("{v:e}"); // shortest digits: "-1.5e-7"
    let (mantissa, exp) = sci.split_once('e').expect("LowerExp has an exponent");
    let exp: i32 = exp.parse().expect("an integer exponent");
    let (sign, mantissa) = mantissa.strip_prefix('-').map_or(("", mantissa), |m| ("-", m));
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if !(-4..16).contains(&exp) {
        let (head, tail) = digits.split_at(1);
        let frac = if tail.is_empty() { String::new() } else { format!(".{tail}") };
        return format!("{sign}{head}{frac}e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    }
    let point = exp + 1; // digits before the decimal point
    let body = if point <= 0 {
        format!("0.{}{digits}", "0".repeat((-point) as usize))
    } else if point as usize >= digits.len() {
        format!("{digits}{}.0", "0".repeat(point as usize - digits.len()))
    } else {
        format!("{}.{}", &digits[..point as usize], &digits[point as usize..])
    };
    format!("{sign}{body}")
}

/// Python's `repr(str)`: single quotes unless the text has one and no double quote.
fn str_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => out.push_str(&format!("\\x{:02x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::{Float, Param};

    #[test]
    fn floats_print_as_python_does() {
        for (v, want) in [
            (0.5, "0.5"),
            (1.0, "1.0"),
            (1e-5, "1e-05"),
            (1e-4, "0.0001"),
            (123456.0, "123456.0"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (-2.5e-7, "-2.5e-07"),
            (0.1 + 0.2, "0.30000000000000004"),
            (f64::INFINITY, "inf"),
        ] {
            assert_eq!(float_repr(v), want, "{v}");
        }
    }

    #[test]
    fn constants_print_as_python_does() {
        let c = Constant::Tuple(vec![
            Constant::Str("it's".into()),
            Constant::None(()),
            Constant::Bool(true),
            Constant::List(vec![Constant::Float(Float(2.0))]),
        ]);
        assert_eq!(python_repr(&c), "(\"it's\", None, True, [2.0])");
        assert_eq!(python_repr(&Constant::Tuple(vec![Constant::Int(1)])), "(1,)");
        assert_eq!(python_repr(&Constant::Str("a\nb'\"".into())), "'a\\nb\\'\"'");
    }

    #[test]
    fn signatures_print_as_python_does() {
        let p =
            |n: &str, kind, default: Option<Constant>| Param { name: n.into(), kind, default, default_weight: None };
        let sig = Signature {
            name: "f".into(),
            params: vec![
                p("a", ParamKind::PositionalOnly, None),
                p("b", ParamKind::PositionalOrKeyword, Some(Constant::Int(1))),
                p("k", ParamKind::KeywordOnly, Some(Constant::None(()))),
                p("kw", ParamKind::VarKeyword, None),
            ],
        };
        assert_eq!(signature_text(&sig), "f(a, /, b=1, *, k=None, **kw)");
        let only = Signature { name: "g".into(), params: vec![p("x", ParamKind::PositionalOnly, None)] };
        assert_eq!(signature_text(&only), "g(x, /)");
    }

    #[test]
    fn describes_a_file() {
        let a = crate::artifact::open(&crate::artifact::tests::file(|_| {})).unwrap();
        let d = serde_json::to_value(a.describe()).unwrap();
        let m = &d["methods"]["forward"];
        assert_eq!(m["signature"], "f(x, *, scale=0.5)");
        assert_eq!(m["inputs"][0]["shape"], serde_json::json!(["s0 (s0 in [2, 8])", 2]));
        assert_eq!(m["inputs"][1], serde_json::json!({"kind": "constant", "path": "scale", "value": 0.5}));
        assert_eq!(m["ops"], serde_json::json!({"aten::mul.Tensor": 1}));
        assert_eq!(m["writes"], serde_json::json!([]));
        assert_eq!(d["weights"], serde_json::json!({"tensors": 1, "bytes": 8}));
        assert_eq!(d["extra_files"], serde_json::json!({"notes.txt": 2}));
        assert_eq!(d["needs_upgrade"], false);
        assert_eq!(d["optimized"], "exact");
    }
}
