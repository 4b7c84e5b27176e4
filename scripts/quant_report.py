"""Quantization report: perplexity, decoding speed (plain and EAGLE) and memory per precision, as a markdown table.

    python scripts/quant_report.py --compile                                   # float32, bfloat16, int8, int4.g32
    python scripts/quant_report.py --configs int8 --max_new_tokens 4 --prompts 1   # a quick check that it runs

A config is a float dtype (float32, bfloat16, float16) or a quantized variant's name (int8, int4.g32, int4.g64,
int8.head8, ...; see quantize.py), which runs with --quant_dtype activations. Missing quantized weights are
written beside the checkpoint first (quantize.py's files). Each config then runs in a process of its own, so the
memory columns are that config's alone: load, perplexity on tests/data/ppl_text.txt, then greedy decoding of the
same chat prompts plain and with an EAGLE head (the dynamic tree generate.py picks for that config here: the tree
column), each warmed up (compiled) on the first prompt before timing; EOS is ignored so every run makes
--max_new_tokens tokens.
Columns: weights read per forward (MiB), perplexity, tokens/s plain and with EAGLE, tau (new tokens per
verification), whether EAGLE's output equalled plain's, RSS before and after loading (their difference is the
config's own load) and peak RSS (VmHWM: transient copies while loading, and compilation, included).
"""
import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import generate as gen  # noqa: E402
import quantize as Q  # noqa: E402
from benchmark import load_prompts  # noqa: E402
from eagle_head import load_head, random_head  # noqa: E402
from generate import DTYPES, Drafter, default_checkpoint, die, load_model, model_size_bytes  # noqa: E402
from tokenizer import get_tokenizer  # noqa: E402

PPL_TEXT = ROOT / "tests" / "data" / "ppl_text.txt"


def proc_status_mib(field):
    """VmRSS (now) or VmHWM (peak) of this process, in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def perplexity(model, ids):
    model.setup_caches(1, len(ids))
    with torch.no_grad():
        logits = model(torch.tensor([ids]), torch.arange(len(ids)))[0]
    return math.exp(F.cross_entropy(logits[:-1].double(), torch.tensor(ids[1:])).item())


def run_config(args):
    """One config, in this process: returns its row as a dict."""
    config, checkpoint = args.one, args.checkpoint or default_checkpoint()
    quant = None if config in DTYPES else config
    dtype = DTYPES[args.quant_dtype if quant else config]
    rss_base = proc_status_mib("VmRSS")  # torch and friends imported, no weights yet
    model = load_model(checkpoint, "cpu", dtype, quantization=quant)
    rss_loaded = proc_status_mib("VmRSS")
    tokenizer = get_tokenizer(checkpoint)
    row = {"config": config, "dtype": str(dtype).removeprefix("torch."), "weights_mib": model_size_bytes(model) / 2**20,
           "rss_base_mib": rss_base, "rss_loaded_mib": rss_loaded}
    row["perplexity"] = perplexity(model, tokenizer.encode(PPL_TEXT.read_text())[:model.config.block_size])

    # (random_head picks fp32 when the LM head is int8: cast it to the activations' dtype)
    if args.draft == "random":
        head = random_head(model, seed=0).to(dtype)
    else:
        head = load_head(args.draft, model, "cpu", dtype)
    tree = gen.default_tree("cpu", config)  # the dynamic tree generate.py picks for these weights here
    drafter = Drafter(head, "dynamic", tree["depth"], tree["top_k"], tree["total_tokens"])
    row["tree"] = f"depth {tree['depth']}, top-k {tree['top_k']}, {tree['total_tokens']} nodes"
    prompts = [ids for _, ids in load_prompts(args.prompts_file, tokenizer, model.checkpoint_config, args.prompts)]
    cache = max(map(len, prompts)) + args.max_new_tokens + drafter.headroom + 1
    if args.compile:
        gen.decode_one_token = gen.compile_step(gen.decode_one_token)
        gen.draft_step = gen.compile_step(gen.draft_step)
        gen.verify_step = gen.compile_step(gen.verify_step)

    def run(ids, n, draft):
        model.setup_caches(1, cache)
        t0 = time.perf_counter()
        tokens, stats = gen.generate(model, torch.tensor(ids, dtype=torch.int), n, draft=draft, temperature=0)
        return tokens, stats, time.perf_counter() - t0

    outputs = {}
    for name, draft in (("plain", None), ("eagle", drafter)):
        t0 = time.perf_counter()
        run(prompts[0][:64], 16, draft)  # compile / warm caches, timed apart
        row[f"{name}_warmup_s"] = time.perf_counter() - t0
        runs = [run(ids, args.max_new_tokens, draft) for ids in prompts]
        outputs[name] = [tokens for tokens, _, _ in runs]
        row[f"{name}_tokens_per_s"] = sum(len(t) for t, _, _ in runs) / sum(s for _, _, s in runs)
        if draft is not None:
            row["tau"] = statistics.fmean(st["mean_accepted"] for _, st, _ in runs)  # new tokens per verification
    row["exact"] = outputs["eagle"] == outputs["plain"]
    row["peak_rss_mib"] = proc_status_mib("VmHWM")
    return row


def ensure_quantized(checkpoint, name):
    """Write a quantized variant beside the checkpoint unless it is there already."""
    from generate import read_config
    try:
        Q.quantized_file(checkpoint, read_config(checkpoint), name)
    except gen.CheckpointError:
        mode, groupsize, head = Q.parse_name(name)
        print(f"writing {name} weights beside {checkpoint} ...", file=sys.stderr)
        Q.quantize_checkpoint(checkpoint, mode, groupsize, head)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=None)
    p.add_argument("--configs", default="float32,bfloat16,int8,int4.g32", help="comma-separated")
    p.add_argument("--quant_dtype", default="bfloat16", help="activation dtype of the quantized configs")
    p.add_argument("--draft", default="random", help="EAGLE head directory or head file, or 'random'")
    p.add_argument("--prompts_file", default=str(ROOT / "data" / "mt_bench.jsonl"))
    p.add_argument("--prompts", type=int, default=5, help="prompts timed per config")
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--compile", action="store_true", help="compile the decode, draft and verify steps")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one config, print its JSON
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(run_config(args)))
        return
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if args.quant_dtype not in DTYPES:
        die(f"unknown --quant_dtype {args.quant_dtype!r}; choose from {', '.join(DTYPES)}")
    if args.max_new_tokens < 1 or args.prompts < 1:
        die("--max_new_tokens and --prompts must be at least 1")
    if args.draft != "random" and not Path(args.draft).exists():  # (each config's process would fail on it)
        die(f"--draft {args.draft}: no such head directory or file")
    if not Path(args.prompts_file).is_file():
        die(f"--prompts_file {args.prompts_file}: no such file")
    try:
        checkpoint = args.checkpoint or default_checkpoint()
        for c in configs:
            if c not in DTYPES:
                Q.parse_name(c)
                ensure_quantized(checkpoint, c)
    except (gen.CheckpointError, Q.QuantizeError) as e:
        die(e)

    rows = []
    forward = list(argv if argv is not None else sys.argv[1:])
    for c in configs:
        print(f"running {c} ...", file=sys.stderr)
        out = subprocess.run([sys.executable, __file__, *forward, "--checkpoint", str(checkpoint), "--one", c],
                             stdout=subprocess.PIPE, text=True)
        if out.returncode != 0:
            die(f"config {c} failed (exit code {out.returncode}); its error is above")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))

    print(f"\n{checkpoint.name}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{'compiled' if args.compile else 'eager'}, {args.prompts} prompts x {args.max_new_tokens} new tokens, "
          f"EAGLE head: {args.draft}\n")
    print("| config | activations | weights MiB | perplexity | plain tok/s | EAGLE tok/s | speed-up | tree | tau "
          "| exact | RSS before load MiB | RSS loaded MiB | peak RSS MiB |\n" + "|---" * 13 + "|")
    for r in rows:
        print(f"| {r['config']} | {r['dtype']} | {r['weights_mib']:.0f} | {r['perplexity']:.3f} "
              f"| {r['plain_tokens_per_s']:.1f} | {r['eagle_tokens_per_s']:.1f} "
              f"| {r['eagle_tokens_per_s'] / r['plain_tokens_per_s']:.2f}x | {r['tree']} | {r['tau']:.2f} "
              f"| {'yes' if r['exact'] else 'NO'} | {r['rss_base_mib']:.0f} | {r['rss_loaded_mib']:.0f} "
              f"| {r['peak_rss_mib']:.0f} |")


if __name__ == "__main__":
    main()
