import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import generate as gen
from conftest import make_tiny_model
from eagle_head import (EAGLE1_TREE, EagleHead, StaticTree, head_config_from_target, load_head, random_head,
                        save_head, target_info, top_k_rows, tree_ancestors, tree_attention_mask, tree_from_paths)
from generate import Drafter, generate, logits_to_probs

TREES = [("chain", dict(depth=4)), ("static", {}), ("dynamic", dict(depth=4, top_k=3, total_tokens=10))]


def plain_and_spec(model, drafter, prompt, n, cache, **kw):
    model.setup_caches(1, cache)
    plain, _ = generate(model, prompt, n, temperature=0, **kw)
    model.setup_caches(1, cache)
    spec, stats = generate(model, prompt, n, temperature=0, draft=drafter, **kw)
    return plain, spec, stats


# ---------------------------------------------------------------- trees

def test_eagle1_default_tree_shape():
    parents, ranks, depths = tree_from_paths(EAGLE1_TREE)
    assert len(parents) == 26 and max(depths) == 5
    tree = StaticTree(EAGLE1_TREE)
    assert tree.n_nodes == 25 and tree.width == 4
    with pytest.raises(ValueError, match="no parent"):
        tree_from_paths([[0], [1, 0, 0]])


def test_tree_ancestors_from_parents():
    parents, _, depths = tree_from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    anc, depth = tree_ancestors(torch.tensor([0] + parents[1:]), 3)
    assert depth.tolist() == depths
    for i in range(len(parents)):
        want, j = {i}, i
        while j:
            j = parents[j]
            want.add(j)
        assert set(anc[i].nonzero().view(-1).tolist()) == want


def test_tree_attention_mask_eager_and_compiled():
    """Row i sees slot j < L, and slot L + w when tree_part[i, w]; nothing else. Compiled too: Inductor once
    aliased every row of a mask written into an expanded tensor."""
    torch.manual_seed(0)
    S = 40
    compiled = torch.compile(lambda L, part: tree_attention_mask(L, S, part), fullgraph=True, dynamic=False)
    for L, T, W in ((0, 3, 3), (7, 5, 5), (30, 4, 10), (37, 2, 3)):
        part = torch.rand(T, W) < 0.5
        want = torch.zeros(T, S, dtype=torch.bool)
        want[:, :L] = True
        want[:, L:L + W] = part
        L_t = torch.tensor([L])
        assert torch.equal(tree_attention_mask(L_t, S, part), want)
        assert torch.equal(compiled(L_t, part), want)


# ---------------------------------------------------------------- greedy exactness

@pytest.mark.parametrize("kind, kw", TREES)
def test_tiny_greedy_exact_with_random_head(kind, kw):
    model = make_tiny_model()
    drafter = Drafter(random_head(model), kind, **kw)
    for prompt in ([1, 2, 3, 4, 5], [7], list(range(30, 60))):
        prompt = torch.tensor(prompt, dtype=torch.int)
        plain, spec, stats = plain_and_spec(model, drafter, prompt, 80, 160)
        assert spec == plain and len(spec) == 80
        assert stats["target_forwards"] <= len(spec) - 1


@pytest.mark.parametrize("kind, kw", TREES)
def test_tiny_greedy_exact_at_stop_ids_and_cache_end(kind, kw):
    model = make_tiny_model(seed=3)
    drafter = Drafter(random_head(model, seed=1), kind, **kw)
    prompt = torch.tensor([9, 8, 7], dtype=torch.int)
    plain, spec, _ = plain_and_spec(model, drafter, prompt, 200, 64)  # the cache ends before the budget
    assert spec == plain and len(plain) == 64 - 3
    stop = {plain[20]}
    plain, spec, _ = plain_and_spec(model, drafter, prompt, 200, 64, stop_ids=stop)
    assert spec == plain and plain[-1] in stop


class OracleDrafter(Drafter):
    """Proposes exactly the target's greedy continuation as a chain: every token must be accepted."""

    def __init__(self, head, future, depth):
        super().__init__(head, "chain", depth=depth)
        self.future = future  # full greedy sequence, prompt included

    def draft(self, h_root, L):
        pos = int(L)
        toks = torch.tensor([self.future[min(pos + 1 + i, len(self.future) - 1)] for i in range(self.depth)])
        return toks, torch.arange(self.depth)


def test_oracle_draft_is_fully_accepted():
    model = make_tiny_model()
    prompt = [3, 1, 4, 1, 5]
    model.setup_caches(1, 128)
    plain, _ = generate(model, torch.tensor(prompt, dtype=torch.int), 60, temperature=0)
    depth = 4
    drafter = OracleDrafter(random_head(model), prompt + plain, depth)
    model.setup_caches(1, 128)
    spec, stats = generate(model, torch.tensor(prompt, dtype=torch.int), 1 + 11 * (depth + 1), temperature=0,
                           draft=drafter)
    assert spec == plain[:len(spec)]
    assert stats["mean_accepted"] == depth + 1 and stats["verify_forwards"] == 11
    assert stats["accepted_at_depth"] == [11] * depth


def bf16_packed_tiny_model(seed=0):
    """A tiny model in bf16 with its weights packed for kernels.py: the path the default model runs on CPU."""
    import kernels
    from model import pack_weights
    if not kernels.load():
        pytest.skip("the C++ kernels are not available here")
    model = pack_weights(make_tiny_model(seed=seed).to(torch.bfloat16))
    assert model.output.weight.dim() == 4
    return model


@pytest.mark.parametrize("kind, kw", TREES)
def test_bf16_greedy_exact_on_the_small_m_kernels(kind, kw):
    """In bf16, verification rows equal one-token decode rows bit for bit only because kernels.py computes every
    row the same way whatever the number of tokens; oneDNN's matmuls did not (greedy paths parted)."""
    model = bf16_packed_tiny_model(seed=4)
    drafter = Drafter(random_head(model, seed=3), kind, **kw)
    for prompt in ([1, 2, 3, 4, 5], list(range(30, 60))):
        plain, spec, _ = plain_and_spec(model, drafter, torch.tensor(prompt, dtype=torch.int), 80, 160)
        assert spec == plain and len(spec) == 80


def test_bf16_oracle_draft_is_fully_accepted_on_the_small_m_kernels():
    """Every drafted token is the target's own: each must be accepted, so every verification row (not just the
    root's) must reproduce the decode step's logits exactly, in bf16."""
    model = bf16_packed_tiny_model()
    prompt, depth = [3, 1, 4, 1, 5], 6
    model.setup_caches(1, 128)
    plain, _ = generate(model, torch.tensor(prompt, dtype=torch.int), 60, temperature=0)
    drafter = OracleDrafter(random_head(model), prompt + plain, depth)
    model.setup_caches(1, 128)
    spec, stats = generate(model, torch.tensor(prompt, dtype=torch.int), 1 + 8 * (depth + 1), temperature=0,
                           draft=drafter)
    assert spec == plain[:len(spec)] and stats["mean_accepted"] == depth + 1


# ---------------------------------------------------------------- sampling is lossless

def exact_pair_distribution(model, prompt, **sampling):
    """P(x2, x3) under plain sampling, summed over x1, computed from the model's own probabilities."""
    V = model.config.vocab_size
    model.setup_caches(V * V, 16)
    T = len(prompt)
    with torch.no_grad():
        p1 = logits_to_probs(model(torch.tensor([prompt]), torch.arange(T))[0, -1], **sampling)  # (V,)
        x1 = torch.arange(V)
        seq2 = torch.cat([torch.tensor(prompt).expand(V, T), x1[:, None]], 1)
        p2 = logits_to_probs(model(seq2, torch.arange(T + 1))[:, -1], **sampling)  # (V, V): x1 -> x2
        x12 = torch.cartesian_prod(x1, x1)
        seq3 = torch.cat([torch.tensor(prompt).expand(V * V, T), x12], 1)
        p3 = logits_to_probs(model(seq3, torch.arange(T + 2))[:, -1], **sampling).view(V, V, V)
    return (p1[:, None, None] * p2[:, :, None] * p3).sum(0)  # (V, V)


def chi_square_p_value(counts, probs, min_expected=5.0):
    """Pearson's test with sparse cells pooled; returns the p-value (Wilson-Hilferty approximation)."""
    n = counts.sum()
    expected = probs * n
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum().item()
    df = int(keep.sum()) - 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def sample_pairs(model, drafter, prompt, n, seed, **sampling):
    V = model.config.vocab_size
    counts = torch.zeros(V, V)
    torch.manual_seed(seed)
    p = torch.tensor(prompt, dtype=torch.int)
    for _ in range(n):
        model.setup_caches(1, 32)
        toks, _ = generate(model, p, 3, draft=drafter, **sampling)
        counts[toks[1], toks[2]] += 1
    return counts


SAMPLING = dict(temperature=0.9, top_k=6, top_p=0.95)


def small_vocab_setup():
    model = make_tiny_model(seed=5, vocab_size=8)
    with torch.no_grad():  # flatter logits so many tokens are in play
        model.output.weight.mul_(0.25)
    head = random_head(model, seed=2)
    return model, Drafter(head, "dynamic", depth=2, top_k=3, total_tokens=5)


@pytest.mark.slow
def test_speculative_sampling_matches_plain_distribution():
    model, drafter = small_vocab_setup()
    prompt = [1, 2, 3]
    exact = exact_pair_distribution(model, prompt, **SAMPLING)
    counts = sample_pairs(model, drafter, prompt, 2500, seed=0, **SAMPLING)
    assert chi_square_p_value(counts.flatten(), exact.flatten()) > 1e-3
    # the drafts were really used: a fair share of cycles accepted a drafted token
    model.setup_caches(1, 32)
    torch.manual_seed(1)
    accepted = sum(generate(model, torch.tensor(prompt, dtype=torch.int), 3, draft=drafter,
                            **SAMPLING)[1]["accepted_at_depth"][0] for _ in range(200))
    assert accepted > 40


@pytest.mark.slow
def test_broken_acceptance_rule_is_detected(monkeypatch):
    """Accepting a drafted child whenever the target gives it at least 10% (a tempting shortcut) skews
    the distribution; the same chi-square test must catch it, or the test above proves nothing."""
    model, drafter = small_vocab_setup()

    def broken(logits, tree_tokens, parents, **sampling):
        picks = gen.sample(logits, **sampling).view(-1).clone()
        probs = logits_to_probs(logits, sampling["temperature"], sampling["top_k"], sampling["top_p"])
        for child in range(1, tree_tokens.numel()):
            parent = int(parents[child])
            if probs[parent, tree_tokens[child]] >= 0.1:
                picks[parent] = tree_tokens[child]
        return picks

    monkeypatch.setattr(gen, "choose_tokens", broken)
    prompt = [1, 2, 3]
    exact = exact_pair_distribution(model, prompt, **SAMPLING)
    counts = sample_pairs(model, drafter, prompt, 2500, seed=0, **SAMPLING)
    assert chi_square_p_value(counts.flatten(), exact.flatten()) < 1e-3


# ---------------------------------------------------------------- the real model

@pytest.mark.slow
def test_real_model_greedy_exact_with_random_head(real_model, real_tokenizer, hf_reference):
    from tokenizer import apply_chat_template
    head = random_head(real_model)
    system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    prompts = [hf_reference["greedy"]["results"][0]["prompt_ids"],  # ends at <|im_end|> after 8 tokens
               real_tokenizer.encode(apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                                         "chatml", system)),
               hf_reference["text"]["ids"][:40]]
    for kind, kw in TREES:
        drafter = Drafter(head, kind, **kw)
        for i, ids in enumerate(prompts):
            prompt = torch.tensor(ids, dtype=torch.int)
            cache = len(ids) + 30 if i == 2 else len(ids) + 64  # the last one runs into the end of the cache
            plain, spec, _ = plain_and_spec(real_model, drafter, prompt, 40, cache, stop_ids={2})
            assert spec == plain, (kind, i)
    assert plain_and_spec(real_model, Drafter(head, "chain", depth=3), torch.tensor(prompts[0], dtype=torch.int),
                          40, 128, stop_ids={2})[1][-1] == 2


@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.mtbench  # not in the default run (5 min on a Zen 3): python -m pytest -m mtbench
def test_real_model_bf16_compiled_eagle_equals_plain_on_mt_bench(default_checkpoint, real_tokenizer):
    """Issue 10's bar: in bf16, compiled as generate.py --compile runs it, with the shipped head, greedy EAGLE gives
    plain decoding's tokens on 20 MT-bench first turns x 128 tokens (before the small-M kernels they parted at a
    median of token 23, on 17 of 20)."""
    import kernels
    from benchmark import load_prompts
    from generate import DEFAULT_HEAD, load_model
    if not kernels.load():
        pytest.skip("bf16 exactness needs the C++ kernels")
    model = load_model(default_checkpoint, "cpu", torch.bfloat16)
    drafter = Drafter(load_head(DEFAULT_HEAD, model, "cpu", torch.bfloat16), "dynamic")
    prompts = load_prompts(gen.ROOT / "data" / "mt_bench.jsonl", real_tokenizer, model.checkpoint_config, 20)
    config = torch._inductor.config
    original = (gen.decode_one_token, gen.eagle_cycle), (config.cpp_wrapper, config.cpp_wrapper_build_separate)
    shims = config.aot_inductor.custom_ops_to_c_shims
    cache = max(len(ids) for _, ids in prompts) + 128 + drafter.headroom  # one size: one graph per step kind
    try:
        gen.compile_steps(cpp_wrapper=gen.default_cpp_wrapper("cpu"))  # the launcher generate.py picks
        parted = []
        for pid, ids in prompts:
            plain, spec, _ = plain_and_spec(model, drafter, torch.tensor(ids, dtype=torch.int), 128, cache)
            if spec != plain:
                parted.append((pid, next(i for i, (a, b) in enumerate(zip(plain, spec)) if a != b)))
    finally:
        (gen.decode_one_token, gen.eagle_cycle), (config.cpp_wrapper, config.cpp_wrapper_build_separate) = original
        config.aot_inductor.custom_ops_to_c_shims = shims
    assert len(prompts) == 20 and not parted, parted


# ---------------------------------------------------------------- checkpoints

def to_official_layout(head: EagleHead, out_dir, use_bin: bool):
    """Writes `head` the way the EAGLE authors publish heads: HF LLaMA config, HF key names, rotate-half Q/K."""
    from safetensors.torch import save_file
    c = head.config
    sd = head.state_dict()
    q_size, kv_size = c.n_head * c.head_dim, c.n_local_heads * c.head_dim
    q, k, v = sd["layer.attention.wqkv.weight"].split([q_size, kv_size, kv_size])

    def to_rotate_half(w, n):  # inverse of the interleaved permutation
        return w.view(n, c.head_dim // 2, 2, -1).transpose(1, 2).reshape(w.shape)

    weights = {"fc.weight": sd["fc.weight"], "fc.bias": sd["fc.bias"],
               "layers.0.self_attn.q_proj.weight": to_rotate_half(q, c.n_head),
               "layers.0.self_attn.k_proj.weight": to_rotate_half(k, c.n_local_heads),
               "layers.0.self_attn.v_proj.weight": v,
               "layers.0.self_attn.o_proj.weight": sd["layer.attention.wo.weight"],
               "layers.0.mlp.gate_proj.weight": sd["layer.feed_forward.w1.weight"],
               "layers.0.mlp.up_proj.weight": sd["layer.feed_forward.w3.weight"],
               "layers.0.mlp.down_proj.weight": sd["layer.feed_forward.w2.weight"],
               "layers.0.post_attention_layernorm.weight": sd["layer.ffn_norm.weight"],
               "embed_tokens.weight": torch.zeros(c.vocab_size, c.dim)}
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": c.dim, "intermediate_size": c.intermediate_size,
              "num_attention_heads": c.n_head, "num_key_value_heads": c.n_local_heads, "num_hidden_layers": 1,
              "vocab_size": c.vocab_size, "rope_theta": c.rope_base, "rms_norm_eps": c.norm_eps,
              "max_position_embeddings": c.block_size, "bias": True}
    (out_dir / "config.json").write_text(json.dumps(config))
    if use_bin:
        torch.save(weights, out_dir / "pytorch_model.bin")
    else:
        save_file({k: t.contiguous() for k, t in weights.items()}, str(out_dir / "model.safetensors"))
    return weights


@pytest.mark.parametrize("use_bin", [False, True])
def test_official_layout_loads_and_drafts_like_project_layout(tmp_path, use_bin):
    model = make_tiny_model()
    head = random_head(model, seed=4)
    save_head(head, tmp_path / "ours", target_info(model))
    to_official_layout(head, tmp_path / "official", use_bin)
    ours = load_head(tmp_path / "ours", model)
    official = load_head(tmp_path / "official", model)
    for k, v in ours.state_dict().items():
        assert torch.equal(v, official.state_dict()[k]), k
    prompt = torch.tensor([4, 5, 6, 7], dtype=torch.int)
    drafts = []
    for h in (head, ours, official):
        spy = []
        drafter = Drafter(h, "dynamic", depth=3, top_k=2, total_tokens=5)
        original = drafter.draft
        drafter.draft = lambda h_root, L, f=original: spy.append(f(h_root, L)) or spy[-1]
        model.setup_caches(1, 64)
        generate(model, prompt, 20, temperature=0, draft=drafter)
        drafts.append([t.tolist() for t, _ in spy])
    assert drafts[0] == drafts[1] == drafts[2]


def test_official_layout_missing_keys_and_mismatched_target(tmp_path):
    model = make_tiny_model()
    head = random_head(model)
    weights = to_official_layout(head, tmp_path / "official", use_bin=False)
    from safetensors.torch import save_file
    del weights["layers.0.mlp.up_proj.weight"]
    save_file({k: t.contiguous() for k, t in weights.items()}, str(tmp_path / "official" / "model.safetensors"))
    with pytest.raises(ValueError, match="missing keys: layers.0.mlp.up_proj.weight"):
        load_head(tmp_path / "official", model)
    save_head(head, tmp_path / "ours", target_info(model))
    other = make_tiny_model(dim=32, n_head=4, n_local_heads=2)
    with pytest.raises(ValueError, match="dim=64"):
        load_head(tmp_path / "ours", other)
    with pytest.raises(ValueError, match="does not match the target"):
        EagleHead(head_config_from_target(model.config)).attach(make_tiny_model(vocab_size=50))
    with pytest.raises(FileNotFoundError):
        load_head(tmp_path / "nowhere", model)
    (tmp_path / "ours" / "head.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="corrupt"):
        load_head(tmp_path / "ours", model)
    # an official head cloned without git-lfs: its pytorch_model.bin is a pointer, no pickle
    to_official_layout(head, tmp_path / "lfs", use_bin=True)
    (tmp_path / "lfs" / "pytorch_model.bin").write_text("version https://git-lfs.github.com/spec/v1\n")
    with pytest.raises(ValueError, match="corrupt draft head weights"):
        load_head(tmp_path / "lfs", model)
    save_head(head, tmp_path / "ours", target_info(model))
    official = tmp_path / "official2"
    to_official_layout(head, official, use_bin=False)
    assert load_head(official / "model.safetensors", model).fc.weight.shape == head.fc.weight.shape  # its weights file
    with pytest.raises(ValueError, match="is not the int8 head asked for"):  # not silently the float head
        load_head(tmp_path / "ours" / "head.safetensors", model, quantization="int8")
    config = json.loads((tmp_path / "ours" / "head_config.json").read_text())
    (tmp_path / "ours" / "head_config.json").write_text(json.dumps({**config, "kind": "eagle3"}))
    with pytest.raises(ValueError, match="config lacks target_dim, feature_layers"):
        load_head(tmp_path / "ours", model)
    (tmp_path / "ours" / "head_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object"):
        load_head(tmp_path / "ours", model)


# ---------------------------------------------------------------- compiled steps

@pytest.mark.compile
def test_compiled_eagle_cycle_matches_eager(monkeypatch):
    """compile_steps(): draft and verification in one compiled graph a cycle, guards checked once per generation."""
    model = make_tiny_model()
    drafter = Drafter(random_head(model), "dynamic", depth=3, top_k=2, total_tokens=6)
    prompt = torch.tensor([2, 7, 1, 8], dtype=torch.int)
    model.setup_caches(1, 96)
    eager, eager_stats = generate(model, prompt, 40, temperature=0, draft=drafter)
    monkeypatch.setattr(gen, "decode_one_token", gen.decode_one_token)  # restored after the test
    monkeypatch.setattr(gen, "eagle_cycle", gen.eagle_cycle)
    gen.compile_steps()
    for cache in (96, 160):  # a second cache size: a new graph, not the stale one run without its guards
        model.setup_caches(1, cache)
        compiled, stats = generate(model, prompt, 40, temperature=0, draft=drafter)
        assert compiled == eager and stats == eager_stats


def test_reduced_draft_vocabulary_stays_exact_and_round_trips(tmp_path):
    model = make_tiny_model()
    head = random_head(model, seed=6)
    vocab = torch.tensor([1, 5, 9, 20, 33, 40, 41, 42, 60, 70])
    head.set_draft_vocab(vocab)
    for kind, kw in TREES:
        spy = []
        drafter = Drafter(head, kind, **kw)
        original = drafter.draft
        drafter.draft = lambda h_root, L, f=original: spy.append(f(h_root, L)) or spy[-1]
        plain, spec, _ = plain_and_spec(model, drafter, torch.tensor([1, 2, 3, 4], dtype=torch.int), 40, 128)
        assert spec == plain
        drafted = torch.cat([t for t, _ in spy])
        assert torch.isin(drafted, vocab).all()  # drafts come only from the draft vocabulary
    save_head(head, tmp_path / "h", target_info(model))
    loaded = load_head(tmp_path / "h", model)
    assert torch.equal(loaded.draft_vocab, vocab)
    assert json.loads((tmp_path / "h" / "head_config.json").read_text())["draft_vocab_size"] == 10
    from safetensors.torch import load_file, save_file
    weights = load_file(str(tmp_path / "h" / "head.safetensors"))
    weights["draft_vocab"] = torch.tensor([1, 2, 500])
    save_file(weights, str(tmp_path / "h" / "head.safetensors"))
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        load_head(tmp_path / "h", model)


def test_head_loads_in_the_requested_dtype(tmp_path):
    model = make_tiny_model().to(torch.bfloat16)
    head = random_head(model)
    head.set_draft_vocab(torch.arange(10))
    save_head(head, tmp_path / "h", target_info(model))
    loaded = load_head(tmp_path / "h", model, dtype=torch.bfloat16)
    assert loaded.fc.weight.dtype == torch.bfloat16 and loaded.draft_vocab.dtype == torch.long
    drafter = Drafter(loaded, "dynamic", depth=3, top_k=2, total_tokens=5)
    model.setup_caches(1, 64)
    generate(model, torch.tensor([1, 2, 3], dtype=torch.int), 10, temperature=0, draft=drafter)  # runs in bf16


def test_total_tokens_auto_picks_the_fastest_size(monkeypatch):
    model = make_tiny_model()
    head = random_head(model)
    clock, real_generate, seen = [0.0], gen.generate, []

    def timed_generate(model, prompt, n, draft=None, **kw):  # a machine where 12 nodes cost least per token
        tokens, stats = real_generate(model, prompt, n, draft=draft, **kw)
        seen.append(draft.n_nodes)
        clock[0] += len(tokens) * (1 + abs(draft.n_nodes - 12))
        return tokens, stats

    monkeypatch.setattr(gen, "generate", timed_generate)
    monkeypatch.setattr(gen.time, "perf_counter", lambda: clock[0])
    best, table = gen.auto_total_tokens(model, head, [3, 1, 4, 1, 5], depth=4, top_k=3, new_tokens=10)
    assert best == 12
    assert list(table) == [3, 4, 8, 12, 16, 24, 30]  # 31 exceeds the 3 + 3 * 9 = 30 nodes of depth 4, top-k 3: 30
    assert seen == [3, 4, 8, 12, 16, 24, 30] * 2  # interleaved rounds
    assert all(tau >= 1 for _, tau in table.values())
    # a tree smaller than every size tries its own (was: max() of nothing); a prompt filling the context is one error
    assert list(gen.auto_total_tokens(model, head, [3, 1, 4], depth=1, top_k=2, new_tokens=4)[1]) == [2]
    with pytest.raises(ValueError, match="leaves no room for a draft tree"):
        gen.auto_total_tokens(model, head, [1] * (model.config.block_size - 3), depth=4, top_k=3, new_tokens=4)


def test_top_k_rows_is_torch_topk_eager_and_compiled():
    torch.manual_seed(0)
    compiled = torch.compile(top_k_rows, fullgraph=True, dynamic=False)
    for shape, k in (((8192,), 2), ((2, 8192), 2), ((3, 1000), 3), ((4, 7), 1)):
        x = torch.log_softmax(torch.randn(shape) * 3, -1)
        want = x.topk(k)
        for fn in (top_k_rows, compiled):
            values, indices = fn(x, k)
            assert torch.equal(values, want.values) and torch.equal(indices, want.indices)
    values, indices = top_k_rows(torch.tensor([1.0, 3.0, 3.0, 2.0]), 3)  # ties by index
    assert values.tolist() == [3.0, 3.0, 2.0] and indices.tolist() == [1, 2, 3]


def test_top_k_rows_compiled_for_avx2_is_torch_topk(tmp_path):
    """The same, compiled as an AVX2-only CPU compiles it (ATEN_CPU_CAPABILITY=avx2 on a CPU with more; its own
    Inductor cache, which does not tell the two kinds of code apart): Inductor's AVX2 code for an int64 min over a
    row returned the row's length where it held its max, so every draft token was wrong and EAGLE on AVX2 CPUs no
    faster than plain decoding (the indices are int32 inside since)."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX512",):
        pytest.skip("this CPU compiles AVX2 code (or less) for the test above already")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        f"{__file__}::test_top_k_rows_is_torch_topk_eager_and_compiled"],
                       env=env, cwd=Path(__file__).parent.parent,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-3000:]
