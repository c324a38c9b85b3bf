"""Tracing: ``kwexport.export`` binds the call to the original signature, maps the user's
dynamic shapes onto flat leaves, traces with torch.export and encodes the result.

The export traces a *canonical* call: the user's ``(args, kwargs)`` bound to the original
signature with defaults applied, flattened to leaves. The traced forward takes only those
leaves, so torch.export never sees keyword arguments (and none of its kwargs quirks); the
saved input treespec and signature let the runtime rebuild any call into the same leaves.
"""

from __future__ import annotations

import inspect
import warnings

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from kwexport._graph import header_json
from kwexport._rt import ArtifactError, SignatureError
from kwexport._signature import signature_from_json, signature_json
from kwexport._weights import check_weight


class Exported:
    """The result of :func:`kwexport.export`: the traced program, ready to :func:`save`."""

    def __init__(
        self,
        exported_program,
        method: dict,
        weights: dict[str, torch.Tensor],
        mutable: set[str],
        tensor_defaults: dict | None = None,
    ):
        self.exported_program = exported_program
        self._method = method  # its entry of the header's `methods`
        self._weights = weights  # the weights the method reads, by the names `_method` uses
        self._mutable = mutable  # the ones it writes
        self._tensor_defaults = tensor_defaults or {}

    @property
    def signature(self) -> inspect.Signature:
        return signature_from_json(self._method["signature"], self._tensor_defaults)

    def __repr__(self) -> str:
        return f"<kwexport.Exported {self._method['signature']['name']}{self.signature}>"


def export(f, args, kwargs=None, *, dynamic_shapes=None, dynamic: bool = False) -> Exported:
    traced = trace(f, args, kwargs, dynamic_shapes=dynamic_shapes, dynamic=dynamic)
    return traced.encode(traced.exported_program)


class Traced:
    """A call traced over its flat leaves: the ExportedProgram, and what encoding it (or a
    program made from it, such as its quantized form) needs."""

    def __init__(self, exported_program, sig, sig_json, leaves, in_spec, *, flat_shapes, tensor_defaults):
        self.exported_program = exported_program
        self.sig, self.sig_json, self.leaves, self.in_spec = sig, sig_json, leaves, in_spec
        self.flat_shapes, self.tensor_defaults = flat_shapes, tensor_defaults

    def dynamic_shapes(self):
        """The leaves' dynamic shapes for ``torch.export.export`` of a module that takes the
        leaves as its positional arguments (such as ``exported_program.module()``), or ``None``."""
        shapes = self.flat_shapes
        return tuple(shapes) if any(s is not None for s in shapes) else None

    def leaves_of(self, args, kwargs=None) -> list:
        """Another call's leaves, bound and flattened as the traced one's were; a
        ``SignatureError`` where the traced program can't take them (another structure, a
        tensor where the trace had none, another value for a non-tensor the trace fixed)."""
        try:
            bound = self.sig.bind(*args, **dict(kwargs or {}))
        except TypeError as e:
            raise SignatureError(f"a calibration call: {e}") from None
        bound.apply_defaults()
        leaves, spec = pytree.tree_flatten((tuple(bound.args), dict(bound.kwargs)))
        traced = self.leaves
        same = spec == self.in_spec and all(
            isinstance(a, torch.Tensor) == isinstance(b, torch.Tensor) and (isinstance(a, torch.Tensor) or a == b)
            for a, b in zip(leaves, traced)
        )
        if not same:
            raise SignatureError("a calibration call differs from the traced call other than in its tensors' values")
        return leaves

    def encode(self, ep) -> Exported:
        """``ep``, a program over the same leaves, as an ``Exported`` with the traced signature."""
        return _encode(
            ep,
            self.sig_json,
            self.leaves,
            self.in_spec,
            dim_names=_dim_names(self.flat_shapes),
            tensor_defaults=self.tensor_defaults,
        )


def trace(f, args, kwargs=None, *, dynamic_shapes=None, dynamic: bool = False) -> Traced:
    """What :func:`export` traces: ``f`` bound to its signature and traced over the leaves."""
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple, got {type(args).__name__}")
    if dynamic and dynamic_shapes is not None:
        raise ValueError("pass dynamic=True or dynamic_shapes, not both")
    kwargs = dict(kwargs or {})
    if isinstance(f, torch.nn.Module):
        module, target = f, f.forward
        # A GraphModule's class is made per instance (`GraphModule.__new__.<locals>...`).
        name = "forward" if isinstance(f, torch.fx.GraphModule) else f"{type(f).__qualname__}.forward"
    elif inspect.ismethod(f) and isinstance(f.__self__, torch.nn.Module):
        # A module's other method (`model.encode`): traced over the module, so its parameters
        # and buffers are the module's weights and state, as they are for `forward`.
        module, target = f.__self__, f
        name = f"{type(module).__qualname__}.{f.__name__}"
    elif callable(f):
        module, target = _FunctionModule(), f
        name = getattr(f, "__qualname__", getattr(f, "__name__", "function"))
    else:
        raise TypeError(f"expected an nn.Module or a function, got {type(f).__name__}")

    sig = inspect.signature(target)
    tensor_defaults: dict = {}
    sig_json = signature_json(name, sig, tensor_defaults)  # before tracing: an unsaveable default fails fast
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as e:
        raise SignatureError(f"{name}() {e}") from None
    bound.apply_defaults()
    canonical = (tuple(bound.args), dict(bound.kwargs))
    leaves, in_spec = pytree.tree_flatten(canonical)
    leaves = _unaliased(leaves)
    if dynamic:
        # torch's Dim.AUTO on every dimension of every tensor: torch decides what stays dynamic.
        auto = torch.export.Dim.AUTO
        flat_shapes = [{i: auto for i in range(x.dim())} if isinstance(x, torch.Tensor) else None for x in leaves]
    else:
        flat_shapes = _leaf_dynamic_shapes(sig, bound, dynamic_shapes, len(leaves))

    call_as_given = _call_as_given(sig, args, kwargs)

    def flat_forward(*flat):
        a, k = pytree.tree_unflatten(list(flat), in_spec)
        return call_as_given(target, sig.bind(*a, **k).arguments)

    # An instance attribute shadows the class's forward for this one trace.
    module.forward = flat_forward
    try:
        ep = torch.export.export(
            module,
            tuple(leaves),
            dynamic_shapes={"flat": tuple(flat_shapes)} if any(s is not None for s in flat_shapes) else None,
        )
    finally:
        del module.forward

    return Traced(ep, sig, sig_json, leaves, in_spec, flat_shapes=flat_shapes, tensor_defaults=tensor_defaults)


def _dim_names(flat_shapes: list) -> list[dict[int, str]]:
    """Per leaf, the name of the user's ``Dim`` at each dimension that has one (a derived
    dim's root's name), so messages and ``inspect`` say ``batch`` rather than ``s39``."""
    from torch.export.dynamic_shapes import Dim

    out = []
    for spec in flat_shapes:
        by_dim = spec.items() if isinstance(spec, dict) else enumerate(spec) if isinstance(spec, (tuple, list)) else ()
        names = {}
        for i, d in by_dim:
            root = getattr(d, "root", d)
            if isinstance(root, Dim) and isinstance(getattr(root, "__name__", None), str):
                names[i] = root.__name__
        out.append(names)
    return out


def _encode(
    ep,
    sig_json: dict,
    leaves: list,
    in_spec,
    *,
    dim_names: list[dict[int, str]] | None = None,
    tensor_defaults: dict | None = None,
) -> Exported:
    """The header and weights of a traced program whose user inputs are ``leaves``."""
    ep = _plain(ep)
    # torch.export's graph runs as-is when its in-place ops only touch the call's own fresh
    # intermediates. Otherwise functionalize: writes to buffers and inputs become outputs
    # that the runtime copies back after each call (the program's state). Not by default: functionalizing also turns every
    # `contiguous` and `reshape` into a copy, a third slower on a transformer here.
    if _mutates_inputs(ep):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec")  # torch-internal
            ep = ep.run_decompositions({})
    method, weights, mutable = header_json(ep, sig_json, leaves, in_spec, dim_names)
    # A tensor default is saved as it is, a weight of its own (not the clone the trace took).
    weights.update({k: v.detach() for k, v in (tensor_defaults or {}).items()})
    for name, weight in weights.items():
        check_weight(name, weight)  # at export, not first at save
    return Exported(ep, method, weights, mutable, tensor_defaults)


def _plain(ep):
    """``ep`` with plain tensors for weights and no torchao op. torchao's int8 configs
    (``quantize_(model, Int8DynamicActivationInt8WeightConfig())``, weight-only) keep each
    weight as a tensor subclass and call torchao's ops, which a file can't hold and a process
    without torchao can't run. ``run_decompositions`` flattens each subclass weight into its
    inner tensors (``<module>.parametrizations.weight.original0``, ...) and, with torchao's
    own decompositions, rewrites its ops as aten's; every other op stays as traced."""
    weights = [*ep.state_dict.values(), *ep.constants.values()]
    ops = {n.target for n in ep.graph.nodes if isinstance(n.target, torch._ops.OpOverload)}
    if not any(is_traceable_wrapper_subclass(w) for w in weights) and not any(o.namespace == "torchao" for o in ops):
        return ep
    table = {op: fn for op, fn in torch.export.default_decompositions().items() if op.namespace == "torchao"}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec")  # torch-internal
        return ep.run_decompositions(table)


def from_exported_program(ep) -> Exported:
    """An ExportedProgram made elsewhere (``torch.export.export``, ``torch.export.load`` of a
    ``.pt2``, transformers' exporters) as an ``Exported``. Its signature is rebuilt from the
    input treespec and torch's record of the forward's argument names: the positional
    arguments the export saw become positional-or-keyword parameters, its keyword arguments
    keyword-only ones. Defaults, parameters the export didn't see and the exact parameter
    kinds are not in an ExportedProgram, so they are lost (``kwexport.export`` keeps them)."""
    if not isinstance(ep, torch.export.ExportedProgram):
        raise TypeError(f"expected a torch.export.ExportedProgram, got {type(ep).__name__}")
    in_spec = ep.call_spec.in_spec
    if in_spec is None or in_spec.type is not tuple or in_spec.num_children != 2:
        raise ArtifactError("exported program: its input treespec is not (args, kwargs)")
    args_spec, kwargs_spec = in_spec.children()
    n_args, kw_names = args_spec.num_children, list(kwargs_spec.context or [])
    names = list(ep.module_call_graph[0].signature.forward_arg_names or [])
    if len(names) != n_args + len(kw_names):
        names = [f"arg{i}" for i in range(n_args)] + kw_names
    P = inspect.Parameter
    params = [P(n, P.POSITIONAL_OR_KEYWORD) for n in names[:n_args]] + [P(n, P.KEYWORD_ONLY) for n in kw_names]
    sig_json = signature_json("forward", inspect.Signature(params))
    return _encode(ep, sig_json, _example_leaves(ep, in_spec), in_spec)


def _example_leaves(ep, in_spec) -> list:
    """The user inputs' example values: the program's own examples where it kept them, else
    the placeholders' fake tensors and the constants torch specialized."""
    if ep.example_inputs is not None:
        leaves, spec = pytree.tree_flatten(ep.example_inputs)
        if spec == in_spec:
            return leaves
    InputKind = torch.export.graph_signature.InputKind
    vals = {n.name: n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder"}
    out = []
    for spec in ep.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            out.append(getattr(spec.arg, "value", None) if spec.arg.name not in vals else vals[spec.arg.name])
    return out


def _unaliased(leaves: list) -> list:
    """The leaves with every tensor that shares memory with an earlier one cloned. torch.export
    traces a tensor passed twice as one input and drops the other from the graph, so a later
    call with two different tensors would silently compute with one of them."""
    seen = set()
    out = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.untyped_storage().nbytes():
            key = (leaf.untyped_storage().data_ptr(), leaf.device)
            out.append(leaf.clone() if key in seen else leaf)
            seen.add(key)
        else:
            out.append(leaf)
    return out


def _call_as_given(sig: inspect.Signature, args: tuple, kwargs: dict):
    """How to call the target from a binding's values exactly as the user called it: the
    same positional arguments, the same keywords in the same order, and nothing else.
    Decorators around a forward (transformers wraps most) see the user's own call; the
    defaults the user left out are recorded in the signature and bound by the runtime."""
    P = inspect.Parameter
    params = list(sig.parameters.values())
    positional = [p.name for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    var_positional = next((p.name for p in params if p.kind is P.VAR_POSITIONAL), None)
    var_keyword = next((p.name for p in params if p.kind is P.VAR_KEYWORD), None)
    # (parameter, None) for a named parameter's value; (parameter, key) for an item of it.
    by_position = [
        (positional[i], None) if i < len(positional) else (var_positional, i - len(positional))
        for i in range(len(args))
    ]
    named = (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)
    by_keyword = [
        (key, (key, None) if key in sig.parameters and sig.parameters[key].kind in named else (var_keyword, key))
        for key in kwargs
    ]
    # A tensor default the call left out is passed all the same: left to the function, it
    # would be traced as a constant, and a later call that passes its own would be ignored.
    given = {name for name, _ in by_position} | {key for key, _ in by_keyword}
    for i, p in enumerate(params):
        if p.name in given or not isinstance(p.default, torch.Tensor):
            continue
        if p.kind is P.POSITIONAL_ONLY:  # by position: every positional before it too
            by_position += [(name, None) for name in positional[len(by_position) : i + 1]]
        else:
            by_keyword.append((p.name, (p.name, None)))

    def value(arguments, where):
        name, item = where
        return arguments[name] if item is None else arguments[name][item]

    def call(target, arguments):
        return target(
            *[value(arguments, w) for w in by_position],
            **{key: value(arguments, w) for key, w in by_keyword},
        )

    return call


def _mutates_inputs(ep) -> bool:
    """Whether an in-place op writes to a placeholder (input or weight) or a view of one."""
    for node in ep.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if not target._schema.is_mutable:
            continue
        for i, arg in enumerate(target._schema.arguments):
            written = arg.alias_info is not None and arg.alias_info.is_write
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            root = _view_root(value)
            if written and isinstance(root, torch.fx.Node) and root.op == "placeholder":
                return True
    return False


def _view_root(value):
    """Follows views (ops whose first return aliases their first argument) back to their base."""
    while (
        isinstance(value, torch.fx.Node)
        and value.op == "call_function"
        and isinstance(value.target, torch._ops.OpOverload)
        and value.target._schema.returns
        and value.target._schema.returns[0].alias_info is not None
        and value.args
    ):
        value = value.args[0]
    return value


class _FunctionModule(torch.nn.Module):
    """A parameterless module to trace a plain function through."""


def _leaf_dynamic_shapes(sig, bound, dynamic_shapes, n_leaves) -> list:
    """Turns the user's ``dynamic_shapes`` (as torch.export takes it for ``f``: a dict by
    parameter name, or a tuple in parameter order) into one entry per flat leaf."""
    if dynamic_shapes is None:
        return [None] * n_leaves
    names = list(bound.arguments)
    if isinstance(dynamic_shapes, dict):
        unknown = [k for k in dynamic_shapes if k not in sig.parameters]
        var_kw = next((p.name for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), None)
        extra = bound.arguments.get(var_kw, {}) if var_kw else {}
        per_param = dict(dynamic_shapes)
        for k in unknown:  # torch also accepts **kwargs entries by their own name
            if k not in extra:
                raise ValueError(f"dynamic_shapes names {k!r}, which is not a parameter of the exported callable")
            per_param.setdefault(var_kw, {})[k] = per_param.pop(k)
    elif isinstance(dynamic_shapes, (tuple, list)):
        if len(dynamic_shapes) > len(names):
            raise ValueError(f"dynamic_shapes has {len(dynamic_shapes)} entries for {len(names)} parameters")
        per_param = dict(zip(names, dynamic_shapes))
    else:
        raise TypeError(f"dynamic_shapes must be a dict, tuple or list, got {type(dynamic_shapes).__name__}")

    flat_by_param = {}
    for pname, value in bound.arguments.items():
        flat_by_param[pname] = _match_shapes(value, per_param.get(pname), pname)
    # Leaves are in (args, kwargs) order, which is parameter order with defaults applied.
    out = [s for pname in names for s in flat_by_param[pname]]
    if len(out) != n_leaves:
        raise AssertionError(f"kwexport: {len(out)} dynamic-shape entries for {n_leaves} leaves")
    return out


def _match_shapes(value, spec, path) -> list:
    """One dynamic-shape entry per pytree leaf of ``value``; ``spec`` mirrors its structure."""
    n = len(pytree.tree_leaves(value))
    if spec is None:
        return [None] * n
    if isinstance(value, torch.Tensor):
        return [spec]
    if isinstance(value, dict):
        if not isinstance(spec, dict):
            raise ValueError(f"dynamic_shapes[{path}]: expected a dict mirroring the input, got {type(spec).__name__}")
        return [s for k, v in value.items() for s in _match_shapes(v, spec.get(k), f"{path}[{k!r}]")]
    if isinstance(value, (tuple, list)):
        if not isinstance(spec, (tuple, list)) or len(spec) != len(value):
            raise ValueError(f"dynamic_shapes[{path}]: expected a sequence of {len(value)} entries")
        return [s for i, (v, sp) in enumerate(zip(value, spec)) for s in _match_shapes(v, sp, f"{path}[{i}]")]
    return [None] * n
