//! The kwexport file format and its validation, with no Python anywhere.
//!
//! A `.kwx` file is a 16-byte prefix, a JSON header and a 64-byte-aligned data section of
//! weights and extra files (`docs/format.md` describes it exactly). This crate opens one:
//!
//! ```no_run
//! let bytes = std::fs::read("model.kwx")?;
//! let artifact = kwexport_core::open(&bytes)?; // parse, upgrade, validate: or a typed Error
//! println!("{}", artifact.describe().methods["forward"].signature); // what `kwexport inspect` prints
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! The modules follow the file, outside in:
//!
//! - [`container`]  the file's sections (magic, header length, header, data)
//! - [`schema`]     the header's JSON types
//! - [`upgrade`]    format versions and the upgraders between them
//! - [`opschema`]   op-schema drift between torch versions, and op upgraders
//! - [`tables`]     the format's tables: magic, alignment, dtypes, operators, name rules
//! - [`treespec`]   nested-structure specs: validation and leaf paths
//! - [`binder`]     binding a call to the saved signature, as CPython does
//! - [`checks`]     input shape checks: static sizes, symbols, derived dims
//! - [`graph`]      graph validation into value slots, with last-use frees
//! - [`hops`]       higher-order ops (`cond`, grad-mode and autocast regions) and their subgraphs
//! - [`weights`]    the storage table's bounds, alignment and overlap
//! - [`artifact`]   the whole file: parse, then validate every cross-field rule once
//! - [`describe`]   what a file holds, as `kwexport inspect` prints it
//! - [`passes`]     graph rewrites an optimization level applies, decided without torch
//! - [`error`]      one error variant per failure

#![deny(missing_docs)]

pub mod artifact;
pub mod binder;
pub mod checks;
pub mod container;
pub mod describe;
pub mod error;
pub mod graph;
pub mod hops;
pub mod opschema;
pub mod passes;
pub mod schema;
pub mod tables;
pub mod treespec;
pub mod upgrade;
pub mod weights;

pub use artifact::{open, parse, Artifact, Parsed};
pub use describe::Description;
pub use error::{Error, ErrorKind, Result};

/// Parses and validates a file's bytes, keeping nothing: `Ok` if kwexport would load it
/// (op names are checked against the running torch only by the runtime).
pub fn validate(bytes: &[u8]) -> Result<()> {
    open(bytes).map(|_| ())
}
