"""The verify-cost curve: one target forward over T tree tokens, relative to one plain decode step (T=1).

    python scripts/verify_cost.py --dtype bfloat16 --sizes 1 8 16 32 64
    python scripts/verify_cost.py --dtype bfloat16 --quant int8 --sizes 1 5 --profile   # and where each T's time goes
    python scripts/verify_cost.py --quant int8.head8 int4.g32.a8.head8 --sizes 1 5 9   # variants in turn, one process

This is what sizes the draft tree for a machine: tokens a verification can check for about the price of one
decode step are nearly free. Each T runs with the static KV cache at a realistic prefix length, a tree mask, and
(by default) the forward compiled for that shape; the sizes are timed interleaved, several rounds, medians. With
several --quant variants each is loaded and compiled in this one process and they are timed in turn, round by
round: on a noisy host the one fair comparison of their absolute times.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from eagle_head import tree_ancestors, tree_attention_mask  # noqa: E402
import generate as gen  # noqa: E402
import kernels  # noqa: E402
from generate import DTYPES  # noqa: E402
import model as model_module  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=None)
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--quant", nargs="+", default=[None], help="a quantized variant (int8, int4.g32, ...), or several")
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    p.add_argument("--prefix", type=int, default=200, help="tokens already in the cache")
    p.add_argument("--rounds", type=int, default=30,
                   help="rounds of 3 forwards a size, sizes interleaved; the median is reported (with 7 the ratios "
                        "moved by up to 0.1 between runs on a noisy host; with 40, by 0.01-0.05)")
    p.add_argument("--no_compile", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="then the PyTorch profiler's operators for each T: the linears, attention, the compiled "
                        "graph's own kernels, ms a forward")
    p.add_argument("--cpp_wrapper", action=argparse.BooleanOptionalAction, default=True,
                   help="compiled graphs launch their kernels from C++ (as generate.py does on a CPU)")
    p.add_argument("--small_t", type=int, default=None,
                   help="use the matmul attention up to this many query tokens (model.SMALL_T; 0 = SDPA always)")
    args = p.parse_args()
    if min(args.sizes) < 1 or args.rounds < 1 or args.prefix < 1:
        gen.die("--sizes, --rounds and --prefix must be at least 1")
    if args.small_t is not None and args.small_t < 0:
        gen.die("--small_t must be 0 or more")
    if args.small_t is not None:
        model_module.SMALL_T = args.small_t
    S = args.prefix + max(args.sizes) + 8
    if not args.no_compile:
        gen.compile_steps(cpp_wrapper=args.cpp_wrapper)  # the settings generate.py compiles with
        # one graph a size and variant for the one verify function: more than Dynamo's default of 8 with variants
        limit = 2 * len(args.sizes) * len(args.quant)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
    runs = {}  # variant -> (step, inputs)
    for quant in args.quant:
        model = gen.load_model_or_die(args.checkpoint, "cpu", DTYPES[args.dtype], quant)
        gen.setup_caches_or_die(model, 1, S, f"--prefix {args.prefix} and {max(args.sizes)} tokens")
        with torch.no_grad():
            model(torch.randint(0, 1000, (1, args.prefix)), torch.arange(args.prefix))

        def verify(tokens, slots, mask, rope_pos, model=model):
            return model(tokens, slots, mask=mask, rope_pos=rope_pos, return_features=True)

        step = verify if args.no_compile else gen.compile_step(verify)
        torch.manual_seed(0)  # every variant the same trees and tokens
        inputs = {}
        for T in args.sizes:  # a random tree of T nodes (each node's parent comes before it)
            parents = torch.tensor([0] + [int(torch.randint(0, i, (1,))) for i in range(1, T)])
            anc, depth = tree_ancestors(parents, T)
            L = torch.tensor([args.prefix])
            inputs[T] = (torch.randint(0, 1000, (1, T)), L + torch.arange(T), tree_attention_mask(L, S, anc), L + depth)
            with torch.no_grad():
                for _ in range(2):  # compile and warm up
                    step(*inputs[T])
        runs[quant] = (step, inputs)
    times = {(quant, T): [] for quant in args.quant for T in args.sizes}
    with torch.no_grad():
        for _ in range(args.rounds):
            for quant, (step, inputs) in runs.items():
                for T in args.sizes:
                    step(*inputs[T])  # guarded: the right graph for this size
                    with gen.guards_checked_once(1):
                        t0 = time.perf_counter()
                        for _ in range(3):
                            step(*inputs[T])
                        times[quant, T].append((time.perf_counter() - t0) / 3)
    for quant, (step, inputs) in runs.items():
        base = statistics.median(times[quant, args.sizes[0]])
        how = "eager" if args.no_compile else "compiled" + (" (C++ launcher)" if args.cpp_wrapper else "")
        print(f"{args.dtype}{', ' + quant if quant else ''}, {how}, prefix {args.prefix}, "
              f"kernels {kernels.isa()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
        print("| T | ms | relative to T=%d |\n|---|---|---|" % args.sizes[0])
        for T in args.sizes:
            m = statistics.median(times[quant, T])
            print(f"| {T} | {m * 1e3:.1f} | {m / base:.2f} |")
        if args.profile:
            profile_sizes(step, inputs)


def profile_sizes(step, inputs, calls=10):
    """Self CPU time a forward of each operator (top 6), per T, from one profiled run of `calls` forwards."""
    from torch.profiler import ProfilerActivity, profile
    for T, x in inputs.items():
        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(calls):
                step(*x)
        ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:6]
        print(f"T={T}: " + ", ".join(f"{e.key[:40]} {e.self_cpu_time_total / calls / 1e3:.2f} ms" for e in ops))


if __name__ == "__main__":
    main()
