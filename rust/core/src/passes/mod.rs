//! Graph passes: rewrites of a document that need no torch, chosen by the optimization level
//! a program is loaded at. Each pass is a module of its own with its tests; the runtime
//! applies what a pass decides that needs torch (repacking a weight).
//!
//! - [`views_as_reshapes`]  `view` nodes as `reshape`, for tensors whose strides may differ
//!   from the ones the graph was traced with
//! - [`channels_last`]      the convolution weights to hold in channels-last memory format
//! - [`dead_code`]          unread pure nodes and assertions a checked call can't fail (every
//!   level)
//! - [`rms_norm`]           RMS normalization's six ops as one `rms_norm` node (`fast`)
//! - [`inplace_state`]      state writes (a KV cache's) run in place, with nothing to copy back
//!   (every level: the values are the same)

pub mod channels_last;
pub mod dead_code;
pub mod inplace_state;
pub mod rms_norm;
pub mod views_as_reshapes;

/// How far a program is optimized at load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    /// The graph as exported, run with eager's kernels: bitwise what eager computes.
    Exact,
    /// Faster kernels and layouts, within a stated tolerance of eager (`docs/optimize.md`).
    Fast,
}

impl Level {
    /// Parses `"exact"` or `"fast"`.
    pub fn parse(s: &str) -> Option<Level> {
        match s {
            "exact" => Some(Level::Exact),
            "fast" => Some(Level::Fast),
            _ => None,
        }
    }

    /// The name `parse` reads.
    pub fn name(self) -> &'static str {
        match self {
            Level::Exact => "exact",
            Level::Fast => "fast",
        }
    }
}
