//! Any JSON: treespec validation never panics and never recurses without bound.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(spec) = serde_json::from_slice::<kwexport::schema::TreeSpec>(data) {
        let _ = kwexport::treespec::validate(&spec, "fuzz");
    }
});
