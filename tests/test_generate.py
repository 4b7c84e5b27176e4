import json
import os
import re

import pytest
import torch

import generate as gen
import kernels
from conftest import make_tiny_model
from generate import generate, logits_to_probs, main, sample


def test_greedy_is_argmax_and_temperature_zero():
    logits = torch.randn(3, 50)
    assert torch.equal(sample(logits, temperature=0).view(-1), logits.argmax(-1).int())


def test_argmax_is_torch_argmax_with_ties_first_eager_and_compiled():
    torch.manual_seed(0)
    compiled = torch.compile(gen.argmax, fullgraph=True, dynamic=False)
    for shape, dtype in (((1, 49152), torch.bfloat16), ((5, 1000), torch.float32), ((2, 3, 77), torch.bfloat16)):
        x = torch.randn(shape).to(dtype)
        x[..., 5] = x[..., -3] = 100  # a tie: the first index wins, as torch.argmax picks
        if shape[0] > 1:
            x[1] = torch.randn(shape[1:]).to(dtype)
        want = torch.argmax(x, dim=-1, keepdim=True)
        for got in (gen.argmax(x), compiled(x)):
            assert got.dtype == torch.int32 and torch.equal(got.long(), want)


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    p = logits_to_probs(logits, 1.0, top_k=2)
    assert (p[0, 2:] == 0).all() and torch.allclose(p.sum(), torch.tensor(1.0))
    full = torch.softmax(logits, -1)[0]  # 0.636, 0.234, 0.086, ...
    p = logits_to_probs(logits, 1.0, top_p=0.7)  # 0.636 < 0.7, so the second token is needed too
    assert (p[0, :2] > 0).all() and (p[0, 2:] == 0).all()
    torch.testing.assert_close(p[0, :2], full[:2] / full[:2].sum())
    p = logits_to_probs(logits, 1.0, top_p=0.5)  # the top token alone already holds 0.5
    assert p[0, 0] == 1
    hot = logits_to_probs(logits, 0.5)
    assert hot[0, 0] > full[0]  # lower temperature sharpens


def test_sampling_without_sync_follows_the_distribution():
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    draws = gen.multinomial_sample_one_no_sync(probs.expand(20000, 4)).view(-1)
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    assert (freq - probs).abs().max() < 0.015


def test_generate_stops_at_stop_id_and_at_cache_end():
    model = make_tiny_model()
    prompt = torch.tensor([1, 2, 3], dtype=torch.int)
    model.setup_caches(1, 64)
    free, _ = generate(model, prompt, 30, temperature=0)
    assert len(free) == 30
    stop = free[4]
    stopped, stats = generate(model, prompt, 30, stop_ids={stop}, temperature=0)
    assert stopped == free[:free.index(stop) + 1] and stats["target_forwards"] == len(stopped) - 1
    model.setup_caches(1, 16)  # 3 prompt tokens leave room for 13 new ones
    capped, _ = generate(model, prompt, 30, temperature=0)
    assert capped == free[:13]


def test_generate_with_sampling_is_seeded():
    model = make_tiny_model()
    model.setup_caches(1, 64)
    prompt = torch.tensor([5, 6], dtype=torch.int)
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(generate(model, prompt, 20, temperature=1.0, top_k=20)[0])
    assert runs[0] == runs[1]
    torch.manual_seed(8)
    assert generate(model, prompt, 20, temperature=1.0, top_k=20)[0] != runs[0]


@pytest.mark.compile
def test_compiled_decode_step_matches_eager():
    model = make_tiny_model()
    prompt = torch.tensor([1, 2, 3, 4], dtype=torch.int)
    model.setup_caches(1, 64)
    eager, _ = generate(model, prompt, 24, temperature=0)
    original = gen.decode_one_token
    gen.decode_one_token = torch.compile(original, fullgraph=True, dynamic=False)
    try:
        compiled, _ = generate(model, prompt, 24, temperature=0)
    finally:
        gen.decode_one_token = original
    assert compiled == eager


@pytest.mark.compile
def test_direct_step_skips_dynamo_within_a_generation():
    """compile_step on a CPU (DirectStep): a generation's first call runs through Dynamo, its later calls with the
    same kinds of arguments call the graph it ran, with their own tensors; anything else goes through Dynamo."""
    state = torch.zeros(4)  # module state: read by the graph and written in place, never replaced

    def step(x, k):
        state.add_(x)
        return state * k, (x + 1).sum()

    direct = gen.compile_step(step)
    with torch.no_grad():
        with gen.guards_checked_once(0):
            first = direct(torch.ones(4), 2)
        assert torch.equal(first[0], torch.full((4,), 2.0)) and first[1].item() == 8
        dynamo = []
        direct.compiled = lambda *a, **k: dynamo.append(a)  # Dynamo answers with None from here on
        with gen.guards_checked_once(1):
            values, total = direct(torch.full((4,), 2.0), 2)
        assert not dynamo  # the graph itself ran: the new x was added to the state in place
        assert torch.equal(values, torch.full((4,), 6.0)) and total.item() == 12 and torch.equal(state, values / 2)
        with gen.guards_checked_once(1):
            assert direct(torch.ones(4), 3) is None and len(dynamo) == 1  # another k: another graph, Dynamo's
            assert direct(torch.ones(5), 2) is None and len(dynamo) == 2  # another shape likewise
        with gen.guards_checked_once(0):
            direct(torch.ones(4), 2)  # a new generation: its first call through Dynamo (caches may be new)
        with gen.guards_checked_once(1):
            direct(torch.ones(4), 2)  # ... and what that call left is all there is
        assert len(dynamo) == 4

    passed = gen.compile_step(lambda x: (x * 2, x))  # an input handed back as it is: not the graph's output
    with torch.no_grad(), gen.guards_checked_once(0):
        x = torch.ones(3)
        assert passed(x)[1] is x and not passed.graphs  # such a step always runs through Dynamo


@pytest.mark.compile
def test_direct_steps_sample_as_dynamo_does(monkeypatch):
    """Sampling through DirectStep draws the same random numbers as through Dynamo (the graphs' seeds come from
    the generator at each call), plain and EAGLE alike; the same seed the same tokens, another seed others."""
    from eagle_head import random_head
    model = make_tiny_model()
    drafter = gen.Drafter(random_head(model), "dynamic", depth=3, top_k=2, total_tokens=4)
    prompt = torch.tensor([1, 2, 3, 4], dtype=torch.int)
    model.setup_caches(1, 96)
    plain_step, cycle = gen.decode_one_token, gen.eagle_cycle
    runs = {}
    for how, compile_step in (("dynamo", lambda f: torch.compile(f, fullgraph=True, dynamic=False)),
                              ("direct", gen.compile_step)):
        monkeypatch.setattr(gen, "decode_one_token", compile_step(plain_step))
        monkeypatch.setattr(gen, "eagle_cycle", compile_step(cycle))
        runs[how] = []
        for seed in (0, 0, 1):
            for draft in (None, drafter):
                torch.manual_seed(seed)
                runs[how].append(generate(model, prompt, 40, temperature=0.8, draft=draft)[0])
    assert runs["direct"] == runs["dynamo"]
    assert runs["direct"][:2] == runs["direct"][2:4] and runs["direct"][0] != runs["direct"][4]


@pytest.mark.compile
@pytest.mark.slow
def test_cpp_wrapper_steps_match_eager():
    """--cpp_wrapper: the compiled decode step and EAGLE cycle launch their kernels (kernels.py's ops included, on
    packed weights, called as C functions: kernels.c_shims) from C++; tokens equal eager decoding's (float32). The
    graphs go through Inductor's graph cache (the C functions in its key once made every graph skip it)."""
    import kernels
    from eagle_head import random_head
    from model import pack_weights
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code
    model = make_tiny_model(dim=64, intermediate_size=192)
    drafter = gen.Drafter(random_head(model), "dynamic", depth=3, top_k=2, total_tokens=4)
    if kernels.load():
        pack_weights(model)
    prompt = torch.tensor([1, 2, 3, 4], dtype=torch.int)
    model.setup_caches(1, 96)
    eager, _ = generate(model, prompt, 32, temperature=0)
    eager_spec, _ = generate(model, prompt, 32, temperature=0, draft=drafter)
    config = torch._inductor.config
    original, setting = (gen.decode_one_token, gen.eagle_cycle), (config.cpp_wrapper, config.cpp_wrapper_build_separate)
    shims = config.aot_inductor.custom_ops_to_c_shims
    torch._dynamo.reset()  # graphs other tests compiled from the same functions would be reused
    skipped = counters["inductor"]["fxgraph_cache_bypass"]
    try:
        gen.compile_steps("cpu", cpp_wrapper=True)
        assert config.cpp_wrapper_build_separate  # the launcher at -O1, apart from the kernels
        (plain, _), code = run_and_get_code(lambda: generate(model, prompt, 32, temperature=0))
        assert plain == eager
        assert generate(model, prompt, 32, temperature=0, draft=drafter)[0] == eager_spec == eager
        assert counters["inductor"]["fxgraph_cache_bypass"] == skipped
    finally:
        gen.decode_one_token, gen.eagle_cycle = original
        config.cpp_wrapper, config.cpp_wrapper_build_separate = setting
        config.aot_inductor.custom_ops_to_c_shims = shims
        torch._dynamo.reset()
    launcher = "\n".join(code)
    assert "aoti_torch" in launcher
    if kernels.load():  # the ops' C functions, not the dispatcher
        assert "aoti_torch_cpu_linear(" in launcher and "call_dispatcher(\"eagle_fast" not in launcher


def test_compiled_code_is_cached_per_instruction_set(monkeypatch):
    """Kernels compiled on an AVX-512 machine must not serve an AVX2 one (a shared cache once handed a kernel built
    for the other, which read out of bounds). Inductor puts its own default into the environment on first use,
    usually before compile_steps runs; that default must not win over the per-ISA directory."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    for name in ("decode_one_token", "decode_batch_step", "eagle_cycle"):
        monkeypatch.setattr(gen, name, getattr(gen, name))  # compile_steps rebinds them; restored after the test
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    cache_dir()  # what any Inductor use does first: sets TORCHINDUCTOR_CACHE_DIR to /tmp/torchinductor_$USER
    gen.compile_steps()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(gen.ROOT / ".inductor-cache" / gen.cache_key())
    assert cache_dir() == os.environ["TORCHINDUCTOR_CACHE_DIR"]
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/my-own-cache")  # a user's own root, still one dir per ISA
    gen.compile_steps()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == os.path.join("/tmp/my-own-cache", gen.cache_key())
    gen.compile_steps()  # twice: not nested twice
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == os.path.join("/tmp/my-own-cache", gen.cache_key())


# ---------------------------------------------------------------- the command line

def run_main(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return e.value.code, err


@pytest.mark.parametrize("argv, message", [
    (["--dtype", "float8"], "unknown --dtype"),
    (["--device", "tpu9"], "--device"),
    (["--max_new_tokens", "0"], "--max_new_tokens must be at least 1"),
    (["--temperature", "-0.5"], "--temperature must be >= 0"),
    (["--top_p", "0"], "--top_p must be in (0, 1]"),
    (["--top_p", "1.5"], "--top_p must be in (0, 1]"),
    (["--top_k", "0"], "--top_k must be at least 1"),
    (["--num_samples", "0"], "--num_samples"),
    (["--checkpoint", "/nonexistent/model"], "checkpoint directory not found"),
    (["--depth", "0"], "--depth must be in 1..16"),
    (["--depth", "2", "--draft_top_k", "2", "--total_tokens", "7"], "--total_tokens must be in 1..6"),
    (["--tree", "chain", "--speculate_k", "17"], "--speculate_k must be in 1..16"),
    # a size flag of another tree shape would be ignored: said, not ignored
    (["--speculate_k", "3"], "--speculate_k is a --tree chain flag, but this run drafts --tree dynamic"),
    (["--tree", "chain", "--depth", "4"], "--depth is a --tree dynamic flag, but this run drafts --tree chain"),
    (["--tree_paths", "[[0]]"], "--tree_paths is a --tree static flag"),
    (["--tree", "static", "--tree_paths", "[[0],[0,0]"], "--tree_paths is not a valid tree"),
    # a verification's attention computes at most 32 rows as decoding does: larger trees would not be exact
    (["--depth", "5", "--draft_top_k", "3", "--total_tokens", "32"], "--total_tokens must be in 1..31"),
    (["--tree", "static", "--tree_paths", str([[i] for i in range(4)] + [[i, j] for i in range(4) for j in range(7)])],
     "--tree_paths has 32 nodes: at most 31"),
    (["--metrics-json", "/nonexistent/dir/m.json"], "--metrics-json /nonexistent/dir/m.json: not a file in"),
])
def test_bad_arguments_give_one_clear_line(argv, message, capsys):
    code, err = run_main(argv, capsys)
    assert code == 2 and len(err) == 1 and message in err[0], err


def test_corrupt_and_incomplete_checkpoints(tmp_path, capsys, default_checkpoint):
    (tmp_path / "config.json").write_text("{not json")
    code, err = run_main(["--checkpoint", str(tmp_path)], capsys)
    assert code == 2 and "corrupt" in err[-1]
    (tmp_path / "config.json").write_text((default_checkpoint / "config.json").read_text())
    code, err = run_main(["--checkpoint", str(tmp_path)], capsys)
    assert code == 2 and "weights file not found" in err[-1]
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage!" * 10)
    code, err = run_main(["--checkpoint", str(tmp_path)], capsys)
    assert code == 2 and "corrupt weights file" in err[-1]
    from safetensors.torch import save_file
    save_file({"norm.weight": torch.ones(576)}, str(tmp_path / "model.safetensors"))
    code, err = run_main(["--checkpoint", str(tmp_path)], capsys)
    assert code == 2 and "does not match its config" in err[-1]


def test_an_unknown_chat_template_in_the_config_is_one_line(tmp_path, capsys, default_checkpoint):
    for name in ("model.safetensors", "tokenizer.json"):
        (tmp_path / name).symlink_to(default_checkpoint / name)
    config = json.loads((default_checkpoint / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "chat_template": "llama3"}))
    code, err = run_main(["--checkpoint", str(tmp_path), "--chat", "--draft", "none", "--no-compile"], capsys)
    assert code == 2 and "config.json's chat_template 'llama3' is none of chatml, llama-3" in err[-1]


def test_prompt_longer_than_cache(capsys):
    code, err = run_main(["--prompt", "word " * 50, "--max_seq_length", "16"], capsys)
    assert code == 2 and "does not fit the KV cache" in err[-1]


def test_cli_plain_decoding_with_draft_none(tmp_path, capsys, hf_reference):
    out = tmp_path / "m.jsonl"
    main(["--chat", "--prompt", "What is the capital of France?", "--temperature", "0", "--max_new_tokens", "12",
          "--draft", "none", "--dtype", "float32", "--no-compile", "--metrics-json", str(out)])
    r = json.loads(out.read_text())
    n = hf_reference["greedy"]["results"][0]["first_eos_index"] + 1
    assert r["token_ids"] == hf_reference["greedy"]["results"][0]["new_ids"][:n] and r["target_forwards"] == n - 1


def test_cli_chat_greedy_and_metrics(tmp_path, capsys, hf_reference):
    out = tmp_path / "m.jsonl"
    main(["--chat", "--prompt", "What is the capital of France?", "--temperature", "0", "--max_new_tokens", "12",
          "--num_samples", "2", "--dtype", "float32", "--no-compile", "--metrics-json", str(out)])
    stdout = capsys.readouterr().out
    assert "Paris" in stdout
    records = [json.loads(line) for line in out.read_text().splitlines()]
    ref = hf_reference["greedy"]["results"][0]
    assert len(records) == 2
    for r in records:
        assert r["prompt_ids"] == ref["prompt_ids"]
        n = ref["first_eos_index"] + 1  # the model stops at <|im_end|>
        assert r["token_ids"] == ref["new_ids"][:n] and r["new_tokens"] == n
        assert r["tokens_per_s"] > 0 and "Paris" in r["text"]
        # the shipped EAGLE head drafts by default: same tokens, fewer target forwards (greedy, fp32)
        assert r["target_forwards"] <= n - 1 and r["mean_accepted"] >= 1


def test_cli_interactive_keeps_the_conversation_and_warms_up_first(tmp_path, capsys, monkeypatch, hf_reference):
    import io
    import generate
    out = tmp_path / "m.jsonl"
    compiled = []
    monkeypatch.setattr(generate, "compile_steps", lambda *a, **k: compiled.append(1))  # eager, but the warm-up runs
    monkeypatch.setattr("sys.stdin", io.StringIO("What is the capital of France?\nAnd what is its population?\n"))
    main(["--interactive", "--temperature", "0", "--max_new_tokens", "12", "--dtype", "float32", "--compile",
          "--no-cpp_wrapper", "--metrics-json", str(out)])
    captured = capsys.readouterr()
    assert compiled and captured.err.count("Compilation and warm-up") == 1
    first, second = [json.loads(line) for line in out.read_text().splitlines()]
    ref = hf_reference["greedy"]["results"][0]
    n = ref["first_eos_index"] + 1
    assert first["prompt_ids"] == ref["prompt_ids"] and first["token_ids"] == ref["new_ids"][:n]  # as --chat gives
    # the second turn's prompt is the whole conversation: the first question, its answer, then the new question
    assert second["prompt_ids"][:len(first["prompt_ids"])] == first["prompt_ids"]
    assert len(second["prompt_ids"]) > len(first["prompt_ids"]) + len(first["token_ids"])
    assert "Paris" in first["text"] and captured.out.count("You: ") == 3  # two questions, then the end of input
    # a cache too small even for the warm-up's prompt: no warm-up, and the question gets the one-line error, the chat
    # going on (here to the end of input)
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n"))
    main(["--interactive", "--max_seq_length", "8", "--draft", "none", "--compile"])
    err = capsys.readouterr().err
    assert "error: prompt of" in err and "does not fit the KV cache of 8 tokens" in err and "warm-up" not in err


def test_cli_interactive_leaves_out_the_oldest_turns_when_the_cache_is_full(tmp_path, capsys, monkeypatch):
    import io
    out = tmp_path / "m.jsonl"
    monkeypatch.setattr("sys.stdin", io.StringIO("What is the capital of France?\nAnd of Italy?\nAnd of Spain?\n"))
    main(["--interactive", "--temperature", "0", "--max_seq_length", "80", "--max_new_tokens", "10", "--draft", "none",
          "--dtype", "float32", "--no-compile", "--metrics-json", str(out)])
    prompts = [json.loads(line)["prompt_ids"] for line in out.read_text().splitlines()]
    assert len(prompts) == 3 and all(len(p) <= 80 - 1 - 10 for p in prompts)  # each with room for its reply
    assert "oldest turn left out" in capsys.readouterr().err
    assert prompts[2][:len(prompts[0]) - 8] != prompts[0][:-8]  # the first question is gone from the third prompt


def test_cli_total_tokens_auto(tmp_path, capsys, hf_reference):
    out = tmp_path / "m.jsonl"
    main(["--chat", "--prompt", "What is the capital of France?", "--temperature", "0", "--max_new_tokens", "12",
          "--total_tokens", "auto", "--depth", "2", "--draft_top_k", "2", "--dtype", "float32", "--no-compile",
          "--metrics-json", str(out)])
    err = capsys.readouterr().err
    # depth 2, top-k 2 offer at most 6 nodes: the sizes tried are 3, 4 and 6 (the whole pool for the larger ones),
    # and the faster one on this machine wins
    assert re.search(r"--total_tokens auto: [346] \(", err), err
    ref = hf_reference["greedy"]["results"][0]
    assert json.loads(out.read_text())["token_ids"] == ref["new_ids"][:ref["first_eos_index"] + 1]


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@CUDA
@pytest.mark.compile
def test_cuda_graph_steps_match_eager_on_cuda():
    """compile_steps("cuda"): the decode step and the EAGLE cycle replay as CUDA graphs (mode="reduce-overhead"),
    fed their own previous outputs; tokens equal eager decoding's (float32)."""
    from eagle_head import random_head
    model = make_tiny_model().to("cuda")
    drafter = gen.Drafter(random_head(model), "dynamic", depth=3, top_k=2, total_tokens=4)
    prompt = torch.tensor([1, 2, 3, 4], dtype=torch.int, device="cuda")
    model.setup_caches(1, 96)
    eager, _ = generate(model, prompt, 32, temperature=0)
    eager_spec, _ = generate(model, prompt, 32, temperature=0, draft=drafter)
    original = (gen.decode_one_token, gen.eagle_cycle)
    try:
        gen.compile_steps("cuda")
        for _ in range(2):  # the second run replays the recorded graphs
            assert generate(model, prompt, 32, temperature=0)[0] == eager
            assert generate(model, prompt, 32, temperature=0, draft=drafter)[0] == eager_spec == eager
    finally:
        gen.decode_one_token, gen.eagle_cycle = original


def test_defaults_pick_the_fastest_exact_configuration():
    """No flags: bf16 where kernels.py runs (exact EAGLE in bf16), float32 where it cannot; compiled where a C++
    compiler is found, with the C++ launcher on a CPU. Explicit flags are kept."""
    import kernels
    args = gen.resolve_defaults(gen.build_parser().parse_args([]))
    assert args.dtype == ("bfloat16" if kernels.load() else "float32")
    assert args.compile is True and args.cpp_wrapper is True  # this machine has g++ (torch.compile needs it)
    args = gen.resolve_defaults(gen.build_parser().parse_args(["--dtype", "float32", "--no-compile", "--no-cpp_wrapper"]))
    assert args.dtype == "float32" and args.compile is False and args.cpp_wrapper is False
    assert gen.default_cpp_wrapper("cuda") is False


@pytest.mark.parametrize("isa, argv, dtype, quant", [
    ("avx2", [], "bfloat16", "int8.head8"),  # no bf16 arithmetic: int8 weights (LM head too) decode fastest
    ("avx2_vnni", [], "bfloat16", "int8.head8"),
    ("avx512_bf16", [], "bfloat16", "int8.head8"),  # Zen 4 / Zen 5: int8 by integer dot products (vpdpwssd)
    ("amx", [], "bfloat16", "int8.head8"),  # AMX: int8 through the int8 tiles
    ("avx512", [], "bfloat16", None),  # AVX-512 without bf16 or VNNI: int8 converted to fp32, the float weights
    ("avx2", ["--dtype", "float32"], "float32", None),  # a dtype asked for: its float weights
    ("avx2", ["--quant", "none"], "bfloat16", None), ("avx512_bf16", ["--quant", "int4.g32"], "bfloat16", "int4.g32"),
])
def test_default_weights_follow_the_cpu(monkeypatch, isa, argv, dtype, quant):
    import kernels
    monkeypatch.setattr(kernels, "isa", lambda: isa)
    args = gen.resolve_defaults(gen.build_parser().parse_args(argv))
    assert (args.dtype, args.quant) == (dtype, quant)
    assert gen.fastest_quant("cuda") is None


@pytest.mark.parametrize("isa, given, kind", [
    ("avx2", "auto", "int8"), ("avx2_vnni", "auto", "int8"), ("amx", "auto", "int8"), ("avx512_bf16", "auto", "int8"), ("avx512", "auto", "float"), ("avx2", "none", "float"),
    ("avx512_bf16", "int8", "int8"), ("avx2", "int4.g32", "int4")])
def test_default_head_weights_follow_the_cpu(tmp_path, monkeypatch, isa, given, kind):
    """--draft_quant auto: an int8 head where kernels.py's build takes int8 by integer dot products or tiles
    (INT8_BUILDS), quantized at load (nothing written beside the head); the head as saved elsewhere, or with none; a head file given loads as it is."""
    import kernels
    import quantize as Q
    from eagle_head import random_head, save_head, target_info
    from model import Linear
    monkeypatch.setattr(kernels, "isa", lambda: isa)
    target = make_tiny_model()
    save_head(random_head(target, seed=1), tmp_path / "head", target_info(target))
    head = gen.load_draft_head(tmp_path / "head", target, "cpu", torch.float32, given)
    assert type(head.fc) is {"int8": Q.Int8Linear, "int4": Q.Int4Linear, "float": Linear}[kind]
    assert sorted(p.name for p in (tmp_path / "head").iterdir()) == ["head.safetensors", "head_config.json"]
    as_file = gen.load_draft_head(tmp_path / "head" / "head.safetensors", target, "cpu", torch.float32, "auto")
    assert type(as_file.fc) is Linear


def test_auto_quant_writes_int8_weights_on_first_use(tmp_path, capsys, monkeypatch):
    """--quant auto's int8 weights (LM head too) are written beside the checkpoint once, then loaded; a process that may not write, or a
    directory that cannot take the file, gets the float weights and one line saying why."""
    from conftest import save_checkpoint
    ckpt = save_checkpoint(make_tiny_model(), tmp_path / "ckpt")
    assert gen.make_quantized_on_first_use(ckpt, "int8.head8", write=False) is None
    assert not (ckpt / "model_int8.head8.safetensors").exists()
    assert gen.make_quantized_on_first_use(ckpt, "int8.head8") == "int8.head8"
    assert (ckpt / "model_int8.head8.safetensors").is_file() and "writing int8.head8" in capsys.readouterr().err
    assert gen.make_quantized_on_first_use(ckpt, "int8.head8", write=False) == "int8.head8"  # there now: no second write
    assert capsys.readouterr().err == ""
    model = gen.load_model(ckpt, "cpu", torch.float32, quantization="int8.head8")
    for w in (model.output.weight, model.layers[0].feed_forward.w2.weight):  # packed: uint8 q + 128 on AVX-512-BF16
        assert (kernels.unpack(w) if w.dim() == 4 else w).dtype == torch.int8
    other = save_checkpoint(make_tiny_model(), tmp_path / "other")

    def read_only(*a, **k):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(gen, "quantize_checkpoint", read_only)
    assert gen.make_quantized_on_first_use(other, "int8.head8") is None
    assert "could not write them" in capsys.readouterr().err


@pytest.mark.parametrize("isa, device, weights, tree", [
    ("amx", "cpu", "bfloat16", gen.WIDE_TREE), ("amx", "cpu", "int4.g32", gen.SMALL_TREE),
    ("amx", "cpu", "int4.g32.head8", gen.SMALL_TREE), ("amx", "cpu", "int8.head8", gen.TREE),
    ("amx", "cpu", "float32", gen.TREE), ("avx512_bf16", "cpu", "int4.g32", gen.SMALL_TREE),
    ("avx512_bf16", "cpu", "int4i.head8", gen.TREE), ("avx2", "cpu", "int4.g32", gen.TREE),
    ("avx512_bf16", "cpu", "int8.head8", gen.SMALL_TREE), ("avx512_bf16", "cpu", "int8", gen.SMALL_TREE),
    ("avx2", "cpu", "int8.head8", gen.TREE), ("avx512", "cpu", "int8", gen.TREE),
    ("avx512_bf16", "cpu", "bfloat16", gen.TREE), ("avx2", "cpu", "bfloat16", gen.TREE),
    ("fallback", "cuda", "bfloat16", gen.WIDE_TREE), ("fallback", "cuda", "int4.g32", gen.WIDE_TREE)])
def test_default_tree_follows_the_verification_cost(monkeypatch, isa, device, weights, tree):
    """The 8-node tree only where a 9-token verification costs about one step (AMX bf16, CUDA), 3 nodes for int4 on
    AMX (its tiles' cheap rows end at 4) and for int8 and int4 on AVX-512-BF16 without AMX (each row costs); flags given
    override their defaults, and a default --total_tokens shrinks to what a given --depth allows."""
    monkeypatch.setattr(kernels, "isa", lambda: isa)
    parse = gen.build_parser().parse_args
    args = gen.fill_tree_defaults(parse([]), weights, device)
    assert (args.depth, args.draft_top_k, args.total_tokens, args.speculate_k) == (
        tree["depth"], tree["top_k"], tree["total_tokens"], tree["speculate_k"])
    args = gen.fill_tree_defaults(parse(["--depth", "5", "--speculate_k", "2"]), weights, device)
    assert (args.depth, args.draft_top_k, args.total_tokens, args.speculate_k) == (5, tree["top_k"],
                                                                                   tree["total_tokens"], 2)
    args = gen.fill_tree_defaults(parse(["--depth", "1"]), weights, device)  # one level: top_k nodes at most
    assert args.total_tokens == min(tree["total_tokens"], tree["top_k"]) and gen.check_tree(args) is None


# ---------------------------------------------------------------- batched decoding

BATCH_PROMPTS = [[1, 2, 3, 4, 5], [7], list(range(30, 60)), [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12, 13]]


@pytest.mark.parametrize("dtype, pack", [(torch.float32, False), (torch.bfloat16, True)])
def test_batch_rows_equal_their_own_batch_1_decoding(dtype, pack):
    """Prompts of different lengths, left-padded: each row gives exactly what it gives alone, stopping at its own
    stop id (row 0 stops early, the others run on). bf16 rows are exact on the packed kernels."""
    import kernels
    from model import pack_weights
    if pack and not kernels.load():
        pytest.skip("the C++ kernels are not available here")
    model = make_tiny_model(seed=1).to(dtype)
    if pack:
        pack_weights(model)
    model.setup_caches(len(BATCH_PROMPTS), 128)
    rows = gen.generate_batch(model, BATCH_PROMPTS, 40, stop_ids={5})
    assert [len(r) for r in rows] != [40] * 4 and rows[0][-1] == 5
    for prompt, row in zip(BATCH_PROMPTS, rows):
        model.setup_caches(1, 128)
        assert row == generate(model, torch.tensor(prompt, dtype=torch.int), 40, stop_ids={5}, temperature=0)[0]


def test_batch_sampling_follows_each_rows_distribution():
    """Sampled rows: with the same prompt twice, the rows are independent draws (they differ), and a row's first
    tokens follow the model's distribution (their frequency over many draws matches the probability)."""
    model = make_tiny_model(seed=2, vocab_size=8)
    with torch.no_grad():
        model.output.weight.mul_(0.2)  # flat enough that several tokens are likely
    prompt = [1, 2, 3]
    model.setup_caches(1, 16)
    with torch.no_grad():
        p = gen.logits_to_probs(model(torch.tensor([prompt]), torch.arange(3))[0, -1], temperature=1.0)
    B = 400
    model.setup_caches(B, 16)
    torch.manual_seed(0)
    rows = gen.generate_batch(model, [prompt] * B, 2, temperature=1.0, top_k=None)
    first = torch.bincount(torch.tensor([r[0] for r in rows]), minlength=8).float() / B
    assert (first - p).abs().max() < 0.08 and len({tuple(r) for r in rows}) > 10


def test_batch_errors():
    model = make_tiny_model()
    model.setup_caches(2, 16)
    with pytest.raises(ValueError, match="set up for a batch of 2"):
        gen.generate_batch(model, [[1], [2], [3]], 4)
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        gen.generate_batch(model, [[1] * 20, [2]], 4)


def test_total_tokens_auto_is_refused_under_torchrun(monkeypatch, capsys):
    import generate
    monkeypatch.setattr(generate, "init_distributed", lambda device: (0, 2))  # as rank 0 of 2 processes
    code, err = run_main(["--total_tokens", "auto"], capsys)
    assert code == 2 and "under torchrun give a size" in err[-1]
