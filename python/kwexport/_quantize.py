"""``kwexport.quantize``: a call traced as ``kwexport.export`` traces it, then quantized to int8
by torch's own pt2e flow (torchao's ``prepare_pt2e`` / ``convert_pt2e`` with the x86
quantizer): per-channel int8 weights, and int8 activations whose scales come from
calibration calls (static) or from each call's values (dynamic). The result keeps the
signature and saves as any program does; loading it needs neither torchao nor a flag."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from kwexport._trace import Exported, trace


def quantize(
    f: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    calibration: list[tuple[tuple[Any, ...], dict[str, Any]]] | None = None,
    activations: str = "static",
    reduce_range: bool = False,
    dynamic_shapes: Any = None,
    dynamic: bool = False,
) -> Exported:
    if activations not in ("static", "dynamic"):
        raise ValueError(f"activations must be 'static' or 'dynamic', not {activations!r}")
    try:
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
        from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as xiq
    except ImportError as e:
        raise ImportError(
            "kwexport.quantize runs torch's pt2e flow, which lives in torchao: pip install 'kwexport[quantize]'"
        ) from e
    traced = trace(f, args, kwargs, dynamic_shapes=dynamic_shapes, dynamic=dynamic)
    calls = [traced.leaves] + [traced.leaves_of(a, k) for a, k in (calibration or [])]
    quantizer = xiq.X86InductorQuantizer()
    config = xiq.get_default_x86_inductor_quantization_config(
        is_dynamic=activations == "dynamic", reduce_range=reduce_range
    )
    quantizer.set_global(config)
    # The quantizer would also quantize the inputs of elementwise `mul`s (inside GPT-2's tanh
    # GELU, for one): no kernel here takes int8 there, so that is only quantize/dequantize
    # arithmetic and error, and it keeps the GELU from fusing.
    quantizer.set_function_type_qconfig(torch.mul, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchao's deprecation notes about torch internals
        graph = _calls_apart(_addmm_as_linear(traced.exported_program.module()))
        prepared = prepare_pt2e(graph, quantizer)
        with torch.no_grad():
            for leaves in calls:
                prepared(*leaves)
        converted = convert_pt2e(prepared)
        ep = torch.export.export(converted, tuple(traced.leaves), dynamic_shapes=traced.dynamic_shapes())
    return traced.encode(ep)


def _calls_apart(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Each call of a module called more than once as a source of its own. Without a
    ``source_fn_stack`` (torch.export's graphs now), the quantizer's partitions group nodes by
    their innermost module's path (``nn_module_stack``), so torchvision's ResNet blocks, which
    call one ``ReLU`` twice, made one partition of two outputs, and the x86 quantizer raised
    "Input partition has more than one output node" on every ResNet. The stack's key already
    tells the calls apart (``layer1.0.relu@1``): its suffix goes into the path."""
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if node.op != "call_function" or not stack:
            continue
        key, (path, cls) = list(stack.items())[-1]
        _, at, call = key.rpartition("@")
        if at and call.isdigit():
            node.meta["nn_module_stack"] = {**stack, key: (f"{path}@{call}", cls)}
    return gm


def _addmm_as_linear(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``addmm(bias, x, w)`` with a ``[k, n]`` parameter ``w`` (transformers' ``Conv1D``:
    GPT-2's attention and MLP) as ``linear(x, w_t, bias)`` over the transposed parameter, the
    same product, which the x86 quantizer annotates and ``addmm`` it does not: without this, a
    GPT-2 quantizes only its head. The weights are int8 copies after ``convert_pt2e`` anyway."""
    aten = torch.ops.aten
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target != aten.addmm.default or node.kwargs or len(node.args) != 3:
            continue  # beta or alpha given: another product
        bias, x, w = node.args
        if not (isinstance(w, torch.fx.Node) and w.op == "get_attr"):
            continue
        try:
            weight = gm.get_parameter(w.target)
        except AttributeError:
            continue  # a buffer or a constant, not a parameter
        if weight.ndim != 2:
            continue
        owner, _, name = w.target.rpartition(".")
        transposed = torch.nn.Parameter(weight.detach().t().contiguous(), requires_grad=False)
        gm.get_submodule(owner).register_parameter(f"{name}_t", transposed)
        with gm.graph.inserting_before(node):
            w_t = gm.graph.get_attr(f"{w.target}_t")
            linear = gm.graph.call_function(aten.linear.default, (x, w_t, bias))
        w_t.meta["val"] = transposed
        # The quantizer finds linears by where they came from (`source_fn_stack`).
        linear.meta = {**node.meta, "source_fn_stack": [(linear.name, torch.nn.functional.linear)]}
        node.replace_all_uses_with(linear)
        gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm
