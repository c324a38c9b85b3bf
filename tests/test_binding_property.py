"""The binder agrees with Python on generated signatures and calls: the same bound result,
or a TypeError (SignatureError) in both.

The oracle is a real call of a function with that signature. `inspect.Signature.bind` is
not quite it: on Python 3.11 it refuses `f(a=2)` for `def f(a=1, /, **kw)`, which CPython
accepts (`a` goes to `**kw`); hypothesis found that case.
"""

import inspect
import json

from hypothesis import example, given, settings
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
        allowed = [
            k
            for k in kinds
            if k >= last and not (k in (P.VAR_POSITIONAL, P.VAR_KEYWORD) and any(p.kind == k for p in params))
        ]
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
    return json.dumps(
        {
            "name": "f",
            "params": [
                {
                    "name": p.name,
                    "kind": p.kind.name.lower(),
                    **({"default": {"int": 1}} if p.default is not P.empty else {}),
                }
                for p in sig.parameters.values()
            ],
        }
    )


@settings(max_examples=400, deadline=None)
@example(sig=inspect.Signature([P("a", P.POSITIONAL_ONLY, default=1), P("b", P.VAR_KEYWORD)]), n_args=0, kw=["a"])
@given(
    sig=signatures(), n_args=st.integers(0, 7), kw=st.lists(st.sampled_from(NAMES + ["zz"]), unique=True, max_size=4)
)
def test_binder_matches_inspect(sig, n_args, kw):
    args = [f"arg{i}" for i in range(n_args)]
    kwargs = {k: f"kw_{k}" for k in kw}
    namespace = {}
    exec(f"def f{sig}:\n    return dict(locals())", namespace)  # the test's own signature, not a file's
    try:
        expected = namespace["f"](*args, **kwargs)
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
        if b[0] == "default":
            values[p.name] = p.default
        elif b[0] == "positional":
            values[p.name] = args[b[1]]
        elif b[0] == "keyword":
            values[p.name] = kwargs[b[1]]
        elif b[0] == "var_positional":
            values[p.name] = tuple(args[b[1] : b[2]])
        elif b[0] == "var_keyword":
            values[p.name] = {k: kwargs[k] for k in b[1]}
    assert values == expected
