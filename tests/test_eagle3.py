"""EAGLE-3 heads (eagle_head.Eagle3Head): drafting stays lossless, and published checkpoints load (SafeAILab's
layout and the speculators / vLLM one), built here as small synthetic checkpoints."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import make_tiny_model
from eagle_head import Eagle3Head, load_head, random_head, save_head, target_info
from generate import Drafter, generate

TREES = [("chain", dict(depth=4)), ("static", {}), ("dynamic", dict(depth=4, top_k=3, total_tokens=10))]


def greedy(model, prompt, n=60, **kw):
    model.setup_caches(1, 160)
    return generate(model, torch.tensor(prompt, dtype=torch.int), n, temperature=0, **kw)


@pytest.mark.parametrize("kind, kw", TREES)
@pytest.mark.parametrize("extra_layers", [0, 1])
def test_eagle3_drafts_are_verified_losslessly(kind, kw, extra_layers):
    model = make_tiny_model()
    drafter = Drafter(random_head(model, seed=1, kind="eagle3", draft_vocab_size=48, extra_layers=extra_layers),
                      kind, **kw)
    drafted, original = [], drafter.draft
    drafter.draft = lambda h_root, L: drafted.append(original(h_root, L)) or drafted[-1]
    for prompt in ([1, 2, 3, 4, 5], list(range(30, 60))):
        plain, _ = greedy(model, prompt)
        spec, stats = greedy(model, prompt, draft=drafter)
        assert spec == plain and stats["verify_forwards"] < len(plain)
    # every drafted token is a draft-vocabulary id mapped to the target's (id + d2t[id]), never a raw draft id
    mapped = set(drafter.head.to_target(torch.arange(48)).tolist())
    tokens = {t for nodes, _ in drafted for t in nodes.tolist()}
    assert tokens and tokens <= mapped and not tokens <= set(range(48))


def test_eagle3_reads_three_target_features_and_maps_draft_ids():
    model = make_tiny_model(n_layer=9)
    head = random_head(model, kind="eagle3", draft_vocab_size=32)
    assert head.feature_layers == (2, 4, 6) and head.fc.in_features == 3 * model.config.dim
    ids = head.to_target(torch.arange(32))
    assert ids.tolist() == torch.linspace(0, 95, 32).long().tolist()  # id + d2t[id]
    with torch.no_grad():
        model.setup_caches(1, 32)
        _, feats = model(torch.tensor([[1, 2, 3]]), torch.arange(3), return_features=True,
                         feature_layers=head.feature_layers)
    assert len(feats) == 3 and all(f.shape == (1, 3, model.config.dim) for f in feats)


def to_official_eagle3(head: Eagle3Head, out_dir, layout: str, vocab_size: int):
    """Writes `head` as SafeAILab (keys midlayer.*) or speculators (keys layers.0.*, config with
    transformer_layer_config) publish EAGLE-3 heads: HF key names, rotate-half Q/K, d2t and t2d."""
    c, sd = head.config, head.state_dict()
    q_size, kv_size = c.n_head * c.head_dim, c.n_local_heads * c.head_dim
    q, k, v = sd["layer.attention.wqkv.weight"].split([q_size, kv_size, kv_size])

    def to_rotate_half(w, n):  # inverse of the interleaved permutation
        return w.view(n, c.head_dim // 2, 2, -1).transpose(1, 2).reshape(w.shape)

    p = "midlayer." if layout == "safeailab" else "layers.0."
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[head.to_target(torch.arange(len(head.d2t)))] = True
    weights = {"fc.weight": sd["fc.weight"], "norm.weight": sd["norm.weight"], "lm_head.weight": sd["lm_head.weight"],
               "d2t": sd["d2t"], "t2d": t2d,
               p + "self_attn.q_proj.weight": to_rotate_half(q, c.n_head),
               p + "self_attn.k_proj.weight": to_rotate_half(k, c.n_local_heads), p + "self_attn.v_proj.weight": v,
               p + "self_attn.o_proj.weight": sd["layer.attention.wo.weight"],
               p + "input_layernorm.weight": sd["layer.input_norm.weight"],
               p + "hidden_norm.weight": sd["layer.hidden_norm.weight"],
               p + "post_attention_layernorm.weight": sd["layer.ffn_norm.weight"],
               p + "mlp.gate_proj.weight": sd["layer.feed_forward.w1.weight"],
               p + "mlp.up_proj.weight": sd["layer.feed_forward.w3.weight"],
               p + "mlp.down_proj.weight": sd["layer.feed_forward.w2.weight"]}
    llama = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": c.dim, "intermediate_size": c.intermediate_size,
             "num_attention_heads": c.n_head, "num_key_value_heads": c.n_local_heads, "num_hidden_layers": 1,
             "vocab_size": vocab_size, "rms_norm_eps": c.norm_eps, "max_position_embeddings": c.block_size,
             "draft_vocab_size": len(head.d2t), "tie_word_embeddings": False}  # no rope_theta: 10000, as SafeAILab
    if layout == "safeailab":
        config = llama
    else:
        config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                  "draft_vocab_size": len(head.d2t), "norm_before_residual": head.layer.norm_before_residual,
                  "transformer_layer_config": {**llama, "rope_theta": c.rope_base, "model_type": "llama"},
                  "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "tiny"}}}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config))
    save_file({k: t.contiguous() for k, t in weights.items()}, str(out_dir / "model.safetensors"))


@pytest.mark.parametrize("layout", ["safeailab", "speculators"])
def test_published_eagle3_layouts_load_and_draft_like_the_original(tmp_path, layout):
    model = make_tiny_model(n_layer=9)
    head = random_head(model, seed=3, kind="eagle3", draft_vocab_size=40)
    to_official_eagle3(head, tmp_path / layout, layout, model.config.vocab_size)
    loaded = load_head(tmp_path / layout, model)
    assert isinstance(loaded, Eagle3Head) and loaded.feature_layers == head.feature_layers
    assert torch.equal(loaded.d2t, head.d2t)
    for k, v in head.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v, rtol=0, atol=0)
    for kind, kw in TREES:  # the same drafts: the same number of target forwards for the same tokens
        a = greedy(model, [5, 6, 7], draft=Drafter(head, kind, **kw))
        b = greedy(model, [5, 6, 7], draft=Drafter(loaded, kind, **kw))
        assert a == b


def test_eagle3_head_for_another_target_is_refused(tmp_path):
    model = make_tiny_model(n_layer=9)
    head = random_head(model, kind="eagle3", draft_vocab_size=40)
    to_official_eagle3(head, tmp_path / "h", "safeailab", model.config.vocab_size)
    with pytest.raises(ValueError, match="hidden size is 128: it was made for another target"):
        load_head(tmp_path / "h", make_tiny_model(n_layer=9, dim=128, intermediate_size=256))
    with pytest.raises(ValueError, match="maps a vocabulary of 96 target tokens, but the target has 200"):
        load_head(tmp_path / "h", make_tiny_model(n_layer=9, vocab_size=200))
    from safetensors.torch import load_file
    w = load_file(str(tmp_path / "h" / "model.safetensors"))
    w["d2t"] = w["d2t"].roll(1)
    save_file(w, str(tmp_path / "h" / "model.safetensors"))
    with pytest.raises(ValueError, match="d2t and t2d do not describe the same draft vocabulary"):
        load_head(tmp_path / "h", model)
    del w["midlayer.hidden_norm.weight"]
    save_file(w, str(tmp_path / "h" / "model.safetensors"))
    with pytest.raises(ValueError, match="missing keys: midlayer.hidden_norm.weight"):
        load_head(tmp_path / "h", model)


@pytest.mark.parametrize("extra_layers", [0, 2])
def test_eagle3_project_layout_round_trip(tmp_path, extra_layers):
    model = make_tiny_model(n_layer=9)
    head = random_head(model, seed=5, kind="eagle3", draft_vocab_size=40, extra_layers=extra_layers)
    save_head(head, tmp_path / "h", target_info(model))
    config = json.loads((tmp_path / "h" / "head_config.json").read_text())
    assert config["kind"] == "eagle3" and config["feature_layers"] == [2, 4, 6] and config["draft_vocab_size"] == 40
    assert config["extra_layers"] == extra_layers
    loaded = load_head(tmp_path / "h", model)
    assert loaded.state_dict().keys() == head.state_dict().keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in head.state_dict().items())
    with pytest.raises(ValueError, match="trained for a target with n_layer=9"):
        load_head(tmp_path / "h", make_tiny_model(n_layer=8))


def test_eagle3_bf16_exact_on_the_small_m_kernels():
    import kernels
    from model import pack_weights
    if not kernels.load():
        pytest.skip("the C++ kernels are not available here")
    model = pack_weights(make_tiny_model(n_layer=9).to(torch.bfloat16))
    drafter = Drafter(random_head(model, kind="eagle3", draft_vocab_size=48), "dynamic", depth=3, top_k=2,
                      total_tokens=4)
    assert drafter.head.fc.weight.dim() == 4  # the head follows its packed target
    assert greedy(model, [1, 2, 3, 4, 5], draft=drafter)[0] == greedy(model, [1, 2, 3, 4, 5])[0]


@pytest.mark.parametrize("weights", ["bf16", "packed", "int8", "int4"])
@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_eagle3_layer_adds_its_residuals_inside_wo_and_w2_bit_for_bit(weights, norm_before_residual):
    """Eagle3Layer hands its residuals to wo and w2 as the target's blocks do: the same bits as the adds outside,
    with the feature (or its normed form) as the attention's residual."""
    import quantize as Q
    from model import pack_weights, precompute_freqs_cis
    model = make_tiny_model(dim=128, intermediate_size=256)
    head = random_head(model, seed=3, kind="eagle3", draft_vocab_size=48).to(torch.bfloat16)
    if weights == "packed":
        pack_weights(head)
    elif weights != "bf16":
        Q.quantize_model(head, weights, 32)
        Q.prepare(head, torch.bfloat16)
    layer, c, T = head.layer, model.config, 5
    layer.norm_before_residual = norm_before_residual
    embeds, hidden = torch.randn(2, 1, T, c.dim, dtype=torch.bfloat16)
    freqs, mask = precompute_freqs_cis(T, c.head_dim, c.rope_base), torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        inside = layer(embeds, hidden, torch.arange(T), freqs, mask)
        normed = layer.hidden_norm(hidden)
        x = torch.cat([layer.input_norm(embeds), normed], -1)
        h = (normed if norm_before_residual else hidden) + layer.attention(x, freqs, mask, torch.arange(T))
        outside = h + layer.feed_forward(layer.ffn_norm(h))
    assert torch.equal(inside, outside)


def test_download_keeps_a_published_head_as_is(tmp_path, monkeypatch, capsys):
    """scripts/download.py --head: the files as published (no conversion), then --draft reads them."""
    import scripts.download as dl
    model = make_tiny_model(n_layer=9)
    head = random_head(model, seed=4, kind="eagle3", draft_vocab_size=40)
    to_official_eagle3(head, tmp_path / "repo", "safeailab", model.config.vocab_size)
    asked = []

    def fake_snapshot_download(repo_id, local_dir, allow_patterns, **kw):
        asked.append(allow_patterns)
        for f in (tmp_path / "repo").iterdir():
            if any(f.match(p) for p in allow_patterns):
                (Path(local_dir) / f.name).write_bytes(f.read_bytes())
    monkeypatch.setattr(dl, "snapshot_download", fake_snapshot_download)
    dl.main(["--repo_id", "someone/EAGLE3-tiny", "--head", "--out", str(tmp_path / "heads" / "tiny")])
    assert "wrote" in capsys.readouterr().out and len(asked) == 1
    assert sorted(p.name for p in (tmp_path / "heads").iterdir()) == ["tiny"]  # no leftover download directory
    loaded = load_head(tmp_path / "heads" / "tiny", model)
    assert torch.equal(loaded.d2t, head.d2t)
    with pytest.raises(SystemExit):  # an existing output is not overwritten
        dl.main(["--repo_id", "someone/EAGLE3-tiny", "--head", "--out", str(tmp_path / "heads" / "tiny")])
    assert "exists already" in capsys.readouterr().err
