"""Where a plain decode step's time goes, against the memory-bandwidth floor.

    python scripts/profile_decode.py --dtype bfloat16            # compiled (default), 200-token prefix
    python scripts/profile_decode.py --dtype bfloat16 --quant int4.g32

Decoding one token at batch 1 reads every weight once, so its floor is bytes of weights / read bandwidth. This
measures the read bandwidth (a large tensor summed, medians), the decode step (medians of interleaved rounds),
and prints the step as a fraction of the floor, then the PyTorch profiler's top operators by self CPU time.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import generate as gen  # noqa: E402
import kernels  # noqa: E402
from generate import DTYPES, model_size_bytes  # noqa: E402


def read_bandwidth(n_bytes=1 << 30, rounds=5):
    """Bytes per second one `sum` over a buffer far larger than the caches reads, on the threads torch uses."""
    x = torch.ones(n_bytes // 4, dtype=torch.float32)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return n_bytes / statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=None)
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--quant", default=None, help="a quantized variant (int8, int4.g32, ...)")
    p.add_argument("--prefix", type=int, default=200)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--no_compile", action="store_true")
    p.add_argument("--cpp_wrapper", action=argparse.BooleanOptionalAction, default=True,
                   help="compiled graphs launch their kernels from C++ (as generate.py does on a CPU)")
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args()
    if min(args.prefix, args.steps, args.top) < 1:
        gen.die("--prefix, --steps and --top must be at least 1")
    model = gen.load_model_or_die(args.checkpoint, "cpu", DTYPES[args.dtype], args.quant)
    gen.setup_caches_or_die(model, 1, args.prefix + args.steps + 8, f"--prefix {args.prefix} and --steps {args.steps}")
    if not args.no_compile and not gen.compiler_found("cpu"):
        print("no C++ compiler found (g++, c++ or clang++; $CXX): profiling eager steps", file=sys.stderr)
        args.no_compile = True
    if not args.no_compile:
        gen.compile_steps(cpp_wrapper=args.cpp_wrapper)  # as generate.py compiles it
    step = gen.decode_one_token
    tok, pos = torch.tensor([[42]], dtype=torch.int), torch.tensor([args.prefix])
    with torch.no_grad():
        model(torch.randint(0, 1000, (1, args.prefix)), torch.arange(args.prefix))
        for _ in range(3):
            step(model, tok, pos, temperature=0)  # compile and warm up
        times = []
        with gen.guards_checked_once(1):  # as inside a generation: guards checked on its first step only
            for _ in range(args.steps):
                t0 = time.perf_counter()
                step(model, tok, pos, temperature=0)
                times.append(time.perf_counter() - t0)
        bandwidth = read_bandwidth()
        with profile(activities=[ProfilerActivity.CPU]) as prof, gen.guards_checked_once(1):
            for _ in range(10):
                step(model, tok, pos, temperature=0)
    ms = statistics.median(times) * 1e3
    weights = model_size_bytes(model)
    floor_ms = weights / bandwidth * 1e3
    print(f"{args.dtype}{', ' + args.quant if args.quant else ''}, {'eager' if args.no_compile else 'compiled' + (' (C++ launcher)' if args.cpp_wrapper else '')}, "
          f"kernels {kernels.isa()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"weights read per token: {weights / 2**20:.0f} MiB; read bandwidth: {bandwidth / 1e9:.1f} GB/s; "
          f"floor {floor_ms:.1f} ms/token ({1e3 / floor_ms:.0f} tokens/s)")
    print(f"decode step: {ms:.1f} ms/token ({1e3 / ms:.1f} tokens/s) = {floor_ms / ms:.0%} of the floor, "
          f"{weights / ms / 1e6:.1f} GB/s")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))


if __name__ == "__main__":
    main()
