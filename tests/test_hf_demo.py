"""``kvpool demo --hf``: the engine drives a saved transformers checkpoint with continuous
batching on the pool, and every request's output equals transformers' generate run on
that prompt alone (tokens equal, logits within 1e-4 at every step)."""

from __future__ import annotations

import json

import pytest
import torch
from _hf_models import greedy, tiny_model  # noqa: I001  (skips without transformers)

import kvpool
from kvpool.cli import main
from kvpool.demo.engine import Engine
from kvpool.demo.hf import load_hf_model
from kvpool.demo.requests import synthetic_requests

TOL = 1e-4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {}
    for arch in ("llama", "qwen2"):
        path = tmp_path_factory.mktemp(arch)
        tiny_model(arch, seed=4).save_pretrained(path)
        out[arch] = path
    yield out
    torch.set_num_threads(threads)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_outputs_equal_generate_per_prompt(checkpoints, arch, page_size):
    path = checkpoints[arch]
    with torch.inference_mode():
        model = load_hf_model(str(path), max_context=64)
    assert kvpool.audit(model) == []  # loaded outside inference mode, frozen
    pool = kvpool.KVPool(model.cfg.layers, model.cfg.kv_heads, model.cfg.head_dim, dtype=torch.float32,
                         page_size=page_size, num_pages=-(-64 // page_size) + 1, max_requests=4,
                         max_context_len=64)
    reqs = synthetic_requests(8, vocab_size=model.cfg.vocab_size, prompt_len=(2, 24), output_len=(1, 20), seed=2)
    engine = Engine(model, pool, max_running=3, record=True)
    with torch.inference_mode():
        stats = engine.run(reqs)
    assert stats.requests_done == 8 and max(stats.batch_sizes) >= 2  # requests really were batched
    assert stats.steps_blocked_by_pool > 0  # and the pool was tight enough to make admission wait
    pool.allocator.check()
    assert pool.allocator.used_pages == 0
    hf = model.hf
    for r in reqs:
        prompt = torch.from_numpy(r.prompt)[None]
        ref = greedy(hf, prompt, None, r.max_new_tokens, eos_token_id=None)
        assert r.output == ref.sequences[0, prompt.shape[1]:].tolist(), f"request {r.rid}"
        # Recorded logits: the prefill's last row, then one row per decode step.
        got = [r.logits[0][-1:]] + r.logits[1:]
        assert len(got) == len(ref.logits) == r.max_new_tokens
        for step, (a, b) in enumerate(zip(got, ref.logits)):
            diff = (a - b).abs().max().item()
            assert diff <= TOL, f"request {r.rid} step {step}: logits differ by {diff}"


def test_cli_demo_hf_runs_and_reports_the_checkpoint(checkpoints, tmp_path, capsys):
    path = checkpoints["llama"]
    out = tmp_path / "fig.json"
    assert main(["demo", "--hf", str(path), "--requests", "10", "--prompt-len", "4:24", "--output-len", "2:12",
                 "--pool-tokens", "160", "--max-running", "4", "--no-progress", "--json", str(out)]) == 0
    captured = capsys.readouterr()
    text = captured.out
    assert f"llama checkpoint {path}" in text and "audit" in text and "clean" in text
    # --no-progress hides transformers' weight-loading bar too (it was drawn), and gives
    # back transformers' process-wide setting.
    assert "Loading weights" not in captured.err, captured.err
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()
    fig = json.loads(out.read_text())
    assert fig["requests_done"] == 10 and fig["settings"]["model"]["hf_path"] == str(path)
    assert fig["settings"]["open_requests_at_end"] == 0 and fig["settings"]["pages_in_use_at_end"] == 0


def test_unsupported_checkpoints_are_rejected(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64)).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="Llama-architecture"):
        load_hf_model(str(tmp_path / "gpt2"))
    tiny_model("mistral", sliding_window=16).save_pretrained(tmp_path / "mistral")
    with pytest.raises(ValueError, match="sliding-window"):
        load_hf_model(str(tmp_path / "mistral"), max_context=64)
    with pytest.raises(OSError):
        load_hf_model(str(tmp_path / "missing"))
