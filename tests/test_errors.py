"""Every error class, with its exact message."""

import json
import struct

import pytest
import torch

import kwexport


def kw_func(x, y, *, cfg, b=2):
    return x + y * cfg["shift"][0] + b


@pytest.fixture
def prog(roundtrip):
    return roundtrip(kw_func, (torch.ones(2, 3), torch.ones(2, 3)), {"cfg": {"shift": [torch.ones(3)]}})


def call_ok(prog):
    return prog(torch.ones(2, 3), torch.ones(2, 3), cfg={"shift": [torch.ones(3)]})


def test_hierarchy():
    assert issubclass(kwexport.ArtifactError, kwexport.KwexportError)
    assert issubclass(kwexport.ArtifactError, ValueError)
    assert issubclass(kwexport.VersionError, kwexport.ArtifactError)
    assert issubclass(kwexport.SignatureError, kwexport.KwexportError)
    assert issubclass(kwexport.SignatureError, TypeError)
    assert issubclass(kwexport.InputError, kwexport.KwexportError)
    assert issubclass(kwexport.InputError, ValueError)
    assert kwexport.InputError.__module__ == "kwexport"


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda p, x: p(x, x), "kw_func() missing 1 required keyword-only argument: 'cfg'"),
        (lambda p, x: p(x, x, cfgg={}), "kw_func() got an unexpected keyword argument 'cfgg'"),
        (
            lambda p, x: p(x, x, x, cfg={}),
            "kw_func() takes 2 positional arguments but 3 positional arguments (and 1 keyword-only argument) were given",
        ),
        (lambda p, x: p(x, x, x), "kw_func() takes 2 positional arguments but 3 were given"),
        (lambda p, x: p(x, x=x, cfg={}), "kw_func() got multiple values for argument 'x'"),
        (lambda p, x: p(cfg={}), "kw_func() missing 2 required positional arguments: 'x' and 'y'"),
    ],
)
def test_signature_errors_match_python(prog, call, message):
    x = torch.ones(2, 3)
    with pytest.raises(kwexport.SignatureError) as e:
        call(prog, x)
    assert str(e.value) == message
    # The same words Python uses for the original function.
    with pytest.raises(TypeError) as py:
        call(kw_func, x)
    assert str(py.value).endswith(message.removeprefix("kw_func"))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"cfg": {"shift": [torch.ones(3, dtype=torch.float64)]}},
            "cfg['shift'][0]: expected dtype torch.float32, got torch.float64",
        ),
        (
            {"cfg": {"shift": [torch.ones(4)]}},
            "cfg['shift'][0]: dimension 0 must be 3 (static at export), got 4 (shape [4])",
        ),
        (
            {"cfg": {"shift": [torch.ones(3, 1)]}},
            "cfg['shift'][0]: expected a tensor with 1 dimension, got 2 (shape [3, 1])",
        ),
        ({"cfg": {"shift": [1.0]}}, "cfg['shift'][0]: expected a tensor of dtype torch.float32, got a float"),
        ({"cfg": {"shift": (torch.ones(3),)}}, "cfg['shift']: expected a list of 1 items, got a tuple of 1 items"),
        (
            {"cfg": {"shift": [torch.ones(3)], "scale": 1}},
            "cfg: expected a dict with keys ['shift'], got one with unexpected key(s) 'scale'",
        ),
        (
            {"cfg": {"shfit": [torch.ones(3)]}},
            "cfg: expected a dict with keys ['shift'], got one with missing key(s) 'shift' and unexpected key(s) 'shfit'",
        ),
        ({"cfg": [torch.ones(3)]}, "cfg: expected a dict with keys ['shift'], got a list of 1 items"),
        ({"cfg": {"shift": [torch.ones(3)]}, "b": 3}, "b: expected 2 (specialized at export), got 3"),
        ({"cfg": {"shift": [torch.ones(3)]}, "b": 2.0}, "b: expected 2 (specialized at export), got 2.0"),
    ],
)
def test_input_errors_name_the_path(prog, kwargs, message):
    with pytest.raises(kwexport.InputError) as e:
        prog(torch.ones(2, 3), torch.ones(2, 3), **kwargs)
    assert str(e.value) == message
    assert call_ok(prog) is not None  # a failed call leaves the program usable


def test_input_errors_for_variadics(roundtrip):
    def f(x, *rest, **extra):
        return x + rest[0] + extra["k"]

    t = torch.ones(2)
    prog = roundtrip(f, (t, t), {"k": t})
    with pytest.raises(
        kwexport.InputError, match=r"^\*rest: expected 1 extra positional argument\(s\), as exported, got 2$"
    ):
        prog(t, t, t, k=t)
    with pytest.raises(kwexport.InputError, match=r"^k: missing keyword argument: at export \*\*extra held 'k'$"):
        prog(t, t)
    with pytest.raises(kwexport.InputError, match=r"^j: unexpected keyword argument: at export \*\*extra held 'k'$"):
        prog(t, t, k=t, j=t)
    with pytest.raises(kwexport.InputError, match=r"^rest\[0\]: expected dtype torch.float32, got torch.int64$"):
        prog(t, torch.ones(2, dtype=torch.long), k=t)


def test_device_mismatch_is_an_input_error(prog):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = torch.ones(2, 3, device="cuda")
    with pytest.raises(kwexport.InputError, match=r"^x: expected a tensor on cpu, got one on cuda:0$"):
        prog(x, torch.ones(2, 3), cfg={"shift": [torch.ones(3)]})


def test_export_time_signature_error():
    with pytest.raises(kwexport.SignatureError, match=r"kw_func\(\) missing a required argument: 'cfg'"):
        kwexport.export(kw_func, (torch.ones(2), torch.ones(2)))


def test_unsaveable_default_is_an_artifact_error():
    def f(x, mode=object()):  # noqa: B008 - an unsaveable default is the point
        return x

    with pytest.raises(
        kwexport.ArtifactError, match=r"default of parameter 'mode': can't save a value of type object without pickle"
    ):
        kwexport.export(f, (torch.ones(2),))


def test_unsafe_extra_file_name(tmp_path):
    ex = kwexport.export(lambda x: x + 1, (torch.ones(2),))
    with pytest.raises(kwexport.ArtifactError, match=r"unsafe extra-file name"):
        kwexport.save(ex, tmp_path / "p.kwx", extra_files={"../evil": "x"})
    assert not (tmp_path / "p.kwx").exists()


# ---------------------------------------------------------------- broken files


def read_parts(path):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[8:16])[0]
    return raw, json.loads(raw[16 : 16 + n]), 16 + n


def rewrite(path, header, raw, header_end):
    """Same data section, new header (the data section moves to the next 64-byte boundary)."""
    data_start = (header_end + 63) // 64 * 64
    blob = json.dumps(header).encode()
    prefix = b"KWEXPORT" + struct.pack("<Q", len(blob)) + blob
    prefix += b"\0" * ((-len(prefix)) % 64)
    path.write_bytes(prefix + raw[data_start:])


@pytest.fixture
def saved(tmp_path):
    ex = kwexport.export(torch.nn.Linear(3, 2), (torch.ones(1, 3),))
    path = tmp_path / "m.kwx"
    kwexport.save(ex, path)
    return path


def test_version_error_for_newer_major(saved):
    raw, header, end = read_parts(saved)
    header["format_version"] = {"major": 99, "minor": 0}
    rewrite(saved, header, raw, end)
    with pytest.raises(kwexport.VersionError) as e:
        kwexport.load(saved)
    major = kwexport.FORMAT_VERSION[0]
    assert str(e.value) == (
        f"file format 99.0 is newer than this runtime, which reads "
        f"{kwexport.OLDEST_FORMAT_VERSION[0]}.{kwexport.OLDEST_FORMAT_VERSION[1]} to {major}.x: upgrade kwexport"
    )


@pytest.mark.parametrize(
    "mutate, message",
    [
        (
            lambda h: h["methods"]["forward"]["ops"][0].update(name="mylib::evil.default"),
            r"^methods\.forward\.ops\[0\] \(mylib::evil.default\): op namespace \"mylib\" is not allowed",
        ),
        (
            lambda h: h["methods"]["forward"]["ops"][0].update(name="aten::no_such_op.default"),
            r"^methods\.forward\.ops\[0\] \(aten::no_such_op.default\): op not found in the running torch",
        ),
        (
            lambda h: h["methods"]["forward"]["graph"]["nodes"][0].update(op=5),
            r"^methods\.forward\.graph.nodes\[0\]: op 5 is not in the op table \(1 ops\)",
        ),
        (
            lambda h: (
                h["methods"]["forward"]["graph"]["nodes"][0]["args"].append({"int": 1})
                or h["methods"]["forward"]["graph"]["nodes"][0]["args"].append({"int": 1})
            ),
            r"^methods\.forward\.graph.nodes\[0\] \(aten::linear.default\): 5 positional arguments, but the op takes 3",
        ),
        (
            lambda h: h["methods"]["forward"]["graph"]["nodes"][0]["args"].__setitem__(0, {"ref": "nope"}),
            r"value \"nope\" is used before it is defined",
        ),
        (
            lambda h: h["weights"]["tensors"]["weight"].update(shape=[200, 3]),
            r"weights.tensors\[\"weight\"\]: needs 2400 bytes of storage 0 but it has 24",
        ),
        (
            lambda h: h["methods"]["forward"]["inputs"]["leaves"].append(
                h["methods"]["forward"]["inputs"]["leaves"][0]
            ),
            r"^methods\.forward\.inputs: the spec has 1 leaves but inputs.leaves describes 2",
        ),
        (lambda h: h["methods"]["forward"].pop("graph"), r"header: missing field `graph`"),
        (
            lambda h: h["methods"]["forward"]["signature"]["params"][0].update(name="not valid"),
            r"not a Python identifier",
        ),
    ],
)
def test_artifact_errors_name_the_entry(saved, mutate, message):
    raw, header, end = read_parts(saved)
    mutate(header)
    rewrite(saved, header, raw, end)
    with pytest.raises(kwexport.ArtifactError, match=message):
        kwexport.load(saved)


def test_corrupt_container(saved):
    raw = saved.read_bytes()
    saved.write_bytes(raw[:30])
    with pytest.raises(kwexport.ArtifactError, match=r"^file: truncated: header claims \d+ bytes, only 14 remain$"):
        kwexport.load(saved)
    saved.write_bytes(b"PK\x03\x04" + raw[4:])
    with pytest.raises(kwexport.ArtifactError, match=r"^file: not a kwexport file"):
        kwexport.load(saved)
    n = struct.unpack("<Q", raw[8:16])[0]
    saved.write_bytes(raw[:16] + b"\xff" * n + raw[16 + n :])
    with pytest.raises(kwexport.ArtifactError, match=r"^header: invalid JSON"):
        kwexport.load(saved)
    saved.write_bytes(b"")
    with pytest.raises(kwexport.ArtifactError, match=r"^file: truncated: 0 bytes$"):
        kwexport.load(saved)
    with pytest.raises(FileNotFoundError):
        kwexport.load(saved.parent / "missing.kwx")
