"""Hostile files: every one gives exactly the expected error class, never a crash."""

import pytest
import torch
from hostile_corpus import generate

import kwexport


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    torch.manual_seed(0)
    real = tmp / "real.kwx"
    kwexport.save(kwexport.export(torch.nn.Linear(3, 2), (torch.ones(1, 3),)), real)
    return tmp / "corpus", generate(real, tmp / "corpus")


def test_corpus_is_broad(corpus):
    _, expected = corpus
    assert len(expected) >= 50


def test_every_hostile_file_is_refused_with_its_class(corpus):
    folder, expected = corpus
    wrong = {}
    for name, cls in expected.items():
        try:
            kwexport.load(folder / name)
        except BaseException as e:  # a PanicException is a BaseException: catch it to report it
            if type(e) is not cls:
                wrong[name] = f"{type(e).__name__}: {e}"
        else:
            wrong[name] = "loaded"
    assert not wrong, wrong


def test_inspect_refuses_them_too(corpus):
    folder, expected = corpus
    from kwexport.__main__ import describe

    for name in expected:
        if name.startswith("op_") or name.removesuffix(".kwx") in (
            "bad_layout_literal",
            "python_operator_not_allowed",
            "torch_function_not_allowed",
            "sym_function_with_overload",
        ):
            continue  # ops are resolved against torch only when loading to run
        with pytest.raises(kwexport.ArtifactError):
            describe(folder / name)
