//! Any bytes: the container parser and the whole pure load path never panic.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(layout) = kwexport_core::container::parse_layout(data) {
        assert!(layout.header.end <= data.len() && layout.data.end == data.len());
    }
    if let Ok(artifact) = kwexport_core::open(data) {
        let _ = artifact.describe();
    }
});
