"""Export and save: trace with torch.export, then write one self-describing file.

The export traces a *canonical* call: the user's ``(args, kwargs)`` bound to the original
signature with defaults applied, flattened to leaves. The traced forward takes only those
leaves, so torch.export never sees keyword arguments (and none of its kwargs quirks); the
saved input treespec and signature let the runtime rebuild any call into the same leaves.
"""

from __future__ import annotations

import collections
import inspect
import json
import math
import operator
import os
import struct
import sys
import tempfile
import warnings
from typing import Any

import torch
from torch.utils import _pytree as pytree

import kwexport
from kwexport._rt import FORMAT_VERSION, ArtifactError, SignatureError

MAGIC = b"KWEXPORT"
ALIGN = 64
_I64 = (-(2**63), 2**63 - 1)

_DTYPES = {
    getattr(torch, n): n
    for n in (
        "float64", "float32", "float16", "bfloat16", "complex128", "complex64",
        "int64", "int32", "int16", "int8", "uint8", "bool",
    )
}
# Python operators graphs apply to symbolic sizes; the runtime allows the same table.
_PY_OPERATORS = {
    getattr(operator, n): n
    for n in (
        "add", "sub", "mul", "floordiv", "truediv", "mod", "pow", "neg", "pos", "abs",
        "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "not_",
    )
}


class Exported:
    """The result of :func:`kwexport.export`: the traced program, ready to :func:`save`."""

    def __init__(self, exported_program, header: dict, storages: list):
        self.exported_program = exported_program
        self._header = header
        self._storages = storages  # uint8 CPU tensors, one per distinct storage

    @property
    def signature(self) -> inspect.Signature:
        return _signature_from_json(self._header["signature"])

    def __repr__(self) -> str:
        return f"<kwexport.Exported {self._header['signature']['name']}{self.signature}>"


# ------------------------------------------------------------------------------ export


def export(f, args, kwargs=None, *, dynamic_shapes=None) -> Exported:
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple, got {type(args).__name__}")
    kwargs = dict(kwargs or {})
    if isinstance(f, torch.nn.Module):
        module, target = f, f.forward
        name = f"{type(f).__qualname__}.forward"
    elif callable(f):
        module, target = _FunctionModule(), f
        name = getattr(f, "__qualname__", getattr(f, "__name__", "function"))
    else:
        raise TypeError(f"expected an nn.Module or a function, got {type(f).__name__}")

    sig = inspect.signature(target)
    sig_json = _signature_json(name, sig)  # before tracing: an unsaveable default fails fast
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as e:
        raise SignatureError(f"{name}() {e}") from None
    bound.apply_defaults()
    canonical = (tuple(bound.args), dict(bound.kwargs))
    leaves, in_spec = pytree.tree_flatten(canonical)
    flat_shapes = _leaf_dynamic_shapes(sig, bound, dynamic_shapes, len(leaves))

    def flat_forward(*flat):
        a, k = pytree.tree_unflatten(list(flat), in_spec)
        return target(*a, **k)

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

    # torch.export's graph runs as-is when its in-place ops only touch the call's own fresh
    # intermediates. Otherwise functionalize: buffer updates become outputs (refused below),
    # in-place ops on inputs become copies. Not by default: functionalizing also turns every
    # `contiguous` and `reshape` into a copy, a third slower on a transformer here.
    if _mutates_inputs(ep):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec")  # torch-internal
            ep = ep.run_decompositions({})
    header, storages = _serialize(ep, sig_json, leaves, in_spec)
    return Exported(ep, header, storages)


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
    while (isinstance(value, torch.fx.Node) and value.op == "call_function"
           and isinstance(value.target, torch._ops.OpOverload) and value.target._schema.returns
           and value.target._schema.returns[0].alias_info is not None and value.args):
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


# ------------------------------------------------------------------------------ serialize


def _serialize(ep, sig_json, leaves, in_spec):
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

    for spec in gs.output_specs:
        if spec.kind != OutputKind.USER_OUTPUT:
            what = "mutates a buffer (call .eval() for batch norm?)" if spec.kind == OutputKind.BUFFER_MUTATION else f"has a {spec.kind.name} output"
            raise ArtifactError(f"graph output {spec.arg.name!r}: the program {what}; kwexport saves pure inference programs")

    leaf_specs = [None] * len(leaves)
    ops = _OpTable()
    nodes = []
    outputs = None
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            if node.name in user_placeholders:
                i = user_placeholders[node.name]
                leaf_specs[i] = _leaf_spec(node.meta.get("val"), leaves[i], i)
        elif node.op == "call_function":
            encoded = _node(node, ops)
            if encoded is not None:
                nodes.append(encoded)
        elif node.op == "output":
            outputs = [_arg(a, "graph.outputs") for a in node.args[0]]
        else:
            raise ArtifactError(f"node {node.name!r}: unsupported node kind {node.op!r} (control flow and submodules are not supported)")

    symbols = []
    for sym, rng in ep.range_constraints.items():
        if getattr(sym, "is_Symbol", False):
            upper = rng.upper
            symbols.append({
                "name": str(sym),
                "min": int(rng.lower),
                "max": None if _is_inf(upper) else int(upper),
            })

    storage_table, tensor_table, storages = _weights(weights)
    header = {
        "format_version": {"major": FORMAT_VERSION[0], "minor": FORMAT_VERSION[1]},
        "producer": {
            "kwexport": kwexport.__version__,
            "torch": torch.__version__,
            "python": ".".join(map(str, sys.version_info[:3])),
        },
        "signature": sig_json,
        "inputs": {"spec": _treespec(in_spec, "inputs"), "leaves": leaf_specs},
        "outputs": _treespec(ep.call_spec.out_spec, "outputs"),
        "symbols": symbols,
        "ops": ops.entries,
        "graph": {"inputs": graph_inputs, "nodes": nodes, "outputs": outputs},
        "weights": {"storages": storage_table, "tensors": tensor_table},
    }
    return header, storages


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


def _node(node, ops):
    target = node.target
    if target is operator.getitem and isinstance(node.args[0], torch.fx.Node) and _is_multi(node.args[0]):
        return None  # folded into the producer's outputs
    if isinstance(target, torch._ops.OpOverload):
        op, schema = f"{target._schema.name}.{target._overloadname}", str(target._schema)
    elif target in _PY_OPERATORS:
        op, schema = f"operator::{_PY_OPERATORS[target]}", None
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
        "args": [_arg(a, where) for a in node.args],
        "kwargs": {k: _arg(v, where) for k, v in node.kwargs.items()},
        "outputs": outputs,
    }


def _is_multi(node) -> bool:
    return isinstance(node.meta.get("val"), (tuple, list))


def _arg(x, where):
    if isinstance(x, torch.fx.Node):
        return {"ref": x.name}
    if isinstance(x, (list, tuple)):
        return {"list": [_arg(i, where) for i in x]}
    if isinstance(x, torch.dtype):
        if x not in _DTYPES:
            raise ArtifactError(f"{where}: unsupported dtype {x}")
        return {"dtype": _DTYPES[x]}
    if isinstance(x, torch.device):
        return {"device": str(x)}
    if isinstance(x, torch.layout):
        return {"layout": str(x).removeprefix("torch.")}
    if isinstance(x, torch.memory_format):
        return {"memory_format": str(x).removeprefix("torch.")}
    try:
        return _constant(x, where, allow_containers=False)
    except ArtifactError:
        raise ArtifactError(f"{where}: can't save an argument of type {type(x).__name__}: {x!r}") from None


def _constant(x, where, allow_containers=True):
    if x is None:
        return {"none": None}
    if isinstance(x, bool):
        return {"bool": x}
    if isinstance(x, int):
        if not _I64[0] <= x <= _I64[1]:
            raise ArtifactError(f"{where}: integer {x} does not fit in 64 bits")
        return {"int": x}
    if isinstance(x, float):
        if math.isnan(x):
            return {"float": "nan"}
        if math.isinf(x):
            return {"float": "inf" if x > 0 else "-inf"}
        return {"float": x}
    if isinstance(x, str):
        return {"str": x}
    if allow_containers and type(x) in (tuple, list):
        return {type(x).__name__: [_constant(i, where) for i in x]}
    raise ArtifactError(f"{where}: can't save a value of type {type(x).__name__} without pickle")


def _leaf_spec(val, value, i):
    where = f"input leaf {i}"
    if isinstance(val, torch.Tensor):
        if val.layout != torch.strided or val.dtype not in _DTYPES:
            raise ArtifactError(f"{where}: unsupported tensor ({val.layout}, {val.dtype})")
        return {"tensor": {
            "dtype": _DTYPES[val.dtype],
            "device": str(value.device) if isinstance(value, torch.Tensor) else str(val.device),
            "shape": [_dim(s, where) for s in val.shape],
        }}
    if isinstance(value, torch.Tensor):
        raise AssertionError(f"kwexport: {where} is a tensor but its placeholder is not")
    return {"constant": _constant(value, where)}


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


def _treespec(spec, where):
    if spec.is_leaf():
        return {"type": "leaf"}
    t = spec.type
    kids = [_treespec(c, where) for c in spec.children()]
    if t is tuple:
        return {"type": "tuple", "children": kids}
    if t is list:
        return {"type": "list", "children": kids}
    if t is dict or t is collections.OrderedDict:
        entries = [{"key": _key(k, where), "value": v} for k, v in zip(spec.context, kids)]
        return {"type": "dict" if t is dict else "ordered_dict", "entries": entries}
    if t is type(None):
        return {"type": "none"}
    cls = spec.context
    if isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields"):
        return {"type": "namedtuple", "name": cls.__name__, "module": cls.__module__,
                "fields": list(cls._fields), "children": kids}
    raise ArtifactError(f"{where}: can't save a container of type {getattr(t, '__qualname__', t)!r}")


def _key(k, where):
    if isinstance(k, str):
        return {"str": k}
    if isinstance(k, int) and not isinstance(k, bool) and _I64[0] <= k <= _I64[1]:
        return {"int": k}
    raise ArtifactError(f"{where}: dict key {k!r} is neither a str nor an int")


def _signature_json(name, sig):
    params = []
    for p in sig.parameters.values():
        entry = {"name": p.name, "kind": p.kind.name.lower()}
        if p.default is not inspect.Parameter.empty:
            entry["default"] = _constant(p.default, f"default of parameter {p.name!r}")
        params.append(entry)
    return {"name": name, "params": params}


def _constant_value(c):
    """The Python value of a JSON constant (the inverse of ``_constant``)."""
    ((kind, v),) = c.items()
    if kind == "float" and isinstance(v, str):
        return float(v)
    if kind in ("tuple", "list"):
        items = [_constant_value(i) for i in v]
        return tuple(items) if kind == "tuple" else items
    return v


def _signature_from_json(sig):
    return inspect.Signature([
        inspect.Parameter(
            p["name"],
            getattr(inspect.Parameter, p["kind"].upper()),
            **({"default": _constant_value(p["default"])} if "default" in p else {}),
        )
        for p in sig["params"]
    ])


def _weights(weights):
    if sys.byteorder != "little":
        raise ArtifactError("kwexport writes little-endian weights; saving on a big-endian machine is not supported")
    storage_table, storages, by_storage = [], [], {}
    tensors = {}
    for name, t in weights.items():
        where = f"weight {name!r}"
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise ArtifactError(f"{where}: tensor subclass {type(t).__name__} can't be saved")
        if t.layout != torch.strided or t.is_quantized or t.dtype not in _DTYPES:
            raise ArtifactError(f"{where}: unsupported tensor ({t.layout}, {t.dtype})")
        t = t.detach()
        st = t.untyped_storage()
        key = (st.data_ptr(), str(t.device), st.nbytes()) if st.nbytes() else ("empty", name)
        if key not in by_storage:
            data = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,)).cpu()
            by_storage[key] = len(storages)
            storages.append(data)
            storage_table.append({"offset": None, "nbytes": st.nbytes()})
        tensors[name] = {
            "dtype": _DTYPES[t.dtype],
            "shape": list(t.shape),
            "strides": list(t.stride()),
            "storage": by_storage[key],
            "storage_offset": t.storage_offset(),
        }
    return storage_table, tensors, storages


# ------------------------------------------------------------------------------ save


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def check_extra_name(name) -> None:
    """The same rule the runtime enforces: a relative path without empty, '.' or '..' parts."""
    if not isinstance(name, str):
        raise TypeError(f"extra file names must be str, got {type(name).__name__}")
    parts = name.split("/")
    if (not name or len(name.encode()) > 255 or name.startswith("/") or "\\" in name or "\0" in name
            or any(p in ("", ".", "..") for p in parts)):
        raise ArtifactError(f"extra_files[{name!r}]: unsafe extra-file name")


def save(ex: Exported, path, *, extra_files=None) -> None:
    if not isinstance(ex, Exported):
        raise TypeError(f"save() takes the result of kwexport.export, got {type(ex).__name__}")
    header = json.loads(json.dumps(ex._header))  # a copy we can fill in
    chunks = []  # (offset in data section, buffer)
    cursor = 0
    for entry, data in zip(header["weights"]["storages"], ex._storages):
        entry["offset"] = cursor
        chunks.append((cursor, memoryview(data.numpy())))
        cursor = _align(cursor + entry["nbytes"])
    extras = {}
    for name, value in (extra_files or {}).items():
        check_extra_name(name)
        if isinstance(value, str):
            blob, encoding = value.encode("utf-8"), "utf8"
        elif isinstance(value, (bytes, bytearray, memoryview)):
            blob, encoding = bytes(value), "bytes"
        else:
            raise TypeError(f"extra_files[{name!r}] must be str or bytes, got {type(value).__name__}")
        extras[name] = {"offset": cursor, "nbytes": len(blob), "encoding": encoding}
        chunks.append((cursor, blob))
        cursor = _align(cursor + len(blob))
    header["extra_files"] = extras
    blob = json.dumps(header, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
    prefix = MAGIC + struct.pack("<Q", len(blob)) + blob
    data_start = _align(len(prefix))
    _write_atomic(os.fspath(path), prefix, data_start, chunks)


def _file_mode(path: str) -> int:
    try:
        return os.stat(path).st_mode & 0o777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _write_atomic(path: str, prefix: bytes, data_start: int, chunks) -> None:
    """Temp file in the same folder, fsync, rename: readers see the old file or the new one."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(prefix)
            for offset, buf in chunks:
                f.write(b"\0" * (data_start + offset - f.tell()))
                f.write(buf)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _file_mode(path))  # mkstemp makes 0600; give what open() would
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:
        dir_fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
