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
    quantizer.set_global(xiq.get_default_x86_inductor_quantization_config(is_dynamic=activations == "dynamic"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchao's deprecation notes about torch internals
        prepared = prepare_pt2e(traced.exported_program.module(), quantizer)
        with torch.no_grad():
            for leaves in calls:
                prepared(*leaves)
        converted = convert_pt2e(prepared)
        ep = torch.export.export(converted, tuple(traced.leaves), dynamic_shapes=traced.dynamic_shapes())
    return traced.encode(ep)
