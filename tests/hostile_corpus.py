"""Generates hostile kwexport files from a real one: each a way a file can lie or break.

    python tests/hostile_corpus.py REAL.kwx OUT_DIR

`generate` returns `{file name: the exception class loading must raise}`; test_hostile.py
loads every file and checks exactly that class, never a crash, hang or other error.
"""

from __future__ import annotations

import copy
import json
import pathlib
import struct
import sys

import kwexport

ARTIFACT, VERSION = kwexport.ArtifactError, kwexport.VersionError


def split(raw: bytes):
    n = struct.unpack("<Q", raw[8:16])[0]
    header = json.loads(raw[16 : 16 + n])
    data_start = (16 + n + 63) // 64 * 64
    return header, raw[data_start:]


def build(header_bytes: bytes, data: bytes) -> bytes:
    prefix = b"KWEXPORT" + struct.pack("<Q", len(header_bytes)) + header_bytes
    return prefix + b"\0" * ((-len(prefix)) % 64) + data


# The fields of a method, which a 4.0 header holds under `methods`: `header_cases` mutates a
# flat view with them at the top level (as 3.x files held them), `nested` puts them back.
METHOD_FIELDS = ("signature", "inputs", "outputs", "symbols", "ops", "graph", "subgraphs")


def flat(h: dict) -> dict:
    """The header with its one method's fields at the top level."""
    d = {k: v for k, v in h.items() if k != "methods"}
    ((name, method),) = h["methods"].items()
    d.update(method, _method=name)
    return d


def nested(d: dict) -> dict:
    """`flat`'s inverse: the method's fields (whatever a case left of them) under `methods`."""
    h = {k: v for k, v in d.items() if k not in METHOD_FIELDS and k != "_method"}
    h["methods"] = {d["_method"]: {k: d[k] for k in METHOD_FIELDS if k in d}}
    return h


def method_cases(h: dict):
    """Cases about a file's methods: (name, mutate(4.0 header) -> header or raw bytes, class)."""
    ((name, method),) = h["methods"].items()

    def second(mutate=None):
        def go(d):
            other = copy.deepcopy(method)
            if mutate:
                mutate(other)
            d["methods"]["second"] = other

        return go

    yield "methods_empty", lambda d: d.update(methods={}), ARTIFACT
    yield "methods_missing", lambda d: d.pop("methods"), ARTIFACT
    yield "method_name_private", lambda d: d.update(methods={"__class__": method}), ARTIFACT
    yield "method_name_not_identifier", lambda d: d.update(methods={"os.system": method}), ARTIFACT
    yield "method_name_huge", lambda d: d.update(methods={"m" * 5000: method}), ARTIFACT
    yield "method_not_an_object", lambda d: d["methods"].update(second=[1, 2]), ARTIFACT
    yield "op_forbidden_in_a_second_method", second(lambda m: m["ops"][0].update(name="os::system.default")), ARTIFACT
    yield (
        "second_method_reads_a_missing_weight",
        second(lambda m: m["graph"]["inputs"][0]["source"].update(weight="ghost")),
        ARTIFACT,
    )
    yield (
        "second_method_on_another_device",
        second(lambda m: m["inputs"]["leaves"][0]["tensor"].update(device="meta")),
        ARTIFACT,
    )
    yield (
        "duplicate_method",
        lambda d: json.dumps(d)[:-1].encode() + b',"methods":' + json.dumps({name: method}).encode() + b"}",
        ARTIFACT,
    )
    yield (
        "duplicate_method_key",
        lambda d: (
            json.dumps(d).replace(f'"methods": {{"{name}": ', f'"methods": {{"{name}": {{}}, "{name}": ', 1).encode()
        ),
        ARTIFACT,
    )


def header_cases(h: dict):
    """(name, mutate(flat header) -> header or raw header bytes, expected class); see `flat`."""
    node0 = lambda d: d["graph"]["nodes"][0]  # noqa: E731
    first_weight = lambda d: next(iter(d["weights"]["tensors"].values()))  # noqa: E731

    def nest(depth, leaf=None):
        spec = leaf or {"type": "leaf"}
        for _ in range(depth):
            spec = {"type": "list", "children": [spec]}
        return spec

    def container(**over):
        spec = {
            "type": "container",
            "kind": "model_output",
            "module": "transformers.modeling_outputs",
            "qualname": "CausalLMOutput",
            "context": {"list": [{"str": "logits"}]},
            "keys": [{"key": {"str": "logits"}}],
            "children": [{"type": "leaf"}],
        }
        spec.update(over)
        return lambda d: d.update(outputs=spec)

    yield "container_keys_children_mismatch", container(children=[{"type": "leaf"}] * 2), ARTIFACT
    yield (
        "container_repeats_key",
        container(keys=[{"key": {"str": "a"}}] * 2, children=[{"type": "leaf"}] * 2),
        ARTIFACT,
    )
    yield "container_key_of_wrong_kind", container(keys=[{"attr": "logits"}]), ARTIFACT
    yield "container_class_name_is_code", container(module="os; import sys"), ARTIFACT
    yield "container_unknown_kind", container(kind="pickle"), ARTIFACT
    yield "container_context_not_a_constant", container(context={"dict": {}}), ARTIFACT
    yield "container_missing_keys", container(keys=None), ARTIFACT
    yield (
        "defaultdict_factory_is_code",
        lambda d: d.update(
            outputs={
                "type": "defaultdict",
                "factory": "eval",
                "entries": [{"key": {"str": "a"}, "value": {"type": "leaf"}}],
            }
        ),
        ARTIFACT,
    )

    def hop(name, args, subgraphs=None, outputs=1):
        """A higher-order node reading the first graph input, with the given subgraphs."""

        def mutate(d):
            d["ops"].append({"name": f"higher_order::{name}", "schema": None})
            x = d["graph"]["inputs"][-1]["name"]

            def fill(a):
                if a == "X":
                    return {"ref": x}
                return {"list": [fill(i) for i in a["list"]]} if isinstance(a, dict) and "list" in a else a

            args_ = [fill(a) for a in args]
            d["graph"]["nodes"].append(
                {"op": len(d["ops"]) - 1, "args": args_, "outputs": {"many": [f"h{i}" for i in range(outputs)]}}
            )
            d["subgraphs"] = subgraphs if subgraphs is not None else {}

        return mutate

    body = {"inputs": ["a"], "nodes": [], "outputs": [{"ref": "a"}]}
    grad = lambda *rest: [{"bool": False}, {"subgraph": "b"}, *rest]  # noqa: E731
    yield "hop_unknown_subgraph", hop("wrap_with_set_grad_enabled", grad("X")), ARTIFACT
    yield "hop_operand_count", hop("wrap_with_set_grad_enabled", grad("X", "X"), {"b": body}), ARTIFACT
    yield "hop_bad_layout", hop("wrap_with_set_grad_enabled", [{"subgraph": "b"}, "X"], {"b": body}), ARTIFACT
    yield "hop_unsupported", hop("flex_attention", grad("X"), {"b": body}), ARTIFACT
    two = {"inputs": ["a"], "nodes": [], "outputs": [{"ref": "a"}, {"ref": "a"}]}
    loop = [{"subgraph": "c"}, {"subgraph": "b"}, {"list": ["X"]}, {"list": []}]
    yield "while_loop_cond_returns_two", hop("while_loop", loop, {"c": two, "b": body}), ARTIFACT
    yield "while_loop_bad_layout", hop("while_loop", grad("X"), {"b": body}), ARTIFACT
    yield "map_without_xs", hop("map_impl", [{"subgraph": "b"}, {"list": []}, {"list": ["X"]}], {"b": body}), ARTIFACT
    three_in = {"inputs": ["a", "b", "c"], "nodes": [], "outputs": [{"ref": "a"}]}
    scan = [{"subgraph": "b"}, {"list": ["X", "X"]}, {"list": ["X"]}, {"list": []}]
    yield "scan_carry_longer_than_returns", hop("scan", scan, {"b": three_in}), ARTIFACT
    assoc = [{"subgraph": "b"}, {"list": ["X"]}, {"list": []}]
    yield "associative_scan_operand_count", hop("associative_scan", assoc, {"b": body}), ARTIFACT
    yield "hop_too_many_outputs", hop("wrap_with_set_grad_enabled", grad("X"), {"b": body}, outputs=3), ARTIFACT
    selfish = {
        "inputs": ["a"],
        "nodes": [{"op": 1, "args": [{"bool": True}, {"subgraph": "b"}, {"ref": "a"}], "outputs": {"many": ["z"]}}],
        "outputs": [{"ref": "a"}],
    }

    def recursive(d):
        hop("wrap_with_set_grad_enabled", grad("X"), {"b": selfish})(d)
        selfish["nodes"][0]["op"] = len(d["ops"]) - 1

    yield "hop_subgraph_runs_itself", recursive, ARTIFACT
    yield (
        "subgraph_passed_to_a_plain_op",
        lambda d: node0(d)["args"].append({"subgraph": "b"}) or d.update(subgraphs={"b": body}),
        ARTIFACT,
    )
    yield (
        "cond_branches_differ",
        hop(
            "cond",
            [{"bool": True}, {"subgraph": "t"}, {"subgraph": "f"}, {"list": ["X"]}],
            {"t": body, "f": {"inputs": ["a"], "nodes": [], "outputs": [{"ref": "a"}, {"ref": "a"}]}},
        ),
        ARTIFACT,
    )
    yield (
        "mutable_weight_nothing_writes",
        lambda d: first_weight(d).update(mutable=True),
        ARTIFACT,
    )
    yield (
        "mutation_of_a_missing_weight",
        lambda d: d["graph"].update(mutations=[{"target": {"weight": "nope"}, "value": d["graph"]["outputs"][0]}]),
        ARTIFACT,
    )
    yield (
        "mutation_of_a_read_only_weight",
        lambda d: d["graph"].update(
            mutations=[{"target": {"weight": next(iter(d["weights"]["tensors"]))}, "value": d["graph"]["outputs"][0]}]
        ),
        ARTIFACT,
    )
    yield (
        "mutation_of_a_missing_input",
        lambda d: d["graph"].update(mutations=[{"target": {"user": 99}, "value": d["graph"]["outputs"][0]}]),
        ARTIFACT,
    )
    yield "optimized_unknown_level", lambda d: d.update(optimized="turbo"), ARTIFACT
    yield "newer_major", lambda d: d.update(format_version={"major": 999, "minor": 0}), VERSION
    yield "older_than_supported", lambda d: d.update(format_version={"major": 0, "minor": 1}), VERSION
    yield "version_not_numbers", lambda d: d.update(format_version={"major": "2", "minor": 0}), ARTIFACT
    yield "missing_graph", lambda d: d.pop("graph"), ARTIFACT
    yield "weight_out_of_bounds", lambda d: d["weights"]["storages"][0].update(offset=1 << 40), ARTIFACT
    yield (
        "weight_offset_overflows",
        lambda d: d["weights"]["storages"][0].update(offset=2**64 - 64, nbytes=128),
        ARTIFACT,
    )
    yield "weight_misaligned", lambda d: d["weights"]["storages"][0].update(offset=3), ARTIFACT
    yield "weights_overlap", lambda d: d["weights"]["storages"].append(dict(d["weights"]["storages"][0])), ARTIFACT
    yield "weight_shape_too_big", lambda d: first_weight(d).update(shape=[10**6, 10**6], strides=[10**6, 1]), ARTIFACT
    yield "weight_dims_overflow", lambda d: first_weight(d).update(shape=[2**62, 4], strides=[2**62, 1]), ARTIFACT
    yield "weight_negative_dim", lambda d: first_weight(d).update(shape=[-1, 3]), ARTIFACT
    yield "weight_rank_mismatch", lambda d: first_weight(d).update(strides=[1]), ARTIFACT
    yield "weight_bad_dtype", lambda d: first_weight(d).update(dtype="object"), ARTIFACT
    yield "weight_missing_storage", lambda d: first_weight(d).update(storage=99), ARTIFACT
    yield "weight_missing", lambda d: d["weights"]["tensors"].clear(), ARTIFACT
    yield "graph_cycle", lambda d: node0(d)["args"].__setitem__(0, {"ref": d["graph"]["outputs"][0]["ref"]}), ARTIFACT
    yield "graph_dangling_ref", lambda d: node0(d)["args"].__setitem__(0, {"ref": "ghost"}), ARTIFACT
    yield "graph_defined_twice", lambda d: d["graph"]["nodes"].append(copy.deepcopy(node0(d))), ARTIFACT
    yield "graph_op_index_out_of_range", lambda d: node0(d).update(op=10**9), ARTIFACT
    yield "graph_user_leaf_out_of_range", lambda d: d["graph"]["inputs"][-1]["source"].update(user=7), ARTIFACT
    yield "op_not_allowed", lambda d: d["ops"][0].update(name="os::system.default"), ARTIFACT
    yield "op_injection", lambda d: d["ops"][0].update(name="aten::__import__('os').system"), ARTIFACT
    yield "python_operator_not_allowed", lambda d: d["ops"][0].update(name="operator::attrgetter"), ARTIFACT
    yield "torch_function_not_allowed", lambda d: d["ops"][0].update(name="torch::load"), ARTIFACT
    yield "default_weight_unknown", lambda d: d["signature"]["params"][0].update(default_weight="ghost"), ARTIFACT
    yield (
        "default_weight_beside_default",
        lambda d: d["signature"]["params"][0].update(default_weight="weight", default={"int": 1}),
        ARTIFACT,
    )
    yield "sym_function_with_overload", lambda d: d["ops"][0].update(name="torch::sym_max.default"), ARTIFACT
    yield "op_wrong_arity", lambda d: node0(d)["args"].extend([{"int": 1}] * 9), ARTIFACT
    yield "op_unknown_kwarg", lambda d: node0(d)["kwargs"].update(evil={"int": 1}), ARTIFACT
    yield "bad_layout_literal", lambda d: node0(d)["args"].__setitem__(1, {"layout": "__class__"}), ARTIFACT
    yield "leaf_count_lies", lambda d: d["inputs"]["leaves"].append(d["inputs"]["leaves"][0]), ARTIFACT
    yield "output_count_lies", lambda d: d["graph"]["outputs"].append(d["graph"]["outputs"][0]), ARTIFACT
    yield "treespec_too_deep", lambda d: d.update(outputs=nest(100)), ARTIFACT
    yield "treespec_unknown_type", lambda d: d.update(outputs={"type": "set", "children": []}), ARTIFACT
    yield (
        "namedtuple_lies",
        lambda d: d.update(
            outputs={"type": "namedtuple", "name": "P", "fields": ["a", "b"], "children": [{"type": "leaf"}]}
        ),
        ARTIFACT,
    )
    yield (
        "input_root_malformed",
        lambda d: d["inputs"].update(spec={"type": "list", "children": [{"type": "leaf"}]}),
        ARTIFACT,
    )
    yield "dim_negative", lambda d: d["inputs"]["leaves"][0]["tensor"]["shape"].__setitem__(0, {"static": -5}), ARTIFACT
    yield (
        "dim_unknown_symbol",
        lambda d: d["inputs"]["leaves"][0]["tensor"]["shape"].__setitem__(
            0, {"symbolic": {"symbol": "zz", "coeff": 1, "offset": 0}}
        ),
        ARTIFACT,
    )
    yield "symbol_bad_range", lambda d: d.update(symbols=[{"name": "s0", "min": 10, "max": 2}]), ARTIFACT
    yield (
        "signature_duplicate_param",
        lambda d: d["signature"]["params"].append(dict(d["signature"]["params"][0])),
        ARTIFACT,
    )
    yield (
        "signature_bad_kind_order",
        lambda d: d["signature"]["params"].insert(0, {"name": "kwonly", "kind": "keyword_only"}),
        ARTIFACT,
    )
    yield (
        "extra_file_traversal",
        lambda d: d.update(extra_files={"../../etc/passwd": {"offset": 0, "nbytes": 1, "encoding": "bytes"}}),
        ARTIFACT,
    )
    yield (
        "extra_file_absolute",
        lambda d: d.update(extra_files={"/etc/passwd": {"offset": 0, "nbytes": 1, "encoding": "bytes"}}),
        ARTIFACT,
    )
    yield (
        "extra_file_out_of_bounds",
        lambda d: d.update(extra_files={"x": {"offset": 0, "nbytes": 1 << 50, "encoding": "bytes"}}),
        ARTIFACT,
    )
    yield (
        "extra_file_not_utf8",
        lambda d: d.update(extra_files={"x": {"offset": 0, "nbytes": 64, "encoding": "utf8"}}),
        ARTIFACT,
    )
    yield "float_not_a_number", lambda d: node0(d)["args"].__setitem__(1, {"float": "1e999x"}), ARTIFACT
    yield "int_too_big", lambda d: node0(d)["args"].__setitem__(1, {"int": 2**70}), ARTIFACT
    yield (
        "duplicate_weight_entry",
        lambda d: (
            json.dumps(nested(d), separators=(",", ":"))
            .replace('"tensors":{', '"tensors":{"weight":{"dtype":"float32","shape":[1],"strides":[1],"storage":0},', 1)
            .encode()
        ),
        ARTIFACT,
    )
    yield "duplicate_top_level_field", lambda d: json.dumps(nested(d))[:-1].encode() + b',"weights":{}}', ARTIFACT
    yield (
        "json_nesting_bomb",
        lambda d: b'{"format_version":{"major":2,"minor":0},"x":' + b"[" * 100000 + b"]" * 100000 + b"}",
        ARTIFACT,
    )
    yield (
        "header_not_utf8",
        lambda d: json.dumps(nested(d)).encode().replace(b'"producer"', b'"prod\xff\xfeer"', 1),
        ARTIFACT,
    )
    yield "header_not_json", lambda d: b"not json at all", ARTIFACT
    yield "header_empty", lambda d: b"", ARTIFACT


def generate(src, out) -> dict[str, type]:
    src, out = pathlib.Path(src), pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    raw = src.read_bytes()
    header, data = split(raw)
    expected = {}

    def write(name, content, cls):
        (out / f"{name}.kwx").write_bytes(content)
        expected[f"{name}.kwx"] = cls

    for name, mutate, cls in header_cases(flat(header)):
        d = flat(copy.deepcopy(header))
        result = mutate(d)
        blob = result if isinstance(result, bytes) else json.dumps(nested(d)).encode()
        write(name, build(blob, data), cls)
    for name, mutate, cls in method_cases(header):
        h = copy.deepcopy(header)
        result = mutate(h)
        blob = result if isinstance(result, bytes) else json.dumps(h).encode()
        write(name, build(blob, data), cls)

    n = struct.unpack("<Q", raw[8:16])[0]
    write("empty", b"", ARTIFACT)
    write("magic_only", b"KWEXPORT", ARTIFACT)
    write("wrong_magic", b"PK\x03\x04" + raw[4:], ARTIFACT)
    write("truncated_header", raw[: 16 + n // 2], ARTIFACT)
    write("truncated_data", raw[: len(raw) - 8], ARTIFACT)
    write("header_length_huge", raw[:8] + struct.pack("<Q", 2**63) + raw[16:], ARTIFACT)
    write("header_length_past_end", raw[:8] + struct.pack("<Q", len(raw)) + raw[16:], ARTIFACT)
    write("nonzero_padding", raw[: 16 + n] + b"\x01" + raw[17 + n :], ARTIFACT)
    return expected


if __name__ == "__main__":
    for name, cls in generate(sys.argv[1], sys.argv[2]).items():
        print(f"{name}: {cls.__name__}")
