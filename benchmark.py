"""Benchmark plain and EAGLE decoding side by side, the way the paper does: same prompts, greedy, τ and speed-up.

    python benchmark.py --prompts data/mt_bench.jsonl --limit 10 --max_new_tokens 256 --out results.json

A prompts file is JSONL whose records have `turns` (the first is used, with the chat template) or `prompt` (raw
text, no template); `python scripts/make_prompts.py` writes MT-bench and HumanEval files into data/. Every method is
warmed up first (compile time reported apart), then all run over the same prompts, method by method per prompt, so
machine drift hits them alike. Greedy EAGLE outputs must equal plain's token for token: any mismatch is reported.
"""
import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

import generate as gen
from eagle_head import load_head, random_head
from generate import DTYPES, CheckpointError, Drafter, default_checkpoint, die, load_model, peak_memory_bytes
from tokenizer import apply_chat_template, get_tokenizer

METHODS = ("plain", "eagle-chain", "eagle-static", "eagle-dynamic")


def load_prompts(path, tokenizer, config, limit):
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file not found: {path} (python scripts/make_prompts.py writes data/)")
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        r = json.loads(line)
        if "turns" in r:
            text = apply_chat_template([{"role": "user", "content": r["turns"][0]}], config.get("chat_template"),
                                       config.get("default_system_prompt"))
        elif "prompt" in r:
            text = r["prompt"]
        else:
            raise ValueError(f"{path}:{n}: a record needs 'turns' or 'prompt'")
        prompts.append((r.get("id", n), tokenizer.encode(text)))
        if limit and len(prompts) >= limit:
            break
    return prompts


def drafter_for(method, head, args):
    if method == "plain":
        return None
    kind = method.split("-", 1)[1]
    if kind == "chain":
        return Drafter(head, "chain", depth=args.speculate_k)
    if kind == "static":
        return Drafter(head, "static")
    return Drafter(head, "dynamic", depth=args.depth, top_k=args.draft_top_k, total_tokens=args.total_tokens)


def run_one(model, drafter, prompt_ids, args, stop_ids, cache):
    model.setup_caches(1, cache)
    prompt = torch.tensor(prompt_ids, device=args.device)
    t0 = time.perf_counter()
    tokens, stats = gen.generate(model, prompt, args.max_new_tokens, stop_ids, draft=drafter, temperature=0)
    return tokens, stats, time.perf_counter() - t0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", default="data/mt_bench.jsonl")
    p.add_argument("--limit", type=int, default=10, help="prompts used (0 = all)")
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {', '.join(METHODS)}")
    p.add_argument("--checkpoint", type=Path, default=None)
    p.add_argument("--draft", default=None, help="head directory, or 'random' (default: the shipped head)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--no_compile", action="store_true", help="eager decoding (compiled by default)")
    p.add_argument("--ignore_eos", action="store_true", help="always generate max_new_tokens")
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--draft_top_k", type=int, default=4)
    p.add_argument("--total_tokens", type=int, default=15)
    p.add_argument("--speculate_k", type=int, default=4)
    p.add_argument("--out", type=Path, default=Path("results.json"))
    p.add_argument("--plot", type=Path, default=None, help="PNG of tokens/s and acceptance per depth (matplotlib)")
    args = p.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if unknown := [m for m in methods if m not in METHODS]:
        die(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    if args.dtype not in DTYPES:
        die(f"unknown --dtype {args.dtype!r}; choose from {', '.join(DTYPES)}")
    if args.max_new_tokens < 1:
        die("--max_new_tokens must be at least 1")
    torch.manual_seed(0)
    try:
        checkpoint = args.checkpoint or default_checkpoint()
        model = load_model(checkpoint, args.device, DTYPES[args.dtype])
        tokenizer = get_tokenizer(checkpoint)
        config = model.checkpoint_config
        prompts = load_prompts(args.prompts, tokenizer, config, args.limit)
        head = None
        if any(m != "plain" for m in methods):
            draft = args.draft or (str(gen.DEFAULT_HEAD) if gen.DEFAULT_HEAD.is_dir() else "random")
            head = random_head(model) if draft == "random" else load_head(draft, model, args.device,
                                                                          DTYPES[args.dtype])
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        die(e)
    if not prompts:
        die(f"no prompts in {args.prompts}")
    stop_ids = set() if args.ignore_eos else set(config.get("stop_token_ids", []))
    drafters = {m: drafter_for(m, head, args) for m in methods}
    headroom = max([d.headroom for d in drafters.values() if d] + [0])
    cache = max(len(ids) for _, ids in prompts) + args.max_new_tokens + headroom + 1
    if not args.no_compile:
        gen.decode_one_token = torch.compile(gen.decode_one_token, fullgraph=True, dynamic=False)
        gen.draft_step = torch.compile(gen.draft_step, fullgraph=True, dynamic=False)
        gen.verify_step = torch.compile(gen.verify_step, fullgraph=True, dynamic=False)

    warmup = {}
    for m in methods:  # compile (or warm caches) on the first prompt, timed apart
        t0 = time.perf_counter()
        run_one(model, drafters[m], prompts[0][1][:64], argparse.Namespace(**{**vars(args), "max_new_tokens": 16}),
                stop_ids, cache)
        warmup[m] = time.perf_counter() - t0
        print(f"warm-up {m}: {warmup[m]:.1f} s", file=sys.stderr)

    per_prompt = {m: [] for m in methods}
    for i, (pid, ids) in enumerate(prompts):
        for m in methods:
            tokens, stats, seconds = run_one(model, drafters[m], ids, args, stop_ids, cache)
            per_prompt[m].append({"id": pid, "token_ids": tokens, "seconds": seconds, **stats})
        print(f"prompt {i + 1}/{len(prompts)} done", file=sys.stderr)

    mismatches = []
    results = {"machine": {"platform": platform.platform(), "processor": platform.processor(),
                           "threads": torch.get_num_threads()},
               "torch": torch.__version__, "dtype": args.dtype, "compiled": not args.no_compile,
               "prompts": str(args.prompts), "n_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
               "peak_memory_bytes_process": peak_memory_bytes(args.device), "methods": {}}
    for m in methods:
        runs = per_prompt[m]
        new = sum(len(r["token_ids"]) for r in runs)
        secs = sum(r["seconds"] for r in runs)
        entry = {"tokens_per_s": new / secs, "new_tokens": new, "seconds": secs, "warmup_seconds": warmup[m],
                 "per_prompt": runs}
        if m != "plain":
            verifies = sum(r["verify_forwards"] for r in runs)
            depth_counts = [sum(c) for c in zip(*(r["accepted_at_depth"] for r in runs))]
            entry["mean_accepted"] = sum(len(r["token_ids"]) - 1 for r in runs) / max(verifies, 1)
            entry["accepted_at_depth"] = depth_counts
            entry["acceptance_rate_by_depth"] = [n / d if d else 0.0 for n, d in
                                                 zip(depth_counts, [verifies] + depth_counts[:-1])]
        if "plain" in per_prompt and m != "plain":
            for a, b in zip(per_prompt["plain"], runs):
                if a["token_ids"] != b["token_ids"]:
                    mismatches.append({"method": m, "prompt": a["id"]})
        results["methods"][m] = entry
    if "plain" in results["methods"]:
        base = results["methods"]["plain"]["tokens_per_s"]
        for m, e in results["methods"].items():
            e["speedup_vs_plain"] = e["tokens_per_s"] / base
    results["mismatches"] = mismatches
    args.out.write_text(json.dumps(results, indent=1))

    print(f"\n{len(prompts)} prompts from {args.prompts}, {args.max_new_tokens} new tokens max, {args.dtype}, "
          f"{'compiled' if not args.no_compile else 'eager'}, torch {torch.__version__}\n")
    print("| method | tokens/s | speed-up | τ | acceptance by depth |\n|---|---|---|---|---|")
    for m, e in results["methods"].items():
        tau = f"{e['mean_accepted']:.2f}" if "mean_accepted" in e else "1"
        rates = " ".join(f"{r:.2f}" for r in e.get("acceptance_rate_by_depth", []))
        print(f"| {m} | {e['tokens_per_s']:.1f} | {e.get('speedup_vs_plain', float('nan')):.2f}x | {tau} | {rates} |")
    if mismatches:
        print(f"\nMISMATCH: {len(mismatches)} greedy outputs differ from plain decoding: {mismatches[:5]}",
              file=sys.stderr)
    if args.plot:
        plot(results, args.plot)
    return 1 if mismatches else 0


def plot(results, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    methods = results["methods"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.bar(list(methods), [e["tokens_per_s"] for e in methods.values()], color="tab:blue")
    a.set_ylabel("tokens/s")
    a.set_title(f"decoding speed ({results['dtype']}, {results['n_prompts']} prompts)")
    a.tick_params(axis="x", rotation=20)
    for m, e in methods.items():
        if "acceptance_rate_by_depth" in e:
            b.plot(range(1, len(e["acceptance_rate_by_depth"]) + 1), e["acceptance_rate_by_depth"], marker="o", label=m)
    b.set_xlabel("draft depth")
    b.set_ylabel("acceptance rate (given the previous depth)")
    b.set_ylim(0, 1)
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
