"""Tokens/s of batched plain decoding at several batch sizes (prompts of different lengths, left-padded).

    python scripts/batch_throughput.py                      # bf16 (auto), compiled, B = 1, 8, 32
    python scripts/batch_throughput.py --dtype float32 --batch_sizes 1 4 16 --new_tokens 64

Prompts are the MT-bench first turns (data/mt_bench.jsonl) in the chat template, cycled to fill a batch; EOS is
ignored so every row decodes --new_tokens tokens. Decoding is timed apart from the prefill (a run of 1 token is
subtracted from a run of --new_tokens). Each batch size is compiled and warmed up first; then the sizes run in
turn, --rounds times, and the best round counts (the machine is shared).
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import generate as gen  # noqa: E402
import kernels  # noqa: E402
from benchmark import load_prompts  # noqa: E402
from generate import DTYPES, default_checkpoint  # noqa: E402
from tokenizer import get_tokenizer  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    p.add_argument("--quant", default=None)
    p.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--new_tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no_compile", action="store_true")
    args = p.parse_args()
    if min(args.batch_sizes) < 1 or args.new_tokens < 1 or args.rounds < 1:
        gen.die("--batch_sizes, --new_tokens and --rounds must be at least 1")
    checkpoint = args.checkpoint or default_checkpoint()
    dtype = gen.fastest_dtype("cpu") if args.dtype == "auto" else args.dtype
    model = gen.load_model_or_die(checkpoint, "cpu", DTYPES[dtype], args.quant)
    prompts = [ids for _, ids in load_prompts(gen.ROOT / "data" / "mt_bench.jsonl", get_tokenizer(checkpoint),
                                              model.checkpoint_config, 0)]
    cache = -(-(max(len(ids) for ids in prompts) + args.new_tokens) // 64) * 64
    if not args.no_compile:
        gen.compile_steps()
    batches = {B: [prompts[i % len(prompts)] for i in range(B)] for B in args.batch_sizes}
    best, prefill = {}, {}
    for r in range(args.rounds + 1):  # round 0 compiles and warms up
        for B, batch in batches.items():
            gen.setup_caches_or_die(model, B, cache, f"the longest prompt and --new_tokens {args.new_tokens}")
            t0 = time.perf_counter()
            gen.generate_batch(model, batch, 1, temperature=0)  # the prefill and its first token
            t1 = time.perf_counter()
            rows = gen.generate_batch(model, batch, args.new_tokens, temperature=0)
            t2 = time.perf_counter()
            # decoding alone: the long run minus the prefill run (the prompts are the same)
            tps = sum(len(row) - 1 for row in rows) / ((t2 - t1) - (t1 - t0))
            if r:
                best[B] = max(best.get(B, 0), tps)
                prefill[B] = min(prefill.get(B, 1e9), t1 - t0)
    print(f"{dtype}{', ' + args.quant if args.quant else ''}, {'eager' if args.no_compile else 'compiled'}, kernels "
          f"{kernels.isa()}, {torch.get_num_threads()} threads, torch {torch.__version__}; {args.new_tokens} new tokens "
          f"a row, MT-bench prompts of {min(len(i) for i in prompts)}-{max(len(i) for i in prompts)} tokens")
    print("| batch | decode tokens/s | vs batch 1 | prefill s (all rows) |\n|---|---|---|---|")
    base = best.get(1)
    for B, tps in best.items():
        print(f"| {B} | {tps:.1f} | {f'{tps / base:.2f}x' if base else '-'} | {prefill[B]:.2f} |")


if __name__ == "__main__":
    main()
