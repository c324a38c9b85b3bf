"""Generation with a static KV cache: a tiny Llama built from config, exported through
transformers' own export wrapper, decoded token by token through kwexport exactly as through
the eager module the wrapper traced."""

import pytest
import torch

import kwexport

transformers = pytest.importorskip("transformers")
executorch = pytest.importorskip("transformers.integrations.executorch")

PROMPT = [5, 17, 42, 8, 99, 3]
NEW_TOKENS = 32
CACHE_LEN = 48


def decoder():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.generation_config.cache_implementation = "static"
    return executorch.TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=CACHE_LEN)


def greedy(step):
    """The prompt fed token by token, then NEW_TOKENS greedy tokens: the tokens generated."""
    out, token = [], None
    for pos in range(len(PROMPT) + NEW_TOKENS):
        if pos < len(PROMPT):
            token = PROMPT[pos]
        logits = step(torch.tensor([[token]]), torch.tensor([pos]))
        if pos >= len(PROMPT) - 1:
            token = int(logits[0, -1].argmax())
            out.append(token)
    return out[:NEW_TOKENS]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    wrapper = decoder()
    ep = wrapper.export(input_ids=torch.tensor([[1]]), cache_position=torch.tensor([0]))
    path = tmp_path_factory.mktemp("gen") / "llama.kwx"
    kwexport.save(ep, path)
    # The eager module the wrapper traced, from its fresh (zero) cache.
    with torch.no_grad():
        want = greedy(lambda ids, pos: wrapper.model(input_ids=ids, cache_position=pos))
    return path, want


@pytest.mark.parametrize("dispatch", ["auto", "python"])
def test_decode_loop_matches_eager_token_for_token(exported, dispatch):
    path, want = exported
    prog = kwexport.load(path, dispatch=dispatch)
    assert any(name.startswith("key_cache") or "cache" in name for name in prog.state)
    got = greedy(lambda ids, pos: prog(input_ids=ids, cache_position=pos))
    assert got == want
    # A second load decodes the same tokens from a fresh cache; so does the first after reset.
    second = kwexport.load(path, dispatch=dispatch)
    assert greedy(lambda ids, pos: second(input_ids=ids, cache_position=pos)) == want
    prog.reset()
    assert greedy(lambda ids, pos: prog(input_ids=ids, cache_position=pos)) == want


def test_an_op_error_leaves_the_state_and_reset_recovers(exported):
    path, want = exported
    prog = kwexport.load(path)
    before = {k: v.clone() for k, v in prog.state.items()}
    with pytest.raises((RuntimeError, IndexError), match=r"index"):
        prog(input_ids=torch.tensor([[1]]), cache_position=torch.tensor([CACHE_LEN + 5]))
    for k, v in prog.state.items():
        assert torch.equal(v, before[k]), k
    prog.reset()
    assert greedy(lambda ids, pos: prog(input_ids=ids, cache_position=pos)) == want
