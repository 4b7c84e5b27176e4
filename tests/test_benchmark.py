import argparse
import json

import pytest
import torch

import benchmark
import kernels
from benchmark import first_difference, parse_method, summarize
from conftest import make_tiny_model
from model import pack_weights


def test_method_specs():
    assert parse_method("plain", "bfloat16") == ("plain", "bfloat16")
    assert parse_method("eagle-dynamic@int4.g32", "bfloat16") == ("eagle-dynamic", "int4.g32")
    assert parse_method("hf@float32", "bfloat16") == ("hf", "float32")
    assert parse_method("llama.cpp", "float32") == ("llama.cpp", "gguf")
    for bad, message in [("eagle-tree", "unknown method"), ("hf@int8", "float weights"),
                         ("llama.cpp@int8", "no @weights"), ("plain@int3", "unknown quantization")]:
        with pytest.raises(ValueError, match=message):
            parse_method(bad, "float32")


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_summary_flags_eagle_outputs_that_differ_from_plain():
    methods = {"plain@float32": ("plain", "float32"), "eagle-chain@float32": ("eagle-chain", "float32"),
               "hf@float32": ("hf", "float32")}
    eagle = {"verify_forwards": 2, "mean_accepted": 1.5, "accepted_at_depth": [1, 0]}
    per_prompt = {"plain@float32": [{"id": 1, "token_ids": [5, 6, 7, 8], "seconds": 2.0}],
                  "eagle-chain@float32": [{"id": 1, "token_ids": [5, 6, 9, 8], "seconds": 1.0, **eagle}],
                  "hf@float32": [{"id": 1, "token_ids": [5, 6, 7, 8], "seconds": 4.0}]}
    args = argparse.Namespace(dtype="float32", no_compile=True, cpp_wrapper=False, prompts="p.jsonl", max_new_tokens=4, device="cpu")
    memory = {m: {"weights_bytes": 1} for m in methods}
    r = summarize(methods, per_prompt, {m: 0.0 for m in methods}, memory, args, 1)
    assert r["mismatches"] == [{"method": "eagle-chain@float32", "prompt": 1, "first_difference": 2}]
    e = r["methods"]["eagle-chain@float32"]
    assert e["speedup_vs_plain"] == 2.0 and e["equal_to_reference"] == 0 and e["mean_accepted"] == 1.5
    assert e["acceptance_rate_by_depth"] == [0.5, 0.0]
    assert r["methods"]["hf@float32"]["equal_to_reference"] == 1 and r["methods"]["hf@float32"]["speedup_vs_plain"] == 0.5


def test_benchmark_end_to_end_exact_in_float32(tmp_path, capsys, default_checkpoint):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "turns": ["Name three colours."]}) + "\n"
                       + json.dumps({"id": "b", "prompt": "def fib(n):"}) + "\n")
    out = tmp_path / "r.json"
    code = benchmark.main(["--prompts", str(prompts), "--max_new_tokens", "10", "--no_compile", "--dtype", "float32",
                           "--methods", "plain,eagle-chain,eagle-dynamic", "--out", str(out)])
    assert code == 0
    r = json.loads(out.read_text())
    assert r["n_prompts"] == 2 and r["mismatches"] == [] and r["torch"] == torch.__version__
    plain = r["methods"]["plain@float32"]
    for m in ("eagle-chain@float32", "eagle-dynamic@float32"):
        e = r["methods"][m]
        assert e["equal_to_reference"] == 2 and e["mean_accepted"] >= 1 and e["tokens_per_s"] > 0
        assert [p["token_ids"] for p in e["per_prompt"]] == [p["token_ids"] for p in plain["per_prompt"]]
    out = capsys.readouterr().out
    assert "| eagle-dynamic | float32 |" in out and "eagle-chain@float32: chain tree, depth 3, 3 nodes" in out
    assert r["methods"]["eagle-dynamic@float32"]["draft_tree"] == "dynamic tree, depth 3, top-k 2, 4 nodes"


def test_benchmark_runs_an_eagle3_head(tmp_path, capsys, real_model):
    """benchmark.py --draft with an EAGLE-3 head (its own LM head, no slice of the target's): exact, and its weights
    (fp32, --draft_quant none) counted in the method's size."""
    from eagle_head import Eagle3Head, default_feature_layers, head_config_from_target, save_head
    from train import target_info
    c = real_model.config
    torch.manual_seed(0)
    head = Eagle3Head(head_config_from_target(c), c.dim, default_feature_layers(c.n_layer), 512)
    save_head(head, tmp_path / "e3", target_info(real_model))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "turns": ["Name three colours."]}) + "\n")
    out = tmp_path / "r.json"
    code = benchmark.main(["--prompts", str(prompts), "--max_new_tokens", "8", "--no_compile", "--dtype", "float32",
                           "--methods", "plain,eagle-dynamic", "--draft", str(tmp_path / "e3"), "--out", str(out),
                           "--draft_quant", "none"])  # the head as saved (auto makes it int8 on AVX2-only CPUs)
    assert code == 0
    r = json.loads(out.read_text())
    assert r["mismatches"] == [] and r["methods"]["eagle-dynamic@float32"]["equal_to_reference"] == 1
    own = sum(p.numel() for p in head.parameters()) * 4
    extra = r["methods"]["eagle-dynamic@float32"]["weights_bytes"] - r["methods"]["plain@float32"]["weights_bytes"]
    assert own <= extra < 1.1 * own


@pytest.mark.parametrize("argv, message", [
    (["--methods", "plain,fast"], "unknown method"),
    (["--max_new_tokens", "0"], "--max_new_tokens"),
    (["--prompts", "/nonexistent.jsonl"], "prompts file not found"),
    (["--methods", "plain,eagle-chain", "--speculate_k", "0"], "eagle-chain@bfloat16: --speculate_k must be in 1..16"),
    (["--methods", "eagle-dynamic@int8", "--total_tokens", "11"], "--total_tokens must be in 1..10 for depth 3"),
    (["--out", "/nonexistent/dir/r.json"], "--out /nonexistent/dir/r.json: not a file in an existing directory"),
    (["--device", "gpu"], "unknown --device 'gpu'"),
    (["--methods", "plain", "--max_new_tokens", "8192"], "more than the model's 8192-token context"),
])
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        benchmark.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and message in err[-1]


@pytest.mark.parametrize("packed", [False, True])
def test_hf_peer_holds_the_same_weights(packed):
    pytest.importorskip("transformers")
    model = make_tiny_model(n_layer=2, tie_embeddings=True)
    if packed:  # as generate.load_model gives it on CPU: weights re-laid for kernels.py
        if not kernels.load():
            pytest.skip("kernels.py did not build here")
        pack_weights(model)
        assert model.output.weight.dim() == 4
    model.setup_caches(1, 32)
    ids = torch.randint(0, model.config.vocab_size, (1, 12))
    with torch.no_grad():
        ours = model(ids, torch.arange(12))
        theirs = benchmark.hf_model_from(model)(ids).logits
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)


def test_empty_prompts_are_refused_where_they_are(tmp_path):
    from tokenizer import get_tokenizer
    from generate import default_checkpoint
    tokenizer, path = get_tokenizer(default_checkpoint()), tmp_path / "p.jsonl"
    for record, words in (({"turns": []}, "non-empty 'turns'"), ({"prompt": ""}, "non-empty 'turns'"),
                          ({"x": 1}, "non-empty 'turns'")):
        path.write_text(json.dumps({"id": "a", "prompt": "Hi"}) + "\n" + json.dumps(record) + "\n")
        with pytest.raises(ValueError, match=f"p.jsonl:2: .*{words}"):
            benchmark.load_prompts(path, tokenizer, {"chat_template": "chatml"}, 0)


def test_a_speed_up_against_other_weights_names_them(capsys):
    row = dict(weights_bytes=0, warmup_seconds=0.0)
    results = {"n_prompts": 1, "prompts": "p", "max_new_tokens": 8, "compiled": False, "torch": "x",
               "machine": {"threads": 2}, "methods": {
                   "plain@bfloat16": dict(row, method="plain", weights="bfloat16", tokens_per_s=10.0),
                   "eagle-dynamic@int8": dict(row, method="eagle-dynamic", weights="int8", tokens_per_s=20.0,
                                              speedup_vs_plain=2.0, speedup_baseline="plain@bfloat16")}}
    benchmark.print_table(results)
    assert "| 2.00x (vs bfloat16) |" in capsys.readouterr().out
