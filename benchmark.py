"""Benchmark plain and EAGLE decoding side by side, the way the paper does: same prompts, greedy, τ and speed-up.

    python benchmark.py --prompts data/mt_bench.jsonl --limit 10 --max_new_tokens 256 --out results.json
    python benchmark.py --methods plain,eagle-dynamic,plain@int4.g32,eagle-dynamic@int4.g32,hf,llama.cpp

A prompts file is JSONL whose records have `turns` (the first is used, with the chat template) or `prompt` (raw
text, no template); `python scripts/make_prompts.py` writes MT-bench and HumanEval files into data/.

A method is a name and an optional `@weights`: `plain`, `eagle-chain`, `eagle-static`, `eagle-dynamic` (this
project), and the peers `hf` (Hugging Face transformers `generate` on the same weights), `hf-lookup` (its prompt
lookup decoding) and `llama.cpp` (llama-cpp-python on the original GGUF). `@float32`, `@bfloat16` pick the float
weights' dtype (default --dtype); `@int8`, `@int4.g32`, ... the variant quantize.py wrote (activations in --dtype).
Peers that are not installed are skipped with a message.

Every method is warmed up first (compile time reported apart), then all run over the same prompts, method by
method per prompt, so machine drift hits them alike. Greedy EAGLE outputs must equal plain decoding's on the same
weights token for token: any mismatch is reported loudly.
"""
import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import generate as gen
import kernels
from eagle_head import random_head
from generate import (DTYPES, CheckpointError, default_checkpoint, default_gguf, die, load_model,
                      model_size_bytes, peak_memory_bytes)
from tokenizer import apply_chat_template, get_tokenizer

METHODS = ("plain", "eagle-chain", "eagle-static", "eagle-dynamic")
PEERS = ("hf", "hf-lookup", "llama.cpp")


def load_prompts(path, tokenizer, config, limit):
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file not found: {path} (python scripts/make_prompts.py writes data/)")
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
        if not isinstance(r, dict) or not (r.get("turns") or r.get("prompt")):
            raise ValueError(f"{path}:{n}: a record needs a non-empty 'turns' list or 'prompt'")
        if r.get("turns"):
            text = apply_chat_template([{"role": "user", "content": r["turns"][0]}], config.get("chat_template"),
                                       config.get("default_system_prompt"))
        else:
            text = r["prompt"]
        ids = tokenizer.encode(text)
        if not ids:
            raise ValueError(f"{path}:{n}: the prompt encodes to no tokens")
        prompts.append((r.get("id", n), ids))
        if limit and len(prompts) >= limit:
            break
    return prompts


def parse_method(spec, dtype):
    """'eagle-dynamic@int8' -> ('eagle-dynamic', 'int8'); the weights default to --dtype."""
    from quantize import QuantizeError, parse_name
    name, _, weights = spec.partition("@")
    if name not in METHODS + PEERS:
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS + PEERS)}")
    if name == "llama.cpp":
        if weights:
            raise ValueError("llama.cpp runs the GGUF as it is: no @weights")
        return name, "gguf"
    weights = weights or dtype
    if weights not in DTYPES:
        if name.startswith("hf"):
            raise ValueError(f"{spec}: the transformers peer runs float weights (@float32, @bfloat16)")
        try:
            parse_name(weights)
        except QuantizeError as e:
            raise ValueError(f"{spec}: {e}") from None
    return name, weights


def hf_model_from(model):
    """A transformers LlamaForCausalLM holding exactly `model`'s float weights (Q/K back to rotate-half)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    c = model.config
    hf_config = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.intermediate_size,
                            num_hidden_layers=c.n_layer, num_attention_heads=c.n_head,
                            num_key_value_heads=c.n_local_heads, head_dim=c.head_dim, rms_norm_eps=c.norm_eps,
                            rope_theta=c.rope_base, max_position_embeddings=c.block_size,
                            rope_scaling=dict(c.rope_scaling, rope_type="llama3") if c.rope_scaling else None,
                            tie_word_embeddings=c.tie_embeddings, bos_token_id=None, eos_token_id=None,
                            pad_token_id=0)

    def rotate_half(w, heads):  # inverse of scripts/convert_hf_checkpoint.permute_rotate_half
        return w.view(heads, c.head_dim // 2, 2, -1).transpose(1, 2).reshape(w.shape)

    # the plain layout, whatever our model runs with (packed for the CPU kernels, see model.pack_weights)
    sd = {k: kernels.unpack(v) if v.dim() == 4 else v for k, v in model.state_dict().items()}
    q_size, kv_size = c.n_head * c.head_dim, c.n_local_heads * c.head_dim
    hf_sd = {"model.embed_tokens.weight": sd["tok_embeddings.weight"], "model.norm.weight": sd["norm.weight"],
             "lm_head.weight": sd["output.weight"]}
    for i in range(c.n_layer):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        q, k, v = sd[p + "attention.wqkv.weight"].split([q_size, kv_size, kv_size])
        hf_sd.update({h + "self_attn.q_proj.weight": rotate_half(q, c.n_head),
                      h + "self_attn.k_proj.weight": rotate_half(k, c.n_local_heads),
                      h + "self_attn.v_proj.weight": v, h + "self_attn.o_proj.weight": sd[p + "attention.wo.weight"],
                      h + "mlp.gate_proj.weight": sd[p + "feed_forward.w1.weight"],
                      h + "mlp.up_proj.weight": sd[p + "feed_forward.w3.weight"],
                      h + "mlp.down_proj.weight": sd[p + "feed_forward.w2.weight"],
                      h + "input_layernorm.weight": sd[p + "attention_norm.weight"],
                      h + "post_attention_layernorm.weight": sd[p + "ffn_norm.weight"]})
    hf = LlamaForCausalLM(hf_config).to(sd["norm.weight"].device, sd["norm.weight"].dtype)
    hf.load_state_dict(hf_sd)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf.eval()


def hf_runner(hf, lookup, stop_ids):
    def run(ids, max_new_tokens):
        x = torch.tensor([ids], device=hf.device)
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                          eos_token_id=sorted(stop_ids) or None, prompt_lookup_num_tokens=10 if lookup else None)
        return out[0, len(ids):].tolist(), {}
    return run


def llama_cpp_runner(gguf, n_ctx, stop_ids):
    from llama_cpp import Llama
    llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=torch.get_num_threads(), verbose=False)

    def run(ids, max_new_tokens):
        llm.reset()  # no reuse of an earlier prompt's cache: every method starts from an empty cache
        out = []
        for t in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
            out.append(t)
            if len(out) >= max_new_tokens or t in stop_ids:
                break
        return out, {}
    return run


def our_runner(model, drafter, cache, stop_ids, device):
    def run(ids, max_new_tokens):
        model.setup_caches(1, cache)
        return gen.generate(model, torch.tensor(ids, device=device), max_new_tokens, stop_ids, draft=drafter,
                            temperature=0)
    return run


def tree_args(args, weights):
    """args with the tree flags left unset filled for these weights (generate.py's default here)."""
    return gen.fill_tree_defaults(argparse.Namespace(**vars(args)), weights, args.device)


def tree_summary(drafter) -> str:
    if drafter.kind == "dynamic":
        return f"dynamic tree, depth {drafter.depth}, top-k {drafter.top_k}, {drafter.n_nodes} nodes"
    return f"{drafter.kind} tree, depth {drafter.depth}, {drafter.n_nodes} nodes"


def build_runners(methods, args, checkpoint, stop_ids, prompts):
    """{method spec: (run(ids, max_new_tokens) -> (tokens, stats), bytes of weights it reads per step, the draft
    tree's summary or None)}."""
    models, heads, drafters = {}, {}, {}
    for spec, (name, weights) in methods.items():  # weights, heads and trees first: they size the KV cache
        if name == "llama.cpp":
            continue
        if weights not in models:
            quant = None if weights in DTYPES else weights
            models[weights] = load_model(checkpoint, args.device, DTYPES[weights if quant is None else args.dtype],
                                         quantization=quant)
        if name.startswith("eagle"):
            if weights not in heads:
                draft = args.draft or (str(gen.DEFAULT_HEAD) if gen.DEFAULT_HEAD.is_dir() else "random")
                dtype = DTYPES[weights if weights in DTYPES else args.dtype]
                heads[weights] = (random_head(models[weights]) if draft == "random"
                                  else gen.load_draft_head(draft, models[weights], args.device, dtype,
                                                           args.draft_quant))
            sized = tree_args(args, weights)
            drafter = gen.tree_drafter(heads[weights], name.split("-", 1)[1], sized)
            drafters[spec] = gen.timed_drafter(models[weights], drafter, sized, prompts[0][1])
            print(f"{spec}: {tree_summary(drafters[spec])}", file=sys.stderr)
    cache = max(len(ids) for _, ids in prompts) + args.max_new_tokens + max([d.headroom for d in drafters.values()] + [0]) + 1
    if models and cache > (context := min(m.config.block_size for m in models.values())):
        raise ValueError(f"the longest prompt and --max_new_tokens {args.max_new_tokens}"
                         f"{' and the draft tree' if drafters else ''} need {cache} cache slots, more than the "
                         f"model's {context}-token context")
    runners = {}
    for spec, (name, weights) in methods.items():
        if name == "llama.cpp":
            try:
                import llama_cpp  # noqa: F401
            except ImportError:
                print(f"skipping {spec}: llama-cpp-python is not installed (pip install llama-cpp-python)",
                      file=sys.stderr)
                continue
            gguf = args.gguf or (default_gguf() if Path(checkpoint) == gen.DEFAULT_CHECKPOINT else None)
            if gguf is None or not Path(gguf).is_file():
                raise FileNotFoundError(f"llama.cpp needs the model's GGUF: pass --gguf PATH (got {gguf})")
            runners[spec] = (llama_cpp_runner(gguf, cache, stop_ids), Path(gguf).stat().st_size, None)
        elif name.startswith("hf"):
            try:
                hf = hf_model_from(models[weights])
            except ImportError:
                print(f"skipping {spec}: transformers is not installed (pip install transformers)", file=sys.stderr)
                continue
            runners[spec] = (hf_runner(hf, name == "hf-lookup", stop_ids), model_size_bytes(models[weights]), None)
        else:
            drafter = drafters.get(spec)
            # the head's own weights (an EAGLE-3 head's LM head among them; the embedding is the target's) and an
            # EAGLE-1/2 head's copy of the target's LM-head rows for its draft vocabulary
            head_bytes = 0 if drafter is None else sum(p.numel() * p.element_size() for p in drafter.head.parameters())
            draft_rows = None if drafter is None else getattr(drafter.head, "_draft_weight", None)
            if draft_rows is not None:
                head_bytes += draft_rows.numel() * draft_rows.element_size()
            runners[spec] = (our_runner(models[weights], drafter, cache, stop_ids, args.device),
                             model_size_bytes(models[weights]) + head_bytes, drafter and tree_summary(drafter))
    return runners


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def summarize(methods, per_prompt, warmup, memory, args, n_prompts):
    results = {"machine": {"platform": platform.platform(), "processor": platform.processor(),
                           "threads": torch.get_num_threads(), "kernels": kernels.isa()},
               "torch": torch.__version__, "dtype": args.dtype, "compiled": not args.no_compile,
               "cpp_wrapper": args.cpp_wrapper,
               "prompts": str(args.prompts), "n_prompts": n_prompts, "max_new_tokens": args.max_new_tokens,
               "peak_memory_bytes_process": peak_memory_bytes(args.device), "methods": {}, "mismatches": []}
    for spec, runs in per_prompt.items():
        name, weights = methods[spec]
        new, secs = sum(len(r["token_ids"]) for r in runs), sum(r["seconds"] for r in runs)
        entry = {"method": name, "weights": weights, "tokens_per_s": new / secs, "new_tokens": new, "seconds": secs,
                 "warmup_seconds": warmup[spec], **memory[spec]}
        if "verify_forwards" in runs[0]:
            verifies = sum(r["verify_forwards"] for r in runs)
            depth_counts = [sum(c) for c in zip(*(r["accepted_at_depth"] for r in runs))]
            entry["mean_accepted"] = sum(r["mean_accepted"] * r["verify_forwards"] for r in runs) / max(verifies, 1)
            entry["accepted_at_depth"] = depth_counts
            entry["acceptance_rate_by_depth"] = [n / d if d else 0.0 for n, d in
                                                 zip(depth_counts, [verifies] + depth_counts[:-1])]
        # the reference: this project's plain decoding on the same weights (llama.cpp: on --dtype's)
        ref = f"plain@{weights if weights != 'gguf' else args.dtype}"
        if ref in per_prompt and spec != ref:
            diffs = [first_difference(a["token_ids"], b["token_ids"]) for a, b in zip(per_prompt[ref], runs)]
            entry["reference"] = ref
            entry["equal_to_reference"] = sum(d is None for d in diffs)
            entry["first_difference"] = diffs
            if name.startswith("eagle"):
                results["mismatches"] += [{"method": spec, "prompt": r["id"], "first_difference": d}
                                          for r, d in zip(runs, diffs) if d is not None]
        entry["per_prompt"] = runs
        results["methods"][spec] = entry
    for spec, e in results["methods"].items():  # against the same weights' plain decoding, else --dtype's, named
        ref = e.get("reference", f"plain@{args.dtype}")
        if ref in results["methods"] and ref != spec:
            e["speedup_vs_plain"] = e["tokens_per_s"] / results["methods"][ref]["tokens_per_s"]
            e["speedup_baseline"] = ref
    return results


def print_table(results):
    print(f"\n{results['n_prompts']} prompts from {results['prompts']}, {results['max_new_tokens']} new tokens max, "
          f"{'compiled' if results['compiled'] else 'eager'}, torch {results['torch']}, "
          f"{results['machine']['threads']} threads\n")
    print("| method | weights | tokens/s | vs plain (same weights) | τ | acceptance by depth | = plain | "
          "weights MiB | warm-up s |\n|---|---|---|---|---|---|---|---|---|")
    for spec, e in results["methods"].items():
        tau = f"{e['mean_accepted']:.2f}" if "mean_accepted" in e else ""
        rates = " ".join(f"{r:.2f}" for r in e.get("acceptance_rate_by_depth", []))
        same = f"{e['equal_to_reference']}/{results['n_prompts']}" if "equal_to_reference" in e else ""
        speedup = f"{e['speedup_vs_plain']:.2f}x" if "speedup_vs_plain" in e else ""
        if speedup and e["speedup_baseline"] != f"plain@{e['weights']}" and e["method"] != "llama.cpp":
            speedup += f" (vs {e['speedup_baseline'].split('@')[1]})"  # no plain run on its own weights
        print(f"| {e['method']} | {e['weights']} | {e['tokens_per_s']:.1f} | {speedup} | {tau} | {rates} | {same} | "
              f"{e['weights_bytes'] / 2**20:.0f} | {e['warmup_seconds']:.0f} |")
    trees = [f"{spec}: {e['draft_tree']}" for spec, e in results["methods"].items() if "draft_tree" in e]
    if trees:
        print("\nDraft trees: " + "; ".join(trees))


def plot(results, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): no plot", file=sys.stderr)
        return
    methods = results["methods"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    a.barh(list(methods)[::-1], [e["tokens_per_s"] for e in methods.values()][::-1], color="tab:blue")
    a.set_xlabel("tokens/s")
    a.set_title(f"{results['n_prompts']} prompts, {results['max_new_tokens']} new tokens, "
                f"{'compiled' if results['compiled'] else 'eager'}")
    for m, e in methods.items():
        if "acceptance_rate_by_depth" in e:
            b.plot(range(1, len(e["acceptance_rate_by_depth"]) + 1), e["acceptance_rate_by_depth"], marker="o", label=m)
    depth = max([len(e.get("acceptance_rate_by_depth", [])) for e in methods.values()] + [1])
    b.set_xticks(range(1, depth + 1))
    b.set_xlabel("draft depth")
    b.set_ylabel("acceptance rate (given the previous depth)")
    b.set_ylim(0, 1)
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot written to {path}", file=sys.stderr)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", default="data/mt_bench.jsonl")
    p.add_argument("--limit", type=int, default=10, help="prompts used (0 = all)")
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated NAME[@WEIGHTS], NAME from {', '.join(METHODS + PEERS)}")
    p.add_argument("--checkpoint", type=Path, default=None)
    p.add_argument("--draft", default=None, help="head directory, or 'random' (default: the shipped head)")
    p.add_argument("--draft_quant", default="auto", help="the head's weights, as generate.py's --draft_quant")
    p.add_argument("--gguf", type=Path, default=None, help="GGUF for llama.cpp (default: the default model's)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--no_compile", action="store_true", help="eager decoding (compiled by default)")
    p.add_argument("--cpp_wrapper", action=argparse.BooleanOptionalAction, default=None,
                   help="compiled graphs launch their kernels from C++ (CPU; default: as generate.py, on for a CPU)")
    p.add_argument("--ignore_eos", action="store_true", help="always generate max_new_tokens")
    # unset tree flags take generate.py's default for each method's weights (gen.default_tree)
    p.add_argument("--depth", type=int, default=None)
    p.add_argument("--draft_top_k", type=int, default=None)
    p.add_argument("--total_tokens", type=gen.total_tokens_arg, default=None, help="dynamic tree size, or 'auto'")
    p.add_argument("--speculate_k", type=int, default=None)
    p.add_argument("--out", type=Path, default=Path("results.json"))
    p.add_argument("--plot", type=Path, default=None, help="PNG of tokens/s and acceptance per depth (matplotlib)")
    args = p.parse_args(argv)
    if args.dtype not in DTYPES:
        die(f"unknown --dtype {args.dtype!r}; choose from {', '.join(DTYPES)}")
    if args.max_new_tokens < 1:
        die("--max_new_tokens must be at least 1")
    if (msg := gen.check_device(args.device)) is not None:
        die(msg)
    if args.cpp_wrapper is None:
        args.cpp_wrapper = gen.default_cpp_wrapper(args.device)
    if not args.no_compile and not gen.compiler_found(args.device):
        print("no C++ compiler found (g++, c++ or clang++; $CXX): the methods run eager", file=sys.stderr)
        args.no_compile = True
    if args.limit < 0:
        die("--limit must be 0 (all) or more")
    for flag, path in (("--out", args.out), ("--plot", args.plot)):  # written after the whole run: checked first
        if (msg := gen.output_path_error(flag, path)) is not None:
            die(msg)
    try:
        specs = [m.strip() for m in args.methods.split(",") if m.strip()]
        methods = {}
        for s in specs:
            name, weights = parse_method(s, args.dtype)
            methods[f"{name}@{weights}" if name != "llama.cpp" else name] = (name, weights)
    except ValueError as e:
        die(e)
    if not methods:
        die("--methods is empty")
    for spec, (name, weights) in methods.items():  # tree flags, per weights, before anything loads
        if name.startswith("eagle") and (msg := gen.check_tree(tree_args(args, weights))) is not None:
            die(f"{spec}: {msg}")
    torch.manual_seed(0)
    try:
        checkpoint = args.checkpoint or default_checkpoint()
        config = gen.read_config(checkpoint)
        prompts = load_prompts(args.prompts, get_tokenizer(checkpoint), config, args.limit)
        if not prompts:
            raise ValueError(f"no prompts in {args.prompts}")
        stop_ids = set() if args.ignore_eos else set(config.get("stop_token_ids", []))
        runners = build_runners(methods, args, checkpoint, stop_ids, prompts)
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        die(e)
    if not args.no_compile:
        torch._dynamo.config.recompile_limit = 64  # one graph per weights variant and tree shape
        gen.compile_steps(args.device, cpp_wrapper=args.cpp_wrapper)

    warmup, memory = {}, {}
    for spec, (run, weights_bytes, tree) in runners.items():  # compile or warm caches on the first prompt, timed apart
        t0 = time.perf_counter()
        run(prompts[0][1][:64], 16)
        warmup[spec] = time.perf_counter() - t0
        memory[spec] = {"weights_bytes": weights_bytes, "peak_rss_bytes_after_warmup": peak_memory_bytes(args.device),
                        **({"draft_tree": tree} if tree else {})}
        print(f"warm-up {spec}: {warmup[spec]:.1f} s", file=sys.stderr)

    per_prompt = {spec: [] for spec in runners}
    for i, (pid, ids) in enumerate(prompts):
        for spec, (run, _, _) in runners.items():
            t0 = time.perf_counter()
            tokens, stats = run(ids, args.max_new_tokens)
            per_prompt[spec].append({"id": pid, "token_ids": tokens, "seconds": time.perf_counter() - t0, **stats})
        print(f"prompt {i + 1}/{len(prompts)} done", file=sys.stderr)

    results = summarize({s: methods[s] for s in runners}, per_prompt, warmup, memory, args, len(prompts))
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    tmp.replace(args.out)
    print_table(results)
    for spec, e in results["methods"].items():
        if e["method"].startswith("eagle") and "reference" not in e:
            print(f"note: no plain@{e['weights']} in this run, so {spec}'s output was not compared with plain "
                  "decoding's", file=sys.stderr)
    if mismatches := results["mismatches"]:
        where = statistics.median(m["first_difference"] for m in mismatches)
        print(f"\nMISMATCH: {len(mismatches)} greedy EAGLE outputs differ from plain decoding on the same weights "
              f"(first difference at token {where:.0f}, median): {mismatches[:5]}", file=sys.stderr)
        if any(methods[m["method"]][1] == "float32" for m in mismatches):
            print("In float32 this is a bug: please report it.", file=sys.stderr)
        else:
            print("In bf16/fp16 (and quantized weights, which compute in --dtype) a verification over several tokens "
                  "rounds differently from one-token steps, so greedy paths can part; float32 is exact (tested).",
                  file=sys.stderr)
    if args.plot:
        plot(results, args.plot)
    return 1 if any(methods[m["method"]][1] == "float32" for m in results["mismatches"]) else 0


if __name__ == "__main__":
    sys.exit(main())
