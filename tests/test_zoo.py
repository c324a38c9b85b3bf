"""Real models no one here wrote, built from config with tiny random weights (nothing is
downloaded), exported with the call their users make, called back with the keywords in
another order, and compared leaf by leaf with eager."""

import inspect
import subprocess
import sys

import pytest
import torch
from conftest import reversed_kwargs

import kwexport

transformers = pytest.importorskip("transformers")
torchvision = pytest.importorskip("torchvision")

torch.manual_seed(0)
IDS = torch.randint(0, 100, (2, 7))
MASK = torch.ones(2, 7, dtype=torch.long).index_fill_(1, torch.tensor([6]), 0)
PIXELS = torch.randn(2, 3, 32, 32)
# A prompt with one 32x32 image (16 patches of 8x8) after its first token, as Llava's
# processor lays it out.
LLAVA_IMAGE_TOKEN = 99
LLAVA_IDS = torch.cat([IDS[:1, :1], torch.full((1, 16), LLAVA_IMAGE_TOKEN), IDS[:1, 1:] % LLAVA_IMAGE_TOKEN], dim=1)


def text(name):
    common = dict(vocab_size=100, hidden_size=32, num_attention_heads=2, intermediate_size=64)
    if name == "bert":
        return transformers.BertModel(transformers.BertConfig(num_hidden_layers=2, **common))
    if name == "distilbert":
        cfg = transformers.DistilBertConfig(vocab_size=100, dim=32, n_layers=2, n_heads=2, hidden_dim=64)
        return transformers.DistilBertForSequenceClassification(cfg)
    if name == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=64)
        return transformers.GPT2LMHeadModel(cfg)
    if name == "llama":
        cfg = transformers.LlamaConfig(num_hidden_layers=2, num_key_value_heads=1, max_position_embeddings=64, **common)
        return transformers.LlamaForCausalLM(cfg)
    if name == "llava":
        vision_cfg = transformers.CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        )
        text_cfg = transformers.LlamaConfig(
            num_hidden_layers=2, num_key_value_heads=1, max_position_embeddings=64, **common
        )
        cfg = transformers.LlavaConfig(
            vision_config=vision_cfg, text_config=text_cfg, image_token_index=LLAVA_IMAGE_TOKEN, vision_feature_layer=-1
        )
        return transformers.LlavaForConditionalGeneration(cfg)
    if name == "t5_encoder":
        cfg = transformers.T5Config(vocab_size=100, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2)
        return transformers.T5EncoderModel(cfg)
    raise ValueError(name)


def vision(name):
    if name == "vit":
        cfg = transformers.ViTConfig(
            image_size=32,
            patch_size=8,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            num_labels=5,
        )
        return transformers.ViTForImageClassification(cfg)
    if name == "resnet18":
        return torchvision.models.resnet18(num_classes=10)
    if name == "mobilenet_v3_small":
        return torchvision.models.mobilenet_v3_small(num_classes=10)
    if name == "vision_transformer":
        return torchvision.models.VisionTransformer(
            image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=10
        )
    raise ValueError(name)


# (model, keyword call, the output's class)
ZOO = {
    "bert": (
        lambda: text("bert"),
        {"input_ids": IDS, "attention_mask": MASK},
        "BaseModelOutputWithPoolingAndCrossAttentions",
    ),
    "distilbert": (lambda: text("distilbert"), {"input_ids": IDS, "attention_mask": MASK}, "SequenceClassifierOutput"),
    "gpt2": (
        lambda: text("gpt2"),
        {"input_ids": IDS, "attention_mask": MASK, "use_cache": False},
        "CausalLMOutputWithCrossAttentions",
    ),
    "llama": (
        lambda: text("llama"),
        {"input_ids": IDS, "attention_mask": MASK, "use_cache": False},
        "CausalLMOutputWithPast",
    ),
    "llava": (
        lambda: text("llava"),
        {
            "input_ids": LLAVA_IDS,
            "pixel_values": PIXELS[:1],
            "attention_mask": torch.ones_like(LLAVA_IDS),
            "use_cache": False,
        },
        "LlavaCausalLMOutputWithPast",
    ),
    "t5_encoder": (
        lambda: text("t5_encoder"),
        {"input_ids": IDS, "attention_mask": MASK},
        "BaseModelOutputWithPastAndCrossAttentions",
    ),
    "vit": (lambda: vision("vit"), {"pixel_values": PIXELS}, "ImageClassifierOutput"),
    "resnet18": (lambda: vision("resnet18"), {"x": PIXELS}, "Tensor"),
    "mobilenet_v3_small": (lambda: vision("mobilenet_v3_small"), {"x": PIXELS}, "Tensor"),
    "vision_transformer": (lambda: vision("vision_transformer"), {"x": PIXELS}, "Tensor"),
}


def leaves(out):
    if isinstance(out, torch.Tensor):
        return [out]
    values = out.values() if hasattr(out, "values") else out
    return [leaf for v in values for leaf in leaves(v)]


def same_signature(prog, fn):
    """Names, kinds and defaults as the model's forward has them (annotations aren't saved)."""
    want = [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]
    got = [(p.name, p.kind, p.default) for p in inspect.signature(prog).parameters.values()]
    return got == want


@pytest.mark.parametrize("name", list(ZOO))
@pytest.mark.parametrize("dispatch, optimize", [("auto", "exact"), ("python", "exact"), ("auto", "fast")])
def test_zoo_model(name, dispatch, optimize, tmp_path):
    build, kwargs, out_type = ZOO[name]
    torch.manual_seed(0)
    model = build().eval()
    path = tmp_path / f"{name}.kwx"
    kwexport.save(kwexport.export(model, (), kwargs), path)
    prog = kwexport.load(path, dispatch=dispatch, optimize=optimize)
    with torch.no_grad():
        want = model(**kwargs)
    got = prog(**reversed_kwargs(kwargs))
    assert type(got).__name__ == out_type
    assert type(got) is type(want)  # the class is imported here, so the real one comes back
    got_leaves, want_leaves = leaves(got), leaves(want)
    assert len(got_leaves) == len(want_leaves) > 0
    for g, w in zip(got_leaves, want_leaves):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
        if optimize == "fast" and g.is_floating_point() and g.numel():
            # docs/optimize.md: within 1e-4 of eager, relative to the output's scale.
            assert ((g - w).abs().max() / w.abs().max().clamp_min(1e-12)).item() < 1e-4
    if out_type != "Tensor":
        assert list(got.keys()) == list(want.keys())
        torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-4)
    assert same_signature(prog, model.forward)


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_model_in_bf16(name, tmp_path):
    """docs/optimize.md: `precision="bf16"` within 2e-2 of eager, relative to each output's
    scale, with the same outputs, classes and signature."""
    build, kwargs, out_type = ZOO[name]
    torch.manual_seed(0)
    model = build().eval()
    path = tmp_path / f"{name}.kwx"
    kwexport.save(kwexport.export(model, (), kwargs), path)
    prog = kwexport.load(path, precision="bf16")
    with torch.no_grad():
        want = model(**kwargs)
    got = prog(**reversed_kwargs(kwargs))
    assert type(got) is type(want)
    got_leaves, want_leaves = leaves(got), leaves(want)
    assert len(got_leaves) == len(want_leaves) > 0
    for g, w in zip(got_leaves, want_leaves):
        assert (g.shape, g.dtype) == (w.shape, w.dtype)
        if g.is_floating_point() and g.numel():
            assert ((g - w).abs().max() / w.abs().max().clamp_min(1e-12)).item() < 2e-2
        else:
            assert torch.equal(g, w)
    assert same_signature(prog, model.forward)


def test_model_output_stand_in_in_a_fresh_process(tmp_path):
    """A serving process that never imports transformers gets a stand-in with the API people
    use on ModelOutputs."""
    model = text("distilbert").eval()
    path = tmp_path / "d.kwx"
    kwexport.save(kwexport.export(model, (), {"input_ids": IDS, "attention_mask": MASK}), path)
    torch.save((IDS, MASK, model(input_ids=IDS, attention_mask=MASK).logits.detach()), tmp_path / "io.pt")
    code = f"""
import sys, torch, kwexport
ids, mask, want = torch.load({str(tmp_path / "io.pt")!r})
out = kwexport.load({str(path)!r})(attention_mask=mask, input_ids=ids)
assert "transformers" not in sys.modules
assert isinstance(out, kwexport.StandIn), type(out)
assert out.class_name == "transformers.modeling_outputs.SequenceClassifierOutput"
assert list(out.keys()) == ["logits"] and len(out) == 1
torch.testing.assert_close(out.logits, want, atol=1e-4, rtol=1e-4)
torch.testing.assert_close(out["logits"], out[0])
assert out.to_tuple()[0] is out.logits and out[:1] == (out.logits,)
print(repr(out).split("(")[0])
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "<kwexport stand-in for transformers.modeling_outputs.SequenceClassifierOutput>"


def test_bert_exported_with_dynamic_true_takes_any_batch_and_length(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_attention_heads=2,
        intermediate_size=64,
        num_hidden_layers=2,
        max_position_embeddings=128,
    )
    model = transformers.BertForSequenceClassification(cfg).eval()
    path = tmp_path / "bert.kwx"
    kwexport.save(kwexport.export(model, (), {"input_ids": IDS, "attention_mask": MASK}, dynamic=True), path)
    prog = kwexport.load(path)
    for batch in (1, 3, 8):
        for length in (5, 31, 128):
            ids = torch.randint(0, 100, (batch, length))
            mask = torch.ones(batch, length, dtype=torch.long)
            mask[:, length // 2 :] = torch.randint(0, 2, (batch, length - length // 2))
            with torch.no_grad():
                want = model(input_ids=ids, attention_mask=mask).logits
            got = prog(attention_mask=mask, input_ids=ids).logits
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


# The zoo's models whose inputs are floats: the images, and the text models fed embeddings.
NONFINITE_ZOO = {
    "vit": (lambda: vision("vit"), lambda: {"pixel_values": PIXELS.clone()}, "pixel_values"),
    "resnet18": (lambda: vision("resnet18"), lambda: {"x": PIXELS.clone()}, "x"),
    "mobilenet_v3_small": (lambda: vision("mobilenet_v3_small"), lambda: {"x": PIXELS.clone()}, "x"),
    "vision_transformer": (lambda: vision("vision_transformer"), lambda: {"x": PIXELS.clone()}, "x"),
    **{
        name: (
            lambda name=name: text(name),
            lambda cache=cache: {"inputs_embeds": torch.randn(2, 7, 32), "attention_mask": MASK, **cache},
            "inputs_embeds",
        )
        for name, cache in (("bert", {}), ("gpt2", {"use_cache": False}), ("llama", {"use_cache": False}))
    },
}


@pytest.mark.parametrize("name", list(NONFINITE_ZOO))
@pytest.mark.parametrize("special", [float("nan"), float("inf"), float("-inf")])
def test_zoo_model_keeps_eagers_nan_and_inf(name, special, tmp_path):
    """A NaN or an infinity in an input reaches the outputs exactly where eager's does, at
    `fast` and at `precision="bf16"`: a corrupt input never becomes a plausible answer."""
    build, make_kwargs, field = NONFINITE_ZOO[name]
    torch.manual_seed(0)
    model = build().eval()
    kwargs = make_kwargs()
    path = tmp_path / f"{name}.kwx"
    kwexport.save(kwexport.export(model, (), kwargs), path)
    bad = kwargs[field]
    bad[..., 5] = special  # a column of the image, or one feature of every token
    with torch.no_grad():
        want = leaves(model(**kwargs))
    for options in ({"optimize": "fast"}, {"precision": "bf16"}):
        prog = kwexport.load(path, **options)
        for _ in range(2):  # measured on the first call, or (weights of 1 MiB or more) one kernel a call
            got = leaves(prog(**kwargs))
            for g, w in zip(got, want):
                if g.is_floating_point():
                    assert torch.equal(g.isnan(), w.isnan()), (options, int(g.isnan().sum()), int(w.isnan().sum()))
                    assert torch.equal(g.isinf(), w.isinf()), options
