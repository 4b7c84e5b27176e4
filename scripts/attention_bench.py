"""Time kernels.py's attention op alone at the default model's shape: a cache of 1032 slots, a causal prefix of 300,
a chain of T query rows past it (each seeing the ones before), 9 query heads over 3 KV heads, head_dim 64.

    python scripts/attention_bench.py [--threads 2] [--dtype bfloat16]

Prints the median of 7 rounds of 300 calls (microseconds a call, one layer's attention, the op's dispatch included).
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kernels  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 5, 9, 17])
    args = p.parse_args()
    if args.threads < 1 or not all(1 <= T <= 732 for T in args.sizes):
        sys.exit("error: --threads must be at least 1 and --sizes in 1..732 (the cache holds 1032 slots, 300 "
                 "of them a prefix)")
    if not kernels.load():
        sys.exit(f"error: kernels.py did not build here ({kernels._state.get('why')})")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype, H, KV, D, S, L = getattr(torch, args.dtype), 9, 3, 64, 1032, 300
    k, v = (torch.randn(1, KV, S, D).to(dtype) for _ in range(2))
    out = []
    for T in args.sizes:
        q = torch.randn(1, T, H, D).to(dtype).transpose(1, 2)  # (B, H, T, D) laid out as the model makes it
        mask = torch.zeros(1, T, S, dtype=torch.bool)
        mask[..., :L] = True
        for t in range(T):
            mask[0, t, L:L + t + 1] = True
        for _ in range(50):
            kernels.attention(q, k, v, mask)
        rounds = []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(300):
                kernels.attention(q, k, v, mask)
            rounds.append((time.perf_counter() - t0) / 300 * 1e6)
        out.append(f"T={T} {sorted(rounds)[3]:.1f} us")
    print(f"{kernels.isa()}, {args.threads} threads, {args.dtype}: " + ", ".join(out))


if __name__ == "__main__":
    main()
