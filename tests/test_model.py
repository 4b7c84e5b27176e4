import math

import pytest
import torch
import torch.nn.functional as F

from conftest import make_tiny_model
from generate import generate
from model import ModelArgs, Transformer, apply_rope_scaling, transformer_configs


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("prompt_len", [1, 5, 17])
def test_kv_cache_matches_full_forward(batch, prompt_len):
    model = make_tiny_model()
    total = prompt_len + 12
    ids = torch.randint(0, model.config.vocab_size, (batch, total))
    model.setup_caches(batch, 64)
    with torch.no_grad():
        full = model(ids, torch.arange(total))
        model.setup_caches(batch, 32)  # a fresh cache of another size: nothing carries over
        parts = [model(ids[:, :prompt_len], torch.arange(prompt_len))]
        for t in range(prompt_len, total):
            parts.append(model(ids[:, t:t + 1], torch.tensor([t])))
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-4, rtol=1e-4)


def test_features_are_the_lm_head_input_and_layer_inputs():
    model = make_tiny_model()
    model.setup_caches(1, 32)
    ids = torch.randint(0, model.config.vocab_size, (1, 7))
    entering = {}
    hooks = [layer.register_forward_pre_hook(lambda m, a, i=i: entering.__setitem__(i, a[0]))
             for i, layer in enumerate(model.layers)]
    with torch.no_grad():
        plain = model(ids, torch.arange(7))
        logits, feature = model(ids, torch.arange(7), return_features=True)
        _, layer_states = model(ids, torch.arange(7), return_features=True, feature_layers=(0, 1, 2))
    for h in hooks:
        h.remove()
    torch.testing.assert_close(logits, plain)
    torch.testing.assert_close(model.output(feature), logits)
    assert len(layer_states) == 3
    torch.testing.assert_close(layer_states[0], entering[0])
    torch.testing.assert_close(layer_states[1], entering[1])
    torch.testing.assert_close(layer_states[2], feature)  # index n_layer is the final normed state


def test_tree_mask_and_rope_positions_match_sequential_paths():
    """Two branches written side by side in the cache, each seeing only the prefix and its own ancestors,
    give the same logits as running each branch as a plain sequence."""
    model = make_tiny_model()
    V = model.config.vocab_size
    prefix, a, b = torch.randint(0, V, (1, 6)), torch.randint(0, V, (1, 3)), torch.randint(0, V, (1, 3))
    S = 32
    model.setup_caches(1, S)
    with torch.no_grad():
        model(prefix, torch.arange(6))
        tree = torch.cat([a, b], 1)
        slots = torch.arange(6, 12)
        mask = torch.zeros(6, S, dtype=torch.bool)
        mask[:, :6] = True
        for branch in range(2):
            for i in range(3):
                mask[branch * 3 + i, 6 + branch * 3: 6 + branch * 3 + i + 1] = True
        depth = torch.tensor([0, 1, 2, 0, 1, 2])
        tree_logits = model(tree, slots, mask=mask, rope_pos=6 + depth)
        for branch, seq in enumerate((a, b)):
            model.setup_caches(1, S + 1)
            ref = model(torch.cat([prefix, seq], 1), torch.arange(9))[:, 6:]
            torch.testing.assert_close(tree_logits[:, branch * 3: branch * 3 + 3], ref, atol=1e-4, rtol=1e-4)


def test_named_configs():
    for name in transformer_configs:
        args = ModelArgs.from_name(name)
        assert args.dim % args.n_head == 0 and args.n_head % args.n_local_heads == 0
    assert ModelArgs.from_name("SmolLM2-135M-Instruct").dim == 576  # matched inside a directory name
    assert ModelArgs.from_name("llama-3.1-8b").rope_scaling["factor"] == 8.0
    assert ModelArgs.from_name("llama-2-7b").intermediate_size == 11008  # LLaMA's 2/3 * 4 * dim rule
    with pytest.raises(ValueError, match="unknown model name"):
        ModelArgs.from_name("gpt-j")


def test_llama31_rope_scaling():
    freqs = 1.0 / (500000 ** (torch.arange(0, 128, 2).float() / 128))
    scaled = apply_rope_scaling(freqs, ModelArgs.from_name("llama-3.1-8b").rope_scaling)
    wavelen = 2 * math.pi / freqs
    assert torch.equal(scaled[wavelen < 8192 / 4], freqs[wavelen < 8192 / 4])  # short wavelengths kept
    torch.testing.assert_close(scaled[wavelen > 8192], freqs[wavelen > 8192] / 8)  # long ones slowed 8x
    mid = (wavelen >= 8192 / 4) & (wavelen <= 8192)
    assert mid.any() and ((scaled[mid] < freqs[mid]) & (scaled[mid] > freqs[mid] / 8)).all()


def test_tied_head_shares_the_embedding():
    model = Transformer(ModelArgs(**{**make_tiny_model().config.to_dict(), "tie_embeddings": True}))
    assert model.output.weight is model.tok_embeddings.weight


def test_pack_weights_moves_large_tensors_onto_huge_pages_with_the_same_outputs(monkeypatch):
    """pack_weights ends by moving every tensor of 64 KB+ onto 2 MB pages (kernels.on_huge_pages; Linux): the same
    Parameter objects (a tied LM head still the embedding), the same logits as packed weights left where they were."""
    import copy
    import mmap
    import kernels
    from model import pack_weights
    model = make_tiny_model(vocab_size=2048, tie_embeddings=True).to(torch.bfloat16)  # a 256 KB embedding
    kept = copy.deepcopy(model)
    with monkeypatch.context() as m:
        m.setattr(kernels, "on_huge_pages", list)
        pack_weights(kept)
    pack_weights(model)
    assert model.output.weight is model.tok_embeddings.weight
    large = [t for t in list(model.parameters()) + list(model.buffers()) if t.nbytes >= 1 << 16]
    on_pages = [any(lo <= t.data_ptr() < hi for lo, hi in kernels._arenas) for t in large]
    assert large and all(on_pages) == hasattr(mmap, "MADV_HUGEPAGE")
    idx = torch.randint(0, 2048, (1, 9))
    with torch.no_grad():
        model.setup_caches(1, 16), kept.setup_caches(1, 16)
        assert torch.equal(model(idx, torch.arange(9)), kept(idx, torch.arange(9)))


def test_cache_longer_than_block_size_is_refused():
    model = make_tiny_model(block_size=64)
    with pytest.raises(ValueError, match="block_size"):
        model.setup_caches(1, 65)


# ---------------------------------------------------------------- the real model against transformers

def _real_logits(real_model, ids):
    real_model.setup_caches(1, 512)
    with torch.no_grad():
        return real_model(torch.tensor([ids]), torch.arange(len(ids)))[0]


def test_real_model_perplexity_and_logits_match_transformers(real_model, hf_reference):
    ref = hf_reference["text"]
    logits = _real_logits(real_model, ref["ids"])
    nll = F.cross_entropy(logits[:-1].double(), torch.tensor(ref["ids"][1:]))
    assert abs(nll.item() - ref["mean_nll"]) < 1e-4
    assert logits.argmax(-1).tolist() == ref["argmax_ids"]
    fixed_ids = hf_reference["logits_summary_spec"]["fixed_token_ids"]
    for pos, want in ref["logits_at"].items():
        row = logits[int(pos)]
        torch.testing.assert_close(row[want["top_ids"]], torch.tensor(want["top_logits"]), atol=2e-4, rtol=0)
        torch.testing.assert_close(row[fixed_ids], torch.tensor(want["fixed_logits"]), atol=2e-4, rtol=0)
        assert abs(row.double().logsumexp(0).item() - want["logsumexp"]) < 2e-4


def test_wrong_rope_layout_is_caught(default_checkpoint, hf_reference):
    """Permuting Q/K as if the GGUF were in HF's rotate-half layout still gives fluent-ish logits, but the
    perplexity check above would fail by a wide margin."""
    from generate import load_model
    ids = hf_reference["text"]["ids"]
    model = load_model(default_checkpoint, "cpu", torch.float32, pack=False)  # weights edited in place below
    for layer in model.layers:
        att = layer.attention
        w = att.wqkv.weight.data
        qk = (att.n_head + att.n_local_heads) * att.head_dim
        heads = w[:qk].view(-1, att.head_dim // 2, 2, w.shape[1])
        w[:qk] = heads.transpose(1, 2).reshape(qk, w.shape[1])  # interleaved -> rotate-half
    nll = F.cross_entropy(_real_logits(model, ids)[:-1].double(), torch.tensor(ids[1:])).item()
    assert nll > hf_reference["text"]["mean_nll"] + 0.1


def test_golden_greedy_matches_transformers(real_model, hf_reference):
    """The llama2.c-style golden test: fixed chat prompts, fp32, greedy; the exact 48-token continuation
    Hugging Face transformers produced on the same GGUF (smallest top-1/top-2 logit gap 0.015)."""
    for case in hf_reference["greedy"]["results"]:
        real_model.setup_caches(1, 128)
        tokens, _ = generate(real_model, torch.tensor(case["prompt_ids"]), 48, stop_ids=(), temperature=0)
        assert tokens == case["new_ids"], case["prompt"]


@pytest.mark.parametrize("n_kv", [1, 2, 4])
def test_small_attention_equals_sdpa_with_any_mask(n_kv):
    from model import small_attention
    torch.manual_seed(0)
    T, S = 6, 20
    q, k, v = torch.randn(2, 4, T, 16), torch.randn(2, n_kv, S, 16), torch.randn(2, n_kv, S, 16)
    mask = torch.rand(T, S) < 0.6
    mask[:, 0] = True  # every query sees at least one slot
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], enable_gqa=n_kv != 4)
    torch.testing.assert_close(small_attention(q, k, v, mask[None, None]), ref, atol=1e-5, rtol=1e-5)


def test_small_attention_with_a_mask_padded_to_more_rows():
    """On CUDA every small step's mask is padded to SMALL_T rows (the same cuBLAS kernels for a one-token step and a
    verification); the queries are padded alike inside and the real rows come back, equal to the unpadded result."""
    from model import SMALL_T, small_attention
    torch.manual_seed(0)
    T, S = 5, 20
    q, k, v = torch.randn(1, 6, T, 16), torch.randn(1, 2, S, 16), torch.randn(1, 2, S, 16)
    mask = (torch.rand(T, S) < 0.6)[None, None]
    mask[..., 0] = True
    padded = F.pad(mask, (0, 0, 0, SMALL_T - T), value=True)
    out = small_attention(q, k, v, padded)
    assert out.shape == q.shape and out.isfinite().all()
    torch.testing.assert_close(out, small_attention(q, k, v, mask), atol=1e-6, rtol=1e-6)


def test_padded_attention_rows_change_nothing_but_the_kernels(monkeypatch):
    """CUDA pads every short step's attention to SMALL_T query rows (padded_query_rows); forced on the CPU here, a
    prefill, one-token steps and a tree verification give what they give unpadded (fp32, the same small_attention)."""
    import kernels
    import model as model_module
    from eagle_head import tree_ancestors, tree_attention_mask
    monkeypatch.setattr(kernels, "MAX_M", 0)  # the matmul attention, which is what CUDA runs
    model = make_tiny_model()
    ids = torch.randint(0, model.config.vocab_size, (1, 24))
    parents = torch.tensor([0, 0, 0, 1, 2])
    anc, depth = tree_ancestors(parents, 3)
    L = torch.tensor([20])

    def run():
        model.setup_caches(1, 64)
        with torch.no_grad():
            out = [model(ids[:, :16], torch.arange(16))]
            out += [model(ids[:, t:t + 1], torch.tensor([t])) for t in range(16, 20)]
            out.append(model(ids[:, 19:24], L + torch.arange(5), mask=tree_attention_mask(L, 64, anc), rope_pos=L + depth))
        return out
    plain = run()
    calls = []
    real = model_module.small_attention
    monkeypatch.setattr(model_module, "padded_query_rows", lambda device: model_module.SMALL_T)
    monkeypatch.setattr(model_module, "small_attention", lambda q, k, v, m: calls.append(m.shape[-2]) or real(q, k, v, m))
    padded = run()
    assert set(calls) == {model_module.SMALL_T}  # every short step went through padded
    for a, b in zip(plain, padded):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("use_kernel", [True, False])
def test_short_queries_use_the_small_attention_and_agree_with_sdpa(monkeypatch, use_kernel):
    import kernels
    import model as model_module
    if use_kernel and not kernels.load():
        pytest.skip("the C++ kernels are not available here")
    model = make_tiny_model()
    model.setup_caches(1, 64)
    ids = torch.randint(0, model.config.vocab_size, (1, 20))
    calls = []
    path = (kernels, "attention") if use_kernel else (model_module, "small_attention")
    real = getattr(*path)
    monkeypatch.setattr(*path, lambda *a: calls.append(a[0].shape[2]) or real(*a))
    if not use_kernel:
        monkeypatch.setattr(kernels, "MAX_M", 0)
    with torch.no_grad():
        model(ids[:, :12], torch.arange(12))
        fast = torch.cat([model(ids[:, t:t + 1], torch.tensor([t])) for t in range(12, 20)], 1)
        assert set(calls) == {12, 1}  # the prefill and every decode step: both short
        monkeypatch.setattr(kernels, "MAX_M", 0)
        monkeypatch.setattr(model_module, "SMALL_T", 0)  # SDPA everywhere
        model(ids[:, :12], torch.arange(12))
        slow = torch.cat([model(ids[:, t:t + 1], torch.tensor([t])) for t in range(12, 20)], 1)
    torch.testing.assert_close(fast, slow, atol=1e-4, rtol=1e-4)


@pytest.mark.compile
def test_compiled_one_token_linear_is_a_multiply_sum_equal_to_f_linear():
    from model import linear
    torch.manual_seed(0)
    w, b = torch.randn(48, 32), torch.randn(48)
    f = torch.compile(linear, fullgraph=True, dynamic=False)
    for x in (torch.randn(2, 1, 32), torch.randn(32), torch.randn(1, 3, 32)):  # one token, a vector, three tokens
        torch.testing.assert_close(f(x, w, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    xb, wb = torch.randn(1, 1, 32, dtype=torch.bfloat16), w.bfloat16()
    # bf16 in, fp32 sums, one rounding at the end: within one bf16 ulp of oneDNN's result
    torch.testing.assert_close(f(xb, wb).float(), F.linear(xb, wb).float(), atol=0.02, rtol=0.01)


@pytest.mark.compile
def test_compiled_one_query_attention_is_fused_and_equals_sdpa():
    from model import small_attention
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 20, 16), torch.randn(1, 2, 20, 16)
    mask = torch.rand(1, 20) < 0.7
    mask[:, 0] = True
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], enable_gqa=True)
    fused = torch.compile(small_attention, fullgraph=True, dynamic=False)
    torch.testing.assert_close(fused(q, k, v, mask[None, None]), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad", [dict(n_head=0), dict(n_local_heads=0), dict(dim=-64), dict(n_layer="2")])
def test_model_args_refuse_sizes_that_are_not_positive_integers(bad):
    with pytest.raises(ValueError, match="must be a positive integer"):  # (a config.json's mistake, said as such)
        ModelArgs(**{**make_tiny_model().config.to_dict(), **bad})
