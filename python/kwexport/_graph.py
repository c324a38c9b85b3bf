"""Graph encoding: an ExportedProgram's graph, input leaves, symbols and input/output
treespecs as the header's JSON. The tables it checks against (dtypes, Python operators)
come from ``kwexport._rt``."""

from __future__ import annotations

import collections
import dataclasses
import math
import operator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from kwexport._rt import DTYPES, HIGHER_ORDER_OPS, PY_OPERATORS, SYM_FUNCTIONS, ArtifactError
from kwexport._signature import _I64, constant_json

DTYPE_NAMES = {getattr(torch, name): name for name, _ in DTYPES}
_PY_OPERATORS = {getattr(operator, name): name for name in PY_OPERATORS}
_SYM_FUNCTIONS = {getattr(torch, name): name for name in SYM_FUNCTIONS if hasattr(torch, name)}


def header_json(
    ep, sig_json: dict[str, Any], leaves: list[Any], in_spec, dim_names: list[dict[int, str]] | None = None
) -> tuple[dict[str, Any], dict[str, torch.Tensor], set[str]]:
    """The method entry of the header for ``ep``; the weights it reads, by name; and the names of
    the weights the program writes (its state). ``dim_names`` names, per leaf, the user's
    ``Dim`` at a dimension; their symbols are saved under those names."""
    gs = ep.graph_signature
    InputKind = torch.export.graph_signature.InputKind
    OutputKind = torch.export.graph_signature.OutputKind

    weights: dict[str, torch.Tensor] = {}
    graph_inputs = []
    user_index = 0
    user_placeholders = {}
    for spec in gs.input_specs:
        pname = spec.arg.name
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            tensor = ep.state_dict.get(spec.target)
            if tensor is None:
                tensor = ep.constants.get(spec.target)
            if not isinstance(tensor, torch.Tensor):
                raise ArtifactError(f"weight {spec.target!r}: not a tensor ({type(tensor).__name__})")
            weights[spec.target] = tensor
            graph_inputs.append({"name": pname, "source": {"weight": spec.target}})
        elif spec.kind == InputKind.USER_INPUT:
            graph_inputs.append({"name": pname, "source": {"user": user_index}})
            user_placeholders[pname] = user_index
            user_index += 1
        else:
            raise ArtifactError(f"graph input {pname!r}: unsupported input kind {spec.kind.name}")
    if user_index != len(leaves):
        raise AssertionError(f"kwexport: the graph has {user_index} user inputs for {len(leaves)} leaves")

    # What each output of the graph is: a user output, or a new value of a buffer or input.
    roles = []
    for spec in gs.output_specs:
        if spec.kind == OutputKind.USER_OUTPUT:
            roles.append(None)
        elif spec.kind == OutputKind.BUFFER_MUTATION and spec.target in weights:
            roles.append({"weight": spec.target})
        elif spec.kind == OutputKind.USER_INPUT_MUTATION and spec.target in user_placeholders:
            roles.append({"user": user_placeholders[spec.target]})
        else:
            raise ArtifactError(f"graph output {spec.arg.name!r}: unsupported output kind {spec.kind.name}")

    leaf_specs = [None] * len(leaves)
    for node in ep.graph.nodes:
        if node.op == "placeholder" and node.name in user_placeholders:
            i = user_placeholders[node.name]
            leaf_specs[i] = _leaf_spec(node.meta.get("val"), leaves[i], i)
    ops = _OpTable()
    subgraphs: dict[str, Any] = {}
    graph = _encode_graph(ep.graph_module, "", ops, subgraphs)
    nodes = graph["nodes"]
    if len(graph["outputs"]) != len(roles):
        raise AssertionError(f"kwexport: {len(graph['outputs'])} graph outputs for {len(roles)} output specs")
    outputs = [value for value, role in zip(graph["outputs"], roles) if role is None]
    mutations = [{"target": role, "value": value} for value, role in zip(graph["outputs"], roles) if role]

    # Only the symbols input dimensions use: the table serves the input checks. Unbacked
    # symbols (``u0`` from ``.item()``) can be unbounded both ways and are never an input's.
    used = {
        d["symbolic"]["symbol"]
        for leaf in leaf_specs
        if "tensor" in leaf
        for d in leaf["tensor"]["shape"]
        if "symbolic" in d
    }
    rename = _symbol_names(leaf_specs, dim_names or [], used)
    for leaf in leaf_specs:
        for d in leaf.get("tensor", {}).get("shape", []):
            if "symbolic" in d:
                d["symbolic"]["symbol"] = rename.get(d["symbolic"]["symbol"], d["symbolic"]["symbol"])
    symbols = []
    for sym, rng in ep.range_constraints.items():
        if getattr(sym, "is_Symbol", False) and str(sym) in used:
            upper = rng.upper
            symbols.append(
                {
                    "name": rename.get(str(sym), str(sym)),
                    "min": int(rng.lower),
                    "max": None if _is_inf(upper) else int(upper),
                }
            )

    method = {
        "signature": sig_json,
        "inputs": {"spec": _treespec(in_spec, "inputs"), "leaves": leaf_specs},
        "outputs": _treespec(ep.call_spec.out_spec, "outputs"),
        "symbols": symbols,
        "ops": ops.entries,
        "graph": {"inputs": graph_inputs, "nodes": nodes, "outputs": outputs, "mutations": mutations},
        "subgraphs": subgraphs,
    }
    return method, weights, {m["target"]["weight"] for m in mutations if "weight" in m["target"]}


def _symbol_names(leaf_specs: list, dim_names: list[dict[int, str]], used: set[str]) -> dict[str, str]:
    """torch's symbol -> the user's ``Dim`` name, where the user named the dimension it sizes
    and the name is free (no other symbol has it)."""
    rename: dict[str, str] = {}
    for leaf, names in zip(leaf_specs, dim_names):
        shape = leaf.get("tensor", {}).get("shape", []) if leaf else []
        for i, name in names.items():
            d = shape[i] if i < len(shape) else {}
            if "symbolic" in d:
                rename.setdefault(d["symbolic"]["symbol"], name)
    taken = set(used) - set(rename)
    chosen: dict[str, str] = {}
    for sym, name in rename.items():
        if name not in taken and name not in chosen.values():
            chosen[sym] = name
    return chosen


def _is_inf(v) -> bool:
    try:
        return math.isinf(float(v))
    except (TypeError, ValueError, OverflowError):
        return True


class _OpTable:
    """Each op once, with its schema in this torch, so a later torch can spot drift."""

    def __init__(self):
        self.entries, self._index = [], {}

    def add(self, name: str, schema) -> int:
        if name not in self._index:
            self._index[name] = len(self.entries)
            self.entries.append({"name": name, "schema": schema})
        return self._index[name]


def _encode_graph(gm, prefix: str, ops: _OpTable, subgraphs: dict[str, Any]) -> dict[str, Any]:
    """A graph module's nodes and outputs (and its placeholders' names); the graph modules its
    higher-order ops run are encoded into ``subgraphs`` under their dotted attribute paths."""
    inputs, nodes, outputs = [], [], []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            inputs.append(node.name)
        elif node.op == "get_attr":
            sub = getattr(gm, node.target, None)
            if not isinstance(sub, torch.fx.GraphModule):
                raise ArtifactError(
                    f"node {node.name!r}: reads attribute {node.target!r} ({type(sub).__name__}); kwexport reads only "
                    "the subgraphs of higher-order ops this way"
                )
            name = f"{prefix}{node.target}"
            if name not in subgraphs:
                subgraphs[name] = None  # placeholder: a subgraph running itself can't recurse forever
                subgraphs[name] = _encode_graph(sub, f"{name}.", ops, subgraphs)
        elif node.op == "call_function":
            encoded = _node(node, ops, prefix)
            if encoded is not None:
                nodes.append(encoded)
        elif node.op == "output":
            returned = node.args[0] if isinstance(node.args[0], (tuple, list)) else [node.args[0]]  # one value: a cond
            outputs = [_arg(a, "graph.outputs", prefix) for a in returned]
        else:
            raise ArtifactError(f"node {node.name!r}: unsupported node kind {node.op!r}")
    return {"inputs": inputs, "nodes": nodes, "outputs": outputs}


def _node(node, ops, prefix=""):
    target = node.target
    if target is operator.getitem and isinstance(node.args[0], torch.fx.Node) and _is_multi(node.args[0]):
        return None  # folded into the producer's outputs
    if isinstance(target, torch._ops.OpOverload):
        op, schema = f"{target._schema.name}.{target._overloadname}", str(target._schema)
    elif target in _PY_OPERATORS:
        op, schema = f"operator::{_PY_OPERATORS[target]}", None
    elif target in _SYM_FUNCTIONS:
        op, schema = f"torch::{_SYM_FUNCTIONS[target]}", None
    elif isinstance(target, torch._ops.HigherOrderOperator):
        if target.name() not in HIGHER_ORDER_OPS:
            raise ArtifactError(
                f"node {node.name!r}: kwexport can't run the higher-order op {target.name()!r} (it runs "
                f"{', '.join(HIGHER_ORDER_OPS)}); rewrite that part of the model without it"
            )
        op, schema = f"higher_order::{target.name()}", None
    else:
        raise ArtifactError(f"node {node.name!r}: unsupported call target {target!r}")
    where = f"node {node.name!r} ({op})"
    if _is_multi(node):
        names = [None] * len(node.meta["val"])
        for user in node.users:
            if user.target is not operator.getitem:
                raise ArtifactError(f"{where}: a multi-output value is used whole by {user.name!r}")
            names[user.args[1]] = user.name
        outputs = {"many": names}
    elif node.meta.get("val") is None and not node.users:
        outputs = {"none": None}
    else:
        outputs = {"one": node.name}
    return {
        "op": ops.add(op, schema),
        "args": [_arg(a, where, prefix) for a in node.args],
        "kwargs": {k: _arg(v, where, prefix) for k, v in node.kwargs.items()},
        "outputs": outputs,
    }


def _is_multi(node) -> bool:
    return isinstance(node.meta.get("val"), (tuple, list))


def _arg(x, where, prefix=""):
    if isinstance(x, torch.fx.Node):
        if x.op == "get_attr":
            return {"subgraph": f"{prefix}{x.target}"}
        return {"ref": x.name}
    if isinstance(x, (list, tuple)):
        return {"list": [_arg(i, where, prefix) for i in x]}
    if isinstance(x, torch.dtype):
        if x not in DTYPE_NAMES:
            raise ArtifactError(f"{where}: unsupported dtype {x}")
        return {"dtype": DTYPE_NAMES[x]}
    if isinstance(x, torch.device):
        return {"device": str(x)}
    if isinstance(x, torch.layout):
        return {"layout": str(x).removeprefix("torch.")}
    if isinstance(x, torch.memory_format):
        return {"memory_format": str(x).removeprefix("torch.")}
    try:
        return constant_json(x, where, allow_containers=False)
    except ArtifactError:
        raise ArtifactError(f"{where}: can't save an argument of type {type(x).__name__}: {x!r}") from None


def _leaf_spec(val, value, i):
    where = f"input leaf {i}"
    if isinstance(val, torch.Tensor):
        if val.layout != torch.strided or val.dtype not in DTYPE_NAMES:
            raise ArtifactError(f"{where}: unsupported tensor ({val.layout}, {val.dtype})")
        return {
            "tensor": {
                "dtype": DTYPE_NAMES[val.dtype],
                "device": str(value.device) if isinstance(value, torch.Tensor) else str(val.device),
                "shape": [_dim(s, where) for s in val.shape],
            }
        }
    if isinstance(value, torch.Tensor):
        raise AssertionError(f"kwexport: {where} is a tensor but its placeholder is not")
    return {"constant": constant_json(value, where)}


def _dim(s, where):
    if isinstance(s, int):
        return {"static": s}
    import sympy

    expr = s.node.expr
    if expr.is_Integer:
        return {"static": int(expr)}
    free = list(expr.free_symbols)
    if len(free) == 1:
        sym = free[0]
        coeff, offset = expr.coeff(sym), expr.subs(sym, 0)
        if coeff.is_Integer and offset.is_Integer and sympy.expand(coeff * sym + offset - expr) == 0:
            return {"symbolic": {"symbol": str(sym), "coeff": int(coeff), "offset": int(offset)}}
    raise ArtifactError(f"{where}: dimension {expr} is not of the form a*d + b; kwexport can't check it")


# The default_factory a saved defaultdict may have (the core's DEFAULTDICT_FACTORIES).
_FACTORIES = {
    list: "list",
    dict: "dict",
    set: "set",
    tuple: "tuple",
    int: "int",
    float: "float",
    str: "str",
    bool: "bool",
}


def _treespec(spec, where):
    """A pytree spec as the header records it; ``where`` is the path of the value, for errors."""
    if spec.is_leaf():
        return {"type": "leaf"}
    t = spec.type
    children = spec.children()
    if t is type(None):
        return {"type": "none"}
    if t in (tuple, list):
        return {"type": t.__name__, "children": [_treespec(c, f"{where}[{i}]") for i, c in enumerate(children)]}
    if t in (dict, collections.OrderedDict, collections.defaultdict):
        factory, keys = spec.context if t is collections.defaultdict else (None, spec.context)
        entries = [{"key": _key(k, where), "value": _treespec(c, f"{where}[{k!r}]")} for k, c in zip(keys, children)]
        if t is dict:
            return {"type": "dict", "entries": entries}
        if t is collections.OrderedDict:
            return {"type": "ordered_dict", "entries": entries}
        if factory is not None and factory not in _FACTORIES:
            raise ArtifactError(
                f"{where}: can't save a defaultdict whose default_factory is {factory!r}: kwexport saves only "
                f"the builtin factories {', '.join(_FACTORIES.values())} (loading never runs code from the file)"
            )
        return {"type": "defaultdict", "factory": _FACTORIES.get(factory), "entries": entries}
    cls = spec.context
    if isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields"):
        return {
            "type": "namedtuple",
            "name": cls.__name__,
            "module": cls.__module__,
            "fields": list(cls._fields),
            "children": [_treespec(c, f"{where}.{f}") for f, c in zip(cls._fields, children)],
        }
    return _container(t, spec.context, children, where)


def _container(t, context, children, where):
    """A class registered with torch's pytree: its kind, name, context and children's keys."""
    name = f"{getattr(t, '__module__', '?')}.{getattr(t, '__qualname__', t)}"
    if t not in pytree.SUPPORTED_NODES:
        raise ArtifactError(
            f"{where}: can't save a container of type {name}: it is not registered with torch's pytree; "
            "register it with torch.utils._pytree.register_dataclass or register_pytree_node"
        )
    try:
        context_json = constant_json(context, where)
    except ArtifactError:
        raise ArtifactError(
            f"{where}: can't save a container of type {name}: its pytree context {context!r} is not made of "
            "None, bool, int, float, str, lists and tuples; register it with a flatten function whose context is"
        ) from None
    if _is_model_output(t) and isinstance(context, list) and all(isinstance(k, str) for k in context):
        kind, keys = "model_output", [{"key": {"str": k}} for k in context]
    elif dataclasses.is_dataclass(t) and _is_dataclass_context(context, len(children)):
        kind, keys = "dataclass", [{"attr": k} for k in context[0]]
    else:
        kind, keys = "pytree_node", [{"index": i} for i in range(len(children))]
    steps = [
        f"[{k['key']['str']!r}]" if "key" in k else f".{k['attr']}" if "attr" in k else f"[{k['index']}]" for k in keys
    ]
    return {
        "type": "container",
        "kind": kind,
        "module": t.__module__,
        "qualname": t.__qualname__,
        "context": context_json,
        "keys": keys,
        "children": [_treespec(c, f"{where}{step}") for c, step in zip(children, steps)],
    }


def _is_model_output(t) -> bool:
    """A transformers ModelOutput, told by its bases' names: transformers isn't imported here."""
    return any(b.__name__ == "ModelOutput" and b.__module__ == "transformers.utils.generic" for b in t.__mro__)


def _is_dataclass_context(context, n_children) -> bool:
    """torch's register_dataclass context: [names of the children, names of the None fields]."""
    return (
        isinstance(context, list)
        and len(context) == 2
        and all(isinstance(names, list) and all(isinstance(n, str) for n in names) for names in context)
        and len(context[0]) == n_children
    )


def _key(k, where):
    if isinstance(k, str):
        return {"str": k}
    if isinstance(k, int) and not isinstance(k, bool) and _I64[0] <= k <= _I64[1]:
        return {"int": k}
    raise ArtifactError(f"{where}: dict key {k!r} is neither a str nor an int")
