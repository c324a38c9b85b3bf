//! The runtime's stages import one way: ops -> plan -> exec, all over abi, and abi over
//! nothing of the runtime's but the pure-Rust leaves (`kernels`, `views`), which import
//! nothing of it. Read from the sources, so a new `use` that breaks the layering
//! fails here rather than in review.

use std::path::Path;

/// Each stage and the runtime modules it may import (besides itself and the core).
const ALLOWED: &[(&str, &[&str])] = &[
    ("kernels", &[]),
    ("views", &[]),
    ("abi", &["kernels", "views"]),
    ("ops", &["abi", "errors"]),
    // The plan packs weights in the layout a kernel reads (`kernels::PANEL`) and names the
    // activation a kernel applies (`kernels::Epilogue`).
    ("plan", &["abi", "ops", "errors", "constants", "views", "kernels"]),
    ("exec", &["abi", "plan", "errors", "views"]),
];

fn sources(stage: &str) -> Vec<(String, String)> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let file = src.join(format!("{stage}.rs"));
    let dir = src.join(stage);
    let mut out = Vec::new();
    if file.exists() {
        out.push((file.display().to_string(), std::fs::read_to_string(&file).unwrap()));
    }
    if dir.is_dir() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            out.push((p.display().to_string(), std::fs::read_to_string(&p).unwrap()));
        }
    }
    assert!(!out.is_empty(), "no sources for stage {stage}");
    out
}

#[test]
fn stages_import_one_way() {
    let mut wrong = Vec::new();
    for (stage, allowed) in ALLOWED {
        for (path, text) in sources(stage) {
            for (n, line) in text.lines().enumerate() {
                // `use crate::m` lines, and paths written inline (`crate::m::f(...)`).
                for (at, _) in line.match_indices("crate::") {
                    let module = line[at + 7..].split([':', ';', '{', ' ', '(', ')', ',']).next().unwrap_or_default();
                    if !module.is_empty() && module != *stage && !allowed.contains(&module) {
                        wrong.push(format!("{path}:{}: {stage} imports crate::{module}", n + 1));
                    }
                }
            }
        }
    }
    assert!(wrong.is_empty(), "imports against the stage order:\n{}", wrong.join("\n"));
}
