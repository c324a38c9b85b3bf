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

pub const CURRENT: FormatVersion = FormatVersion { major: 1, minor: 0 };
/// The oldest version this runtime reads.
pub const OLDEST: FormatVersion = FormatVersion { major: 1, minor: 0 };

pub struct Upgrader {
    pub from: FormatVersion,
    pub to: FormatVersion,
    pub name: &'static str,
    pub apply: fn(Value) -> Result<Value>,
}

/// The registered upgraders, oldest first.
pub const UPGRADERS: &[Upgrader] = &[];

/// The outcome of bringing a document to the current version.
#[derive(Debug, Clone, PartialEq)]
pub struct Upgraded {
    pub document: Value,
    pub from: FormatVersion,
    pub applied: Vec<&'static str>,
}

pub fn read_version(doc: &Value) -> Result<FormatVersion> {
    let v = doc
        .get("format_version")
        .ok_or_else(|| Error::Artifact("header: missing format_version".into()))?;
    serde_json::from_value(v.clone())
        .map_err(|e| Error::Artifact(format!("header.format_version: {e}")))
}

/// Checks that `upgraders` form one contiguous chain from `oldest` to `current`.
pub fn validate_chain(upgraders: &[Upgrader], oldest: FormatVersion, current: FormatVersion) -> Result<(), String> {
    let mut at = oldest;
    for u in upgraders {
        if u.from != at {
            return Err(if u.from < at {
                format!("upgrader {} starts at {}, which an earlier upgrader already covers (duplicate)", u.name, u.from)
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
        return Err(Error::Version(format!(
            "file format {from} is newer than this runtime, which reads {OLDEST} to {}.x: upgrade kwexport", CURRENT.major
        )));
    }
    if from < OLDEST {
        return Err(Error::Version(format!(
            "file format {from} is older than the oldest this runtime reads ({OLDEST})"
        )));
    }
    let mut applied = Vec::new();
    let mut at = from;
    for u in UPGRADERS {
        if u.from == at {
            doc = (u.apply)(doc).map_err(|e| Error::Artifact(format!("upgrader {}: {e}", u.name)))?;
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

    #[test]
    fn refuses_newer_major() {
        let e = upgrade(json!({"format_version": {"major": 9, "minor": 0}})).unwrap_err();
        assert_eq!(
            e,
            Error::Version("file format 9.0 is newer than this runtime, which reads 1.0 to 1.x: upgrade kwexport".into())
        );
    }

    #[test]
    fn newer_minor_loads_as_is() {
        let u = upgrade(json!({"format_version": {"major": CURRENT.major, "minor": CURRENT.minor + 3}})).unwrap();
        assert!(u.applied.is_empty());
    }
}
