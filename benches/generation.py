"""Generation side by side (issue 22): kwexport's Rust decode loop (`prog.generate`) against a
Python loop over the same kwexport program, a Python loop over torch.export's `ep.module()`,
and transformers' `generate` on the eager model with a static cache. Tiny models built from
config (2 layers, d=64, vocab 1000); one thread; greedy; interleaved rounds, best of each.

Per prompt: a generation of one token from an 8-token prompt (prefill and the first token).
Per token: (a generation of 1 + N tokens - a generation of 1) / N, so each runtime's fixed
costs (transformers' cache setup, the encoder) fall out. Every runtime generates the same
tokens (checked). Prints a Markdown table (BENCHMARKS.md, "Generation").

    python benches/generation.py [--new 48] [--rounds 5]
"""

import argparse
import tempfile
import time
import warnings
from pathlib import Path

import torch
import transformers
from transformers.integrations import executorch

import kwexport

PROMPT = [11, 401, 7, 93, 250, 3, 77, 512]
CACHE = 80


def tiny(kind):
    torch.manual_seed(0)
    common = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    heads = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, **heads)).eval()
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, **heads)).eval()
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=1000, n_embd=64, n_layer=2, n_head=4, n_positions=128)
        return transformers.GPT2LMHeadModel(cfg).eval()
    cfg = transformers.T5Config(
        vocab_size=1000, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, decoder_start_token_id=0
    )
    return transformers.T5ForConditionalGeneration(cfg).eval()


def decoder_only(kind, folder):
    model = tiny(kind)
    model.generation_config.cache_implementation = "static"
    wrapper = executorch.TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=CACHE)
    ep = wrapper.export(input_ids=torch.tensor([[1]]), cache_position=torch.tensor([0]))
    path = folder / f"{kind}.kwx"
    kwexport.save(ep, path)
    prog, fast = kwexport.load(path), kwexport.load(path, optimize="fast")
    step_kw = kwexport.load(path)
    step_ep = ep.module()

    def loop(step):
        def run(n):
            tokens, logits = list(PROMPT), None
            for pos, t in enumerate(PROMPT):
                logits = step(input_ids=torch.tensor([[t]]), cache_position=torch.tensor([pos]))
            for i in range(n):
                tokens.append(int(logits[0, -1].argmax()))
                if i + 1 < n:
                    logits = step(
                        input_ids=torch.tensor([[tokens[-1]]]), cache_position=torch.tensor([len(tokens) - 1])
                    )
            return tokens

        return run

    def hf(n):
        return model.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False, max_length=None)[0].tolist()

    return {
        "kwexport generate": lambda n: prog.generate(torch.tensor([PROMPT]), max_new_tokens=n)[0].tolist(),
        "kwexport generate, fast": lambda n: fast.generate(torch.tensor([PROMPT]), max_new_tokens=n)[0].tolist(),
        "kwexport, Python loop": loop(step_kw),
        "ep.module(), Python loop": loop(step_ep),
        "transformers generate": hf,
    }


def encoder_decoder(kind, folder):
    model = tiny(kind)
    wrapper = executorch.Seq2SeqLMExportableModule(
        model, batch_size=1, max_cache_length=CACHE, max_hidden_seq_length=32
    )
    wrapper.export()
    path = folder / f"{kind}.kwx"
    kwexport.save({"encode": wrapper.exported_encoder, "decode": wrapper.exported_decoder}, path)
    prog, loop_prog = kwexport.load(path), kwexport.load(path)
    fast = kwexport.load(path, optimize="fast")
    ep_encode, ep_decode = wrapper.exported_encoder.module(), wrapper.exported_decoder.module()

    def loop(encode, decode):
        def run(n):
            hidden = encode(torch.tensor([PROMPT]))
            tokens = [0]
            for i in range(n):
                logits = decode(torch.tensor([[tokens[-1]]]), hidden, torch.tensor([i]))
                tokens.append(int(logits[0, -1].argmax()))
            return tokens

        return run

    def hf(n):
        out = model.generate(
            torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False, cache_implementation="static", max_length=None
        )
        return out[0].tolist()

    return {
        "kwexport generate": lambda n: prog.generate(torch.tensor([PROMPT]), max_new_tokens=n)[0].tolist(),
        "kwexport generate, fast": lambda n: fast.generate(torch.tensor([PROMPT]), max_new_tokens=n)[0].tolist(),
        "kwexport, Python loop": loop(loop_prog.encode, loop_prog.decode),
        "ep.module(), Python loop": loop(ep_encode, ep_decode),
        "transformers generate": hf,
    }


def measure(runners, new, rounds):
    """Best-of-rounds seconds for 1 and 1 + new tokens, per runner, interleaved."""
    best = {name: [float("inf"), float("inf")] for name in runners}
    outputs = {}
    for _ in range(rounds):
        for name, run in runners.items():
            for i, n in enumerate((1, 1 + new)):
                t = time.perf_counter()
                with torch.no_grad():
                    out = run(n)
                best[name][i] = min(best[name][i], time.perf_counter() - t)
                outputs[name] = out
    tails = {name: out[-new:] for name, out in outputs.items()}
    if len({tuple(t) for t in tails.values()}) != 1:
        raise AssertionError(f"the runtimes generated different tokens: {tails}")
    return {name: (first, (full - first) / new) for name, (first, full) in best.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--new", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", nargs="*", default=["llama", "qwen2", "gpt2", "t5"])
    opts = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    names = [
        "kwexport generate",
        "kwexport generate, fast",
        "kwexport, Python loop",
        "ep.module(), Python loop",
        "transformers generate",
    ]
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, one thread; {opts.new} new tokens")
    print()
    print(
        "| model | "
        + " | ".join(f"per token: {n}" for n in names)
        + " | generate / ep.module() loop (exact, fast) | generate / transformers (exact, fast) "
        "| per prompt (8 tokens + first): kwexport generate | ep.module() loop | transformers |"
    )
    print("| --- |" + " ---: |" * (len(names) + 5))
    with tempfile.TemporaryDirectory() as tmp:
        for kind in opts.models:
            runners = (encoder_decoder if kind == "t5" else decoder_only)(kind, Path(tmp))
            r = measure(runners, opts.new, opts.rounds)
            per_token = {n: r[n][1] for n in names}
            cells = [f"{per_token[n] * 1e6:.0f} µs" for n in names]
            ours, fast = per_token["kwexport generate"], per_token["kwexport generate, fast"]
            ep, hf = per_token["ep.module(), Python loop"], per_token["transformers generate"]
            first = [r[n][0] for n in ("kwexport generate", "ep.module(), Python loop", "transformers generate")]
            print(
                f"| {kind} | "
                + " | ".join(cells)
                + f" | {ours / ep:.2f}, {fast / ep:.2f} | {ours / hf:.2f}, {fast / hf:.2f} | "
                + " | ".join(f"{t * 1e3:.2f} ms" for t in first)
                + " |"
            )


if __name__ == "__main__":
    main()
