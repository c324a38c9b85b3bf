"""Generation with a static KV cache: a tiny Llama built from config, exported through
transformers' own export wrapper, decoded token by token through kwexport exactly as through
the eager module the wrapper traced."""

import json

import pytest
import torch
from conftest import causal_lm

import kwexport

transformers = pytest.importorskip("transformers")
executorch = pytest.importorskip("transformers.integrations.executorch")

PROMPT = [5, 17, 42, 8, 99, 3]
NEW_TOKENS = 32
CACHE_LEN = 48


def decoder():
    return executorch.TorchExportableModuleForDecoderOnlyLM(causal_lm("llama"), batch_size=1, max_cache_len=CACHE_LEN)


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


def seq2seq(kind):
    torch.manual_seed(0)
    if kind == "t5":
        cfg = transformers.T5Config(
            vocab_size=100, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2, decoder_start_token_id=0
        )
        return transformers.T5ForConditionalGeneration(cfg).eval()
    cfg = transformers.BartConfig(
        vocab_size=100,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        decoder_start_token_id=0,
    )
    return transformers.BartForConditionalGeneration(cfg).eval()


@pytest.mark.parametrize("kind", ["t5", "bart"])
def test_encoder_decoder_is_one_file_and_matches_eager(tmp_path, kind):
    """transformers' Seq2SeqLMExportableModule exports the encoder and the static-cache
    decoder as two programs; saved as one file's two methods, the weights they share are
    stored once, and decoding through them matches the eager modules the export traced."""
    model = seq2seq(kind)
    wrapper = executorch.Seq2SeqLMExportableModule(model, batch_size=1, max_cache_length=32, max_hidden_seq_length=16)
    wrapper.export()
    path = tmp_path / "seq2seq.kwx"
    kwexport.save({"encode": wrapper.exported_encoder, "decode": wrapper.exported_decoder}, path)
    prog = kwexport.load(path)
    info = json.loads(kwexport._rt.describe(str(path))["description"])
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    state = sum(t.numel() * t.element_size() for t in prog.state.values())
    assert info["weights"]["bytes"] == params + state  # each parameter once, shared or not
    eager_encoder = executorch.Seq2SeqLMEncoderExportableModule(model.get_encoder()).eval()
    eager_decoder = executorch.Seq2SeqLMDecoderExportableModuleWithStaticCache(
        model=model, max_static_cache_length=32, batch_size=1
    ).eval()

    def decode(enc, dec, prompt):
        hidden = enc(prompt)
        tokens = [0]
        for i in range(20):
            logits = dec(torch.tensor([[tokens[-1]]]), hidden, torch.tensor([i]))
            tokens.append(int(logits[0, -1].argmax()))
        return tokens

    prompt = torch.tensor([[7, 3, 55, 21, 9, 14, 2]])
    with torch.no_grad():
        want = decode(eager_encoder, eager_decoder, prompt)
    assert decode(prog.encode, prog.decode, prompt) == want


def test_the_cache_is_written_in_place(exported):
    """A token writes one row of each KV cache: in place, never a copy of the whole cache
    (torch.export's graph computes a new cache per call; the runtime runs that node in place)."""
    path, want = exported
    prog = kwexport.load(path)
    caches = {k: v for k, v in prog.state.items() if "cache" in k}
    assert caches
    pointers = {k: v.data_ptr() for k, v in caches.items()}
    shapes = {tuple(v.shape) for v in caches.values()}
    prog(input_ids=torch.tensor([[5]]), cache_position=torch.tensor([0]))
    with torch.profiler.profile(record_shapes=True) as prof:
        prog(input_ids=torch.tensor([[17]]), cache_position=torch.tensor([1]))
    whole_cache_copies = [
        e.name
        for e in prof.events()
        if e.name in ("aten::copy_", "aten::clone", "aten::index_copy")
        and any(tuple(s) in shapes for s in e.input_shapes if s)
    ]
    assert whole_cache_copies == []
    assert any(e.name == "aten::index_copy_" for e in prof.events())
    for k, v in prog.state.items():
        if k in pointers:
            assert v.data_ptr() == pointers[k], k
    assert not torch.equal(caches[next(iter(caches))][..., 1, :], torch.zeros(1))


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def lm(request, tmp_path_factory):
    model = causal_lm(request.param)
    wrapper = executorch.TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=CACHE_LEN)
    ep = wrapper.export(input_ids=torch.tensor([[1]]), cache_position=torch.tensor([0]))
    path = tmp_path_factory.mktemp("lm") / f"{request.param}.kwx"
    kwexport.save(ep, path)
    return path, model


def test_greedy_generate_matches_transformers(lm):
    path, model = lm
    prog = kwexport.load(path)
    prompt = torch.tensor([PROMPT])
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, max_length=None)
    got = prog.generate(prompt, max_new_tokens=NEW_TOKENS)
    assert got.dtype == torch.long and got.shape == (1, len(PROMPT) + NEW_TOKENS)
    assert got.tolist() == want.tolist()
    # Again from the same program (the cache is rewritten from position 0), and streamed.
    assert prog.generate(prompt, max_new_tokens=NEW_TOKENS).tolist() == want.tolist()
    stream = prog.stream(prompt, max_new_tokens=NEW_TOKENS)
    assert list(stream) == want[0, len(PROMPT) :].tolist()
    assert stream.tokens == want[0].tolist()


def test_generate_stops_and_samples(lm):
    path, _ = lm
    prog = kwexport.load(path)
    prompt = torch.tensor([PROMPT])
    greedy_tokens = prog.generate(prompt, max_new_tokens=8)[0, len(PROMPT) :].tolist()
    eos = greedy_tokens[3]
    stopped = prog.generate(prompt, max_new_tokens=8, eos_token_id=[1000, eos])[0, len(PROMPT) :].tolist()
    assert stopped == greedy_tokens[: greedy_tokens.index(eos) + 1]
    # top_k=1 samples the greedy token; a seed gives the same tokens, another seed others.
    assert prog.generate(prompt, max_new_tokens=8, do_sample=True, top_k=1, seed=3)[0, 6:].tolist() == greedy_tokens
    a = prog.generate(prompt, max_new_tokens=16, do_sample=True, temperature=2.0, seed=1)
    assert torch.equal(a, prog.generate(prompt, max_new_tokens=16, do_sample=True, temperature=2.0, seed=1))
    assert not torch.equal(a, prog.generate(prompt, max_new_tokens=16, do_sample=True, temperature=2.0, seed=2))
    assert int(a.max()) < 128 and int(a.min()) >= 0


def test_generate_refuses_what_the_cache_cant_hold(lm):
    path, _ = lm
    prog = kwexport.load(path)
    with pytest.raises(
        ValueError,
        match=rf"^6 prompt token\(s\) and max_new_tokens=50 need 55 cache positions, but the program's static cache holds {CACHE_LEN}$",
    ):
        prog.generate(torch.tensor([PROMPT]), max_new_tokens=50)
    with pytest.raises(
        ValueError, match=r"^input_ids: expected a LongTensor of shape \[1, n\] \(one sequence\), got shape \[2, 6\]$"
    ):
        prog.generate(torch.tensor([PROMPT, PROMPT]))
    with pytest.raises(ValueError, match=r"^temperature must be a positive float, got 0$"):
        prog.generate(torch.tensor([PROMPT]), do_sample=True, temperature=0.0)


def test_a_streamer_sees_the_prompt_then_each_token(lm):
    path, _ = lm
    prog = kwexport.load(path)
    seen = []

    class Streamer:  # transformers' BaseStreamer protocol
        def put(self, value):
            seen.append(value.tolist())

        def end(self):
            seen.append("end")

    out = prog.generate(torch.tensor([PROMPT]), max_new_tokens=4, streamer=Streamer())
    assert seen == [[PROMPT]] + [[t] for t in out[0, len(PROMPT) :].tolist()] + ["end"]


@pytest.mark.parametrize("kind", ["t5", "bart"])
def test_encoder_decoder_generate(tmp_path, kind):
    model = seq2seq(kind)
    wrapper = executorch.Seq2SeqLMExportableModule(model, batch_size=1, max_cache_length=32, max_hidden_seq_length=16)
    wrapper.export()
    path = tmp_path / "seq2seq.kwx"
    kwexport.save({"encode": wrapper.exported_encoder, "decode": wrapper.exported_decoder}, path)
    prog = kwexport.load(path)
    prompt = torch.tensor([[7, 3, 55, 21, 9, 14, 2]])
    # The wrapper's own loop over its exported programs, from the decoder's start token 0.
    want = wrapper.generate(prompt, max_new_tokens=12)
    got = prog.generate(prompt, max_new_tokens=11)
    assert got[0].tolist() == want


def test_metadata_assertions_do_not_run(exported):
    """torch.export's `_assert_tensor_metadata` nodes check what the input checks already
    enforce: the file keeps them, the program runs without them (same tokens, above)."""
    path, _ = exported
    ops = json.loads(kwexport._rt.describe(str(path))["description"])["methods"]["forward"]["ops"]
    assert ops["aten::_assert_tensor_metadata.default"] > 0
    prog = kwexport.load(path)
    ran = {n["op"] for n in prog.profile(input_ids=torch.tensor([[1]]), cache_position=torch.tensor([0]))}
    assert "aten::_assert_tensor_metadata.default" not in ran and "aten::linear.default" in ran


def test_a_dynamic_length_program_prefills_in_one_step(tmp_path):
    model = causal_lm("llama")
    wrapper = executorch.TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=CACHE_LEN)
    seq = torch.export.Dim("seq", min=1, max=32)
    ep = wrapper.export(
        input_ids=torch.tensor([[1, 2, 3]]),
        cache_position=torch.tensor([0, 1, 2]),
        dynamic_shapes={"input_ids": {1: seq}, "cache_position": {0: seq}},
    )
    kwexport.save(ep, tmp_path / "dyn.kwx")
    prog = kwexport.load(tmp_path / "dyn.kwx")
    prompt = torch.tensor([PROMPT])
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, max_length=None)
    assert prog.generate(prompt, max_new_tokens=NEW_TOKENS).tolist() == want.tolist()
    with torch.profiler.profile() as prof:
        prog.generate(prompt, max_new_tokens=1)
    # One step for the whole prompt: each of the four caches written once.
    assert sum(e.name == "aten::index_copy_" for e in prof.events()) == 4


def test_a_streamer_may_call_back_into_the_program(lm):
    """With a streamer the state lock is taken per step, so a streamer that calls the program
    (here `reset`, which takes the lock) can't deadlock the generation."""
    import threading

    path, _ = lm
    prog = kwexport.load(path)

    class Resetting:
        def put(self, value):
            prog.reset()

        def end(self):
            pass

    done = []
    worker = threading.Thread(
        target=lambda: done.append(prog.generate(torch.tensor([PROMPT]), max_new_tokens=3, streamer=Resetting())),
        daemon=True,
    )
    worker.start()
    worker.join(timeout=60)
    assert done and done[0].shape == (1, len(PROMPT) + 3)
