"""examples/ray_serve.py on a real Ray Serve: two replicas map one saved GPT-2, concurrent HTTP
requests with keyword inputs get eager's answers, and requests that don't fit the saved
signature get a 4xx with kwexport's message while the replicas keep serving."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kwexport

pytest.importorskip("ray.serve")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).parent.parent


def test_ray_serve_replicas_answer_like_eager_and_refuse_bad_input(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=32)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 100, (1, 7))
    call = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}
    path = tmp_path / "gpt2.kwx"
    kwexport.save(kwexport.export(model, (), call), path)

    good = []
    for _ in range(8):
        ids = torch.randint(0, 100, (1, 7))
        good.append({"attention_mask": torch.ones_like(ids).tolist(), "input_ids": ids.tolist(), "use_cache": False})
    bad = [
        {"input_ids": good[0]["input_ids"], "use_cache": False},  # attention_mask missing
        {**good[0], "input_ids": [[1, 2, 3]]},  # a shape the export fixed
        {**good[0], "labelz": 1},  # no such parameter
    ]
    bodies = [json.dumps(b) for b in good + bad] + ["{not json", json.dumps(good[1])]
    (tmp_path / "requests.json").write_text(json.dumps(bodies))

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "examples"), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "ray_serve_check.py")]
        + [str(path), str(tmp_path / "requests.json"), str(tmp_path / "results.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert len(results) == len(bodies)

    prog = kwexport.load(path)
    with torch.no_grad():
        for body, (status, answer) in zip(good + [good[1]], results[:8] + results[-1:]):
            want = model(
                input_ids=torch.tensor(body["input_ids"]),
                attention_mask=torch.tensor(body["attention_mask"]),
                use_cache=False,
            )
            assert status == 200
            assert list(answer) == list(want.keys())
            torch.testing.assert_close(torch.tensor(answer["logits"]), want.logits, atol=1e-4, rtol=1e-4)
    for body, (status, answer) in zip(bad, results[8:11]):
        kwargs = {k: torch.tensor(v) if isinstance(v, list) else v for k, v in body.items()}
        with pytest.raises((kwexport.InputError, kwexport.SignatureError)) as e:
            prog(**kwargs)
        assert (status, answer) == (422, {"error": f"{type(e.value).__name__}: {e.value}"})
    assert results[11] == [400, {"error": "the body is not JSON"}]
