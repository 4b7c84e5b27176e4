"""Checkpoint converters (HF directory, GGUF) and scripts/download.py, on tiny models written here.

Each converted model is checked against an independent forward pass written in Hugging Face's convention
(rotate-half RoPE, repeated KV heads, no cache), so a wrong permutation, a swapped norm or a misread
config value changes the logits.
"""
import json
import math
import shutil
from fnmatch import fnmatch
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from generate import load_model
from scripts import convert_gguf as cg
from scripts import convert_hf_checkpoint as ch
from scripts import download as dl
from tokenizer import HFTokenizer, get_tokenizer

CFG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
           vocab_size=300, rope_theta=1000.0, rms_norm_eps=1e-5, max_position_embeddings=128,
           tie_word_embeddings=False)
T = 12
IDS = torch.randint(0, 267, (T,), generator=torch.Generator().manual_seed(1))  # 267: the tiny GGUF vocab
SYSTEM = "You are a tiny test model"
CHATML_JINJA = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                "{{ '<|im_start|>system\n" + SYSTEM + "<|im_end|>\n' }}{% endif %}"
                "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
                "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


# ---------------------------------------------------------------- tiny HF model and its reference forward

def head_dim(cfg):
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def hf_weights(cfg, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    D, H, KV, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], head_dim(cfg)

    def lin(n_out, n_in):
        return torch.randn(n_out, n_in, generator=g) / math.sqrt(n_in)

    def norm(n):  # random, not ones: a norm applied in the wrong place changes the logits
        return 1 + 0.5 * torch.randn(n, generator=g)

    w = {"model.embed_tokens.weight": torch.randn(cfg["vocab_size"], D, generator=g), "model.norm.weight": norm(D)}
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = lin(cfg["vocab_size"], D)
    for i in range(cfg["num_hidden_layers"]):
        p, inter = f"model.layers.{i}.", cfg["intermediate_size"]
        w |= {p + "self_attn.q_proj.weight": lin(H * hd, D), p + "self_attn.k_proj.weight": lin(KV * hd, D),
              p + "self_attn.v_proj.weight": lin(KV * hd, D), p + "self_attn.o_proj.weight": lin(D, H * hd),
              p + "mlp.gate_proj.weight": lin(inter, D), p + "mlp.up_proj.weight": lin(inter, D),
              p + "mlp.down_proj.weight": lin(D, inter),
              p + "input_layernorm.weight": norm(D), p + "post_attention_layernorm.weight": norm(D)}
    return w


def write_hf_dir(path: Path, cfg, weights, fmt="single") -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg))
    if fmt == "single":
        save_file(weights, str(path / "model.safetensors"))
    elif fmt == "sharded":  # two shards and the index that maps each tensor to its shard
        names = sorted(weights)
        shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
        for f, keys in shards.items():
            save_file({k: weights[k] for k in keys}, str(path / f))
        index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        torch.save(weights, path / "pytorch_model.bin")
    return path


def inv_freq_hf(cfg):
    """HF's RoPE frequencies, with transformers' Llama-3 scaling (_compute_llama3_parameters) if configured."""
    hd = head_dim(cfg)
    inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
    s = cfg.get("rope_scaling")
    if not s:
        return inv
    old, low, high, factor = s["original_max_position_embeddings"], s["low_freq_factor"], s["high_freq_factor"], s["factor"]
    wavelen = 2 * math.pi / inv
    inv_l = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return torch.where(medium, smoothed, inv_l)


def reference_logits(w, cfg, ids, rope="rotate_half"):
    """Direct fp32 forward over the whole sequence in HF's weight layout. rope="interleaved" rotates
    pairs (x0, x1), (x2, x3), ... instead: what a converter that forgot the Q/K permutation computes."""
    D, H, KV, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], head_dim(cfg)
    n = len(ids)
    angles = torch.outer(torch.arange(n).float(), inv_freq_hf(cfg))  # (T, hd/2)

    def apply_rope(x):  # x: (heads, T, hd)
        if rope == "interleaved":
            x0, x1 = x[..., 0::2], x[..., 1::2]
            c, s = angles.cos(), angles.sin()
            return torch.stack([x0 * c - x1 * s, x1 * c + x0 * s], -1).flatten(-2)
        emb = torch.cat([angles, angles], -1)
        rotated = torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1)
        return x * emb.cos() + rotated * emb.sin()

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg["rms_norm_eps"]) * weight

    causal = torch.ones(n, n).tril().bool()
    x = w["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(n, H, hd).transpose(0, 1)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).view(n, KV, hd).transpose(0, 1)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(n, KV, hd).transpose(0, 1)
        q, k = apply_rope(q), apply_rope(k)
        k, v = k.repeat_interleave(H // KV, 0), v.repeat_interleave(H // KV, 0)  # query head j uses KV head j // (H/KV)
        scores = (q @ k.transpose(1, 2) / math.sqrt(hd)).masked_fill(~causal, float("-inf"))
        attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, H * hd)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    x = rms(x, w["model.norm.weight"])
    return x @ w.get("lm_head.weight", w["model.embed_tokens.weight"]).T


@torch.no_grad()
def converted_logits(out_dir, ids):
    model = load_model(out_dir)
    model.setup_caches(1, 64)
    return model(ids.view(1, -1), torch.arange(len(ids)))[0]


def assert_matches_reference(out_dir, w, cfg):
    torch.testing.assert_close(converted_logits(out_dir, IDS), reference_logits(w, cfg, IDS), atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- HF directory conversion

def without_theta(cfg):
    return {k: v for k, v in cfg.items() if k != "rope_theta"}


@pytest.mark.parametrize("fmt", ["single", "sharded", "bin"])
@pytest.mark.parametrize("tie", [False, True])
def test_hf_conversion_matches_reference(tmp_path, fmt, tie):
    cfg = {**CFG, "tie_word_embeddings": tie}
    w = hf_weights(cfg)
    out = ch.convert_hf_checkpoint(write_hf_dir(tmp_path / "hf", cfg, w, fmt), tmp_path / "out")
    assert_matches_reference(out, w, cfg)
    assert load_model(out).config.tie_embeddings == tie


@pytest.mark.parametrize("variant", [
    {"head_dim": 24},  # head_dim given explicitly, not hidden_size / heads
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}},  # transformers >= 5 spelling
])
def test_hf_conversion_config_variants(tmp_path, variant):
    cfg = {**CFG, **variant}
    w = hf_weights(cfg)
    written = without_theta(cfg) if "rope_parameters" in variant else cfg
    out = ch.convert_hf_checkpoint(write_hf_dir(tmp_path / "hf", written, w), tmp_path / "out")
    assert_matches_reference(out, w, cfg)


def test_hf_conversion_depends_on_qk_permutation(tmp_path, monkeypatch):
    w = hf_weights(CFG)
    ref = reference_logits(w, CFG, IDS)
    # the two RoPE layouts really differ on these weights, so the match above is no accident ...
    assert (reference_logits(w, CFG, IDS, rope="interleaved") - ref).abs().max() > 0.1
    # ... and a conversion without the permutation gives the interleaved, wrong logits
    monkeypatch.setattr(ch, "permute_rotate_half", lambda weight, n_heads, hd: weight)
    out = ch.convert_hf_checkpoint(write_hf_dir(tmp_path / "hf", CFG, w), tmp_path / "out")
    got = converted_logits(out, IDS)
    assert (got - ref).abs().max() > 0.1
    torch.testing.assert_close(got, reference_logits(w, CFG, IDS, rope="interleaved"), atol=1e-4, rtol=1e-4)


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 16}  # a short original context: scaling acts at T=12


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_llama3_rope_scaling_converts(tmp_path, key):
    cfg = {**CFG, "rope_scaling": LLAMA3_SCALING}
    w = hf_weights(cfg)
    written = {**CFG, "rope_scaling": LLAMA3_SCALING} if key == "rope_scaling" else \
        {**without_theta(CFG), "rope_parameters": {**LLAMA3_SCALING, "rope_theta": CFG["rope_theta"]}}
    out = ch.convert_hf_checkpoint(write_hf_dir(tmp_path / "hf", written, w), tmp_path / "out")
    assert load_model(out).config.rope_scaling == {k: v for k, v in LLAMA3_SCALING.items() if k != "rope_type"}
    assert_matches_reference(out, w, cfg)
    assert (reference_logits(w, cfg, IDS) - reference_logits(w, CFG, IDS)).abs().max() > 0.01  # scaling matters


@pytest.mark.parametrize("scaling", [{"type": "linear", "factor": 2.0}, {"rope_type": "yarn", "factor": 4.0},
                                     {"rope_type": "llama3", "factor": 8.0}])  # llama3 lacking its parameters
def test_unsupported_rope_scaling_errors(tmp_path, capsys, scaling):
    with pytest.raises(ValueError, match="unsupported rope scaling"):
        ch.args_from_hf_config({**CFG, "rope_scaling": scaling})
    hf = write_hf_dir(tmp_path / "hf", {**CFG, "rope_scaling": scaling}, hf_weights(CFG))
    assert_cli_error(ch.main, ["--hf_dir", str(hf), "--out", str(tmp_path / "out")], capsys, "rope scaling")
    assert not (tmp_path / "out").exists()


def assert_cli_error(main, argv, capsys, words):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error:") and words in err, err


def test_hf_error_paths(tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(FileNotFoundError, match="config.json"):
        ch.convert_hf_checkpoint(tmp_path / "missing", out)
    assert_cli_error(ch.main, ["--hf_dir", str(tmp_path / "missing"), "--out", str(out)], capsys, "config.json")

    (tmp_path / "noconfig").mkdir()
    assert_cli_error(ch.main, ["--hf_dir", str(tmp_path / "noconfig"), "--out", str(out)], capsys, "config.json")

    noweights = tmp_path / "noweights"
    noweights.mkdir()
    (noweights / "config.json").write_text(json.dumps(CFG))
    assert_cli_error(ch.main, ["--hf_dir", str(noweights), "--out", str(out)], capsys, "model.safetensors")

    w = hf_weights(CFG)
    del w["model.layers.1.mlp.up_proj.weight"]
    partial = write_hf_dir(tmp_path / "partial", CFG, w)
    assert_cli_error(ch.main, ["--hf_dir", str(partial), "--out", str(out)], capsys, "layers.1.mlp.up_proj.weight")

    # a tensor the model has no place for (here a Qwen2-style bias) must not be dropped silently
    w = hf_weights(CFG) | {"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}
    biased = write_hf_dir(tmp_path / "biased", CFG, w)
    assert_cli_error(ch.main, ["--hf_dir", str(biased), "--out", str(out)], capsys, "q_proj.bias")

    noheads = write_hf_dir(tmp_path / "noheads", {k: v for k, v in CFG.items() if k != "num_attention_heads"},
                           hf_weights(CFG))
    assert_cli_error(ch.main, ["--hf_dir", str(noheads), "--out", str(out)], capsys, "num_attention_heads")
    assert not out.exists()  # no half-written checkpoint after any failure

    # the output replaces its directory as a whole: a folder holding other things, or the source, is refused
    good = write_hf_dir(tmp_path / "good", CFG, hf_weights(CFG))
    assert_cli_error(ch.main, ["--hf_dir", str(good), "--out", str(tmp_path)], capsys, "is not a checkpoint")
    assert_cli_error(ch.main, ["--hf_dir", str(good), "--out", str(good)], capsys, "is the model being converted")
    assert (good / "config.json").is_file() and (tmp_path / "partial").is_dir()
    first = ch.convert_hf_checkpoint(good, out)  # a checkpoint it wrote is replaced
    assert ch.convert_hf_checkpoint(good, out) == first and (first / "model.safetensors").is_file()


def test_hf_tokenizer_files_chat_template_and_stop_ids(tmp_path):
    w = hf_weights(CFG)
    hf = write_hf_dir(tmp_path / "hf", {**CFG, "eos_token_id": 0}, w)
    bpe_tokenizer().save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML_JINJA}))
    (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 1]}))
    out = ch.convert_hf_checkpoint(hf, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    im_end = HFTokenizer(hf / "tokenizer.json").token_id("<|im_end|>")
    assert config["chat_template"] == "chatml" and config["default_system_prompt"] == SYSTEM
    assert config["stop_token_ids"] == sorted({0, 1, im_end})
    assert (out / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
    # an explicit template wins over the guess
    out2 = ch.convert_hf_checkpoint(hf, tmp_path / "out2", chat_template="llama-3")
    assert json.loads((out2 / "config.json").read_text())["chat_template"] == "llama-3"


# ---------------------------------------------------------------- GGUF

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["u s", "us e", "use r", "h i", "Ġ t", "Ġt h", "Ġth e", "3 4"]


def bpe_vocab():
    """A byte-level BPE vocabulary: 3 control tokens, the 256 byte symbols (so any text encodes), merges."""
    from tokenizers import pre_tokenizers
    tokens = SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + [m.replace(" ", "") for m in MERGES]
    return tokens, [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))


def bpe_tokenizer():
    """The same vocabulary as a Hugging Face tokenizer, for the HF-directory tests."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    tokens, _ = bpe_vocab()
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split()) for m in MERGES]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    return tok


def to_interleaved(w, n_heads, hd):
    """HF rotate-half rows -> the interleaved rows GGUF stores: per head, row 2j is HF row j, row 2j+1 is
    HF row j + hd/2 (written as an explicit index, independent of the converter's reshape)."""
    rows = [h * hd + half * (hd // 2) + j for h in range(n_heads) for j in range(hd // 2) for half in (0, 1)]
    return w[torch.tensor(rows)]


def write_gguf(path, cfg, w, arch="llama", rope_freqs=None, kv=(), pre="gpt2"):
    """The HF weights `w` as llama.cpp's converter writes them: GGUF names, Q/K rows interleaved."""
    H, KV, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], head_dim(cfg)
    tokens, types = bpe_vocab()
    wr = gguf.GGUFWriter(str(path), arch)
    wr.add_context_length(cfg["max_position_embeddings"])
    wr.add_embedding_length(cfg["hidden_size"])
    wr.add_block_count(cfg["num_hidden_layers"])
    wr.add_feed_forward_length(cfg["intermediate_size"])
    wr.add_head_count(H)
    wr.add_head_count_kv(KV)
    wr.add_rope_freq_base(cfg["rope_theta"])
    wr.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    wr.add_rope_dimension_count(hd)
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre(pre)
    wr.add_token_list(tokens)
    wr.add_token_merges(MERGES)
    wr.add_token_types(types)
    wr.add_eos_token_id(0)
    wr.add_chat_template(CHATML_JINJA)
    for key, value in kv:
        wr.add_string(key, value)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, t in w.items():
        if name.startswith("model.layers."):
            i, rest = name.split(".")[2], name.split(".", 3)[3].removesuffix(".weight")
            if rest == "self_attn.q_proj":
                t = to_interleaved(t, H, hd)
            if rest == "self_attn.k_proj":
                t = to_interleaved(t, KV, hd)
            name = f"blk.{i}.{per_layer[rest]}.weight"
        else:
            name = names[name]
        wr.add_tensor(name, t.numpy())  # F32, (out, in) rows as in PyTorch
    if rope_freqs is not None:
        wr.add_tensor("rope_freqs.weight", rope_freqs.numpy())
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


def gguf_cfg(tie):
    return {**CFG, "vocab_size": len(bpe_vocab()[0]), "tie_word_embeddings": tie}


def test_gguf_tensor_layout_round_trips(tmp_path):
    """GGUFReader reports shapes reversed (ggml's ne order); the data read back must still be (out, in)."""
    a = torch.randn(3, 5)
    wr = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    wr.add_tensor("w", a.numpy())
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    t = gguf.GGUFReader(str(tmp_path / "t.gguf")).tensors[0]
    assert list(t.shape) == [5, 3]
    assert torch.equal(cg.read_tensor(t), a)


@pytest.mark.parametrize("tie", [False, True])
def test_gguf_conversion_matches_hf_reference(tmp_path, tie):
    cfg = gguf_cfg(tie)
    w = hf_weights(cfg)
    out = cg.convert_gguf(write_gguf(tmp_path / "m.gguf", cfg, w), tmp_path / "out")
    assert_matches_reference(out, w, cfg)
    assert load_model(out).config.tie_embeddings == tie


def test_gguf_tokenizer_and_chat_config(tmp_path):
    cfg = gguf_cfg(False)
    out = cg.convert_gguf(write_gguf(tmp_path / "m.gguf", cfg, hf_weights(cfg)), tmp_path / "out")
    tokens, _ = bpe_vocab()
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = get_tokenizer(out)
    assert isinstance(tok, HFTokenizer)
    text = "<|im_start|>user\nhi<|im_end|>"
    ids = tok.encode(text)
    # control tokens whole, merges applied ("user", "hi"), "\n" as its byte symbol "Ċ"
    assert ids == [vocab["<|im_start|>"], vocab["user"], vocab["Ċ"], vocab["hi"], vocab["<|im_end|>"]]
    assert tok.decode(ids) == text
    odd = "say the Thé 🙂 <|endoftext|>"
    assert tok.decode(tok.encode(odd)) == odd and vocab["Ġthe"] in tok.encode(odd)
    config = json.loads((out / "config.json").read_text())
    assert config["chat_template"] == "chatml" and config["default_system_prompt"] == SYSTEM
    assert config["stop_token_ids"] == sorted({0, vocab["<|im_end|>"]})  # the GGUF's eos and ChatML's end of turn


def test_gguf_llama3_pretokenizer(tmp_path):
    """Llama-3 GGUFs ("llama-bpe") split digits into groups of three before BPE; GPT-2's pattern does not."""
    cfg = gguf_cfg(False)
    w = hf_weights(cfg)
    vocab = {t: i for i, t in enumerate(bpe_vocab()[0])}

    def encode(pre, text):
        out = cg.convert_gguf(write_gguf(tmp_path / f"{pre}.gguf", cfg, w, pre=pre), tmp_path / pre)
        return get_tokenizer(out).encode(text)

    assert encode("gpt2", "12345") == [vocab[c] for c in ("1", "2", "34", "5")]  # merge "3 4" applies
    assert encode("llama-bpe", "12345") == [vocab[c] for c in "12345"]  # "123" | "45": no "34" to merge


def test_gguf_q8_0_dequantizes_close(tmp_path):
    a = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
    wr = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "llama")
    wr.add_tensor("w", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    t = gguf.GGUFReader(str(tmp_path / "q.gguf")).tensors[0]
    assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0
    got = cg.read_tensor(t)
    assert got.shape == (8, 64) and got.dtype == torch.float32
    # Q8_0: blocks of 32 sharing a scale max|x|/127, so each value is off by at most about half a step
    step = np.abs(a).reshape(8, 2, 32).max(-1, keepdims=True) / 127
    err = np.abs(got.numpy() - a).reshape(8, 2, 32)
    assert (err <= 0.51 * step + 1e-6).all() and err.max() > 0  # close, and really quantized


def llama_cpp_rope_factors(cfg, factor, low=1.0, high=4.0, old=8192):
    """rope_freqs.weight as llama.cpp's convert_hf_to_gguf.py computes it for Llama-3.1/3.2."""
    hd = head_dim(cfg)
    out = []
    for freq in 1.0 / (cfg["rope_theta"] ** (np.arange(0, hd, 2) / hd)):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def test_gguf_llama3_rope_freqs_become_rope_scaling(tmp_path):
    cfg = {**gguf_cfg(False), "rope_theta": 500000.0}  # wavelengths long enough to be scaled
    w = hf_weights(cfg)
    factors = llama_cpp_rope_factors(cfg, factor=32.0)
    assert 1 < len(set(factors.tolist())) < len(factors)  # unscaled, smoothed and fully scaled frequencies
    out = cg.convert_gguf(write_gguf(tmp_path / "m.gguf", cfg, w, rope_freqs=factors), tmp_path / "out")
    assert load_model(out).config.rope_scaling == dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                       original_max_position_embeddings=8192)
    bad = factors.clone()
    bad[len(bad) // 2] *= 1.5
    with pytest.raises(ValueError, match="rope_freqs"):
        cg.convert_gguf(write_gguf(tmp_path / "bad.gguf", cfg, w, rope_freqs=bad), tmp_path / "out2")


def test_gguf_error_paths(tmp_path, capsys):
    cfg = gguf_cfg(False)
    w = hf_weights(cfg)
    out = tmp_path / "out"
    with pytest.raises(FileNotFoundError):
        cg.convert_gguf(tmp_path / "missing.gguf", out)
    assert_cli_error(cg.main, ["--gguf", str(tmp_path / "missing.gguf"), "--out", str(out)], capsys, "not found")
    qwen = write_gguf(tmp_path / "qwen.gguf", cfg, w, arch="qwen2")
    assert_cli_error(cg.main, ["--gguf", str(qwen), "--out", str(out)], capsys, "qwen2")
    linear = write_gguf(tmp_path / "linear.gguf", cfg, w, kv=[("llama.rope.scaling.type", "linear")])
    assert_cli_error(cg.main, ["--gguf", str(linear), "--out", str(out)], capsys, "linear")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    assert_cli_error(cg.main, ["--gguf", str(junk), "--out", str(out)], capsys, "error")
    assert not out.exists()


# ---------------------------------------------------------------- scripts/download.py

def fake_hub(repo_dir: Path, calls: list):
    """snapshot_download stand-in: copies the files of repo_dir that match allow_patterns, as the Hub would."""
    def snapshot_download(repo_id, local_dir, allow_patterns, token=None, **kwargs):
        calls.append(allow_patterns)
        for f in repo_dir.iterdir():
            if any(fnmatch(f.name, p) for p in allow_patterns):
                shutil.copy(f, Path(local_dir) / f.name)
        return str(local_dir)
    return snapshot_download


def test_download_converts_a_fake_hub_repo(tmp_path, monkeypatch):
    cfg = {**CFG, "eos_token_id": 0}
    w = hf_weights(cfg)
    repo = write_hf_dir(tmp_path / "repo", cfg, w)
    torch.save({"stale": torch.zeros(1)}, repo / "pytorch_model.bin")  # many repos carry both formats
    bpe_tokenizer().save(str(repo / "tokenizer.json"))
    (repo / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML_JINJA}))
    (repo / "README.md").write_text("not needed")
    calls = []
    monkeypatch.setattr(dl, "snapshot_download", fake_hub(repo, calls))
    out = dl.download("someone/tiny-llama", tmp_path / "ckpt" / "tiny")
    assert len(calls) == 1  # safetensors found: the .bin was never asked for
    assert_matches_reference(out, w, cfg)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    config = json.loads((out / "config.json").read_text())
    assert config["chat_template"] == "chatml" and config["default_system_prompt"] == SYSTEM
    assert config["source"] == "hf:someone/tiny-llama"
    assert config["stop_token_ids"] == sorted({0, bpe_vocab()[0].index("<|im_end|>")})  # config's eos, ChatML's end
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["tiny"]  # the download directory is gone


def test_download_falls_back_to_pytorch_bin(tmp_path, monkeypatch, capsys):
    w = hf_weights(CFG)
    repo = write_hf_dir(tmp_path / "repo", CFG, w, fmt="bin")
    calls = []
    monkeypatch.setattr(dl, "snapshot_download", fake_hub(repo, calls))
    dl.main(["--repo_id", "someone/old-llama", "--out", str(tmp_path / "old"), "--chat_template", "vicuna"])
    assert "wrote" in capsys.readouterr().out
    assert len(calls) == 2 and "pytorch_model.bin" in calls[1]
    assert_matches_reference(tmp_path / "old", w, CFG)
    assert json.loads((tmp_path / "old" / "config.json").read_text())["chat_template"] == "vicuna"


def hub_error(cls, message):
    # the Hub's HTTP errors want an HTTP response to construct; the message is all download.py reads
    e = cls.__new__(cls)
    Exception.__init__(e, message)
    return e


def test_download_errors(tmp_path, monkeypatch, capsys):
    from huggingface_hub import errors

    def failing(error):
        def snapshot_download(**kwargs):
            raise error
        return snapshot_download

    out = str(tmp_path / "out")
    with pytest.raises(SystemExit) as e:
        dl.main([])  # --repo_id missing: argparse's usage error
    assert e.value.code == 2 and "--repo_id" in capsys.readouterr().err
    for bad in ["not a repo", "a/b/c", "owner/-name", ""]:
        assert_cli_error(dl.main, ["--repo_id", bad, "--out", out], capsys, "bad --repo_id")
    cases = [(hub_error(errors.GatedRepoError, "401 gated\nmore"), "gated"),
             (hub_error(errors.RepositoryNotFoundError, "404\nmore"), "not found"),
             (errors.LocalEntryNotFoundError("Got: ConnectError: no network\nAn error happened"), "could not reach"),
             (ConnectionError("connection reset"), "connection reset"),
             (type("ProxyError", (Exception,), {})("bad proxy"), "ProxyError: bad proxy")]  # the HTTP library's own
    for error, words in cases:
        monkeypatch.setattr(dl, "snapshot_download", failing(error))
        assert_cli_error(dl.main, ["--repo_id", "meta-llama/Llama-3.2-1B", "--out", out], capsys, words)
    # a repository without usable weights downloads, then fails to convert: still one line
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(CFG))
    monkeypatch.setattr(dl, "snapshot_download", fake_hub(empty, []))
    assert_cli_error(dl.main, ["--repo_id", "someone/empty", "--out", out], capsys, "model.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]  # no output, no leftover download directory
