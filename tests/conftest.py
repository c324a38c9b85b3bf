import os
import subprocess
import sys
import threading
from collections.abc import Mapping

import pytest
import torch

import kwexport


@pytest.fixture(params=["abi", "python"])
def roundtrip(tmp_path, request):
    """export -> save -> load, returning the loaded Program: once with every node the stable
    C ABI covers run through it, once with every node through torch's Python ops."""
    counter = iter(range(10**6))

    def go(f, args, kwargs=None, *, dynamic_shapes=None, dynamic=False, extra_files=None):
        ex = kwexport.export(f, args, kwargs, dynamic_shapes=dynamic_shapes, dynamic=dynamic)
        path = tmp_path / f"p{next(counter)}.kwx"
        kwexport.save(ex, path, extra_files=extra_files)
        return kwexport.load(path, dispatch=request.param)

    return go


def same_bits(a, b):
    """Whether two tensors of one dtype and shape hold the same bits, any NaN alike (so
    ``-0.0`` differs from ``0.0``)."""
    if a.device.type == "meta":
        return True
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    if not a.dtype.is_floating_point:
        return torch.equal(a, b)
    a_nan, b_nan = a.isnan(), b.isnan()
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    a, b = a.masked_fill(a_nan, 0).contiguous().view(ints), b.masked_fill(b_nan, 0).contiguous().view(ints)
    return torch.equal(a_nan, b_nan) and torch.equal(a, b)


def assert_same(got, want, *, bitwise=False):
    """Equal values in the same structure: container types, dict key order, namedtuple types.
    Tensors are close, or with ``bitwise`` identical to the bit (NaNs alike) with the same strides."""
    assert type(got).__name__ == type(want).__name__, (type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape
        if bitwise:
            assert got.stride() == want.stride()
            assert same_bits(got, want), (got, want)
        else:
            torch.testing.assert_close(got, want, equal_nan=True)
    elif isinstance(want, Mapping):  # dicts, and kwexport's stand-ins
        assert list(got) == list(want)
        for k in want:
            assert_same(got[k], want[k], bitwise=bitwise)
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want)
        if hasattr(want, "_fields"):
            assert got._fields == want._fields
        for g, w in zip(got, want):
            assert_same(g, w, bitwise=bitwise)
    else:
        assert got == want


def in_threads(work, n):
    """Runs `work()` on `n` threads at once and re-raises the first error any of them hit."""
    errors = []

    def guarded():
        try:
            work()
        except Exception as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=guarded) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def reversed_kwargs(kwargs):
    return dict(reversed(list(kwargs.items())))


# Tests of what runs on the C path need torch's stable C ABI (torch 2.13 and later); on an
# older torch every node runs through Python, which the other tests cover.
requires_abi = pytest.mark.skipif(
    not kwexport._rt.stable_abi_available(), reason="the running torch has no usable stable C ABI"
)


def with_each_kernel(tmp_path, script: str) -> dict:
    """Runs `script` in a child process per forced kernel choice (`KWEXPORT_LINEAR_KERNEL`,
    read once per process): what each saved to `sys.argv[1]`, by choice."""
    outs = {}
    for kernel in ("torch", "kwexport"):
        env = dict(os.environ, KWEXPORT_LINEAR_KERNEL=kernel)
        dst = tmp_path / f"{kernel}.pt"
        r = subprocess.run([sys.executable, "-c", script, str(dst)], env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        outs[kernel] = torch.load(dst)
    return outs


def causal_lm(kind: str = "llama"):
    """A 2-layer transformers Llama or Qwen2 causal LM from config (seed 0), set up for the
    static cache its export wrapper needs (generation's and CUDA graphs' tests)."""
    import transformers

    torch.manual_seed(0)
    common = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    model = model.eval()
    model.generation_config.cache_implementation = "static"
    return model


def cuda_decoder(tmp_path):
    """The CUDA generation tests' setup: `causal_lm("llama")`'s decode step exported through
    transformers' static-cache wrapper and saved, a prompt on CUDA, and transformers' own 24
    greedy tokens for it (its eager loop)."""
    pytest.importorskip("transformers")
    executorch = pytest.importorskip("transformers.integrations.executorch")
    model = causal_lm("llama")
    wrapper = executorch.TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=48)
    ep = wrapper.export(input_ids=torch.tensor([[1]]), cache_position=torch.tensor([0]))
    path = tmp_path / "llama.kwx"
    kwexport.save(ep, path)
    prompt = torch.tensor([[5, 17, 42, 8, 99, 3]], device="cuda")
    with torch.no_grad():
        want = model.cuda().generate(prompt, max_new_tokens=24, do_sample=False, max_length=None, disable_compile=True)
    return path, prompt, want
