//! Any JSON: treespec validation and leaf paths never panic or recurse without bound.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(spec) = serde_json::from_slice::<kwexport_core::schema::TreeSpec>(data) {
        if kwexport_core::treespec::validate(&spec, "fuzz").is_ok() {
            kwexport_core::treespec::leaf_paths(&spec, "x", &mut Vec::new());
        }
    }
});
