//! The runtime's stages import one way: ops -> plan -> exec, over the operator layer
//! (`operators`: kwexport's kernels on torch's tensors) and the binding to torch's C ABI
//! (`abi`); the kernels are leaves that know no tensor, and the binding knows no kernel.
//! Read from the sources, so a new `use` that breaks the layering fails here rather than
//! in review.

use std::path::Path;

/// Each stage and the runtime modules it may import (besides itself and the core).
const ALLOWED: &[(&str, &[&str])] = &[
    ("kernels", &[]),
    ("views", &[]),
    ("abi", &["views"]),
    ("operators", &["abi", "kernels", "views"]),
    ("ops", &["abi", "errors"]),
    // The plan asks the operators which kernel takes a node (geometry, post-op) and names
    // the packed weights they read.
    ("plan", &["abi", "ops", "errors", "constants", "views", "operators"]),
    ("exec", &["abi", "plan", "errors", "views", "operators"]),
];

fn sources(stage: &str) -> Vec<(String, String)> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let file = src.join(format!("{stage}.rs"));
    let dir = src.join(stage);
    let mut out = Vec::new();
    if file.exists() {
        out.push((file.display().to_string(), std::fs::read_to_string(&file).unwrap()));
    }
    let mut dirs = vec![dir];
    while let Some(dir) = dirs.pop() {
        if !dir.is_dir() {
            continue;
        }
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|e| e == "rs") {
                out.push((p.display().to_string(), std::fs::read_to_string(&p).unwrap()));
            }
        }
    }
    assert!(!out.is_empty(), "no sources for stage {stage}");
    out
}

/// Every runtime source file, with its path.
fn all_sources() -> Vec<(String, String)> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut out = Vec::new();
    let mut dirs = vec![src];
    while let Some(dir) = dirs.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|e| e == "rs") {
                out.push((p.display().to_string(), std::fs::read_to_string(&p).unwrap()));
            }
        }
    }
    out
}

/// One place decides which instruction set's kernels run (`kernels/isa.rs`): no other
/// module asks the CPU what it has.
#[test]
fn only_the_kernel_table_reads_cpu_features() {
    let wrong: Vec<String> = all_sources()
        .into_iter()
        .filter(|(path, text)| !path.ends_with("kernels/isa.rs") && text.contains("is_x86_feature_detected"))
        .map(|(path, _)| path)
        .collect();
    assert!(wrong.is_empty(), "CPU features read outside kernels/isa.rs: {wrong:?}");
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

/// exec runs what the plan chose: it names no op (a rule about an op belongs to the plan,
/// which reads the schema) and no instruction set (the kernel table decides those).
#[test]
fn exec_names_no_op_and_no_cpu_feature() {
    let mut wrong = Vec::new();
    for (path, text) in sources("exec") {
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or_default();
            let names_op = ["aten::", "prims::", "mkldnn::", "quantized"].iter().any(|ns| code.contains(ns));
            let names_cpu = ["avx", "neon", "isa::", "target_feature"].iter().any(|f| code.to_lowercase().contains(f));
            if names_op || names_cpu {
                wrong.push(format!("{path}:{}: {}", n + 1, line.trim()));
            }
        }
    }
    assert!(wrong.is_empty(), "exec decides what the plan should:\n{}", wrong.join("\n"));
}
