//! Any header bytes in a well-formed container: the schema parser, upgraders and every
//! validation rule never panic.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let mut file = b"KWEXPORT".to_vec();
    file.extend((data.len() as u64).to_le_bytes());
    file.extend(data);
    file.resize(file.len().div_ceil(64) * 64 + 256, 0);
    let _ = kwexport::program::validate_file(&file);
});
