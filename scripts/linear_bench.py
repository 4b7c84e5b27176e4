"""Time kernels.py's linear op alone on one layer of the default model's shapes (wqkv 960 x 576, wo 576 x 576,
w1 and w3 1536 x 576, w2 576 x 1536), random weights, times 30 layers.

    python scripts/linear_bench.py [--weights int4|int8|bfloat16] [--rows 1 5 9] [--fuse_gate_up] [--stream]
                                   [--act_bits 16|8]

--fuse_gate_up: w1 and w3 as one 3072 x 576 weight, one call instead of two (what fusing them would save).
Prints the median of 7 rounds of 100 layers, in ms for 30 layers: one layer's weights, so they stay in the caches
(the kernels' arithmetic). --stream: 30 layers' own weights (w1 and w3 fused) and the 49152 x 576 LM head, as a
forward reads them from memory (on 2 MB pages, as model.pack_weights leaves them); the median of 15 passes, in ms a
forward. --act_bits 8: int8 and int4 weights with x rounded to 8 bits in groups of 32 (the .a8 variants; AVX2 and
AVX-512 VNNI builds).
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kernels  # noqa: E402


def weight(kind, N, K, act_bits=16):
    """(packed, scales, offsets) of a random N x K weight, packed for act_bits."""
    if kind == "int4":
        packed = kernels.pack(torch.randint(0, 256, (N, K // 2), dtype=torch.uint8), act_bits)
        # the scales and offsets laid out as quantize.py's prepare() lays them out: fp16 values (quantize_int4's),
        # so tall blocks read them in fp16
        scales, offsets = (torch.rand(N, K // 32) / 15).half().float(), -torch.rand(N, K // 32).half().float()
        return (packed, *kernels.tile_groups(scales, offsets, packed))
    if kind == "int8":
        return kernels.pack(torch.randint(-127, 128, (N, K), dtype=torch.int8), act_bits), torch.rand(N) / 127, None
    return kernels.pack(torch.randn(N, K).bfloat16() / K ** 0.5), None, None


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", default="int4", choices=["int4", "int8", "bfloat16"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 5, 9])
    p.add_argument("--fuse_gate_up", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--stream", action="store_true", help="30 layers' own weights and the LM head (from memory)")
    p.add_argument("--act_bits", type=int, default=16, choices=[16, 8])
    args = p.parse_args()
    if args.threads < 1 or min(args.rows) < 1:
        sys.exit("error: --threads and --rows must be at least 1")
    if not kernels.load():
        sys.exit(f"error: kernels.py did not build here ({kernels._state.get('why')})")
    if args.act_bits == 8 and (args.weights == "bfloat16"
                               or not kernels.a8_takes(*weight(args.weights, 64, 576, 8)[:2])):
        sys.exit(f"error: --act_bits 8 takes int8 or int4 weights where kernels.py runs them so (this build: "
                 f"{kernels.isa()}; see kernels.a8_takes)")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    fused = args.fuse_gate_up or args.stream
    shapes = [(960, 576), (576, 576)] + ([(3072, 576)] if fused else [(1536, 576)] * 2) + [(576, 1536)]
    if args.stream:
        shapes = shapes * 30 + [(49152, 576)]
    layer = [(weight(args.weights, N, K, args.act_bits), K) for N, K in shapes]
    if args.stream:  # on 2 MB pages, as model.pack_weights leaves a model's weights
        flat = kernels.on_huge_pages([t for w, _ in layer for t in w if t is not None])[::-1]
        layer = [(tuple(None if t is None else flat.pop() for t in w), K) for w, K in layer]
    out = []
    for M in args.rows:
        xs = [torch.randn(M, K).bfloat16() for _, K in layer]

        def run():
            for ((w, sc, of), _), x in zip(layer, xs):
                kernels.linear(x, w, None, sc, of, act_bits=args.act_bits)
        for _ in range(3 if args.stream else 20):
            run()
        rounds = []
        if args.stream:
            for _ in range(15):
                t0 = time.perf_counter()
                run()
                rounds.append((time.perf_counter() - t0) * 1e3)
            out.append(f"M={M} {sorted(rounds)[7]:.2f} ms")
            continue
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(100):
                run()
            rounds.append((time.perf_counter() - t0) / 100 * 30 * 1e3)
        out.append(f"M={M} {sorted(rounds)[3]:.2f} ms")
    what = ("30 layers' own weights + LM head, a forward" if args.stream
            else f"{'w1+w3 fused, ' if args.fuse_gate_up else ''}30 layers")
    print(f"{kernels.isa()}, {args.threads} threads, {args.weights}, x in {args.act_bits} bits, {what}: "
          + ", ".join(out))


if __name__ == "__main__":
    main()
