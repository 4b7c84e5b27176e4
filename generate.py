"""Generate text with a LLaMA-family model: prefill, then one token per step from a static KV cache.

    python generate.py                                     # default model (SmolLM2-135M-Instruct)
    python generate.py --chat --prompt "What is the capital of France?" --temperature 0
    python generate.py --checkpoint checkpoints/MyModel --compile --dtype bfloat16
"""
import argparse
import contextlib
import itertools
import json
import os
import resource
import shutil
import sys
import time
import weakref
from pathlib import Path

import torch

import kernels

from eagle_head import (EAGLE1_TREE, StaticTree, draft_dynamic, draft_static, head_update, load_head, random_head,
                        target_features,
                        tree_ancestors, tree_attention_mask, tree_from_paths)
from model import (DEFAULT_CHECKPOINT, SMALL_T, CheckpointError, ModelArgs, Transformer,  # noqa: F401
                   default_checkpoint, default_gguf, load_checkpoint, load_safetensors, load_state_dict_strict,
                   pack_weights, read_config)
from quantize import HEAD_CONFIG, act_bits, load_quantized, parse_name, quantize_checkpoint, quantized_file
from tp import finish_distributed, init_distributed, shard_model
from tokenizer import CHAT_TEMPLATES, apply_chat_template, get_tokenizer, incremental_decoder

ROOT = Path(__file__).resolve().parent
DEFAULT_HEAD = ROOT / "heads" / "smollm2-135m-eagle3"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Draft trees sized for 2-core CPUs (docs/performance.md). Once a plain decode step reads weights near memory speed,
# a tree pays off only while verifying it costs about one step: the 8-node tree where 9 tokens cost ~1.2 steps (bf16
# on AMX matmul units; any weights on a GPU), the 4-node one where they cost ~2 (CPUs: AVX2, AVX-512 without AMX,
# int4 weights, whose unpacking is compute-bound). int8 on AMX (the int8 tiles: 9 tokens ~1.27 steps) keeps the
# 4-node tree: on MT-bench the 8-node one decoded as fast (162.2 against 161.2 tokens/s, docs/performance.md).
# int4 on AMX takes 3 nodes: its tiles put two weight groups in one product up to 4 rows, so 1 + 3 tokens verify
# at ~1.25x the linears' one-token time and 1 + 4 at ~1.5x; on MT-bench 1.35-1.37x plain against 1.25-1.28x.
# int4i (int8 arithmetic, no groups in the tiles) keeps 4 nodes: MT-bench 1.44-1.46x plain; 3 nodes 1.43x, 6 1.36x.
# int8 on AVX-512-BF16 without AMX (a Zen 4: each extra row of the 512-bit integer dot products costs ~0.7 ms a
# cycle) takes 3 nodes too: MT-bench, interleaved, 3 nodes against 4 +2.5 to +4.4% tokens/s (docs/performance.md);
# and so does int4 there (the same integer dot products plus each group's scale and offset: 1.13x plain against
# 1.09x with 4 nodes, MT-bench, interleaved).
# default_tree() picks; the flags override it.
TREE = dict(depth=3, top_k=2, total_tokens=4, speculate_k=3)
WIDE_TREE = dict(depth=4, top_k=3, total_tokens=8, speculate_k=4)
SMALL_TREE = dict(TREE, total_tokens=3)
# A verification's attention runs each row as a decode step runs it up to this many rows (the root and the nodes:
# kernels.attention, or on CUDA the padded matmul path); past it, SDPA, which rounds otherwise, and greedy EAGLE
# could part from plain decoding. So a tree has at most MAX_VERIFY_ROWS - 1 nodes.
MAX_VERIFY_ROWS = min(kernels.MAX_M, SMALL_T)
# kernels.py builds where int8 weights (and an int8 head) decode fastest: integer dot products or the int8 tiles
INT8_BUILDS = ("avx2", "avx2_vnni", "avx512_bf16", "amx")
TREE_FLAGS = dict(depth="depth", top_k="draft_top_k", total_tokens="total_tokens", speculate_k="speculate_k")
# the --tree each size flag shapes: generate.py drafts one tree, so a flag of another would be silently ignored
FLAG_TREE = dict(depth="dynamic", draft_top_k="dynamic", total_tokens="dynamic", speculate_k="chain",
                 tree_paths="static")


# ---------------------------------------------------------------- sampling (no host syncs)

def argmax(x):
    """torch.argmax(x, -1, keepdim=True) as int32 (the first index of the largest value), written as a max and
    then the smallest index that holds it: two plain reductions that Inductor vectorises, where its CPU argmax
    carries (value, index) pairs: in the compiled step on Zen 3, 0.21 ms a 49152-wide row, this way 0.021 ms.
    NaN rows give the last index, like any garbage, but never one out of range."""
    V = x.shape[-1]
    first = torch.where(x == x.amax(-1, keepdim=True), torch.arange(V, device=x.device, dtype=torch.int32), V)
    return first.amin(-1, keepdim=True).clamp_max(V - 1)


def multinomial_sample_one_no_sync(probs):
    # argmax(p / Exp(1)) draws from p without torch.multinomial's device-to-host sync
    q = torch.empty_like(probs).exponential_(1)
    return argmax(probs / q)


def logits_to_probs(logits, temperature: float = 1.0, top_k=None, top_p: float = 1.0):
    """The distribution sampling draws from: temperature, then top-k, then top-p (nucleus), renormalised.
    Speculative verification uses this same function, so both sample from one distribution."""
    logits = logits.float() / max(temperature, 1e-5)
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = torch.where(logits < kth, -float("inf"), logits)
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # drop a token when the tokens ranked above it already hold top_p of the mass
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(logits, temperature: float = 0.0, top_k=None, top_p: float = 1.0):
    """logits (..., vocab) -> token ids (..., 1); temperature 0 is greedy."""
    if temperature == 0:
        return argmax(logits)
    return multinomial_sample_one_no_sync(logits_to_probs(logits, temperature, top_k, top_p))


# ---------------------------------------------------------------- plain decoding

def prefill(model, x, input_pos, **sampling):
    # x: (B, T), input_pos: (T,); only the last position's logits are needed
    logits = model(x, input_pos, last_logits_only=True)
    return sample(logits[:, -1], **sampling)


def decode_one_token(model, cur_token, input_pos, **sampling):
    # cur_token: (B, 1), input_pos: (1,) -- fixed shapes, so this compiles to one graph
    logits = model(cur_token, input_pos)
    return sample(logits[:, -1], **sampling)


def decode_n_tokens(model, cur_token, input_pos, num_new_tokens, stop_ids=(), callback=lambda t: None, **sampling):
    new_tokens = []
    for i in range(num_new_tokens):
        with guards_checked_once(i):
            next_token = decode_one_token(model, cur_token, input_pos, **sampling)
        input_pos += 1
        new_tokens.append(next_token.clone())
        token = next_token.item()  # the one sync per step: streaming and the stop check need the id
        callback(token)
        if token in stop_ids:
            break
        cur_token = next_token.clone()
    return new_tokens


_generation = {"direct": False}  # guards_checked_once's state, which DirectStep reads
_direct_steps = weakref.WeakSet()  # every DirectStep: a new generation forgets what they noted in the last one


@contextlib.contextmanager
def guards_checked_once(calls_so_far: int):
    """Dynamo checks ~4,500 guards (the model's modules, weights, caches, settings) before every compiled call:
    ~0.7 ms a call on this CPU. Within one generation none of what they check changes, so after a first guarded
    call the loop runs the same graph without them (Dynamo still tells its cached graphs apart), and on a CPU
    without Dynamo at all (DirectStep). A generation's first call (calls_so_far 0) starts a new one."""
    if calls_so_far == 0:
        for step in _direct_steps:
            step.graphs.clear()
    before = _generation["direct"]
    _generation["direct"] = calls_so_far > 0
    try:
        with torch.compiler.set_stance(skip_guard_eval_unsafe=calls_so_far > 0):
            yield
    finally:
        _generation["direct"] = before


def cache_key() -> str:
    calls = "" if kernels.c_shims() or not kernels.load() else "-dispatcher"  # ops called through the dispatcher
    return (f"{torch.backends.cpu.get_cpu_capability().lower()}-{kernels.isa()}{calls}-ops{kernels.OPS_VERSION}"
            f"-torch{torch.__version__}")


def compile_steps(device="cpu", cpp_wrapper=False):
    """torch.compile what runs every step, like gpt-fast: the plain decode step and the EAGLE cycle (draft and
    verification in one graph: one compiled call, one guard check and one host sync per cycle). Static shapes; on
    CUDA the graphs replay as CUDA graphs (mode="reduce-overhead"). Compiled code is cached on disk.
    cpp_wrapper (CPU; generate.py's default, default_cpp_wrapper): Inductor writes each graph's launcher in C++
    instead of Python, which saves the ~1-3 ms of Python a compiled call runs (on an AMX Xeon, int8.head8, one
    process, interleaved: plain 163.5 -> 187.4 tokens/s, EAGLE 254.5 -> 288.6). The launcher is built apart from the
    graph's kernels (cpp_wrapper_build_separate): the kernels at -O3 as with the Python launcher, the launcher, one
    function of thousands of lines, at -O1. Built together at -O3, a graph took 2.4x the cold compile (230.7 s against
    94.6) for no more speed; apart, 99.7 s. Global Inductor settings, read when a graph compiles (the first call):
    they stay on for the process."""
    global decode_one_token, decode_batch_step, eagle_cycle
    if cpp_wrapper and torch.device(device).type == "cpu":
        torch._inductor.config.cpp_wrapper = True
        torch._inductor.config.cpp_wrapper_build_separate = True
        # kernels.py's ops called as C functions, not through the dispatcher (1.5-3% a forward, kernels.c_shims)
        torch._inductor.config.aot_inductor.custom_ops_to_c_shims = kernels.c_shims()
        # ... left out of the compiled-graph cache's key (cache_key() says whether they are on): its ops do not
        # pickle, and every graph skipped the cache ("Cannot produce stable cache key"), re-running Inductor's
        # code generation at each start (a verification graph: 41 s to the first call, 12.8 s from the cache)
        ignored = getattr(torch._inductor.config, "_cache_config_ignore_prefix", None)  # (a private list)
        if ignored is not None and "aot_inductor.custom_ops_to_c_shims" not in ignored:
            ignored.append("aot_inductor.custom_ops_to_c_shims")
    # one cache per instruction set, under the user's cache directory or .inductor-cache/: a workspace that comes
    # back on another kind of CPU (AVX2 after AVX-512) must not reuse kernels compiled for the other one (a shared
    # directory served an AVX-512 run's graph to AVX2 code: "index out of bounds"). Inductor writes its own default,
    # /tmp/torchinductor_$USER, into the environment the first time anything asks for its cache directory, often
    # before this runs: that default counts as unset.
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    root = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if root in (None, os.path.abspath(default_cache_dir())):
        root = str(ROOT / ".inductor-cache")
    if os.path.basename(os.path.normpath(root)) != cache_key():
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, cache_key())
    # Round bf16 values where eager rounds them. Without this Inductor keeps fused intermediates in fp32 and fuses
    # differently for 1 token and for a tree, and bf16 EAGLE parts from plain decoding within a few dozen tokens.
    torch._inductor.config.emulate_precision_casts = True
    # No size and stride check of every input and every custom op's output at each call: a generation's first call
    # is guarded (guards_checked_once) and its inputs keep their shapes after it, and the ops' output shapes are
    # tested; the ~760 checks of a one-token forward cost ~0.3 ms a call here (docs/performance.md).
    torch._inductor.config.size_asserts = False
    decode_one_token = compile_step(decode_one_token, device)
    decode_batch_step = compile_step(decode_batch_step, device)
    eagle_cycle = compile_step(eagle_cycle, device)


def default_cpp_wrapper(device) -> bool:
    """--cpp_wrapper unset: the C++ launcher on a CPU (tensor-parallel runs too: 3 processes under torchrun, fp32,
    compiled with it, gave one eager process's tokens, plain and EAGLE)."""
    return torch.device(device).type == "cpu"


def compile_step(fn, device="cpu"):
    """torch.compile for a function that runs every step (static shapes, one graph). On CUDA its graphs replay as
    CUDA graphs. On a CPU a graph's own kernels (norms, rotary, SiLU x mul) go parallel only where each thread gets
    4,096 values or more (Inductor's default, 512, split even one token's 1,536 SiLU values over two threads): at a
    few tokens an OpenMP region, a fork and a join of the threads kernels.py's linears use, cost more than it saved
    (docs/performance.md, "Thirty-ninth session"); and within a generation its calls skip Dynamo (DirectStep)."""
    if torch.device(device).type == "cuda":
        return torch.compile(fn, mode="reduce-overhead", fullgraph=True, dynamic=False)
    return DirectStep(fn)


class DirectStep:
    """A compiled CPU step whose calls after a generation's first skip Dynamo. Even with its guards skipped, Dynamo's
    frame gathers the graph's ~490 inputs (weights, caches) from the modules on every call: ~0.7 ms of a 5.3 ms
    one-token forward (int4, C++ launcher, a Zen 4). A generation's first call (guards_checked_once(0)) runs
    through Dynamo, guarded, and notes the graph it ran, that graph's inputs and where the call's own tensors and
    the graph's outputs sit among them; the generation's later calls with the same kinds of arguments call that
    graph with those inputs, this call's tensors put in. The same contract as skipping the guards: within a
    generation the modules' tensors change only in place (caches written by the graph), none is replaced."""

    def __init__(self, fn):
        self.compiled = torch.compile(fn, fullgraph=True, dynamic=False, backend=self._compile)
        self.graphs = {}  # this generation's calls' kinds -> (graph, inputs, call tensors' places, output places, spec)
        self._ran = None
        _direct_steps.add(self)

    def _compile(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx
        graph = compile_fx(gm, example_inputs, config_patches={"cpp.min_chunk_size": 4096})

        def run(*inputs):
            outputs = graph(*inputs)
            self._ran = (graph, inputs, outputs)
            return outputs
        return run

    def __call__(self, *args, **kwargs):
        leaves, _ = torch.utils._pytree.tree_flatten((args, kwargs))
        key = (torch.is_grad_enabled(), len(args), tuple(kwargs)) + tuple(
            (x.shape, x.stride(), x.dtype) if isinstance(x, torch.Tensor) else
            (type(x), x) if isinstance(x, (int, float, str, type(None))) else id(x) for x in leaves)
        known = self.graphs.get(key) if _generation["direct"] else None
        if known is not None:
            graph, inputs, places, out_places, spec = known
            inputs = list(inputs)
            for i, j in places:
                inputs[i] = leaves[j]
            outputs = graph(*inputs)
            return torch.utils._pytree.tree_unflatten([outputs[k] for k in out_places], spec)
        self._ran = None
        result = self.compiled(*args, **kwargs)
        self._note(key, leaves, result)
        return result

    def _note(self, key, leaves, result):
        ran, self._ran = self._ran, None
        self.graphs.pop(key, None)
        if ran is None:
            return
        graph, inputs, outputs = ran
        tensors = [j for j, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        places = [(i, j) for i, t in enumerate(inputs) for j in tensors if t is leaves[j]]
        got, spec = torch.utils._pytree.tree_flatten(result)
        out_places = [next((k for k, o in enumerate(outputs) if o is r), None) for r in got]
        # only a result made of the graph's own outputs, each call tensor at most once among its inputs
        taken = dict(places)
        if None in out_places or len(set(taken.values())) != len(places) or len(taken) != len(places):
            return
        inputs = [None if i in taken else t for i, t in enumerate(inputs)]  # kept: the modules' tensors only
        self.graphs[key] = (graph, inputs, places, out_places, spec)


@torch.no_grad()
def generate(model, prompt, max_new_tokens, stop_ids=(), callback=lambda t: None, draft=None, **sampling):
    """prompt: 1-D int tensor. Returns (new token ids, stats). Stops at a stop id, after max_new_tokens,
    or when the KV cache is full. With a `draft` (a Drafter) decoding is speculative, same output."""
    T = prompt.numel()
    if T >= model.max_seq_length:
        raise ValueError(f"prompt of {T} tokens does not fit the KV cache of {model.max_seq_length}")
    budget = min(max_new_tokens, model.max_seq_length - T)
    if draft is not None:
        return speculative_generate(model, draft, prompt, budget, stop_ids, callback, **sampling)
    device = prompt.device
    input_pos = torch.arange(0, T, device=device)
    first = prefill(model, prompt.view(1, -1), input_pos, **sampling)
    tok = first.item()
    callback(tok)
    tokens = [tok]
    if tok not in stop_ids and budget > 1:
        rest = decode_n_tokens(model, first.view(1, 1), torch.tensor([T], device=device), budget - 1,
                               stop_ids, callback, **sampling)
        tokens += [int(t) for t in torch.cat(rest).view(-1).tolist()]
    return tokens, {"target_forwards": len(tokens) - 1}


# ---------------------------------------------------------------- batched decoding

def batch_mask(pad, positions, S: int):
    """(B, T, S): row b at cache slot p sees slots pad[b]..p, never another row's padding; a padding position sees
    only itself (so its attention stays finite)."""
    slots = torch.arange(S, device=pad.device)
    seen = (slots[None, None, :] >= pad[:, None, None]) & (slots[None, None, :] <= positions[None, :, None])
    return seen | (slots[None, None, :] == positions[None, :, None])


def decode_batch_step(model, cur_tokens, input_pos, pad, **sampling):
    # cur_tokens (B, 1) at cache slot input_pos (1,); row b is at position input_pos - pad[b] of its own sequence
    mask = batch_mask(pad, input_pos, model.max_seq_length)
    logits = model(cur_tokens, input_pos, mask=mask, rope_pos=(input_pos[None, :] - pad[:, None]).clamp(min=0))
    return sample(logits[:, -1], **sampling)


@torch.no_grad()
def generate_batch(model, prompts, max_new_tokens, stop_ids=(), **sampling):
    """B prompts of any lengths decoded together from the static cache (setup_caches(B, ...) first): left-padded to
    the longest, each row with its own RoPE positions and a mask that hides the padding, so a row decodes as it
    would alone (bit for bit on the CPU kernels). A row stops at a stop id or after max_new_tokens; the batch runs
    until all have. Returns B lists of new token ids, each as generate() would return it, except where the cache ends
    first: every row then gets S minus the longest prompt's length (the rows share the cache's columns)."""
    B, T, S = len(prompts), max(len(p) for p in prompts), model.max_seq_length
    device = model.norm.weight.device
    if B > model.max_batch_size:
        raise ValueError(f"{B} prompts but the KV cache was set up for a batch of {model.max_batch_size}")
    if T >= S:
        raise ValueError(f"a prompt of {T} tokens does not fit the KV cache of {S}")
    if min(len(p) for p in prompts) == 0:
        raise ValueError("empty prompt")
    budget = min(max_new_tokens, S - T)
    pad = torch.tensor([T - len(p) for p in prompts], device=device)
    x = torch.zeros(B, T, dtype=torch.int, device=device)
    for b, p in enumerate(prompts):
        x[b, T - len(p):] = torch.as_tensor(p, dtype=torch.int)
    positions = torch.arange(T, device=device)
    logits = model(x, positions, mask=batch_mask(pad, positions, S),
                   rope_pos=(positions[None, :] - pad[:, None]).clamp(min=0), last_logits_only=True)
    cur, input_pos = sample(logits[:, -1], **sampling), torch.tensor([T], device=device)
    out, done = [[] for _ in range(B)], [False] * B
    for i in range(budget):
        for b, t in enumerate(cur.view(-1).tolist()):  # the one host sync per step
            if not done[b]:
                out[b].append(t)
                done[b] = t in stop_ids
        if all(done) or i == budget - 1:
            break
        with guards_checked_once(i):
            cur = decode_batch_step(model, cur, input_pos, pad, **sampling).clone()
        input_pos += 1
    return out


# ---------------------------------------------------------------- speculative decoding (EAGLE)

class Drafter:
    """An EAGLE head plus the tree it drafts: "chain" (k tokens), "static" (fixed paths of ranks) or
    "dynamic" (EAGLE-2: top_k expansions per depth, best total_tokens kept)."""

    def __init__(self, head, tree="dynamic", depth=TREE["depth"], top_k=TREE["top_k"],
                 total_tokens=TREE["total_tokens"], paths=None):
        self.head, self.kind = head, tree
        if tree == "static":
            self.static = StaticTree(paths or EAGLE1_TREE, head.fc.weight.device)
            self.depth, self.n_nodes, self.n_slots = self.static.depth, self.static.n_nodes, self.static.n_slots
        else:
            if tree == "chain":
                top_k, total_tokens = 1, depth
            self.top_k, self.total_tokens = top_k, total_tokens
            self.depth, self.n_nodes, self.n_slots = depth, total_tokens, (depth - 1) * top_k
        if self.n_nodes + 1 > MAX_VERIFY_ROWS:
            raise ValueError(f"a draft tree of {self.n_nodes} nodes: at most {MAX_VERIFY_ROWS - 1}, which a "
                             "verification computes row by row as decoding does (exactly the same output)")
        # cache slots one cycle may touch past the committed prefix (verify and head expansions)
        self.headroom = max(self.n_nodes + 1, self.n_slots, self.depth + 1)

    def draft(self, h_root, L):
        if self.kind == "static":
            return draft_static(self.head, h_root, L, self.static)
        return draft_dynamic(self.head, h_root, L, self.depth, self.top_k, self.total_tokens)


def choose_tokens(logits, tree_tokens, parents, **sampling):
    """The target's own pick at every tree node, each drawn independently from exactly the distribution plain
    decoding samples from (argmax when greedy). A drafted child is accepted iff it equals its parent's pick.

    This is the recursive rejection rule with deterministic (top-k) drafts: q is one-hot on each child, so
    child x is accepted with probability min(1, p(x)/1) = p(x); on rejection p loses x and is renormalised,
    and the next sibling is tried. Summed over siblings, every token keeps exactly probability p(x), which is
    what one draw from p, compared with the children, gives. tests/test_eagle.py checks it against plain
    sampling with a chi-square test that a broken rule fails."""
    return sample(logits, **sampling).view(-1)


def draft_step(drafter, features, tokens, start, last):
    """Feed the head what the last verification accepted, then draft a tree from the new root.
    Returns the tree's tokens (N+1,), root first, its parents (N+1,) and the root's position L (1,)."""
    head = drafter.head
    h_root = head_update(head, features, tokens, start, last)
    L = start + last + 1
    node_tokens, parents = drafter.draft(h_root, L)
    root = tokens.index_select(0, last.view(1))
    return (torch.cat([root.long(), node_tokens.long()]),
            torch.cat([torch.zeros(1, dtype=torch.long, device=L.device), parents.long()]), L)


def verify_step(model, tree_tokens, parents, L, max_depth: int, feature_layers=(), **sampling):
    """One target forward over the root and every node (each sees the prefix and its ancestors), at positions
    L + depth. Keeps the longest accepted path, moves its K/V entries to contiguous slots L..L+len, and returns
    what the head is fed next: the accepted tokens then the bonus token (max_depth+1,), the target features at
    the path (max_depth+1, dim), and the number of accepted draft tokens (a 0-dim tensor)."""
    N1, S, device = tree_tokens.numel(), model.max_seq_length, tree_tokens.device
    anc, depth = tree_ancestors(parents, max_depth)  # (N1, N1), (N1,)
    slots = L + torch.arange(N1, device=device)
    mask = tree_attention_mask(L, S, anc)
    logits, features = model(tree_tokens[None].int(), slots, mask=mask, rope_pos=L + depth, return_features=True,
                             feature_layers=feature_layers)
    if feature_layers:  # EAGLE-3 reads three hidden states side by side
        features = torch.cat(features, dim=-1)
    choices = choose_tokens(logits[0], tree_tokens, parents, **sampling).long()  # (N1,)
    matches = (tree_tokens == choices[parents]) | (torch.arange(N1, device=device) == 0)  # the root always stands
    accepted = matches
    for _ in range(max_depth):
        accepted = matches & accepted[parents]
    best = (accepted * (depth + 1)).argmax().view(1)  # the deepest accepted node; accepted nodes form one path
    n_accepted = depth.index_select(0, best)[0]
    steps = torch.arange(max_depth + 1, device=device)
    path = (anc.index_select(0, best) & (depth[None, :] == steps[:, None])).int().argmax(-1)  # node at each depth
    src, dst = L + path, L + steps
    for layer in model.layers:
        cache = layer.attention.kv_cache
        cache.k_cache.index_copy_(2, dst, cache.k_cache.index_select(2, src))
        cache.v_cache.index_copy_(2, dst, cache.v_cache.index_select(2, src))
    bonus = choices.index_select(0, best)
    next_tokens = torch.cat([tree_tokens[path[1:]], bonus])
    next_tokens = torch.where(steps == n_accepted, bonus, next_tokens)
    return next_tokens, features[0, path], n_accepted


def eagle_cycle(model, drafter, features, tokens, start, n_accepted, **sampling):
    """One EAGLE cycle: feed the head what the last verification accepted, draft a tree, verify it in one target
    forward. Returns what the next cycle needs, and (n_accepted, accepted tokens + bonus) in one tensor for the
    host to read: the one sync per cycle."""
    tree_tokens, parents, L = draft_step(drafter, features, tokens, start, n_accepted)
    next_tokens, next_features, n_accepted = verify_step(model, tree_tokens, parents, L, drafter.depth,
                                                         drafter.head.feature_layers, **sampling)
    return next_tokens, next_features, n_accepted, L, torch.cat([n_accepted.view(1), next_tokens])


def speculative_generate(model, drafter, prompt, budget, stop_ids=(), callback=lambda t: None, **sampling):
    T, S, device = prompt.numel(), model.max_seq_length, prompt.device
    head, D = drafter.head, drafter.depth
    if T + drafter.headroom > S:
        raise ValueError(f"the draft tree needs {drafter.headroom} cache slots after the prompt of {T} tokens, "
                         f"but the KV cache holds {S} (raise --max_seq_length or shrink the tree)")
    head.setup_caches(S)
    logits, features = model(prompt.view(1, -1), torch.arange(T, device=device), return_features=True,
                             last_logits_only=True, feature_layers=head.feature_layers)
    features = target_features(features, head)
    root = sample(logits[:, -1], **sampling).view(1)
    if T > 1:  # the head sees the pairs (f_t, x_{t+1}) for t < T-1; the last pair starts the first cycle
        pos = torch.arange(T - 1, device=device)
        head(prompt[1:].view(1, -1), features[:, :-1], pos, pos[:, None] >= torch.arange(S, device=device)[None])
    next_tokens = torch.zeros(D + 1, dtype=torch.long, device=device)
    next_tokens[0] = root[0]
    next_features = features.new_zeros(D + 1, features.shape[-1])
    next_features[0] = features[0, -1]
    start, n_accepted = torch.tensor([T - 1], device=device), torch.tensor(0, device=device)
    tokens = [int(root.item())]
    callback(tokens[0])
    cycles, accepted_at_depth, plain_steps = 0, [0] * D, 0
    while len(tokens) < budget and tokens[-1] not in stop_ids:
        L = T + len(tokens) - 1  # the root (last emitted token) sits at position L
        if L + drafter.headroom > S:  # no room left for a tree: finish with plain steps
            with guards_checked_once(plain_steps):
                nxt = decode_one_token(model, torch.tensor([[tokens[-1]]], device=device),
                                       torch.tensor([L], device=device), **sampling)
            new = [int(nxt.item())]
            plain_steps += 1
        else:
            with guards_checked_once(cycles):
                state = eagle_cycle(model, drafter, next_features, next_tokens, start, n_accepted, **sampling)
            # fed back in next cycle: copies, since a CUDA graph's replay overwrites the previous one's outputs
            next_tokens, next_features, n_accepted, start, out = (t.clone() for t in state)
            out = out.tolist()  # the one host sync per cycle
            new = out[1:out[0] + 2]
            cycles += 1
            for d in range(out[0]):
                accepted_at_depth[d] += 1
        for t in new:
            if len(tokens) >= budget or tokens[-1] in stop_ids:
                break
            tokens.append(t)
            callback(t)
    stats = {"target_forwards": cycles + plain_steps, "verify_forwards": cycles,
             "mean_accepted": (len(tokens) - 1 - plain_steps) / cycles if cycles else 0.0,
             "accepted_at_depth": accepted_at_depth}
    return tokens, stats


AUTO_SIZES = (3, 4, 8, 12, 16, 24, 31)  # 3: SMALL_TREE's (default_tree); 31: MAX_VERIFY_ROWS - 1


def auto_total_tokens(model, head, prompt_ids, depth, top_k, sizes=AUTO_SIZES, new_tokens=32, rounds=2):
    """--total_tokens auto: the dynamic tree size that decodes fastest on this machine, like the official code's
    auto mode but measured, not modelled. A bigger tree accepts more per verification (τ) and costs more per
    forward (the verify-cost curve); which wins depends on the hardware and the head, so each size generates
    `new_tokens` greedily from the prompt (interleaved, best of `rounds`). Run it before compiling: it times
    eager steps. Returns (best size, {size: (tokens/s, τ)})."""
    pool, room = tree_pool(depth, top_k), model.config.block_size - len(prompt_ids)
    drafters = {n: Drafter(head, "dynamic", depth, top_k, n) for n in sorted({min(n, pool) for n in sizes})}
    drafters = {n: d for n, d in drafters.items() if d.headroom < room}  # (a small tree: its own size the largest)
    if not drafters:
        raise ValueError(f"--total_tokens auto: a prompt of {len(prompt_ids)} tokens leaves no room for a draft tree "
                         f"in the model's {model.config.block_size}-token context")
    prompt = torch.tensor(prompt_ids, dtype=torch.int, device=head.fc.weight.device)
    model.setup_caches(1, min(len(prompt_ids) + new_tokens + max(d.headroom for d in drafters.values()) + 1,
                              model.config.block_size))
    seconds_per_token, tau = {}, {}
    for _ in range(rounds):
        for n, drafter in drafters.items():
            t0 = time.perf_counter()
            tokens, stats = generate(model, prompt, new_tokens, draft=drafter, temperature=0)
            spt = (time.perf_counter() - t0) / len(tokens)
            seconds_per_token[n] = min(seconds_per_token.get(n, spt), spt)
            tau[n] = stats["mean_accepted"]
    table = {n: (1 / seconds_per_token[n], tau[n]) for n in drafters}
    return max(table, key=lambda n: table[n][0]), table


# ---------------------------------------------------------------- checkpoints

def load_model(checkpoint_dir, device="cpu", dtype=torch.float32, quantization=None, pack=True, tp=(0, 1)):
    """The one front door for a target model: a Transformer with the checkpoint's weights in `dtype` on `device`,
    in eval mode. quantization: None for the float weights, or the name of a quantized variant quantize.py wrote
    ("int8", "int4.g32", ...); then the file's tensors decide the module swaps, and `dtype` is that of the
    activations, scales and float weights. pack: re-lay the weights for the CPU's small-M kernels
    (model.pack_weights; inference only, no gradients). tp: (rank, world size): this process's tensor-parallel
    share (tp.py)."""
    shard = (lambda m: shard_model(m, *tp)) if tp[1] > 1 else None
    if quantization is None:
        model = load_checkpoint(checkpoint_dir, device, dtype)
        if shard is not None:
            shard(model)
    else:
        model = load_quantized(checkpoint_dir, quantization, device, dtype, pack=pack, shard=shard)
    if pack:
        pack_weights(model)
    return model.eval()


def load_model_or_die(checkpoint, device, dtype, quantization=None):
    """load_model for a script's command line (checkpoint None: the default model): a missing or bad checkpoint or
    quantized file ends the run with one error line."""
    try:
        return load_model(checkpoint or default_checkpoint(), device, dtype, quantization=quantization)
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        die(str(e))


def acceptance_rates(stats) -> str:
    """Per depth d: the share of cycles that accepted a d-th draft token, given they accepted d-1."""
    reached, rates = stats["verify_forwards"], []
    for n in stats["accepted_at_depth"]:
        rates.append(f"{n / reached:.2f}" if reached else "-")
        reached = n
    return " ".join(rates)


def model_size_bytes(model) -> int:
    """Bytes of weights read per forward (each shared tensor once)."""
    seen, total = set(), 0
    for t in itertools.chain(model.parameters(), (b for n, b in model.named_buffers() if "cache" not in n
                                                   and "freqs" not in n and "mask" not in n)):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def peak_memory_bytes(device) -> int:
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak RSS of this process


# ---------------------------------------------------------------- command line

def total_tokens_arg(text):
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', got {text!r}") from None


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="checkpoint directory (default: SmolLM2-135M-Instruct, converted on first use)")
    p.add_argument("--prompt", default="Hello, my name is", help="input prompt")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system prompt for --chat (default: the model's own, if any)")
    p.add_argument("--interactive", action="store_true", help="chat in a loop, keeping the conversation")
    p.add_argument("--max_new_tokens", type=int, default=200)
    p.add_argument("--max_seq_length", type=int, default=None,
                   help="KV cache length (default: prompt + max_new_tokens, rounded up; 2048 interactive)")
    p.add_argument("--num_samples", type=int, default=1)
    p.add_argument("--batch_size", type=int, default=1,
                   help="decode this many copies of the prompt at once (plain decoding; sampled rows differ)")
    p.add_argument("--ignore_eos", action="store_true", help="do not stop at end-of-turn ids (for timing)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 means greedy")
    p.add_argument("--top_k", type=int, default=200)
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--dtype", default="auto",
                   help="float32, bfloat16, float16, or auto: the fastest exact one here (bfloat16 on CUDA and on CPUs "
                        "the small-M kernels run; float32 without them)")
    p.add_argument("--quant", default="auto",
                   help="a quantized variant written by quantize.py: int8, int4.g32 (g64, g128, g256), int4i, with .head8 "
                        "when the LM head is int8 too, and int8.a8 / int4.g32.a8 (.head8) for x rounded to 8 bits in "
                        "groups of 32 (AVX2 and AVX-512 VNNI CPUs); none: the float weights; auto (with --dtype "
                        "auto): int8.head8 on CPUs whose kernels.py build is AVX2, AVX-512-BF16 or AMX, written beside "
                        "the checkpoint on first use, the float weights elsewhere")
    p.add_argument("--device", default="cpu")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the decode step and the EAGLE cycle (static shapes, fullgraph; CUDA graphs on CUDA). "
                        "Default: on where a C++ compiler is found; the first run compiles for ~1-2 minutes, later "
                        "runs reuse the cache in $TORCHINDUCTOR_CACHE_DIR (default: .inductor-cache here)")
    p.add_argument("--compile_prefill", action="store_true", help="also compile the prefill (dynamic shapes)")
    p.add_argument("--cpp_wrapper", action=argparse.BooleanOptionalAction, default=None,
                   help="CPU: compiled graphs launch their kernels from C++, not Python (5-15%% more tokens/s on an "
                        "AMX Xeon, ~5 s more cold compile). Default: on for a CPU; --no-cpp_wrapper "
                        "for the Python launcher")
    p.add_argument("--draft", default=None,
                   help="EAGLE head directory (project or official layout), 'random' for an untrained head, or "
                        "'none' for plain decoding (default: the shipped head for the default model, if present)")
    p.add_argument("--draft_quant", default="auto",
                   help="the head's weights: int8 or int4.g32 (quantize.py --draft's file, or quantized at load), "
                        "none: as saved; auto: int8 where kernels.py's build runs int8 weights fastest (AVX2, "
                        "AVX-512-BF16, AMX), else as saved")
    p.add_argument("--tree", default="dynamic", choices=["chain", "static", "dynamic"], help="draft tree shape")

    def sizes(key):
        small = (f", {SMALL_TREE[key]} for int4 weights on AMX CPUs and int8 and int4 ones on AVX-512-BF16 CPUs "
                 "without AMX"
                 if SMALL_TREE[key] != TREE[key] else "")
        return f"(default: {WIDE_TREE[key]} for bf16 weights on AMX CPUs and on CUDA{small}, else {TREE[key]})"
    p.add_argument("--depth", type=int, default=None, help=f"dynamic tree: draft depth {sizes('depth')}")
    p.add_argument("--draft_top_k", type=int, default=None,
                   help=f"dynamic tree: nodes expanded per depth {sizes('top_k')}")
    p.add_argument("--total_tokens", type=total_tokens_arg, default=None,
                   help="dynamic tree: draft nodes kept (root excluded), or 'auto' to time sizes "
                        f"{', '.join(map(str, AUTO_SIZES))} on the prompt at start-up and keep the fastest "
                        f"{sizes('total_tokens')}")
    p.add_argument("--speculate_k", type=int, default=None,
                   help=f"chain: draft tokens per cycle {sizes('speculate_k')}")
    p.add_argument("--tree_paths", default=None,
                   help="static tree as JSON paths of child ranks, e.g. '[[0],[1],[0,0]]' or a .json file "
                        "(default: EAGLE-1's 26-node tree)")
    p.add_argument("--metrics-json", dest="metrics_json", type=Path, default=None,
                   help="write one JSON object per sample (JSON lines) to this file")
    return p


def check_device(name: str):
    """--device as one message (or None): unknown, not a CPU or CUDA, or CUDA on a machine without it."""
    try:
        device = torch.device(name)
    except RuntimeError:
        return f"unknown --device {name!r} (try cpu or cuda)"
    if device.type == "cuda" and not torch.cuda.is_available():
        return "--device cuda given but CUDA is not available here"
    if device.type not in ("cpu", "cuda"):
        return f"unsupported --device {name!r} (cpu or cuda)"
    return None


def output_path_error(flag: str, path):
    """A file written after the work (metrics, results, plots), checked before it: one message, or None."""
    if path is not None and (Path(path).is_dir() or not Path(path).parent.is_dir()):
        return f"{flag} {path}: not a file in an existing directory"
    return None


def check_args(args):
    """Every bad input becomes one clear message (and exit code 2), before any work is done."""
    if args.dtype not in DTYPES and args.dtype != "auto":
        return f"unknown --dtype {args.dtype!r}; choose from auto, {', '.join(DTYPES)}"
    if (msg := check_device(args.device)) is not None:
        return msg
    if args.max_new_tokens < 1:
        return f"--max_new_tokens must be at least 1, got {args.max_new_tokens}"
    if args.num_samples < 1:
        return f"--num_samples must be at least 1, got {args.num_samples}"
    if args.batch_size < 1:
        return f"--batch_size must be at least 1, got {args.batch_size}"
    if args.batch_size > 1 and (args.interactive or args.draft not in (None, "none")):
        return "--batch_size decodes plainly, one prompt repeated: drop --interactive and --draft (or --draft none)"
    if not args.temperature >= 0:
        return f"--temperature must be >= 0, got {args.temperature}"
    if not 0 < args.top_p <= 1:
        return f"--top_p must be in (0, 1], got {args.top_p}"
    if args.top_k is not None and args.top_k < 1:
        return f"--top_k must be at least 1, got {args.top_k}"
    if args.max_seq_length is not None and args.max_seq_length < 2:
        return f"--max_seq_length must be at least 2, got {args.max_seq_length}"
    if (msg := output_path_error("--metrics-json", args.metrics_json)) is not None:
        return msg
    stray = [flag for flag, tree in FLAG_TREE.items() if tree != args.tree and getattr(args, flag) is not None]
    if stray:
        return f"--{stray[0]} is a --tree {FLAG_TREE[stray[0]]} flag, but this run drafts --tree {args.tree}"
    if args.tree == "static":
        try:
            parse_tree_paths(args.tree_paths)
        except ValueError as e:
            return str(e)
    if args.draft_quant not in ("auto", "none"):
        try:
            if parse_name(args.draft_quant)[2]:
                return f"--draft_quant {args.draft_quant!r}: a head has no .head8 variant (try int8)"
            if act_bits(args.draft_quant) == 8:
                return f"--draft_quant {args.draft_quant!r}: a head runs 16-bit activations (try int4.g32)"
        except ValueError as e:
            return f"--draft_quant: {e}"
    return check_tree(args)  # the flags given; again once resolve_defaults() has filled the rest


def parse_tree_paths(text):
    """--tree_paths: JSON list of paths, inline or in a file."""
    if text is None:
        return None
    try:
        is_file = Path(text).is_file()
    except OSError:  # a long inline tree is no file name
        is_file = False
    try:
        paths = json.loads(Path(text).read_text() if is_file else text)
        tree_from_paths(paths)
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise ValueError(f"--tree_paths is not a valid tree ({e}); expected e.g. [[0],[1],[0,0]]") from None
    if len(paths) + 1 > MAX_VERIFY_ROWS:
        raise ValueError(f"--tree_paths has {len(paths)} nodes: at most {MAX_VERIFY_ROWS - 1}, which a verification "
                         "computes row by row as decoding does (exactly the same output)")
    return paths


def load_drafter(args, model, checkpoint):
    """The Drafter --draft asks for, or None for plain decoding."""
    draft = args.draft
    if draft is None:  # the shipped head belongs to the default model only
        draft = str(DEFAULT_HEAD) if checkpoint == DEFAULT_CHECKPOINT and DEFAULT_HEAD.is_dir() else "none"
    if draft == "none":
        return None
    dtype = model.tok_embeddings.weight.dtype
    if draft == "random":
        head = random_head(model, seed=args.seed)
    else:
        head = load_draft_head(draft, model, model.tok_embeddings.weight.device, dtype, args.draft_quant)
    return tree_drafter(head, args.tree, args)


def fastest_draft_quant(device) -> str | None:
    """--draft_quant auto: int8 heads where kernels.py's build is AVX2 only (a bf16 head there runs fp32
    multiply-adds on converted weights; an int8 one the integer kernel, half the bytes): on a Zen 3, int8.head8
    target, `scripts/cycle_cost.py`: the draft 3.86 -> 1.83 ms, a cycle 1.60 -> 1.41 plain steps; on AMX CPUs (int8
    through the int8 tiles and vpdpwssd: the draft 2.04 -> 1.53 ms; MT-bench, int8.head8 target, EAGLE 196.2
    against 189.1 tokens/s); and on AVX-512-BF16 CPUs without AMX, where int8 takes integer dot products since the
    fifty-second session (a Zen 4, int8.head8 target, `scripts/cycle_cost.py`: the draft 1.91-2.00 -> 0.89-0.94
    ms; docs/performance.md). Elsewhere the head as saved."""
    return "int8" if torch.device(device).type == "cpu" and kernels.isa() in INT8_BUILDS else None


def load_draft_head(draft, model, device, dtype, quant="auto"):
    """load_head with --draft_quant: auto is fastest_draft_quant() for a project-layout head directory (a head
    file, or an official layout, loads as it is); none the head as saved; a name (int8, int4.g32) that variant."""
    if quant == "auto":
        project_dir = Path(draft).is_dir() and (Path(draft) / HEAD_CONFIG).is_file()
        quant = fastest_draft_quant(device) if project_dir else None
    return load_head(draft, model, device, dtype, quantization=None if quant in (None, "none") else quant)


def tree_drafter(head, tree, args):
    """The Drafter for a tree kind and the size flags (--total_tokens auto: sized by the largest candidate until
    timed_drafter() picks)."""
    if tree == "chain":
        return Drafter(head, "chain", depth=args.speculate_k)
    if tree == "static":
        return Drafter(head, "static", paths=parse_tree_paths(getattr(args, "tree_paths", None)))
    total = max(AUTO_SIZES) if args.total_tokens == "auto" else args.total_tokens
    return Drafter(head, "dynamic", depth=args.depth, top_k=args.draft_top_k, total_tokens=total)


def timed_drafter(model, drafter, args, prompt_ids):
    """With --total_tokens auto, the dynamic drafter with the size auto_total_tokens() measured fastest on this
    prompt (before anything is compiled); otherwise the drafter as it is."""
    if drafter is None or drafter.kind != "dynamic" or args.total_tokens != "auto":
        return drafter
    t0 = time.perf_counter()
    try:
        best, table = auto_total_tokens(model, drafter.head, prompt_ids, args.depth, args.draft_top_k)
    except ValueError as e:
        die(e)
    print(f"--total_tokens auto: {best} ({time.perf_counter() - t0:.1f} s; tokens/s, tau by size: "
          + ", ".join(f"{n}: {v:.1f}, {t:.2f}" for n, (v, t) in table.items()) + ")", file=sys.stderr)
    return Drafter(drafter.head, "dynamic", args.depth, args.draft_top_k, best)


def fastest_dtype(device) -> str:
    """--dtype auto: bfloat16 on CUDA, and on CPUs where kernels.py runs (its bf16 rows equal one-token steps bit for
    bit, so EAGLE stays exact, and bf16 weights halve the bytes a step reads); float32 where it cannot build."""
    if torch.device(device).type == "cuda":
        return "bfloat16"
    return "bfloat16" if kernels.load() else "float32"


def fastest_quant(device) -> str | None:
    """--quant auto: int8 weights, LM head included, where kernels.py's build is AVX2 only (no bf16 arithmetic
    there, so bf16 weights buy nothing but bytes; on a Zen 3, MT-bench, plain int8 decoded 92.9 tokens/s against
    67.3 in bf16, and the int8 LM head reads 17% fewer bytes again, perplexity unchanged; docs/performance.md), has
    AMX tiles (int8 through the int8 tiles: on a Xeon, MT-bench, plain 101.4 against 68.9 tokens/s in bf16, EAGLE
    161.2 against 127.2), or AVX-512-BF16 without them (int8 by integer dot products: on a Zen 4, MT-bench, plain
    126.6 against 85.0, EAGLE 182.8 against 141.5 with a bf16 head); the float weights elsewhere. (On a Zen 4 EAGLE on
    int4.g32.a8.head8 decodes 1.09x faster than on int8.head8 since its scales are read in fp16; int8.head8 stays the
    default: closer to the float model, 96.6% top-1 agreement against 96.1%, and not 4-bit on any checkpoint.)"""
    return "int8.head8" if torch.device(device).type == "cpu" and kernels.isa() in INT8_BUILDS else None


def make_quantized_on_first_use(checkpoint, name, write=True):
    """--quant auto picked `name`: write it beside the checkpoint if it is not there (seconds, once); returns the
    name, or None (the float weights) when the directory cannot take the file or write is False (the processes of
    a tensor-parallel run would race to write it)."""
    config = read_config(checkpoint)  # a missing or corrupt checkpoint is reported as such
    try:
        quantized_file(checkpoint, config, name)
        return name
    except CheckpointError:  # not written yet
        pass
    if not write:
        return None
    print(f"--quant auto: writing {name} weights beside {checkpoint} (first use; python quantize.py does the same)",
          file=sys.stderr)
    try:
        mode, groupsize, head = parse_name(name)
        quantize_checkpoint(checkpoint, mode, groupsize, quantize_head=head)
    except OSError as e:
        print(f"--quant auto: could not write them ({e}); using the float weights", file=sys.stderr)
        return None
    return name


def default_tree(device, weights) -> dict:
    """The draft tree sizes that decode fastest for these weights ("bfloat16", "int4.g32", ...) here (TREE's note)."""
    if torch.device(device).type == "cuda" or (weights == "bfloat16" and kernels.isa() == "amx"):
        return WIDE_TREE
    if (weights.startswith("int4.") and kernels.isa() in ("amx", "avx512_bf16")) or (
            weights.startswith("int8") and kernels.isa() == "avx512_bf16"):
        return SMALL_TREE
    return TREE


def tree_pool(depth, top_k) -> int:
    """Nodes a dynamic tree of this depth and top-k can choose its --total_tokens from."""
    return min(top_k + (depth - 1) * top_k ** 2, 256)


def fill_tree_defaults(args, weights, device):
    """Set the tree flags left unset (None) to default_tree()'s sizes for these weights (a default --total_tokens
    shrunk to what a given --depth and --draft_top_k allow); returns args."""
    tree = default_tree(device, weights)
    given_total = args.total_tokens is not None
    for key, flag in TREE_FLAGS.items():
        if getattr(args, flag) is None:
            setattr(args, flag, tree[key])
    if not given_total:  # (a bad --depth or --draft_top_k is what check_tree reports, before --total_tokens)
        args.total_tokens = min(args.total_tokens, tree_pool(args.depth, args.draft_top_k))
    return args


def check_tree(args):
    """check_args for the tree flags (those still unset are skipped): one message, or None."""
    if args.depth is not None and not 1 <= args.depth <= 16:
        return f"--depth must be in 1..16, got {args.depth}"
    if args.draft_top_k is not None and not 1 <= args.draft_top_k <= 32:
        return f"--draft_top_k must be in 1..32, got {args.draft_top_k}"
    if args.speculate_k is not None and not 1 <= args.speculate_k <= 16:
        return f"--speculate_k must be in 1..16, got {args.speculate_k}"
    if None in (args.depth, args.draft_top_k, args.total_tokens) or args.total_tokens == "auto":
        return None
    most = min(tree_pool(args.depth, args.draft_top_k), MAX_VERIFY_ROWS - 1)
    if not 1 <= args.total_tokens <= most:
        return (f"--total_tokens must be in 1..{most} for depth {args.depth} and top_k {args.draft_top_k}, got "
                f"{args.total_tokens}" + (f" ({most} + the root: the rows a verification computes as decoding does)"
                                          if most == MAX_VERIFY_ROWS - 1 else ""))
    return None


def resolve_defaults(args):
    """--dtype auto, --compile and the tree flags unset become what runs fastest here."""
    args.auto_quant = args.quant == "auto"
    if args.quant == "auto":
        args.quant = fastest_quant(args.device) if args.dtype == "auto" else None
    elif args.quant == "none":
        args.quant = None
    if args.dtype == "auto":
        args.dtype = fastest_dtype(args.device)
    fill_tree_defaults(args, args.quant or args.dtype, args.device)
    if args.cpp_wrapper is None:
        args.cpp_wrapper = default_cpp_wrapper(args.device)
    if args.compile is None:
        args.compile = compiler_found(args.device)
    return args


def compiler_found(device) -> bool:
    """Whether torch.compile can run here: on a CPU it needs a C++ compiler (on CUDA, Triton)."""
    return torch.device(device).type == "cuda" or any(
        shutil.which(c) for c in (os.environ.get("CXX", "g++"), "c++", "clang++"))


def die(msg):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def setup_caches_or_die(model, batch_size, length, what):
    """model.setup_caches, or one error line where `what` (the tokens asked for) outgrows the model's context."""
    if length > model.config.block_size:
        die(f"{what} do not fit the model's {model.config.block_size}-token context")
    model.setup_caches(batch_size, length)


def main(argv=None):
    args = build_parser().parse_args(argv)
    if (msg := check_args(args)) is not None:
        die(msg)
    torch.manual_seed(args.seed)
    resolve_defaults(args)
    if (msg := check_tree(args)) is not None:
        die(msg)
    device, dtype = args.device, DTYPES[args.dtype]
    try:
        rank, world = init_distributed(device)  # under torchrun: this process's share of a tensor-parallel model
    except (RuntimeError, ValueError) as e:
        die(f"could not join the process group: {e}")
    if world > 1 and args.total_tokens == "auto":  # each process would time, and could pick, its own size
        die("--total_tokens auto times tree sizes in one process; under torchrun give a size")
    if rank:  # every process computes the same tokens; one prints them
        sys.stdout = sys.stderr = open(os.devnull, "w")
    try:
        checkpoint = args.checkpoint or default_checkpoint()
        if args.auto_quant and args.quant:
            args.quant = make_quantized_on_first_use(checkpoint, args.quant, write=world == 1)
        t0 = time.perf_counter()
        model = load_model(checkpoint, device, dtype, quantization=args.quant, tp=(rank, world))
        tokenizer = get_tokenizer(checkpoint)
        drafter = load_drafter(args, model, Path(checkpoint).resolve())
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        die(e)
    config = model.checkpoint_config
    if tokenizer.vocab_size > model.config.vocab_size:
        die(f"tokenizer has {tokenizer.vocab_size} tokens but the model only {model.config.vocab_size}")
    print(f"Loaded {checkpoint} ({args.dtype}{', ' + args.quant if args.quant else ''}) "
          f"in {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    stop_ids = set() if args.ignore_eos else set(config.get("stop_token_ids", []))
    template = config.get("chat_template", "none")
    if (args.chat or args.interactive) and template not in CHAT_TEMPLATES:
        die(f"{checkpoint}: config.json's chat_template {template!r} is none of {', '.join(CHAT_TEMPLATES)}")
    system = args.system if args.system is not None else config.get("default_system_prompt")
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)

    def encode(text, messages=()):
        if args.chat or args.interactive:
            text = apply_chat_template([*messages, {"role": "user", "content": text}], template, system)
        return tokenizer.encode(text)

    drafter = timed_drafter(model, drafter, args, encode(args.prompt))
    if args.batch_size > 1:
        drafter = None

    steps = {name: globals()[name] for name in ("decode_one_token", "decode_batch_step", "eagle_cycle", "prefill")}
    cpp_wrapper = torch._inductor.config.cpp_wrapper, torch._inductor.config.cpp_wrapper_build_separate
    try:  # compiled for this run only: main() called in-process (tests) leaves the module as it found it
        if args.compile:
            compile_steps(device, cpp_wrapper=args.cpp_wrapper)
        if args.compile_prefill:
            globals()["prefill"] = torch.compile(prefill, fullgraph=True, dynamic=True)
        run(args, model, tokenizer, drafter, encode, stop_ids, sampling, device, rank)
        finish_distributed()
    finally:
        globals().update(steps)
        torch._inductor.config.cpp_wrapper, torch._inductor.config.cpp_wrapper_build_separate = cpp_wrapper


def launcher(args) -> str:
    return " (C++ launcher)" if args.cpp_wrapper and torch.device(args.device).type == "cpu" else ""


def run(args, model, tokenizer, drafter, encode, stop_ids, sampling, device, rank):
    """The generation loop of main(): one prompt (--num_samples times), a batch, or a chat."""
    messages = []
    size = model_size_bytes(model)
    if args.batch_size > 1:
        return run_batch(args, model, tokenizer, encode(args.prompt), stop_ids, sampling, size)
    metrics_file = open(args.metrics_json, "w") if args.metrics_json and rank == 0 else None
    headroom = drafter.headroom if drafter else 0

    def cache_size(T):  # (KV cache length for a prompt of T tokens, why it cannot hold it or None)
        cache = args.max_seq_length or (2048 if args.interactive else  # a chat's turns share the compiled graphs
                                        -(-(T + args.max_new_tokens + headroom) // 64) * 64)
        cache = min(cache, model.config.block_size)
        if T >= cache:
            return cache, f"prompt of {T} tokens does not fit the KV cache of {cache} tokens (--max_seq_length)"
        if T + headroom > cache:
            return cache, (f"the draft tree needs {headroom} cache slots after the prompt of {T} tokens, but the KV "
                           f"cache holds {cache} (raise --max_seq_length or shrink the tree)")
        return cache, None

    def prepare(prompt_ids):  # a KV cache for the prompt, and the prompt as a tensor (or one line why not)
        cache, problem = cache_size(len(prompt_ids))
        if problem:
            die(problem)
        with torch.device(device):
            model.setup_caches(max_batch_size=1, max_seq_length=cache)
        return torch.tensor(prompt_ids, dtype=torch.int, device=device)

    def warm_up(prompt):  # compile outside the timed run, like gpt-fast
        t0 = time.perf_counter()
        generate(model, prompt, args.max_new_tokens, stop_ids, draft=drafter, **sampling)
        print(f"Compilation and warm-up: {time.perf_counter() - t0:.1f} s{launcher(args)}", file=sys.stderr)

    if args.compile and args.interactive:  # before the first question, so that its answer comes at full speed
        hello = encode("Hello")
        if cache_size(len(hello))[1] is None:  # else the first question's own prompt says why it does not fit
            warm_up(prepare(hello))
    for i in range(sys.maxsize if args.interactive else args.num_samples):
        text = args.prompt
        if args.interactive:
            try:
                text = input("You: ")
            except EOFError:
                break
        # interactive mode keeps the conversation; --num_samples repeats one prompt
        prompt_ids = encode(text, messages)
        if not prompt_ids:
            die("the prompt is empty")
        if args.interactive:  # the oldest turns give way when the conversation and a reply outgrow the cache
            room = cache_size(0)[0] - max(headroom, 1) - args.max_new_tokens
            while messages and len(prompt_ids) > room:
                messages = messages[2:]
                prompt_ids = encode(text, messages)
                print(f"(the conversation's oldest turn left out: with a reply it outgrew the {cache_size(0)[0]}-token "
                      "KV cache, --max_seq_length)", file=sys.stderr)
            if (problem := cache_size(len(prompt_ids))[1]) is not None:  # this message alone: say so, chat on
                print(f"error: {problem}", file=sys.stderr)
                continue
        prompt = prepare(prompt_ids)

        push = incremental_decoder(tokenizer)

        def stream(tok):
            if tok not in stop_ids and (text := push(tok)):
                print(text, end="", flush=True)

        if args.compile and i == 0 and not args.interactive:
            warm_up(prompt)
        if not args.interactive:
            print(args.prompt + ("\n" if args.chat else ""), end="", flush=True)
        t0 = time.perf_counter()
        tokens, stats = generate(model, prompt, args.max_new_tokens, stop_ids, stream, draft=drafter, **sampling)
        seconds = time.perf_counter() - t0
        print()
        reply = tokenizer.decode([t for t in tokens if t not in stop_ids])
        if args.interactive:
            messages += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]
        tps = len(tokens) / seconds
        print(f"[sample {i}] {len(tokens)} tokens in {seconds:.2f} s: {tps:.2f} tokens/s, "
              f"{size * tps / 1e9:.2f} GB/s, peak memory {peak_memory_bytes(device) / 2**30:.2f} GiB, "
              f"{stats['target_forwards']} target forwards", file=sys.stderr)
        if drafter is not None:
            print(f"[sample {i}] tau (new tokens per verification) {stats['mean_accepted']:.2f}; "
                  f"acceptance per depth {acceptance_rates(stats)}", file=sys.stderr)
        if metrics_file:
            record = dict(prompt_ids=prompt_ids, token_ids=tokens, text=reply, new_tokens=len(tokens),
                          seconds=seconds, tokens_per_s=tps, **stats)
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
    if metrics_file:
        metrics_file.close()


def run_batch(args, model, tokenizer, prompt_ids, stop_ids, sampling, size):
    """--batch_size B: B copies of the prompt decoded together; prints each row and the batch's tokens/s."""
    B, device = args.batch_size, args.device
    cache = min(args.max_seq_length or -(-(len(prompt_ids) + args.max_new_tokens) // 64) * 64, model.config.block_size)
    if len(prompt_ids) >= cache:
        die(f"prompt of {len(prompt_ids)} tokens does not fit the KV cache of {cache} tokens (--max_seq_length)")
    with torch.device(device):
        model.setup_caches(max_batch_size=B, max_seq_length=cache)
    if args.compile:  # compile outside the timed run
        t0 = time.perf_counter()
        generate_batch(model, [prompt_ids] * B, args.max_new_tokens, stop_ids, **sampling)
        print(f"Compilation and warm-up: {time.perf_counter() - t0:.1f} s{launcher(args)}", file=sys.stderr)
    t0 = time.perf_counter()
    rows = generate_batch(model, [prompt_ids] * B, args.max_new_tokens, stop_ids, **sampling)
    seconds = time.perf_counter() - t0
    for b, row in enumerate(rows):
        print(f"[row {b}] {tokenizer.decode([t for t in row if t not in stop_ids])}")
    n = sum(len(r) for r in rows)
    print(f"[batch of {B}] {n} tokens in {seconds:.2f} s: {n / seconds:.2f} tokens/s "
          f"({max(len(r) for r in rows)} steps, {size * max(len(r) for r in rows) / seconds / 1e9:.2f} GB/s of weights), "
          f"peak memory {peak_memory_bytes(device) / 2**30:.2f} GiB", file=sys.stderr)


if __name__ == "__main__":
    main()
