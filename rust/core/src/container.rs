//! The file container: one flat file, safetensors-style.
//!
//! ```text
//! offset 0   8 bytes  magic  b"KWEXPORT"
//! offset 8   8 bytes  N, the header length, u64 little-endian
//! offset 16  N bytes  the header: UTF-8 JSON (schema.rs)
//!            padding  zero bytes up to the next multiple of 64
//! data_start ...      the data section: weight storages and extra files, each 64-aligned
//! ```
//! Parsing here is pure and total: any byte string gives a `Layout` or an [`Error`].
//! The constants live in [`crate::tables`].

use std::ops::Range;

use crate::error::{Error, Result};
use crate::tables::{ALIGN, MAGIC, MAX_HEADER_BYTES, PREFIX_LEN as PREFIX};

/// Where the header and data sections lie in a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// The header's bytes.
    pub header: Range<usize>,
    /// The data section's bytes, to the end of the file.
    pub data: Range<usize>,
}

/// `n` rounded up to [`ALIGN`]; `None` on overflow.
pub fn align_up(n: u64) -> Option<u64> {
    n.checked_add(ALIGN - 1).map(|v| v / ALIGN * ALIGN)
}

/// Splits a whole file into its sections, checking every length against the file's size.
pub fn parse_layout(bytes: &[u8]) -> Result<Layout> {
    let len = bytes.len() as u64;
    if len == 0 {
        return Err(Error::EmptyFile);
    }
    if len < PREFIX {
        return Err(Error::TooShort { len });
    }
    if &bytes[..8] != MAGIC {
        return Err(Error::NotKwexport { found: String::from_utf8_lossy(&bytes[..8]).into_owned() });
    }
    let header_len = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes"));
    if header_len > MAX_HEADER_BYTES {
        return Err(Error::HeaderTooLong { len: header_len, max: MAX_HEADER_BYTES });
    }
    let header_end = PREFIX + header_len;
    if header_end > len {
        return Err(Error::HeaderTruncated { claimed: header_len, remaining: len - PREFIX });
    }
    // The last section may end without padding only if there is no data at all.
    let data_start = align_up(header_end).expect("bounded by MAX_HEADER_BYTES").min(len);
    if bytes[header_end as usize..data_start as usize].iter().any(|&b| b != 0) {
        return Err(Error::NonZeroPadding);
    }
    Ok(Layout { header: PREFIX as usize..header_end as usize, data: data_start as usize..len as usize })
}

/// Resolves `(offset, nbytes)` relative to the data section into a range of the file.
/// `what` names the entry for the error.
pub fn data_range(layout: &Layout, offset: u64, nbytes: u64, what: &str) -> Result<Range<usize>> {
    let data_len = (layout.data.end - layout.data.start) as u64;
    let end = offset.checked_add(nbytes).filter(|&end| end <= data_len).ok_or_else(|| Error::OutsideData {
        entry: what.to_owned(),
        offset,
        nbytes,
        data_len,
    })?;
    Ok(layout.data.start + offset as usize..layout.data.start + end as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(header: &[u8], data: &[u8]) -> Vec<u8> {
        let mut v = MAGIC.to_vec();
        v.extend((header.len() as u64).to_le_bytes());
        v.extend(header);
        while !v.len().is_multiple_of(64) {
            v.push(0);
        }
        v.extend(data);
        v
    }

    #[test]
    fn splits_sections() {
        let f = file(b"{}", &[7; 10]);
        let l = parse_layout(&f).unwrap();
        assert_eq!(&f[l.header.clone()], b"{}");
        assert_eq!(l.data, 64..74);
        assert_eq!(data_range(&l, 2, 8, "x").unwrap(), 66..74);
    }

    #[test]
    fn rejects_bad_files() {
        let msg = |b: &[u8]| parse_layout(b).unwrap_err().to_string();
        assert!(msg(b"KWEX").contains("truncated"));
        assert_eq!(parse_layout(b"").unwrap_err(), Error::EmptyFile);
        assert!(msg(b"PK\x03\x04xxxxxxxxxxxxxxxx").contains("not a kwexport file"));
        let mut f = file(b"{}", b"");
        f[8..16].copy_from_slice(&1000u64.to_le_bytes());
        assert!(msg(&f).contains("header claims 1000 bytes"));
        f[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(msg(&f).contains("exceeds"));
        let mut f = file(b"{}", b"x");
        f[20] = 1;
        assert!(msg(&f).contains("padding"));
    }

    #[test]
    fn data_ranges_are_bounded() {
        let l = parse_layout(&file(b"{}", &[0; 8])).unwrap();
        assert!(data_range(&l, 4, 5, "weights.storages[0]").unwrap_err().to_string().contains("weights.storages[0]"));
        assert!(data_range(&l, u64::MAX, 2, "x").is_err());
    }
}
