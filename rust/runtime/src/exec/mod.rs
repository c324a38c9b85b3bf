//! Stage 3, exec: runs a plan on a call's flat leaves. Python segments call torch's op
//! objects; C segments build dispatcher stacks from their encodings, releasing the GIL when
//! they ran long enough last time to be worth it; values cross between the two forms in one
//! batched call each way, where the plan said.

mod choice;
mod heads;

use choice::{choose_linear, faster, Pick};

use std::sync::atomic::Ordering;
use std::time::Instant;

use kwexport_core::graph::SlotOutputs;
use kwexport_core::hops::HopKind;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyTuple};

use crate::abi::encode::{build, decode, Enc, Native};
use crate::abi::shims::{Family, ShimFn};
use crate::abi::{self, Abi, CError, StableIValue, Ty};
use crate::errors::{RtError, RtResult};
use crate::operators::Quant;
use crate::operators::{self, Operators};
use crate::plan::{CStep, HopStep, Int8Params, OwnKernel, OwnOp, Plan, PyArg, PyOp, PyStep, Segment, ShimStep};
use crate::views::{self, ViewArg, ViewKind};

/// What a call allows of shims that skip the dispatcher (see `Plan::direct_kernels_apply`).
#[derive(Clone, Copy)]
struct Direct {
    no_autograd: bool,
    no_autocast: bool,
}

/// C segments that took at least this long last time run with the GIL released. Shorter ones
/// keep it: with several threads, handing the GIL over costs more than a few small ops.
const RELEASE_GIL_AFTER_NS: u64 = 20_000;

thread_local! {
    static INTRA_OP_THREADS_SET: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Applies `torch.set_num_threads` to the calling thread, once per thread.
///
/// OpenMP's thread count is per thread: a thread that Python starts gets the default
/// (every core), whatever the main thread set, and torch only corrects that inside its own
/// `parallel_for`, not before MKL's GEMMs. In a worker thread a 4x32 `mm` then starts an
/// OpenMP team whose spinning threads take the other cores (3x slower alone, and two workers
/// scale to less than one). `torch.get_num_threads()` runs torch's per-thread
/// initialisation.
fn sync_intra_op_threads(py: Python<'_>) -> PyResult<()> {
    if INTRA_OP_THREADS_SET.get() {
        return Ok(());
    }
    py.import("torch")?.getattr("get_num_threads")?.call0()?;
    INTRA_OP_THREADS_SET.set(true);
    Ok(())
}

/// One node's time in a profiled call (`Program.profile`): crossings between the paths
/// are entries of their own, with `node` `None`.
pub struct NodeTime {
    /// The node's index in the top-level graph.
    pub node: Option<usize>,
    /// Its op, or what the crossing converted.
    pub op: String,
    /// `"c"` or `"python"`.
    pub path: &'static str,
    pub ns: u64,
}

/// Handles to a call's tensor leaves, by leaf, made by the input checks: the C path takes
/// these rather than converting the same tensors again.
pub type LeafHandles = Vec<Option<abi::Tensor>>;

impl Plan {
    /// Runs the graph on the flat user leaves and returns the flat outputs.
    pub fn run<'py>(&self, py: Python<'py>, leaves: &[Bound<'py, PyAny>]) -> RtResult<Vec<Bound<'py, PyAny>>> {
        self.run_timed(py, leaves, &mut Vec::new(), &mut None)
    }

    /// `run`, taking the handles in `handles` for the leaves the C path reads, and timing
    /// each node into `profile` where it is `Some` (with the GIL held throughout, so that
    /// each node's time is its own).
    pub fn run_timed<'py>(
        &self,
        py: Python<'py>,
        leaves: &[Bound<'py, PyAny>],
        handles: &mut LeafHandles,
        profile: &mut Option<Vec<NodeTime>>,
    ) -> RtResult<Vec<Bound<'py, PyAny>>> {
        sync_intra_op_threads(py)?;
        let Some((is_enabled, set)) = &self.grad_switch else {
            return self.run_segments(py, leaves, handles, profile);
        };
        if !is_enabled.bind(py).call0()?.is_truthy()? || self.any_requires_grad(py, leaves)? {
            return self.run_segments(py, leaves, handles, profile);
        }
        let set = set.bind(py);
        set.call1((false,))?;
        let result = self.run_segments(py, leaves, handles, profile);
        set.call1((true,))?;
        result
    }

    fn run_segments<'py>(
        &self,
        py: Python<'py>,
        leaves: &[Bound<'py, PyAny>],
        handles: &mut LeafHandles,
        profile: &mut Option<Vec<NodeTime>>,
    ) -> RtResult<Vec<Bound<'py, PyAny>>> {
        let mut pys: Vec<Option<Bound<'py, PyAny>>> = vec![None; self.n_slots];
        let mut natives: Vec<Option<Native>> = Vec::new();
        natives.resize_with(self.n_slots, || None);
        for &(slot, leaf) in &self.user_inputs {
            pys[slot] = Some(leaves[leaf].clone());
        }
        let direct = self.direct_kernels_apply(py, leaves)?;
        for segment in &self.segments {
            match segment {
                Segment::Python { to_py, steps } => {
                    let started = profile.is_some().then(Instant::now);
                    self.to_py(py, to_py, &natives, &mut pys)?;
                    record(profile, None, || "to Python".into(), "python", started);
                    for step in steps {
                        let started = profile.is_some().then(Instant::now);
                        run_python(py, step, &mut pys, &mut natives)?;
                        record(profile, Some(step.node), || step.op_name.to_string(), "python", started);
                    }
                }
                Segment::C { to_native, steps, free_py, last_ns } => {
                    let abi = self.abi.ok_or_else(|| RtError::Internal("a C segment without the ABI".into()))?;
                    let started = profile.is_some().then(Instant::now);
                    self.to_native(py, abi, to_native, &pys, &mut natives, handles)?;
                    record(profile, None, || "to the C path".into(), "c", started);
                    let consts = &self.consts;
                    if let Some(times) = profile.as_mut() {
                        let mut stack = Vec::with_capacity(16);
                        // The steps a 1×1 carries (`plan::heads`) are nodes of their own
                        // where they ran apart; fused, the 1×1's node is all of them.
                        let mut timed = |s: &CStep, run: &mut dyn FnMut() -> RtResult<()>| -> RtResult<()> {
                            let started = Instant::now();
                            run()?;
                            let ns = started.elapsed().as_nanos() as u64;
                            times.push(NodeTime { node: Some(s.node), op: s.op_name(), path: "c", ns });
                            Ok(())
                        };
                        for s in steps {
                            let mut fused = false;
                            timed(s, &mut || {
                                fused = s.run_fused(abi, &mut natives, consts, direct)?;
                                if fused {
                                    return Ok(());
                                }
                                s.run_alone(abi, &mut natives, consts, &mut stack, direct)
                            })?;
                            // Apart, each carried step (an int8 head's view, then its
                            // depthwise convolution) is a node of its own.
                            let mut carried = if fused { None } else { s.then.as_deref() };
                            while let Some(t) = carried {
                                timed(t, &mut || t.run_alone(abi, &mut natives, consts, &mut stack, direct))?;
                                carried = t.then.as_deref();
                            }
                        }
                        for &s in free_py {
                            pys[s] = None;
                        }
                        continue;
                    }
                    let natives = &mut natives;
                    // Timed inside: waiting to take the GIL back is not the segment's cost,
                    // and counting it would keep a short segment releasing under contention.
                    let mut run = move || {
                        let started = Instant::now();
                        let mut stack = Vec::with_capacity(16);
                        let result = steps.iter().try_for_each(|s| s.run(abi, natives, consts, &mut stack, direct));
                        last_ns.store(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
                        result
                    };
                    if last_ns.load(Ordering::Relaxed) >= RELEASE_GIL_AFTER_NS { py.detach(run) } else { run() }?;
                    for &s in free_py {
                        pys[s] = None;
                    }
                }
            }
        }
        let started = profile.is_some().then(Instant::now);
        self.to_py(py, &self.outputs_to_py, &natives, &mut pys)?;
        record(profile, None, || "outputs to Python".into(), "python", started);
        self.outputs.iter().map(|a| value(py, a, &pys)).collect()
    }

    /// Whether shims that skip the dispatcher give this call what the dispatcher would: no
    /// autograd to record (grad mode off, or no input that requires grad) and, for ops that
    /// autocast changes, no autocast.
    fn direct_kernels_apply(&self, py: Python<'_>, leaves: &[Bound<'_, PyAny>]) -> RtResult<Direct> {
        let Some(shims) = self.abi.and_then(|a| a.shims.as_ref()).filter(|_| self.has_direct_shims) else {
            return Ok(Direct { no_autograd: true, no_autocast: true });
        };
        let no_autograd = !shims.grad_mode() || !self.any_requires_grad(py, leaves)?;
        let no_autocast = match &self.autocast_probe {
            Some(probe) => !probe.bind(py).call1((pyo3::intern!(py, "cpu"),))?.is_truthy()?,
            None => true,
        };
        Ok(Direct { no_autograd, no_autocast })
    }

    fn any_requires_grad(&self, py: Python<'_>, leaves: &[Bound<'_, PyAny>]) -> RtResult<bool> {
        let tensor_type = self.tensor_type.bind(py);
        for leaf in leaves {
            if leaf.is_instance(tensor_type)? && leaf.getattr(pyo3::intern!(py, "requires_grad"))?.is_truthy()? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Python values for native ones: numbers directly, tensors in one call to torch.
    fn to_py<'py>(
        &self,
        py: Python<'py>,
        slots: &[usize],
        natives: &[Option<Native>],
        pys: &mut [Option<Bound<'py, PyAny>>],
    ) -> RtResult<()> {
        let mut tensors = Vec::new();
        for &s in slots {
            pys[s] = Some(match &natives[s] {
                Some(Native::Tensor(t)) => {
                    let abi = self.abi.ok_or_else(|| RtError::Internal("a native tensor without the ABI".into()))?;
                    let handle = abi.share(t).map_err(|e| c_error("converting an output to Python", e))?;
                    tensors.push((s, abi.adopt(handle)));
                    continue;
                }
                Some(Native::Int(i)) => i.into_pyobject(py)?.into_any(),
                Some(Native::Float(f)) => f.into_pyobject(py)?.into_any(),
                Some(Native::Bool(b)) => PyBool::new(py, *b).to_owned().into_any(),
                None => return Err(read_after_free(s)),
            });
        }
        if let (Some(abi), false) = (self.abi, tensors.is_empty()) {
            let (targets, handles): (Vec<usize>, Vec<abi::Tensor>) = tensors.into_iter().unzip();
            for (s, t) in targets.into_iter().zip(abi.tensors_of(py, handles)?.iter()) {
                pys[s] = Some(t);
            }
        }
        Ok(())
    }

    /// Native values for Python ones: numbers directly, tensors in one call to torch.
    fn to_native(
        &self,
        py: Python<'_>,
        abi: &Abi,
        slots: &[usize],
        pys: &[Option<Bound<'_, PyAny>>],
        natives: &mut [Option<Native>],
        handles: &mut LeafHandles,
    ) -> RtResult<()> {
        let tensor_type = self.tensor_type.bind(py);
        let mut tensors = Vec::new();
        for &s in slots {
            let v = pys[s].as_ref().ok_or_else(|| read_after_free(s))?;
            natives[s] = Some(if v.is_instance(tensor_type)? {
                tensors.push((s, v.clone()));
                continue;
            } else if let Ok(b) = v.cast::<PyBool>() {
                Native::Bool(b.is_true())
            } else if v.is_instance_of::<PyInt>() {
                Native::Int(v.extract()?)
            } else if v.is_instance_of::<PyFloat>() {
                Native::Float(v.extract()?)
            } else {
                return Err(RtError::Internal(format!(
                    "slot {s} holds a {} where the C path needs a tensor or a number",
                    v.get_type().name()?
                )));
            });
        }
        for (s, t) in tensors {
            // A user input's handle from the checks: the same tensor, already converted.
            let checked = self
                .user_inputs
                .iter()
                .find(|(slot, _)| *slot == s)
                .and_then(|&(_, leaf)| handles.get_mut(leaf)?.take());
            natives[s] = Some(Native::Tensor(match checked {
                Some(h) => h,
                None => abi.handle_of(&t)?,
            }));
        }
        Ok(())
    }
}

/// Adds a node's time since `started` to a profile being taken (the clock is read only then).
fn record(
    profile: &mut Option<Vec<NodeTime>>,
    node: Option<usize>,
    op: impl FnOnce() -> String,
    path: &'static str,
    started: Option<Instant>,
) {
    if let (Some(times), Some(started)) = (profile.as_mut(), started) {
        times.push(NodeTime { node, op: op(), path, ns: started.elapsed().as_nanos() as u64 });
    }
}

fn read_after_free(slot: usize) -> RtError {
    RtError::Internal(format!("slot {slot} read after free"))
}

fn c_error(op: &str, e: CError) -> RtError {
    match e {
        CError::Torch(message) => RtError::Op { op: op.to_owned(), message },
        CError::Internal(what) => RtError::Internal(format!("{op}: {what}")),
        CError::Python(e) => RtError::Python(e),
    }
}

impl CStep {
    /// Runs the node, and the depthwise convolution it carries (`then`), fused with it where
    /// they qualify. `stack` is scratch space reused across nodes; `direct` says whether shims
    /// that skip the dispatcher may run on this call.
    fn run(
        &self,
        abi: &Abi,
        slots: &mut [Option<Native>],
        consts: &[abi::Tensor],
        stack: &mut Vec<StableIValue>,
        direct: Direct,
    ) -> RtResult<()> {
        if self.run_fused(abi, slots, consts, direct)? {
            return Ok(());
        }
        self.run_alone(abi, slots, consts, stack, direct)?;
        match &self.then {
            Some(dw) => dw.run(abi, slots, consts, stack, direct),
            None => Ok(()),
        }
    }

    /// Runs the node alone (not what it carries).
    fn run_alone(
        &self,
        abi: &Abi,
        slots: &mut [Option<Native>],
        consts: &[abi::Tensor],
        stack: &mut Vec<StableIValue>,
        direct: Direct,
    ) -> RtResult<()> {
        let ran = if self.to_caller {
            abi::arena::outside(|| self.call(abi, slots, consts, stack, direct))
        } else {
            self.call(abi, slots, consts, stack, direct)
        };
        ran.map_err(|e| self.error(e))
    }

    /// A failure of the node, with its place in the graph.
    fn error(&self, e: CError) -> RtError {
        c_error(&format!("graph.nodes[{}] ({})", self.node, self.op_name()), e)
    }

    fn call(
        &self,
        abi: &Abi,
        slots: &mut [Option<Native>],
        consts: &[abi::Tensor],
        stack: &mut Vec<StableIValue>,
        direct: Direct,
    ) -> Result<(), CError> {
        if let Some(shim) = &self.shim {
            return self.call_shim(abi, shim, slots, consts, direct);
        }
        if let (Some(own), true) = (&self.own, direct.no_autograd) {
            let pick = self.pick(abi, own, slots, consts);
            // Timed only where this call is one of a choice's trials.
            let start = matches!(pick, Pick::Trial { .. }).then(Instant::now);
            if !matches!(pick, Pick::Theirs | Pick::Trial { ours: false, .. }) {
                if let Some(result) = self.run_own(abi, own, slots, consts) {
                    self.finish(slots, result?);
                    if let (Pick::Trial { choices, key, .. }, Some(start)) = (pick, start) {
                        choices.add_run(key, true, start.elapsed(), faster);
                    }
                    return Ok(());
                }
            }
            if let (Pick::Trial { choices, key, ours: false }, Some(start)) = (pick, start) {
                self.dispatch(abi, slots, consts, stack)?;
                choices.add_run(key, false, start.elapsed(), faster);
                return Ok(());
            }
        }
        if let (Some(kind), true) = (self.view, direct.no_autograd) {
            if let Some(view) = self.view_of(abi, kind, slots)? {
                self.finish(slots, view);
                return Ok(());
            }
        }
        self.dispatch(abi, slots, consts, stack)
    }

    /// Runs the node's op through the dispatcher's stack.
    fn dispatch(
        &self,
        abi: &Abi,
        slots: &mut [Option<Native>],
        consts: &[abi::Tensor],
        stack: &mut Vec<StableIValue>,
    ) -> Result<(), CError> {
        stack.clear();
        for (ty, enc) in &self.args {
            match build(abi, ty, enc, slots, consts) {
                Ok(v) => stack.push(v),
                Err(e) => {
                    for ((ty, _), &v) in self.args.iter().zip(stack.iter()) {
                        // SAFETY: built for `ty` just above, never handed to torch.
                        unsafe { abi.release(ty, v) };
                    }
                    return Err(e);
                }
            }
        }
        stack.resize(stack.len().max(self.returns.len()), 0);
        // SAFETY: one value per schema argument, encoded for its type; room for the returns.
        unsafe { abi.call(&self.name.0, &self.name.1, stack) }?;
        let returned = &stack[..self.returns.len()];
        match &self.outputs {
            SlotOutputs::One(Some(s)) => slots[*s] = decode(abi, &self.returns[0], returned[0]),
            SlotOutputs::None | SlotOutputs::One(None) => {
                for (ty, &v) in self.returns.iter().zip(returned) {
                    // SAFETY: an owned return no one reads.
                    unsafe { abi.release(ty, v) };
                }
            }
            SlotOutputs::Many(targets) => {
                let values: Vec<Option<Native>> = if let [Ty::List(inner)] = self.returns.as_slice() {
                    // SAFETY: the dispatcher returned an owned list for a list return.
                    unsafe { abi.take_list(returned[0])? }.into_iter().map(|item| decode(abi, inner, item)).collect()
                } else {
                    self.returns.iter().zip(returned).map(|(ty, &v)| decode(abi, ty, v)).collect()
                };
                // Values without a target drop here, which frees their tensors.
                for (value, target) in values.into_iter().zip(targets.iter().chain(std::iter::repeat(&None))) {
                    if let Some(s) = target {
                        slots[*s] = value;
                    }
                }
            }
        }
        for &s in &self.free {
            slots[s] = None;
        }
        Ok(())
    }
}

impl CStep {
    /// The view this node makes of its input, computed here (`views.rs`); `None` where
    /// torch's op should decide.
    fn view_of(&self, abi: &Abi, kind: ViewKind, slots: &[Option<Native>]) -> Result<Option<abi::Tensor>, CError> {
        let Some((_, Enc::Slot(input))) = self.args.first() else { return Ok(None) };
        let Some(Native::Tensor(x)) = &slots[*input] else { return Ok(None) };
        if !abi.can_reinterpret() {
            return Ok(None);
        }
        fn read(ty: &Ty, enc: &Enc, slots: &[Option<Native>]) -> Option<ViewArg> {
            Some(match (ty, enc) {
                (Ty::Optional(_), Enc::Bits(0)) => ViewArg::None,
                (Ty::Optional(inner), Enc::Some(e)) => read(inner, e, slots)?,
                (Ty::Int, Enc::Bits(b)) => ViewArg::Int(*b as i64),
                (Ty::Bool, Enc::Bits(b)) => ViewArg::Bool(*b != 0),
                (Ty::Int, Enc::Slot(s)) => match &slots[*s] {
                    Some(Native::Int(i)) => ViewArg::Int(*i),
                    _ => return None,
                },
                (Ty::List(inner), Enc::List(items)) if **inner == Ty::Int => ViewArg::Ints(
                    items
                        .iter()
                        .map(|i| match read(inner, i, slots)? {
                            ViewArg::Int(v) => Some(v),
                            _ => None,
                        })
                        .collect::<Option<_>>()?,
                ),
                _ => return None,
            })
        }
        let Some(args) = self.args[1..].iter().map(|(ty, enc)| read(ty, enc, slots)).collect::<Option<Vec<_>>>() else {
            return Ok(None);
        };
        // SAFETY: a live handle from a slot.
        let Some((sizes, strides)) = (unsafe { abi.sizes_strides(x.raw()) }) else { return Ok(None) };
        match views::geometry(kind, &sizes, &strides, &args) {
            Some(g) => abi.reinterpret(x, &g.sizes, &g.strides, g.offset).map(Some),
            None => Ok(None),
        }
    }

    /// Runs a node through its shim, or its Python op where the shim can't take the tensors.
    fn call_shim(
        &self,
        abi: &Abi,
        shim: &ShimStep,
        slots: &mut [Option<Native>],
        consts: &[abi::Tensor],
        direct: Direct,
    ) -> Result<(), CError> {
        let shims = abi.shims.as_ref().ok_or_else(|| CError::Internal("a shim step without shims".into()))?;
        let mut t = [std::ptr::null_mut(); 4];
        for ((_, enc), raw) in self.args.iter().zip(t.iter_mut()) {
            *raw = match enc {
                Enc::Slot(s) => match &slots[*s] {
                    Some(Native::Tensor(x)) => x.raw(),
                    _ => return Err(CError::Internal(format!("slot {s} holds no tensor"))),
                },
                other => match other.const_index(abi, slots) {
                    Some(i) => consts[i].raw(),
                    None => return Err(CError::Internal(format!("{other:?} for a shim"))),
                },
            };
        }
        let skips_dispatcher = shim.family == Family::Cpu;
        if let Some(conv) = shim.conv.as_deref() {
            return self.call_conv(abi, shim, conv, &t, slots, consts, direct);
        }
        if matches!(shim.f, ShimFn::Gelu | ShimFn::RmsNorm | ShimFn::LayerNorm) {
            // kwexport's own kernels, on the tensors they take; torch's op on the others.
            // SAFETY (each): the handles just read from live slots and constants.
            let done = match shim.f {
                _ if !direct.no_autograd => None,
                ShimFn::Gelu => unsafe { Operators(abi).gelu(t[0], shim.scalars[0] != 0.0) },
                ShimFn::RmsNorm => unsafe {
                    Operators(abi).rms_norm(t[0], t[1], shim.scalars[0], shim.scalars[1] as i64)
                },
                _ => unsafe { Operators(abi).layer_norm(t[0], t[1], t[2], shim.scalars[0], shim.scalars[1] as i64) },
            };
            let Some(result) = done else { return self.on_python(abi, shim, slots) };
            self.finish(slots, result?);
            return Ok(());
        }
        // A contiguous input of more dimensions runs folded into a matrix, as at::linear
        // runs it (the same kernel on the same memory): `folded` keeps the matrix alive.
        let mut folded = None;
        // SAFETY: the handles just read from live slots and constants.
        let admitted = unsafe {
            shims.admits(shim.family, &t[..self.args.len()], shim.floating_only, shim.in_place)
                && match shim.dims {
                    None => true,
                    Some((i, n)) if shims.dim(t[i]) == Some(n) => true,
                    Some((i, _)) if shim.fold => match abi.fold_leading(t[i]) {
                        Some((matrix, leading)) => {
                            t[i] = matrix.raw();
                            folded = Some((matrix, leading));
                            true
                        }
                        None => false,
                    },
                    Some(_) => false,
                }
        };
        if shim.integer_add && !admitted && direct.no_autograd {
            // SAFETY: the handles just read from live slots and constants.
            if let Some(result) = unsafe { Operators(abi).add_i64(t[0], t[1]) } {
                self.finish(slots, result?);
                return Ok(());
            }
        }
        if !admitted || (skips_dispatcher && !direct.no_autograd) || (shim.autocast && !direct.no_autocast) {
            return self.on_python(abi, shim, slots);
        }
        let packed = shim.packed.as_deref();
        // torch's kernel, then a fused linear's activation on its result.
        let torch = || {
            let mut r = torch_kernel(abi, shim, &t)?;
            Operators(abi).apply_epilogue(&mut r, shim.epilogue)?;
            Ok(r)
        };
        let mut result = match packed {
            // SAFETY: live handles; the packed weight is a const of the plan.
            Some(p) => match unsafe { choose_linear(abi, shim, p, &t, consts, torch) } {
                Some(r) => r?,
                None => torch()?,
            },
            None => torch()?,
        };
        if let Some((_, leading)) = &folded {
            // SAFETY: the shim's result, a live 2-D tensor.
            let n = unsafe { abi.size(result.raw(), 1) }.ok_or_else(|| CError::Internal("a result's size".into()))?;
            result = abi.unfold_leading(&result, leading, n)?;
        }
        if shim.in_place {
            // SAFETY: live handles: a slot's tensor and the shim's result.
            abi.status(unsafe { shims.copy(t[0], result.raw()) })?;
            let Enc::Slot(s) = &self.args[0].1 else { return Err(CError::Internal("in place on a constant".into())) };
            let Some(Native::Tensor(this)) = &slots[*s] else { return Err(CError::Internal("in place".into())) };
            result = abi.adopt(abi.share(this)?);
        }
        self.finish(slots, result);
        Ok(())
    }

    /// The node on kwexport's kernel, or `None` where its tensors don't qualify (the
    /// dispatcher's op runs).
    fn run_own(
        &self,
        abi: &Abi,
        own: &OwnOp,
        slots: &[Option<Native>],
        consts: &[abi::Tensor],
    ) -> Option<Result<abi::Tensor, CError>> {
        let tensor = |i: usize| tensor_arg(&self.args.get(i)?.1, slots, consts);
        match own {
            // SAFETY: live handles from slots and constants.
            OwnOp::GlobalAvgPool => unsafe { Operators(abi).global_avg_pool(tensor(0)??) },
            // SAFETY: live handles from slots and constants.
            OwnOp::Contiguous => unsafe { Operators(abi).contiguous(tensor(0)??) },
            OwnOp::Cat { dim } => {
                let Enc::List(items) = &self.args.first()?.1 else { return None };
                let inputs: Vec<abi::Raw> =
                    items.iter().map(|e| tensor_arg(e, slots, consts).flatten()).collect::<Option<_>>()?;
                // A concatenation made in place (`plan::concat`): its convolutions made its
                // result, in its slot, and wrote their parts there.
                if let (1, SlotOutputs::One(Some(o))) = (dim, &self.outputs) {
                    if let Some(Native::Tensor(buffer)) = &slots[*o] {
                        // SAFETY: live handles from slots and constants.
                        if let Some(done) = unsafe { Operators(abi).cat_into(&inputs, buffer) } {
                            return Some(done);
                        }
                    }
                }
                // SAFETY: live handles from slots and constants.
                unsafe { Operators(abi).cat(&inputs, *dim) }
            }
            // SAFETY: as above.
            OwnOp::MeanPixels { keepdim } => unsafe { Operators(abi).mean_pixels(tensor(0)??, *keepdim) },
            // SAFETY: as above.
            OwnOp::MaxPool(pool) => unsafe { Operators(abi).max_pool(tensor(0)??, pool) },
            OwnOp::Attention { causal, scale, .. } => {
                let qkv = [tensor(0)??, tensor(1)??, tensor(2)??];
                // SAFETY: as above.
                unsafe { Operators(abi).attention(qkv, tensor(3)?, *causal, *scale) }
            }
            // SAFETY: as above.
            OwnOp::Rotary { split } => unsafe { Operators(abi).rotary(tensor(0)??, tensor(1)??, tensor(2)??, *split) },
            // SAFETY: as above.
            OwnOp::FakeQuantize(quant) => unsafe { Operators(abi).fake_quantize(tensor(0)??, quant) },
            // SAFETY: as above.
            OwnOp::FakeQuantizeTensors { qmin, qmax } => unsafe {
                let ops = Operators(abi);
                let (scale, zero_point) = (ops.scalar(tensor(1)??)?, ops.scalar(tensor(2)??)?);
                // A zero point that isn't an integer is torch's to refuse.
                if zero_point.fract() != 0.0 {
                    return None;
                }
                let quant = Quant { scale, zero_point: zero_point as i64, qmin: *qmin, qmax: *qmax };
                ops.fake_quantize(tensor(0)??, &quant)
            },
            OwnOp::LinearInt8(l) => {
                let ops = Operators(abi);
                let [qmin, qmax] = l.range;
                let quant = match l.params {
                    Int8Params::Literal(scale, zero_point) => Some(Quant { scale, zero_point, qmin, qmax }),
                    // SAFETY: as above.
                    Int8Params::Tensors => unsafe {
                        let (scale, zero_point) = (ops.scalar(tensor(1)??)?, ops.scalar(tensor(2)??)? as i64);
                        Some(Quant { scale, zero_point, qmin, qmax })
                    },
                    Int8Params::Chosen(_) => None,
                };
                let eps = match l.params {
                    Int8Params::Chosen(eps) => eps,
                    _ => 0.0,
                };
                let input = match quant {
                    Some(q) => crate::operators::Int8Input::Given(q),
                    None => crate::operators::Int8Input::Chosen { qmin, qmax, eps },
                };
                let (panels, layout, peak) = l.panels.get(abi, consts)?;
                // SAFETY: as above.
                unsafe {
                    let (n, k, scale, bias) = (l.n, l.k, tensor(6)??, tensor(8)?);
                    let weight = crate::operators::Int8Weight { panels, layout, peak, n, k, scale, bias };
                    match &l.conv {
                        Some(c) => {
                            let residual = if c.residual { Some(tensor(12)??) } else { None };
                            let winograd = |hw| l.panels.winograd(abi, consts, &c.geometry, hw);
                            let geometry = (&c.geometry, residual);
                            ops.conv_int8(tensor(0)??, input, weight, geometry, (l.epilogue, l.output), winograd)
                        }
                        None => ops.linear_int8(tensor(0)??, input, weight, (l.epilogue, l.output)),
                    }
                }
            }
        }
    }

    /// Runs a shim step's node through its Python op, for tensors or calls the shim can't take.
    fn on_python(&self, abi: &Abi, shim: &ShimStep, slots: &mut [Option<Native>]) -> Result<(), CError> {
        let fallback = shim.fallback.as_ref().ok_or_else(|| CError::Internal("no fallback".into()))?;
        Python::attach(|py| run_fallback(py, abi, fallback, slots)).map_err(CError::Python)
    }

    /// Stores a one-tensor step's result in its slot and frees the slots it read last.
    fn finish(&self, slots: &mut [Option<Native>], result: abi::Tensor) {
        if let SlotOutputs::One(Some(s)) = &self.outputs {
            slots[*s] = Some(Native::Tensor(result));
        }
        for &s in &self.free {
            slots[s] = None;
        }
    }
}

/// A tensor argument's handle: `Some(None)` for an optional one not given.
fn tensor_arg(enc: &Enc, slots: &[Option<Native>], consts: &[abi::Tensor]) -> Option<Option<abi::Raw>> {
    match enc {
        Enc::Slot(s) => match &slots[*s] {
            Some(Native::Tensor(t)) => Some(Some(t.raw())),
            _ => None,
        },
        Enc::Const(c) => Some(Some(consts.get(*c)?.raw())),
        Enc::Some(inner) => tensor_arg(inner, slots, consts),
        Enc::Bits(0) => Some(None),
        _ => None,
    }
}

/// A shim step's torch kernel on its tensors `t`: the new tensor it returns.
fn torch_kernel(abi: &Abi, shim: &ShimStep, t: &[abi::Raw; 4]) -> Result<abi::Tensor, CError> {
    let shims = abi.shims.as_ref().ok_or_else(|| CError::Internal("a shim step without shims".into()))?;
    let mut out: abi::Raw = std::ptr::null_mut();
    let d = &shim.scalars;
    // SAFETY: live handles of the arity the shim's signature takes; scalars as compiled.
    let status = unsafe {
        match shim.f {
            ShimFn::TensorTensorScalar(f) => f(t[0], t[1], d[0], &mut out),
            ShimFn::TensorScalar(f) => f(t[0], d[0], &mut out),
            ShimFn::TensorTensor(f) => f(t[0], t[1], &mut out),
            // linear's addmm has beta = alpha = 1.
            ShimFn::AddmmOut(f) => match shims.empty_like(t[1]) {
                Ok(o) => {
                    out = o;
                    let (beta, alpha) = if d.is_empty() { (1.0, 1.0) } else { (d[0], d[1]) };
                    f(out, t[0], t[1], t[2], beta, alpha)
                }
                Err(status) => status,
            },
            ShimFn::MmOut(f) => match shims.empty_like(t[0]) {
                Ok(o) => {
                    out = o;
                    f(out, t[0], t[1])
                }
                Err(status) => status,
            },
            ShimFn::RmsNorm
            | ShimFn::Gelu
            | ShimFn::LayerNorm
            | ShimFn::ConvPointwise(_)
            | ShimFn::ConvPointwiseBinary(_) => {
                return Err(CError::Internal(format!("{:?} runs in call_shim", shim.f)))
            }
        }
    };
    // The shim's new tensor (or, for an out= shim, the one made for it) is owned here.
    let result = (!out.is_null()).then(|| abi.adopt(out as StableIValue));
    abi.status(status)?;
    result.ok_or_else(|| CError::Internal("a shim returned no tensor".into()))
}

/// Runs a shim step's node through its Python op, converting what it reads and returns.
fn run_fallback(py: Python<'_>, abi: &Abi, step: &PyStep, slots: &mut [Option<Native>]) -> PyResult<()> {
    fn arg<'py>(py: Python<'py>, abi: &Abi, a: &PyArg, slots: &[Option<Native>]) -> PyResult<Bound<'py, PyAny>> {
        Ok(match a {
            PyArg::Slot(s) => match &slots[*s] {
                Some(Native::Tensor(t)) => {
                    let handle = abi.share(t).map_err(|e| c_error("fallback", e))?;
                    abi.tensors_of(py, vec![abi.adopt(handle)])?.get_item(0)?
                }
                Some(Native::Int(i)) => i.into_pyobject(py)?.into_any(),
                Some(Native::Float(f)) => f.into_pyobject(py)?.into_any(),
                Some(Native::Bool(b)) => PyBool::new(py, *b).to_owned().into_any(),
                None => return Err(read_after_free(*s).into()),
            },
            PyArg::Const(c) => c.bind(py).clone(),
            PyArg::List(items) => {
                PyList::new(py, items.iter().map(|i| arg(py, abi, i, slots)).collect::<PyResult<Vec<_>>>()?)?.into_any()
            }
        })
    }
    let PyOp::Call(op) = &step.op else { return Err(RtError::Internal("a fallback to a HOP".into()).into()) };
    let args = step.args.iter().map(|a| arg(py, abi, a, slots)).collect::<PyResult<Vec<_>>>()?;
    let kwargs = PyDict::new(py);
    for (k, a) in &step.kwargs {
        kwargs.set_item(k.bind(py), arg(py, abi, a, slots)?)?;
    }
    let result = op.bind(py).call(PyTuple::new(py, args)?, Some(&kwargs)).map_err(|e| noted(py, e, step))?;
    if let SlotOutputs::One(Some(s)) = &step.outputs {
        slots[*s] = Some(Native::Tensor(abi.handle_of(&result)?));
    }
    Ok(())
}

fn run_python<'py>(
    py: Python<'py>,
    step: &PyStep,
    pys: &mut [Option<Bound<'py, PyAny>>],
    natives: &mut [Option<Native>],
) -> RtResult<()> {
    let args = step.args.iter().map(|a| value(py, a, pys)).collect::<RtResult<Vec<_>>>()?;
    let op = match &step.op {
        PyOp::Call(op) => op,
        PyOp::Hop(hop) => {
            let results = hop.run(py, args)?;
            if let SlotOutputs::Many(out) = &step.outputs {
                for (slot, value) in out.iter().zip(results) {
                    if let Some(s) = slot {
                        pys[*s] = Some(value);
                    }
                }
            }
            for &s in &step.free {
                pys[s] = None;
                natives[s] = None;
            }
            return Ok(());
        }
    };
    let args = PyTuple::new(py, args)?;
    let result = if step.kwargs.is_empty() {
        op.bind(py).call1(args)
    } else {
        let kwargs = PyDict::new(py);
        for (k, a) in &step.kwargs {
            kwargs.set_item(k.bind(py), value(py, a, pys)?)?;
        }
        op.bind(py).call(args, Some(&kwargs))
    }
    .map_err(|e| noted(py, e, step))?;
    match &step.outputs {
        SlotOutputs::None => {}
        SlotOutputs::One(slot) => {
            if let Some(s) = slot {
                pys[*s] = Some(result);
            }
        }
        SlotOutputs::Many(out) => {
            for (i, slot) in out.iter().enumerate() {
                if let Some(s) = slot {
                    pys[*s] = Some(result.get_item(i)?);
                }
            }
        }
    }
    for &s in &step.free {
        pys[s] = None;
        natives[s] = None;
    }
    Ok(())
}

impl HopStep {
    /// Runs the region, or the branch the predicate picks, on `args` (the predicate first,
    /// for `cond`), restoring grad mode and autocast state whatever happens.
    fn run<'py>(&self, py: Python<'py>, mut args: Vec<Bound<'py, PyAny>>) -> RtResult<Vec<Bound<'py, PyAny>>> {
        match self.kind {
            HopKind::Cond => {
                let pred = args.remove(0).is_truthy()?;
                self.bodies[if pred { 0 } else { 1 }].run(py, &args)
            }
            HopKind::SetGradEnabled => {
                let (set, is_enabled) = (self.grad_mode.0.bind(py), self.grad_mode.1.bind(py));
                let before = is_enabled.call0()?;
                set.call1((self.enabled,))?;
                let result = self.bodies[0].run(py, &args);
                set.call1((before,))?;
                result
            }
            HopKind::Autocast => {
                let (autocast, kwargs) = self.autocast.as_ref().ok_or_else(|| RtError::Internal("autocast".into()))?;
                let region = autocast.bind(py).call((), Some(kwargs.bind(py)))?;
                region.call_method0("__enter__")?;
                let result = self.bodies[0].run(py, &args);
                let none = py.None();
                region.call_method1("__exit__", (&none, &none, &none))?;
                result
            }
            HopKind::Map => {
                let (xs, rest) = args.split_at(self.groups[0]);
                let mut rows = Vec::new();
                for i in 0..n_rows(xs)? {
                    let inputs: Vec<_> = row(xs, i)?.into_iter().chain(rest.iter().cloned()).collect();
                    rows.push(self.bodies[0].run(py, &inputs)?);
                }
                self.stacked(py, rows, 0)
            }
            HopKind::Scan => {
                let (init, rest) = args.split_at(self.groups[0]);
                let (xs, additional) = rest.split_at(self.groups[1]);
                let mut carry = init.to_vec();
                let mut rows = Vec::new();
                for i in 0..n_rows(xs)? {
                    let inputs: Vec<_> =
                        carry.iter().cloned().chain(row(xs, i)?).chain(additional.iter().cloned()).collect();
                    let mut out = self.bodies[0].run(py, &inputs)?;
                    if out.len() < carry.len() {
                        return Err(RtError::Internal("scan's combine returned fewer values than its carry".into()));
                    }
                    rows.push(out.split_off(carry.len()));
                    carry = out;
                }
                let ys = self.stacked(py, rows, self.bodies[0].outputs.len() - carry.len())?;
                Ok(carry.into_iter().chain(ys).collect())
            }
            HopKind::WhileLoop => {
                let (carried, additional) = args.split_at(self.groups[0]);
                let mut carried = carried.to_vec();
                loop {
                    let inputs: Vec<_> = carried.iter().cloned().chain(additional.iter().cloned()).collect();
                    let pred = self.bodies[0].run(py, &inputs)?;
                    if !pred.first().ok_or_else(|| RtError::Internal("while_loop's cond".into()))?.is_truthy()? {
                        return Ok(carried);
                    }
                    carried = self.bodies[1].run(py, &inputs)?;
                }
            }
            HopKind::AssociativeScan => {
                // In order, row after row: the op is associative, so this is the scan torch
                // computes (in another association, so floats may round differently).
                let (xs, additional) = args.split_at(self.groups[0]);
                let mut acc = row(xs, 0)?;
                let mut rows = vec![acc.clone()];
                for i in 1..n_rows(xs)? {
                    let inputs: Vec<_> = acc.into_iter().chain(row(xs, i)?).chain(additional.iter().cloned()).collect();
                    acc = self.bodies[0].run(py, &inputs)?;
                    rows.push(acc.clone());
                }
                self.stacked(py, rows, xs.len())
            }
        }
    }

    /// Each output of the rows, stacked along a new dim 0; `n` outputs where there is no row.
    fn stacked<'py>(
        &self,
        py: Python<'py>,
        rows: Vec<Vec<Bound<'py, PyAny>>>,
        n: usize,
    ) -> RtResult<Vec<Bound<'py, PyAny>>> {
        if rows.is_empty() {
            return Err(RtError::Internal(format!(
                "{:?} over no rows: nothing to stack its {n} outputs from",
                self.kind
            )));
        }
        let width = rows[0].len();
        let mut columns: Vec<Vec<Bound<'py, PyAny>>> = (0..width).map(|_| Vec::with_capacity(rows.len())).collect();
        for r in rows {
            for (c, v) in columns.iter_mut().zip(r) {
                c.push(v);
            }
        }
        let stack = self.stack.bind(py);
        columns.into_iter().map(|c| Ok(stack.call1((PyList::new(py, c)?,))?)).collect()
    }
}

/// How many rows (dim 0) the loop's `xs` have: the first one's.
fn n_rows(xs: &[Bound<'_, PyAny>]) -> RtResult<usize> {
    let first = xs.first().ok_or_else(|| RtError::Internal("a loop over no xs".into()))?;
    Ok(first.call_method1(pyo3::intern!(first.py(), "size"), (0,))?.extract()?)
}

/// Row `i` of each of the `xs`.
fn row<'py>(xs: &[Bound<'py, PyAny>], i: usize) -> RtResult<Vec<Bound<'py, PyAny>>> {
    xs.iter().map(|x| Ok(x.call_method1(pyo3::intern!(x.py(), "select"), (0, i))?)).collect()
}

/// torch's exception, as raised, with a note naming the node that raised it.
fn noted(py: Python<'_>, e: PyErr, step: &PyStep) -> PyErr {
    let note = format!("kwexport: raised by graph.nodes[{}] ({})", step.node, step.op_name);
    // `add_note` is Python 3.11's; on 3.10 the exception goes on without it.
    let _ = e.value(py).call_method1(pyo3::intern!(py, "add_note"), (note,));
    e
}

fn value<'py>(py: Python<'py>, a: &PyArg, slots: &[Option<Bound<'py, PyAny>>]) -> RtResult<Bound<'py, PyAny>> {
    match a {
        PyArg::Slot(s) => slots[*s].clone().ok_or_else(|| read_after_free(*s)),
        PyArg::Const(c) => Ok(c.bind(py).clone()),
        PyArg::List(items) => {
            let items = items.iter().map(|i| value(py, i, slots)).collect::<RtResult<Vec<_>>>()?;
            Ok(PyList::new(py, items)?.into_any())
        }
    }
}
