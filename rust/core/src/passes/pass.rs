//! The contract every graph pass keeps, and the context they rewrite in (ONNX Runtime's
//! `GraphTransformer` and its manager are the model): a pass has a name and the lowest
//! level it runs at, says whether it applies to a target, and rewrites what it finds,
//! returning how many rewrites it made. `super::apply` runs a level's passes in their
//! registered order, sweep after sweep, until a sweep changes nothing.

use std::collections::{BTreeMap, HashMap};

use super::readers::{readers, Readers};
use super::{Level, Rewrites, Target};
use crate::schema::{Document, Method, Weights};

/// One graph rewrite.
pub trait Pass {
    /// Its name: the module's, as `Rewrites::counts` reports it.
    fn name(&self) -> &'static str;
    /// The lowest level it runs at.
    fn level(&self) -> Level;
    /// Whether it runs for `target` (a loader's oneDNN, its GEMM); every pass does by default.
    fn runs_for(&self, _target: Target) -> bool {
        true
    }
    /// Rewrites what it finds in `cx`'s document, and records what it leaves the runtime in
    /// `cx.rewrites`; returns how many rewrites it made (0: nothing changed).
    fn apply(&self, cx: &mut Ctx<'_>) -> usize;
}

/// What the passes share while they run over one document.
pub struct Ctx<'a> {
    /// The document the passes rewrite.
    pub doc: &'a mut Document,
    /// What the program that will run it can do.
    pub target: Target,
    /// What the passes leave the runtime to do.
    pub rewrites: Rewrites,
    /// Each method's readers, computed when a pass first asks and dropped when a pass
    /// changes the method: the pattern passes of one sweep share them.
    readers: HashMap<String, Readers>,
}

impl<'a> Ctx<'a> {
    /// A context over `doc` for `target`, with nothing rewritten yet.
    pub fn new(doc: &'a mut Document, target: Target) -> Ctx<'a> {
        Ctx { doc, target, rewrites: Rewrites::default(), readers: HashMap::new() }
    }

    /// Runs `rewrite` on each method (by name, with its readers and the file's weights);
    /// returns the rewrites made in all. A method `rewrite` changed (returned more than 0)
    /// has its readers computed afresh for the next pass.
    pub fn each_method(&mut self, mut rewrite: impl FnMut(&str, &mut Method, &Readers, &Weights) -> usize) -> usize {
        let Document { methods, weights, .. } = &mut *self.doc;
        let mut total = 0;
        for (name, m) in methods.iter_mut() {
            let known = self.readers.entry(name.clone()).or_insert_with(|| readers(&m.graph));
            let made = rewrite(name, m, known, weights);
            if made > 0 {
                self.readers.remove(name);
            }
            total += made;
        }
        total
    }

    /// Drops every method's readers, after a pass changed graphs (the next pass finds them again).
    pub(super) fn forget_readers(&mut self) {
        self.readers.clear();
    }

    /// Counts a pass's rewrites under its name.
    pub(super) fn count(&mut self, pass: &dyn Pass, made: usize) {
        *self.rewrites.counts.entry(pass.name()).or_default() += made;
    }
}

/// The rewrites each pass made, by name (those that made none included).
pub type Counts = BTreeMap<&'static str, usize>;
