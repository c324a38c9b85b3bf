//! Any header bytes in a well-formed container: the schema parser, upgraders, the graph
//! passes (which loading runs before validation, so on unchecked documents), every validation
//! rule, the description and constant folding's split of each validated graph never panic.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let mut file = kwexport_core::tables::MAGIC.to_vec();
    file.extend((data.len() as u64).to_le_bytes());
    file.extend(data);
    file.resize(file.len().div_ceil(64) * 64 + 256, 0);
    if let Ok(mut parsed) = kwexport_core::parse(&file) {
        let mut optimized = parsed.document.clone();
        kwexport_core::passes::apply(&mut optimized, kwexport_core::passes::Level::Fast, kwexport_core::passes::Target { in_place: true, onednn: true, gemm: true });
        parsed.document = optimized;
        if let Ok(artifact) = parsed.validate(&file) {
            let _ = artifact.describe();
            for (name, m) in &artifact.methods {
                let ops = &artifact.document.methods[name].ops;
                let _ = kwexport_core::passes::constant_fold::split(&m.graph, ops, &m.subgraphs, |_| false, |s| format!("<constant {s}>"));
            }
        }
    }
});
