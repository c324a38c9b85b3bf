//! Any header bytes in a well-formed container: the schema parser, upgraders, every
//! validation rule and the description never panic.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let mut file = kwexport_core::tables::MAGIC.to_vec();
    file.extend((data.len() as u64).to_le_bytes());
    file.extend(data);
    file.resize(file.len().div_ceil(64) * 64 + 256, 0);
    if let Ok(artifact) = kwexport_core::open(&file) {
        let _ = artifact.describe();
    }
});
