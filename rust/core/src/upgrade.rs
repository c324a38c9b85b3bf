//! Format versions and the upgraders that bring old documents forward.
//!
//! Each upgrader takes a header document (as untyped JSON) from one version to the next;
//! loading applies the chain before the typed parse, so the rest of the runtime only ever
//! sees the current version.
//!
//! Policy (docs/format.md): a minor bump only adds fields that older readers may ignore; a
//! file with a newer minor loads here. Anything else is a major bump.

use serde_json::Value;

use crate::error::{Error, Result};
use crate::schema::FormatVersion;

/// The version kwexport writes.
pub const CURRENT: FormatVersion = FormatVersion { major: 4, minor: 0 };
/// The oldest version this runtime reads.
pub const OLDEST: FormatVersion = FormatVersion { major: 1, minor: 0 };

/// Brings a document from one version to the next.
pub struct Upgrader {
    /// The version it reads.
    pub from: FormatVersion,
    /// The version it writes.
    pub to: FormatVersion,
    /// Its name, reported when it runs.
    pub name: &'static str,
    /// The rewrite; an `Err` says what in the document it cannot bring forward.
    pub apply: fn(Value) -> Result<Value, String>,
}

/// The registered upgraders, oldest first.
pub const UPGRADERS: &[Upgrader] = &[
    Upgrader {
        from: FormatVersion { major: 1, minor: 0 },
        to: FormatVersion { major: 2, minor: 0 },
        name: "v1_to_v2_op_table",
        apply: v1_to_v2_op_table,
    },
    Upgrader {
        from: FormatVersion { major: 2, minor: 0 },
        to: FormatVersion { major: 3, minor: 0 },
        name: "v2_to_v3_containers",
        apply: v2_to_v3_containers,
    },
    Upgrader {
        from: FormatVersion { major: 3, minor: 0 },
        to: FormatVersion { major: 3, minor: 1 },
        name: "v3_0_to_v3_1_tensor_defaults",
        apply: v3_0_to_v3_1_tensor_defaults,
    },
    Upgrader {
        from: FormatVersion { major: 3, minor: 1 },
        to: FormatVersion { major: 4, minor: 0 },
        name: "v3_to_v4_methods",
        apply: v3_to_v4_methods,
    },
];

/// The fields of one callable, which a 3.x header holds at its top level and 4.0 under
/// `methods`.
const METHOD_FIELDS: [&str; 7] = ["signature", "inputs", "outputs", "symbols", "ops", "graph", "subgraphs"];

/// The name a 3.x file's one callable takes.
pub const DEFAULT_METHOD: &str = "forward";

/// 4.0 holds several callables over one weight table under `methods`; a 3.x file's one
/// callable becomes the method `forward`.
fn v3_to_v4_methods(mut doc: Value) -> Result<Value, String> {
    let top = doc.as_object_mut().ok_or("the header is not a JSON object")?;
    let mut method = serde_json::Map::new();
    for field in METHOD_FIELDS {
        if let Some(v) = top.remove(field) {
            method.insert(field.to_owned(), v);
        }
    }
    top.insert("methods".to_owned(), serde_json::json!({ DEFAULT_METHOD: method }));
    top.insert("format_version".to_owned(), serde_json::json!({"major": 4, "minor": 0}));
    Ok(doc)
}

/// 1.0 named each node's op inline; 2.0 lists each op once in `ops`, with the schema it
/// had when saved (unknown for upgraded files), and nodes refer to it by index.
fn v1_to_v2_op_table(mut doc: Value) -> Result<Value, String> {
    let bad = |what: &str| format!("graph.nodes: {what}");
    let mut ops: Vec<String> = Vec::new();
    let nodes =
        doc.pointer_mut("/graph/nodes").and_then(Value::as_array_mut).ok_or_else(|| bad("missing or not a list"))?;
    for (i, node) in nodes.iter_mut().enumerate() {
        let op = node
            .get("op")
            .and_then(Value::as_str)
            .ok_or_else(|| bad(&format!("[{i}].op: expected an op name")))?
            .to_owned();
        let index = ops.iter().position(|o| *o == op).unwrap_or_else(|| {
            ops.push(op);
            ops.len() - 1
        });
        node["op"] = Value::from(index);
    }
    let table: Vec<Value> = ops.into_iter().map(|name| serde_json::json!({"name": name, "schema": null})).collect();
    doc["ops"] = Value::from(table);
    doc["format_version"] = serde_json::json!({"major": 2, "minor": 0});
    Ok(doc)
}

/// 3.1 adds an optional field (`signature.params[i].default_weight`): a 3.0 document is a
/// 3.1 document as it stands.
fn v3_0_to_v3_1_tensor_defaults(mut doc: Value) -> Result<Value, String> {
    doc["format_version"] = serde_json::json!({"major": 3, "minor": 1});
    Ok(doc)
}

/// 3.0 adds treespec node types (`defaultdict`, `container`), `subgraphs` and higher-order
/// ops, which 2.x readers can't skip; a 2.0 document uses none of them, so it is a 3.0
/// document as it stands.
fn v2_to_v3_containers(mut doc: Value) -> Result<Value, String> {
    doc["format_version"] = serde_json::json!({"major": 3, "minor": 0});
    Ok(doc)
}

/// Every format version this runtime reads, oldest first: where the chain starts, and
/// where each upgrader lands. Each has golden files under `tests/golden/`.
pub fn released() -> Vec<FormatVersion> {
    std::iter::once(OLDEST).chain(UPGRADERS.iter().map(|u| u.to)).collect()
}

/// The outcome of bringing a document to the current version.
#[derive(Debug, Clone, PartialEq)]
pub struct Upgraded {
    /// The document at the current version.
    pub document: Value,
    /// The version it was in.
    pub from: FormatVersion,
    /// The upgraders that ran, in order.
    pub applied: Vec<&'static str>,
}

/// The `format_version` of an untyped document.
pub fn read_version(doc: &Value) -> Result<FormatVersion> {
    let v = doc.get("format_version").ok_or(Error::MissingFormatVersion)?;
    serde_json::from_value(v.clone()).map_err(|e| Error::InvalidFormatVersion { message: e.to_string() })
}

/// Checks that `upgraders` form one contiguous chain from `oldest` to `current`.
pub fn validate_chain(upgraders: &[Upgrader], oldest: FormatVersion, current: FormatVersion) -> Result<(), String> {
    let mut at = oldest;
    for u in upgraders {
        if u.from != at {
            return Err(if u.from < at {
                format!(
                    "upgrader {} starts at {}, which an earlier upgrader already covers (duplicate)",
                    u.name, u.from
                )
            } else {
                format!("gap: no upgrader from {at} (next is {}, from {})", u.name, u.from)
            });
        }
        if u.to <= u.from {
            return Err(format!("upgrader {} goes backwards, {} -> {}", u.name, u.from, u.to));
        }
        at = u.to;
    }
    if at.major != current.major || at > current {
        return Err(format!("the chain ends at {at}, not at the current version {current}"));
    }
    Ok(())
}

/// Brings `doc` to the current version, or says why it cannot.
pub fn upgrade(mut doc: Value) -> Result<Upgraded> {
    let from = read_version(&doc)?;
    if from.major > CURRENT.major {
        return Err(Error::TooNew { found: from, oldest: OLDEST, current: CURRENT });
    }
    if from < OLDEST {
        return Err(Error::TooOld { found: from, oldest: OLDEST });
    }
    let mut applied = Vec::new();
    let mut at = from;
    for u in UPGRADERS {
        if u.from == at {
            doc = (u.apply)(doc).map_err(|problem| Error::Upgrade { upgrader: u.name, problem })?;
            at = u.to;
            applied.push(u.name);
        }
    }
    Ok(Upgraded { document: doc, from, applied })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn registry_is_a_chain() {
        validate_chain(UPGRADERS, OLDEST, CURRENT).unwrap();
    }

    fn noop(v: Value) -> Result<Value, String> {
        Ok(v)
    }
    const fn v(major: u32, minor: u32) -> FormatVersion {
        FormatVersion { major, minor }
    }
    const fn up(from: FormatVersion, to: FormatVersion, name: &'static str) -> Upgrader {
        Upgrader { from, to, name, apply: noop }
    }

    #[test]
    fn chain_validator_catches_gaps_and_duplicates() {
        let gap = [up(v(1, 0), v(2, 0), "a"), up(v(3, 0), v(4, 0), "b")];
        assert_eq!(
            validate_chain(&gap, v(1, 0), v(4, 0)).unwrap_err(),
            "gap: no upgrader from 2.0 (next is b, from 3.0)"
        );
        let dup = [up(v(1, 0), v(2, 0), "a"), up(v(1, 0), v(2, 0), "a2")];
        assert!(validate_chain(&dup, v(1, 0), v(2, 0)).unwrap_err().contains("duplicate"));
        let short = [up(v(1, 0), v(2, 0), "a")];
        assert!(validate_chain(&short, v(1, 0), v(3, 0)).unwrap_err().contains("not at the current version 3.0"));
        let back = [up(v(2, 0), v(1, 0), "z")];
        assert!(validate_chain(&back, v(2, 0), v(2, 0)).unwrap_err().contains("backwards"));
    }

    #[test]
    fn each_upgrader_output_parses_as_the_next_version() {
        // A minimal but complete 1.0 document: one node, used twice.
        let v1 = json!({
            "format_version": {"major": 1, "minor": 0},
            "producer": {"kwexport": "0.1.0", "torch": "2.13.0"},
            "signature": {"name": "f", "params": [{"name": "x", "kind": "positional_or_keyword"}]},
            "inputs": {"spec": {"type": "tuple", "children": [{"type": "tuple", "children": [{"type": "leaf"}]}, {"type": "dict", "entries": []}]},
                       "leaves": [{"tensor": {"dtype": "float32", "device": "cpu", "shape": [{"static": 2}]}}]},
            "outputs": {"type": "leaf"},
            "graph": {"inputs": [{"name": "x", "source": {"user": 0}}],
                      "nodes": [{"op": "aten::neg.default", "args": [{"ref": "x"}], "outputs": {"one": "a"}},
                                {"op": "aten::neg.default", "args": [{"ref": "a"}], "outputs": {"one": "b"}}],
                      "outputs": [{"ref": "b"}]},
            "weights": {"storages": [], "tensors": {}}
        });
        let up = upgrade(v1).unwrap();
        assert_eq!(
            up.applied,
            vec!["v1_to_v2_op_table", "v2_to_v3_containers", "v3_0_to_v3_1_tensor_defaults", "v3_to_v4_methods"]
        );
        let doc: crate::schema::Document = serde_json::from_value(up.document).unwrap();
        assert_eq!(doc.format_version, CURRENT);
        let forward = &doc.methods[DEFAULT_METHOD];
        assert_eq!(doc.methods.len(), 1);
        assert_eq!(forward.ops, vec![crate::schema::OpEntry { name: "aten::neg.default".into(), schema: None }]);
        assert_eq!((forward.graph.nodes[0].op, forward.graph.nodes[1].op), (0, 0));
    }

    #[test]
    fn refuses_newer_major() {
        let e = upgrade(json!({"format_version": {"major": 9, "minor": 0}})).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Version);
        assert_eq!(
            e.to_string(),
            "file format 9.0 is newer than this runtime, which reads 1.0 to 4.x: upgrade kwexport"
        );
    }

    #[test]
    fn newer_minor_loads_as_is() {
        let u = upgrade(json!({"format_version": {"major": CURRENT.major, "minor": CURRENT.minor + 3}})).unwrap();
        assert!(u.applied.is_empty());
    }
}
