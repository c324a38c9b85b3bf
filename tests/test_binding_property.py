"""The binder agrees with Python's own `inspect.Signature.bind` on generated signatures and
calls: the same bound result, or a TypeError (SignatureError) in both."""

import inspect
import json

from hypothesis import given, settings
from hypothesis import strategies as st

import kwexport
from kwexport import _rt

NAMES = ["a", "b", "c", "d", "e", "f"]
P = inspect.Parameter


@st.composite
def signatures(draw):
    names = draw(st.permutations(NAMES))
    params, seen_default = [], False
    kinds = [P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD, P.VAR_POSITIONAL, P.KEYWORD_ONLY, P.VAR_KEYWORD]
    for name in names[: draw(st.integers(0, len(NAMES)))]:
        last = params[-1].kind if params else P.POSITIONAL_ONLY
        allowed = [k for k in kinds if k >= last and not (k in (P.VAR_POSITIONAL, P.VAR_KEYWORD) and any(p.kind == k for p in params))]
        if last == P.VAR_KEYWORD or not allowed:
            break
        kind = draw(st.sampled_from(allowed))
        default = P.empty
        if kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD):
            if seen_default or draw(st.booleans()):
                default, seen_default = 1, True
        elif kind == P.KEYWORD_ONLY and draw(st.booleans()):
            default = 1
        params.append(P(name, kind, default=default))
    return inspect.Signature(params)


def to_json(sig):
    return json.dumps({"name": "f", "params": [
        {"name": p.name, "kind": p.kind.name.lower(), **({"default": {"int": 1}} if p.default is not P.empty else {})}
        for p in sig.parameters.values()
    ]})


@settings(max_examples=400, deadline=None)
@given(sig=signatures(), n_args=st.integers(0, 7), kw=st.lists(st.sampled_from(NAMES + ["zz"]), unique=True, max_size=4))
def test_binder_matches_inspect(sig, n_args, kw):
    args = [f"arg{i}" for i in range(n_args)]
    kwargs = {k: f"kw_{k}" for k in kw}
    try:
        expected = sig.bind(*args, **kwargs)
    except TypeError:
        expected = None
    try:
        got = _rt._bind(to_json(sig), n_args, kw)
    except kwexport.SignatureError:
        got = None
    assert (got is None) == (expected is None), (sig, args, kwargs, got, expected)
    if got is None:
        return
    values = {}
    for p, b in zip(sig.parameters.values(), got):
        if b[0] == "positional":
            values[p.name] = args[b[1]]
        elif b[0] == "keyword":
            values[p.name] = kwargs[b[1]]
        elif b[0] == "var_positional":
            values[p.name] = tuple(args[b[1]:b[2]])
        elif b[0] == "var_keyword":
            values[p.name] = {k: kwargs[k] for k in b[1]}
    expected_values = dict(expected.arguments)
    for p in sig.parameters.values():  # inspect leaves empty variadics out
        if p.kind == P.VAR_POSITIONAL:
            expected_values.setdefault(p.name, ())
        if p.kind == P.VAR_KEYWORD:
            expected_values.setdefault(p.name, {})
    assert values == expected_values
