"""What reading the weights from 2 MB pages gives a compiled forward (model.pack_weights puts every tensor of 64 KB+
there, kernels.on_huge_pages), against the same weights on ordinary 4 KB pages, in one process.

    python scripts/huge_pages_bench.py                                   # int8.head8, T = 1 and 4
    python scripts/huge_pages_bench.py --quant int4.g32.a8.head8 --sizes 1 5 9 17
    EAGLE_KERNELS=avx2 python scripts/huge_pages_bench.py                # the AVX2 build

The model is loaded twice; the second copy's large tensors are copied back to ordinary memory (a 4 MB+ one
madvised as pack() did before, so the comparison is with what shipped until then). Both copies' forwards are
compiled and timed in turn, round by round, each with its own KV cache holding the same prefix: a noisy host moves
both alike. Prints each size's median ms and the median of the per-round ratios. Linux only (MADV_HUGEPAGE).
"""
import argparse
import ctypes
import mmap
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from eagle_head import tree_ancestors, tree_attention_mask  # noqa: E402
import generate as gen  # noqa: E402
import kernels  # noqa: E402
from model import move_large_tensors  # noqa: E402


def on_ordinary_pages(tensors):
    """Copies in ordinary memory; one of 4 MB+ madvised as pack() did before this change (its whole 2 MB pages)."""
    libc, copies = ctypes.CDLL(None), []
    for t in tensors:
        c = torch.empty_like(t.data)
        start = -(-c.data_ptr() // kernels.HUGE_PAGE) * kernels.HUGE_PAGE
        end = (c.data_ptr() + c.nbytes) // kernels.HUGE_PAGE * kernels.HUGE_PAGE
        if end > start:
            libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_HUGEPAGE)
        copies.append(c.copy_(t.data))
    return copies


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quant", default="int8.head8", help="a quantized variant, or 'none' for --dtype weights")
    p.add_argument("--dtype", default="bfloat16", choices=list(gen.DTYPES))
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 4])
    p.add_argument("--prefix", type=int, default=200, help="tokens already in the cache")
    p.add_argument("--rounds", type=int, default=14)
    args = p.parse_args()
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        gen.die("2 MB pages are asked for on Linux only (no mmap.MADV_HUGEPAGE here)")
    if min(args.sizes) < 1 or args.rounds < 1 or args.prefix < 1:
        gen.die("--sizes, --rounds and --prefix must be at least 1")
    quant = None if args.quant == "none" else args.quant
    torch.manual_seed(0)
    S = args.prefix + max(args.sizes) + 8
    prefix = torch.randint(0, 1000, (1, args.prefix))
    steps = {}
    for name in ("2 MB pages", "4 KB pages"):
        model = gen.load_model_or_die(None, "cpu", gen.DTYPES[args.dtype], quant)
        gen.setup_caches_or_die(model, 1, S, f"--prefix {args.prefix} and {max(args.sizes)} tokens")
        if name == "4 KB pages":
            move_large_tensors(model, on_ordinary_pages)
        with torch.no_grad():
            model(prefix, torch.arange(args.prefix))
        steps[name] = gen.compile_step(lambda tokens, slots, mask, rope_pos, model=model: model(
            tokens, slots, mask=mask, rope_pos=rope_pos, return_features=True))
    gen.compile_steps(cpp_wrapper=gen.default_cpp_wrapper("cpu"))
    inputs = {}
    for T in args.sizes:  # a random tree of T tokens after the prefix
        parents = torch.tensor([0] + [int(torch.randint(0, i, (1,))) for i in range(1, T)])
        anc, depth = tree_ancestors(parents, T)
        L = torch.tensor([args.prefix])
        inputs[T] = (torch.randint(0, 1000, (1, T)), L + torch.arange(T), tree_attention_mask(L, S, anc), L + depth)
    ms = {(name, T): [] for name in steps for T in args.sizes}
    with torch.no_grad():
        for T in args.sizes:  # compile, and check that the two copies compute the same logits
            with gen.guards_checked_once(0):
                a, b = (steps[name](*inputs[T])[0] for name in steps)
            if not torch.equal(a, b):
                gen.die(f"the two copies' logits differ at T = {T}")
        with gen.guards_checked_once(1):
            for r in range(args.rounds):
                for name in (list(steps) if r % 2 else list(steps)[::-1]):
                    for T in args.sizes:
                        steps[name](*inputs[T])
                        t0 = time.perf_counter()
                        for _ in range(10):
                            steps[name](*inputs[T])
                        ms[(name, T)].append((time.perf_counter() - t0) / 10 * 1e3)
    print(f"{args.dtype}, {quant or 'float weights'}, compiled, kernels {kernels.isa()}, {torch.get_num_threads()} "
          f"threads, prefix {args.prefix}, {args.rounds} rounds")
    print("| T | 4 KB pages, ms | 2 MB pages, ms | ratio (per-round median) | rounds faster on 2 MB pages |")
    print("|---|---|---|---|---|")
    for T in args.sizes:
        a, b = ms[("4 KB pages", T)], ms[("2 MB pages", T)]
        ratio = statistics.median(y / x for x, y in zip(a, b))
        faster = sum(y < x for x, y in zip(a, b))
        print(f"| {T} | {statistics.median(a):.3f} | {statistics.median(b):.3f} | {ratio:.3f} | {faster}/{len(a)} |")


if __name__ == "__main__":
    main()
