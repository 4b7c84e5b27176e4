"""EAGLE draft heads and their drafting: chain, static tree, dynamic tree.

EAGLE-1/2 (Li et al., 2024, arXiv 2401.15077, 2406.16858): the head predicts the target's next feature (its final
normed hidden state, the LM head's input) from the current feature and the next token:
f_{t+1} ~ layer(fc(cat(embed(x_{t+1}), f_t))). Its output goes through the target's own LM head, and it reads the
target's own embedding; both stay frozen and are not stored twice. One LLaMA decoder layer, whose input RMSNorm is
omitted and with no final norm, as in the official code.

EAGLE-3 (Li et al., 2025, arXiv 2503.01840): Eagle3Head drafts tokens, not features, from a fusion of a low, a
middle and a high target feature (the hidden states entering target layers 2, L/2 and L-3); see its docstring.
Both kinds draft and verify through the same functions below.

Head positions are aligned with target positions: the pair (f_t, x_{t+1}) sits at head position t.
Every drafting function has fixed shapes for fixed (depth, top_k, total_tokens), so it compiles once.
"""
import json
import pickle
from dataclasses import fields
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

import kernels
from model import (Attention, FeedForward, KVCache, Linear, ModelArgs, RMSNorm, TransformerBlock, aligned,
                   args_from_hf_config, linear, pack_weights, permute_rotate_half, precompute_freqs_cis)
from quantize import HEAD_CONFIG, HEAD_FILE, prepare, swap_modules  # noqa: F401 (the project layout's names)
from quantize import Int4Linear, Int8Linear, QuantizeError, act_bits, parse_name, quantize_head_weights, quantize_int8


# EAGLE-1's default tree for 7B models: each path lists child ranks (0 = the draft's top-1) from the root.
# 25 draft nodes + the root = 26, depth 5.
EAGLE1_TREE = [[0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0],
               [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0],
               [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1]]


class EagleHead(nn.Module):
    kind = "eagle"
    feature_layers = ()  # the target feature it reads: the final normed hidden state

    def __init__(self, config: ModelArgs, bias: bool = True, draft_vocab_size: int = 0):
        super().__init__()
        self.config, self.bias = config, bias
        self.fc = Linear(2 * config.dim, config.dim, bias=bias)
        self.layer = TransformerBlock(config)
        self.layer.attention_norm = nn.Identity()  # EAGLE's single layer has no input norm
        # Reduced draft vocabulary (as in FR-Spec / EAGLE-3): drafting scores only these target token ids,
        # the most frequent ones, so a draft step stops paying the full LM head. Verification still uses the
        # target's full vocabulary, so output stays exact.
        self.register_buffer("draft_vocab", torch.zeros(draft_vocab_size, dtype=torch.long) if draft_vocab_size else None)
        self.max_seq_length = -1
        self._target = None  # (embedding, lm_head) of the target, held outside the module tree
        self._draft_weight = self._draft_scales = None

    def attach(self, target):
        """Share the target's embedding and LM head (frozen): the head never stores its own copies. A target packed
        for the CPU kernels (model.pack_weights) gets a packed head too."""
        t = target.config
        for name in ("dim", "vocab_size"):
            if getattr(t, name) != getattr(self.config, name):
                raise ValueError(f"draft head {name} {getattr(self.config, name)} does not match the target's "
                                 f"{getattr(t, name)}: this head was trained for another model")
        self._target = (target.tok_embeddings, target.output)
        if target.output.weight.dim() == 4:
            pack_weights(self)
        self._slice_draft_weight()
        return self

    def embed(self, tokens):
        return self._target[0](tokens)

    def lm_head(self, hidden):
        return self._target[1](hidden)

    def draft_logits(self, hidden):
        """Logits over the draft vocabulary: (..., len(draft_vocab)), or the full vocabulary without one.
        Map indices back to target ids with to_target()."""
        if self.draft_vocab is None:
            return self.lm_head(hidden)
        weight, scales = self._draft_weight, self._draft_scales
        if scales is None:
            return linear(hidden.to(weight.dtype), weight)
        if weight.dim() == 4:
            return kernels.linear(hidden, weight, scales=scales)
        return F.linear(hidden, weight.to(hidden.dtype)) * scales.to(hidden.dtype)

    def to_target(self, draft_ids):
        return draft_ids if self.draft_vocab is None else self.draft_vocab[draft_ids]

    def set_draft_vocab(self, token_ids):
        """Restrict drafting to these target token ids (None: the full vocabulary)."""
        self.draft_vocab = None if token_ids is None else torch.as_tensor(token_ids, dtype=torch.long,
                                                                           device=self.fc.weight.device)
        self._slice_draft_weight()

    def _slice_draft_weight(self):
        # The LM head rows of the draft vocabulary, cut once here rather than inside the compiled draft step. A
        # quantized head (quantize.py --draft) keeps them in int8 with a scale per row, as an int8 LM head holds
        # them: a draft step then reads half the bytes (the rows are 9.4 MB in bf16 for SmolLM2, read at every
        # depth). Drafts only propose, so this changes what is proposed, never what is output.
        self._draft_weight = self._draft_scales = None
        if self.draft_vocab is None or self._target is None:
            return
        lm_head = self._target[1]
        weight = lm_head.weight.detach()
        rows = kernels.packed_rows(weight, self.draft_vocab) if weight.dim() == 4 else weight[self.draft_vocab]
        scales = None if rows.is_floating_point() else lm_head.scales[self.draft_vocab].float()
        if isinstance(self.fc, (Int8Linear, Int4Linear)):
            if scales is None:
                rows, scales = quantize_int8(rows)
        elif scales is not None:  # an int8 LM head (quantize.py --quantize_head) with a float head: dequantize
            dtype = self.layer.ffn_norm.weight.dtype  # the activations'
            rows, scales = rows.to(dtype) * scales[:, None].to(dtype), None
        if weight.dim() == 4 and kernels.can_pack(rows):
            rows = kernels.pack(rows)
        self._draft_weight, self._draft_scales = rows, scales

    def setup_caches(self, max_seq_length: int):
        if self.max_seq_length == max_seq_length:
            return
        self.max_seq_length = max_seq_length
        dtype, device = self.fc.weight.dtype, self.fc.weight.device
        if not dtype.is_floating_point:
            dtype = self.layer.ffn_norm.weight.dtype
        c = self.config
        for layer in self.layers():
            layer.attention.kv_cache = KVCache(1, max_seq_length, c.n_local_heads, c.head_dim, dtype).to(device)
        freqs = precompute_freqs_cis(max(c.block_size, max_seq_length), c.head_dim, c.rope_base, c.rope_scaling)
        self.register_buffer("freqs_cis", freqs.to(device), persistent=False)

    def forward(self, tokens: Tensor, features: Tensor, input_pos: Tensor, mask: Tensor, rope_pos: Tensor = None):
        """tokens (1, T), features (1, T, dim) at cache slots input_pos (T,) -> predicted next features (1, T, dim)."""
        x = self.fc(torch.cat([self.embed(tokens).to(features.dtype), features], dim=-1))
        freqs = self.freqs_cis[input_pos if rope_pos is None else rope_pos]
        return self.layer(x, input_pos, freqs, mask[None, None])

    def layers(self):
        return [self.layer]


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: attention over [norm(embedding), norm(feature)] (2 x dim wide), the feature itself as
    the residual (its normed form with norm_before_residual, as speculators' checkpoints may ask), then the MLP."""

    def __init__(self, config: ModelArgs, norm_before_residual: bool = False):
        super().__init__()
        self.norm_before_residual = norm_before_residual
        self.input_norm = RMSNorm(config.dim, config.norm_eps)
        self.hidden_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.attention.wqkv = Linear(2 * config.dim, self.attention.wqkv.out_features, bias=False)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, embeds, hidden, input_pos, freqs_cis, mask):
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_norm(embeds), normed], dim=-1)  # (B, T, 2 * dim)
        # wo and w2 add the residuals themselves, as in the target's TransformerBlock (the same bits: kernels.py's
        # op rounds its output, then adds; elsewhere it is residual + y)
        h = self.attention(x, freqs_cis, mask, input_pos, residual=normed if self.norm_before_residual else hidden)
        return self.feed_forward(self.ffn_norm(h), residual=h)


class Eagle3Head(nn.Module):
    """An EAGLE-3 head: fc fuses three target hidden states (low, middle, high: those entering target layers
    feature_layers, 3 x target dim concatenated) into one feature g; Eagle3Layer reads [embed(x_{t+1}), g]; its own
    final norm and LM head score a draft vocabulary, whose ids map to the target's as id + d2t[id]. The layer's
    pre-norm output is what the next draft step reads as its feature (fc is only for the target's), so drafting
    (head_update, draft_dynamic, draft_static) runs it exactly as an EAGLE-1/2 head. The embedding is the target's.
    extra_layers plain decoder layers may follow the EAGLE-3 layer (a deeper head, this project's option; published
    heads have none): what they output is then the head's output."""
    kind = "eagle3"

    def __init__(self, config: ModelArgs, target_dim: int, feature_layers, draft_vocab_size: int,
                 norm_before_residual: bool = False, extra_layers: int = 0):
        super().__init__()
        self.config, self.target_dim, self.feature_layers = config, target_dim, tuple(feature_layers)
        self.fc = Linear(3 * target_dim, config.dim, bias=False)
        self.layer = Eagle3Layer(config, norm_before_residual)
        self.blocks = nn.ModuleList(TransformerBlock(config) for _ in range(extra_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = Linear(config.dim, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))  # target id - draft id
        self.max_seq_length = -1
        self._target = None

    def attach(self, target):
        """Check the head fits this target (one clear line if not) and share its embedding."""
        t = target.config
        if self.fc.in_features != 3 * t.dim:
            raise ValueError(f"this EAGLE-3 head fuses features of width {self.fc.in_features // 3}, but the target's "
                             f"hidden size is {t.dim}: it was trained for another model")
        if max(self.feature_layers) > t.n_layer or len(set(self.feature_layers)) != 3:
            raise ValueError(f"this EAGLE-3 head reads target layers {self.feature_layers}, but the target has "
                             f"{t.n_layer}: it was trained for another model")
        if int((self.d2t + torch.arange(len(self.d2t), device=self.d2t.device)).max()) >= t.vocab_size:
            raise ValueError(f"this EAGLE-3 head drafts token ids beyond the target's vocabulary of {t.vocab_size}: "
                             f"it was trained for another model")
        if self.config.dim != t.dim and not hasattr(self, "embedding"):
            raise ValueError(f"this EAGLE-3 head is {self.config.dim} wide and has no embedding of its own; "
                             f"the target's is {t.dim} wide")
        self._target = (target.tok_embeddings, target.output)
        if target.output.weight.dim() == 4:
            pack_weights(self)
        return self

    def embed(self, tokens):
        emb = getattr(self, "embedding", None)
        return emb(tokens) if emb is not None else self._target[0](tokens)

    def draft_logits(self, hidden):
        """Logits over the draft vocabulary (..., len(d2t)); to_target() maps their indices to target ids."""
        return self.lm_head(self.norm(hidden))

    def to_target(self, draft_ids):
        return draft_ids + self.d2t[draft_ids]

    setup_caches = EagleHead.setup_caches

    def forward(self, tokens: Tensor, features: Tensor, input_pos: Tensor, mask: Tensor, rope_pos: Tensor = None):
        """tokens (1, T); features (1, T, 3 x target dim) from the target, or (1, T, dim) the head's own previous
        output -> the last layer's output (1, T, dim), before the final norm."""
        g = self.fc(features) if features.shape[-1] != self.config.dim else features
        freqs, mask = self.freqs_cis[input_pos if rope_pos is None else rope_pos], mask[None, None]
        h = self.layer(self.embed(tokens).to(g.dtype), g, input_pos, freqs, mask)
        for block in self.blocks:
            h = block(h, input_pos, freqs, mask)
        return h

    def layers(self):
        return [self.layer, *self.blocks]


def default_feature_layers(n_layer: int):
    """The target layers EAGLE-3 reads (the hidden states entering them): a low, a middle and a high one, as the
    official code picks them; a model of fewer than 8 layers (tests) gives its first, middle and final states."""
    return (2, n_layer // 2, n_layer - 3) if n_layer >= 8 else (0, n_layer // 2, n_layer)


def target_features(features, head):
    """What the head reads from a target forward (return_features=True, feature_layers=head.feature_layers): the
    final normed state (EAGLE-1/2), or the three hidden states side by side (EAGLE-3)."""
    return torch.cat(features, dim=-1) if head.feature_layers else features


# ---------------------------------------------------------------- trees

def tree_from_paths(paths):
    """A static tree given as paths of child ranks -> (parents, ranks, depths) lists, root first (index 0),
    nodes sorted by depth so every parent comes before its children."""
    paths = sorted((tuple(p) for p in paths), key=lambda p: (len(p), p))
    if len(set(paths)) != len(paths) or any(len(p) == 0 or min(p) < 0 for p in paths):
        raise ValueError("tree paths must be distinct, non-empty lists of ranks >= 0")
    index = {(): 0}
    parents, ranks, depths = [-1], [0], [0]
    for i, p in enumerate(paths, 1):
        if p[:-1] not in index:
            raise ValueError(f"tree path {list(p)} has no parent {list(p[:-1])} in the tree")
        index[p] = i
        parents.append(index[p[:-1]])
        ranks.append(p[-1])
        depths.append(len(p))
    return parents, ranks, depths


def tree_ancestors(parents: Tensor, max_depth: int):
    """parents (N,) with parents[0] == 0 for the root -> ancestor-or-self mask (N, N) and depth (N,),
    with tensor ops only (no host sync), so it runs inside a compiled step."""
    N = parents.numel()
    idx = torch.arange(N, device=parents.device)
    eye = idx[:, None] == idx[None, :]
    anc = eye
    for _ in range(max_depth):  # the root is its own parent, so its row stays itself
        anc = eye | anc[parents]
    return anc, anc.sum(-1) - 1


def tree_attention_mask(L, S: int, tree_part):
    """(T, S) mask over a cache of S slots: every row sees the prefix (slots < L), and tree_part (T, W) says
    which of the slots L..L+W-1 (all < S) it also sees.
    Written into a fresh (T, S) tensor (repeat, not an expanded view: Inductor once aliased every row of that to
    one), so that a compiled graph stores the mask once: built as a formula of gathers instead, Inductor
    recomputed it for each of the 30 layers' attention calls (0.29 ms a cycle on Zen 3)."""
    T, W = tree_part.shape
    prefix = torch.arange(S, device=tree_part.device)[None, :] < L  # (1, S)
    return prefix.repeat(T, 1).index_copy(1, L + torch.arange(W, device=tree_part.device), tree_part)


def head_update(head, features, tokens, start, last):
    """Feed the head the pairs a verification just accepted and return the head output at the last one.

    features (D+1, dim) target features at positions start..start+D; tokens (D+1,) the token after each;
    only the first last+1 pairs are real (the rest is padding so the shape never changes).
    Its output predicts the feature at start+last+1, the new root's position; its LM head gives depth 1."""
    pos = start + torch.arange(tokens.numel(), device=tokens.device)
    mask = torch.arange(head.max_seq_length, device=tokens.device)[None, :] <= pos[:, None]  # causal
    out = head(tokens[None], features[None], pos, mask)[0]  # (D+1, dim)
    return out.index_select(0, last.view(1))[0]  # (dim,)


def top_k_rows(x: Tensor, k: int):
    """torch.topk(x, k) along the last dim for a small k (the draft's 2-3 children of a node over its vocabulary):
    k passes of a max and the first index that holds it, reductions that Inductor vectorises and fuses, where
    torch.topk leaves the compiled graph for ATen's sort-based kernel (tens of us an 8,192-wide row on the CPU).
    Values descending, equal values by index; a row needs k values above -inf (a NaN row gives its last index).
    The indices are int32 inside: Inductor's AVX2 code for an int64 min over a row returned V where the row held its
    max (torch 2.13, CPU capability AVX2: every draft token wrong, EAGLE no faster than plain; AVX-512 unaffected)."""
    V = x.shape[-1]
    idx = torch.arange(V, device=x.device, dtype=torch.int32)
    values, indices = [], []
    for _ in range(k):
        best = x.amax(-1, keepdim=True)
        i = torch.where(x == best, idx, V).amin(-1, keepdim=True).clamp_max(V - 1)
        values.append(best)
        indices.append(i)
        x = x.masked_fill(idx == i, float("-inf"))
    return torch.cat(values, -1), torch.cat(indices, -1).long()


def draft_dynamic(head, h_root, L, depth: int, top_k: int, total_tokens: int):
    """EAGLE-2 dynamic tree: expand the top_k nodes of each depth by cumulative draft log-probability,
    then keep the total_tokens best nodes of all depths. A chain of k is top_k=1, depth=total_tokens=k.

    h_root (dim,) head output at the root; L (1,) root position. Returns node tokens (N,) and parents (N,)
    as indices into [root] + nodes (so 0 is the root), depth-sorted, N = total_tokens."""
    K, device = top_k, h_root.device
    S = head.max_seq_length
    logp = F.log_softmax(head.draft_logits(h_root).float(), -1)
    scores, tokens = top_k_rows(logp, K)  # depth 1, (K,)
    tokens = head.to_target(tokens)
    pool_tokens, pool_scores = [tokens], [scores]
    pool_parents = [torch.zeros(K, dtype=torch.long, device=device)]
    pool_depth = [torch.ones(K, device=device)]
    frontier = torch.arange(1, K + 1, device=device)  # pool indices (0 = root) of the nodes expanded next
    frontier_h, frontier_tok, frontier_score = h_root.expand(K, -1), tokens, scores
    n_slots = (depth - 1) * K
    anc = torch.zeros(K, n_slots, dtype=torch.bool, device=device)  # expansion slots of each frontier's ancestors
    slot_ids = torch.arange(n_slots, device=device)
    for d in range(depth - 1):
        seen = anc | (slot_ids[None, :] == d * K + torch.arange(K, device=device)[:, None])  # + own slot
        mask = tree_attention_mask(L, S, seen)
        out = head(frontier_tok[None].int(), frontier_h[None], L + d * K + torch.arange(K, device=device), mask,
                   rope_pos=(L + d).expand(K))[0]  # (K, dim)
        logp = F.log_softmax(head.draft_logits(out).float(), -1)
        child_logp, child_tok = top_k_rows(logp, K)  # (K, K)
        child_tok = head.to_target(child_tok)
        cand_score = (frontier_score[:, None] + child_logp).flatten()
        base = 1 + K + d * K * K
        pool_tokens.append(child_tok.flatten())
        pool_scores.append(cand_score)
        pool_parents.append(frontier[:, None].expand(K, K).flatten())
        pool_depth.append(torch.full((K * K,), d + 2.0, device=device))
        best = cand_score.topk(K).indices
        frontier = base + best
        frontier_tok, frontier_score = child_tok.flatten()[best], cand_score[best]
        frontier_h, anc = out[best // K], seen[best // K]
    tokens, scores = torch.cat(pool_tokens), torch.cat(pool_scores)
    parents, depths = torch.cat(pool_parents), torch.cat(pool_depth)
    # a child never outscores its parent (log-probs are <= 0); the depth term breaks exact ties that way
    keep = (scores - 1e-6 * depths).topk(total_tokens).indices.sort().values  # pool order is depth order
    node_of_pool = torch.zeros(tokens.numel() + 1, dtype=torch.long, device=device)
    node_of_pool[keep + 1] = torch.arange(1, total_tokens + 1, device=device)
    return tokens[keep], node_of_pool[parents[keep]]


class StaticTree:
    """A fixed tree shape (paths of child ranks); the draft only fills in the tokens."""

    def __init__(self, paths, device="cpu"):
        parents, ranks, depths = tree_from_paths(paths)
        self.n_nodes, self.depth = len(paths), max(depths)
        self.parents = torch.tensor([0] + parents[1:], device=device)  # the root is its own parent
        self.ranks = torch.tensor(ranks, device=device)
        self.depths = depths
        self.width = max(ranks) + 1  # top-k each expansion needs
        # nodes with children, per depth; each gets its own head cache slot when expanded
        self.expanded = [[i for i in range(len(depths)) if depths[i] == d and i in parents] for d in range(self.depth)]
        slot = {i: s for s, i in enumerate(i for level in self.expanded[1:] for i in level)}
        self.n_slots = len(slot)
        anc = torch.zeros(len(depths), self.n_slots, dtype=torch.bool)
        for i in range(1, len(depths)):  # ancestor-or-self expansion slots of each node
            anc[i] = anc[parents[i]]
            if i in slot:
                anc[i, slot[i]] = True
        self.slot_mask = anc.to(device)
        self.slots = [torch.tensor([slot[i] for i in level], device=device) for level in self.expanded[1:]]
        self.levels = [torch.tensor(level, device=device) for level in self.expanded]
        self.children = [torch.tensor([i for i in range(1, len(depths)) if depths[i] == d + 1], device=device)
                         for d in range(self.depth)]


def draft_static(head, h_root, L, tree: StaticTree):
    """Fill a static tree: each expanded node's children are its draft's top-k tokens at the tree's ranks.
    Returns node tokens (N,) and parents (N,), as draft_dynamic does."""
    device, S = h_root.device, head.max_seq_length
    N1 = tree.n_nodes + 1
    tokens = torch.zeros(N1, dtype=torch.long, device=device)
    hidden = h_root.new_zeros(N1, h_root.numel())  # head output at each expanded node
    hidden[0] = h_root
    for d in range(tree.depth):
        level = tree.levels[d]
        if d > 0:  # run the head on this depth's expanded nodes, each fed its parent's output
            seen = tree.slot_mask[level]
            mask = tree_attention_mask(L, S, seen)
            out = head(tokens[level][None].int(), hidden[tree.parents[level]][None], L + tree.slots[d - 1], mask,
                       rope_pos=(L + d - 1).expand(len(level)))[0]
            hidden = hidden.index_copy(0, level, out)
        top = head.to_target(head.draft_logits(hidden[level]).topk(tree.width, dim=-1).indices)  # (len(level), width)
        kids = tree.children[d]
        row = (tree.parents[kids][:, None] == level[None, :]).int().argmax(-1)  # which expanded node is the parent
        tokens = tokens.index_copy(0, kids, top[row, tree.ranks[kids]])
    return tokens[1:], tree.parents[1:]


# ---------------------------------------------------------------- checkpoints

def head_config_from_target(target_config: ModelArgs, **overrides) -> ModelArgs:
    """A head shaped like one layer of the target (the usual choice, and what official heads use)."""
    c = {f.name: getattr(target_config, f.name) for f in fields(ModelArgs)}
    return ModelArgs(**{**c, "n_layer": 1, "tie_embeddings": False, **overrides})


def save_head(head: EagleHead, out_dir, target_info: dict, extra: dict = None):
    """Project layout: head.safetensors (no embedding or LM head) + head_config.json. Written atomically."""
    import os
    import tempfile
    from safetensors.torch import save_file
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if head.kind == "eagle3":
        config = {**head.config.to_dict(), "kind": "eagle3", "target": target_info, "target_dim": head.target_dim,
                  "feature_layers": list(head.feature_layers), "draft_vocab_size": len(head.d2t),
                  "norm_before_residual": head.layer.norm_before_residual, "extra_layers": len(head.blocks),
                  **(extra or {})}
    else:
        config = {**head.config.to_dict(), "bias": head.bias, "target": target_info,
                  "draft_vocab_size": 0 if head.draft_vocab is None else len(head.draft_vocab), **(extra or {})}
    config.pop("quantized", None)  # (carried over in extra from the head it replaces)
    remove_quantized_files(out_dir)
    # weights in the plain layout whatever the head runs with (packed for the CPU kernels, see model.pack_weights)
    state = {k: (kernels.unpack(v) if v.dim() == 4 else v).contiguous() for k, v in head.state_dict().items()}
    for name, write in ((HEAD_FILE, lambda p: save_file(state, p)),
                        (HEAD_CONFIG, lambda p: Path(p).write_text(json.dumps(config, indent=2) + "\n"))):
        fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{name}.")
        os.close(fd)
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes files private; a head is meant to be shared
        os.replace(tmp, out_dir / name)
    return out_dir


def remove_quantized_files(head_dir):
    """A head rewritten in head_dir: the quantized files quantize.py --draft wrote for the old one go (a later
    --draft_quant int8 would load them by name, and draft with the old head)."""
    for f in Path(head_dir).glob("head_*.safetensors"):
        f.unlink()


def target_info(target) -> dict:
    c = target.config
    return {"dim": c.dim, "vocab_size": c.vocab_size, "n_layer": c.n_layer, "n_head": c.n_head,
            "n_local_heads": c.n_local_heads, "name": getattr(target, "name", None)}


def load_head(path, target, device="cpu", dtype=torch.float32, quantization=None):
    """Loads a head (EagleHead or Eagle3Head) from the project layout (head_config.json) or an official layout
    (config.json + pytorch_model.bin / model.safetensors: EAGLE-1/2, SafeAILab EAGLE-3, speculators EAGLE-3),
    checks it fits the target, and attaches the target's embedding (and LM head). Raises ValueError / FileNotFoundError with a clear message. A quantized head (quantize.py
    --draft) is asked for by quantization="int8" / "int4.g32" or by its file's path, e.g. DIR/head_int8.safetensors;
    a project-layout head without that file is quantized in memory, as quantize.py would write it."""
    path = Path(path)
    weights_file = f"head_{quantization}.safetensors" if quantization else HEAD_FILE
    if path.is_file() and path.name in ("model.safetensors", "pytorch_model.bin"):  # an official head's weights
        path = path.parent
    elif path.is_file():
        if quantization and path.name != weights_file:
            raise ValueError(f"draft head file {path} is not the {quantization} head asked for ({weights_file})")
        path, weights_file = path.parent, path.name
    if not dtype.is_floating_point:  # the caller passed an int8 embedding's dtype: use the target's activations'
        dtype = target.norm.weight.dtype
    if not path.is_dir():
        raise FileNotFoundError(f"draft head directory not found: {path}")
    if (path / HEAD_CONFIG).is_file():
        config = _read_json(path / HEAD_CONFIG)
        known = {f.name for f in fields(ModelArgs)}
        args = ModelArgs(**{k: v for k, v in config.items() if k in known})
        want = config.get("target", {})
        for name in ("dim", "vocab_size", "n_head", "n_local_heads", "n_layer"):
            if name in want and want[name] != getattr(target.config, name):
                raise ValueError(f"draft head was trained for a target with {name}={want[name]}, "
                                 f"but this target has {name}={getattr(target.config, name)}")
        if quantization and weights_file != HEAD_FILE and not (path / weights_file).is_file():
            try:
                mode, groupsize, head8 = parse_name(quantization)
                if head8:
                    raise QuantizeError(f"{quantization!r}: a head has no .head8 variant (its LM head is one of its weights)")
                if act_bits(quantization) == 8:
                    raise QuantizeError(f"{quantization!r}: a head runs 16-bit activations (no .a8 variant)")
                weights = quantize_head_weights(_load_weights(path / HEAD_FILE), mode, groupsize)
            except QuantizeError as e:
                raise ValueError(f"draft head {path}: {e}") from None
        else:
            weights = _load_weights(path / weights_file)
        if config.get("kind") == "eagle3":
            if missing := [k for k in ("target_dim", "feature_layers", "draft_vocab_size") if k not in config]:
                raise ValueError(f"{path / HEAD_CONFIG}: an EAGLE-3 head's config lacks {', '.join(missing)}")
            head = Eagle3Head(args, config["target_dim"], config["feature_layers"], config["draft_vocab_size"],
                              config.get("norm_before_residual", False), config.get("extra_layers", 0))
        else:
            head = EagleHead(args, bias=config.get("bias", True), draft_vocab_size=len(weights.get("draft_vocab", ())))
    elif (path / "config.json").is_file() and weights_file != HEAD_FILE:
        raise ValueError(f"{path}: choosing a head file (a quantized head) needs the project layout (head_config.json)")
    elif (path / "config.json").is_file():
        head, weights = _official_head(path, target)
    else:
        raise FileNotFoundError(f"{path} has neither {HEAD_CONFIG} (project layout) nor config.json (official EAGLE)")
    quantized = any(k.endswith(".scales") for k in weights)
    if quantized:  # written by quantize.py: swap in the modules its tensors call for
        swap_modules(head, weights)
    expected = head.state_dict()
    missing, unexpected = expected.keys() - weights.keys(), weights.keys() - expected.keys()
    if missing or unexpected:
        raise ValueError(f"draft head {path}: missing {sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]}")
    for k, v in weights.items():
        if v.shape != expected[k].shape:
            raise ValueError(f"draft head {path}: {k} has shape {tuple(v.shape)}, expected {tuple(expected[k].shape)}")
    if "draft_vocab" in weights and not 0 <= int(weights["draft_vocab"].min()) <= int(weights["draft_vocab"].max()) \
            < target.config.vocab_size:
        raise ValueError(f"draft head {path}: draft_vocab holds ids outside the target's vocabulary")
    if "d2t" in weights and not 0 <= int((weights["d2t"] + torch.arange(len(weights["d2t"]))).min()):
        raise ValueError(f"draft head {path}: d2t maps draft ids below 0")
    head.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()})
    # load_state_dict copies into the module's own (fp32) tensors: cast afterwards to the requested dtype
    head = head.to(device=device, dtype=dtype).eval()  # the KV cache and activations follow the float tensors
    if quantized:  # scales and zeros as saved (fp32), as load_quantized keeps a model's: the kernels take fp32 ones
        for name, m in head.named_modules():
            for k in ("scales", "zeros"):
                if f"{name}.{k}" in weights:
                    setattr(m, k, weights[f"{name}.{k}"].float().to(device))
        prepare(head, dtype)  # on its device first: int4 packs for that device's kernel
    return head.attach(target)


def _read_json(path):
    try:
        config = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"corrupt {path}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"corrupt {path}: not a JSON object")
    return config


def _load_weights(path):
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    if not Path(path).is_file():
        raise FileNotFoundError(f"draft head weights not found: {path}")
    try:
        if str(path).endswith(".bin"):
            return torch.load(path, map_location="cpu", weights_only=True)
        return {k: aligned(v) for k, v in load_file(str(path)).items()}
    except (SafetensorError, OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as e:
        # (a Git LFS pointer, or a whole pickled model, is no state dict torch.load takes with weights_only)
        raise ValueError(f"corrupt draft head weights {path}: {e}") from None


OFFICIAL_KEYS = {"fc.weight": "fc.weight", "fc.bias": "fc.bias",
                 "layers.0.self_attn.o_proj.weight": "layer.attention.wo.weight",
                 "layers.0.mlp.gate_proj.weight": "layer.feed_forward.w1.weight",
                 "layers.0.mlp.up_proj.weight": "layer.feed_forward.w3.weight",
                 "layers.0.mlp.down_proj.weight": "layer.feed_forward.w2.weight",
                 "layers.0.post_attention_layernorm.weight": "layer.ffn_norm.weight"}


def _official_head(path: Path, target):
    """The layouts the authors and their tools publish: an HF LLaMA config with one layer (EAGLE-1/2 heads, keys
    layers.0.*; SafeAILab's EAGLE-3 heads, keys midlayer.* with d2t / t2d), or a speculators / vLLM EAGLE-3
    checkpoint (speculators_model_type "eagle3", its layer config in transformer_layer_config, keys layers.0.*).
    HF's rotate-half Q/K rows are permuted here like the target's conversion. Returns (head, weights)."""
    hf = _read_json(path / "config.json")
    files = [f for f in ("model.safetensors", "pytorch_model.bin") if (path / f).is_file()]
    if not files:
        raise FileNotFoundError(f"official EAGLE head {path} has no model.safetensors or pytorch_model.bin")
    raw = _load_weights(path / files[0])
    speculators = "speculators_model_type" in hf or "transformer_layer_config" in hf
    eagle3 = speculators or any(k.startswith("midlayer.") for k in raw) or "d2t" in raw
    try:
        args = args_from_hf_config(hf.get("transformer_layer_config", hf))
    except KeyError as e:
        raise ValueError(f"official EAGLE config {path / 'config.json'} lacks {e}") from None
    args = ModelArgs(**{**args.to_dict(), "n_layer": 1})
    if eagle3:
        return _official_eagle3(path, hf, raw, args, target, "layers.0." if speculators else "midlayer.", speculators)
    bias = hf.get("bias", "fc.bias" in raw)
    required = [k for k in OFFICIAL_KEYS if k != "fc.bias" or bias]
    required += [f"layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    missing = [k for k in required if k not in raw]
    if missing:
        raise ValueError(f"official EAGLE head {path} is missing keys: {', '.join(missing)}")
    if "embed_tokens.weight" in raw and tuple(raw["embed_tokens.weight"].shape) != (target.config.vocab_size,
                                                                                  target.config.dim):
        raise ValueError(f"official EAGLE head {path} embeds {tuple(raw['embed_tokens.weight'].shape)}, "
                         f"the target ({target.config.vocab_size}, {target.config.dim})")
    weights = {ours: raw[theirs] for theirs, ours in OFFICIAL_KEYS.items() if theirs in raw}
    weights["layer.attention.wqkv.weight"] = _fused_qkv(raw, "layers.0.", args)
    return EagleHead(args, bias=bias), weights


def _fused_qkv(raw, prefix, args):
    q = permute_rotate_half(raw[f"{prefix}self_attn.q_proj.weight"], args.n_head, args.head_dim)
    k = permute_rotate_half(raw[f"{prefix}self_attn.k_proj.weight"], args.n_local_heads, args.head_dim)
    return torch.cat([q, k, raw[f"{prefix}self_attn.v_proj.weight"]])


EAGLE3_KEYS = {"input_layernorm.weight": "layer.input_norm.weight", "hidden_norm.weight": "layer.hidden_norm.weight",
               "self_attn.o_proj.weight": "layer.attention.wo.weight",
               "post_attention_layernorm.weight": "layer.ffn_norm.weight",
               "mlp.gate_proj.weight": "layer.feed_forward.w1.weight", "mlp.up_proj.weight": "layer.feed_forward.w3.weight",
               "mlp.down_proj.weight": "layer.feed_forward.w2.weight"}


def _official_eagle3(path, hf, raw, args, target, prefix, speculators):
    """An EAGLE-3 head as SafeAILab (prefix midlayer.) or speculators / vLLM (prefix layers.0.) write it."""
    required = ["fc.weight", "norm.weight", "lm_head.weight"] + [prefix + k for k in EAGLE3_KEYS]
    required += [f"{prefix}self_attn.{p}_proj.weight" for p in "qkv"]
    missing = [k for k in required if k not in raw]
    if missing:
        raise ValueError(f"EAGLE-3 head {path} is missing keys: {', '.join(missing)}")
    t = target.config
    fc_in, draft_vocab = raw["fc.weight"].shape[1], raw["lm_head.weight"].shape[0]
    if fc_in != 3 * t.dim:
        raise ValueError(f"EAGLE-3 head {path} fuses features of width {fc_in // 3} (fc takes {fc_in}), but the target's "
                         f"hidden size is {t.dim}: it was made for another target")
    if "t2d" in raw and raw["t2d"].numel() != t.vocab_size:
        raise ValueError(f"EAGLE-3 head {path} maps a vocabulary of {raw['t2d'].numel()} target tokens, but the target "
                         f"has {t.vocab_size}: it was made for another target")
    d2t = raw["d2t"].long() if "d2t" in raw else torch.zeros(draft_vocab, dtype=torch.long)  # none: the full vocabulary
    if "t2d" in raw and not torch.equal(raw["t2d"].bool().nonzero().view(-1), d2t + torch.arange(len(d2t))):
        raise ValueError(f"EAGLE-3 head {path}: its d2t and t2d do not describe the same draft vocabulary")
    layers = hf.get("eagle_aux_hidden_state_layer_ids") or default_feature_layers(t.n_layer)
    head = Eagle3Head(args, t.dim, layers, draft_vocab, hf.get("norm_before_residual", speculators))
    weights = {ours: raw[prefix + theirs] for theirs, ours in EAGLE3_KEYS.items()}
    weights.update({"fc.weight": raw["fc.weight"], "norm.weight": raw["norm.weight"],
                    "lm_head.weight": raw["lm_head.weight"], "d2t": d2t,
                    "layer.attention.wqkv.weight": _fused_qkv(raw, prefix, args)})
    return head, weights


def random_head(target, seed=0, scale=1.0, kind="eagle", draft_vocab_size=None, extra_layers=0):
    """An untrained head (for tests and for measuring the machinery): output is still exact, acceptance low.
    kind "eagle3": an Eagle3Head (with extra_layers) over a draft vocabulary of the draft_vocab_size target ids
    spread evenly."""
    torch.manual_seed(seed)
    config = head_config_from_target(target.config)
    if kind == "eagle3":
        V = target.config.vocab_size
        n = draft_vocab_size or V
        head = Eagle3Head(config, target.config.dim, default_feature_layers(target.config.n_layer), n,
                          extra_layers=extra_layers)
        head.d2t.copy_(torch.linspace(0, V - 1, n).long() - torch.arange(n))
    else:
        head = EagleHead(config)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if not name.endswith("norm.weight"):
                p.mul_(scale)
    dtype = target.norm.weight.dtype  # the activation dtype, also when the LM head is quantized
    return head.to(device=target.output.weight.device, dtype=dtype).eval().attach(target)
