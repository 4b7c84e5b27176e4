"""Where one EAGLE cycle's time goes, against a plain decode step, and the speed-up that predicts.

    python scripts/cycle_cost.py                          # bf16, compiled, the shipped head, the default tree
    python scripts/cycle_cost.py --dtype float32 --quant int4.g32 --tree chain
    python scripts/cycle_cost.py --quant int8.head8 --profile 25    # and the operators and kernels a cycle runs

A cycle is: feed the head what the last verification accepted and draft a tree (the draft), one target forward
over the root and the tree (the verification forward), pick the accepted path and move its K/V entries
(acceptance and compaction), read the result on the host (the one sync), plus what the Python loop and Dynamo's
guard check add. Each part is compiled on its own and timed on the state a real generation reached (a chat prompt,
then some cycles), interleaved, medians; the whole cycle is timed as generate() runs it. Speed-up at a given τ
(new tokens per cycle) is τ x plain step / cycle: what the kernels and the loop allow, for a head that reaches τ.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import generate as gen  # noqa: E402
import kernels  # noqa: E402
from eagle_head import tree_ancestors, tree_attention_mask  # noqa: E402
from generate import DTYPES, default_checkpoint  # noqa: E402
from tokenizer import apply_chat_template, get_tokenizer  # noqa: E402

PROMPT = "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences."


def median_ms(fn, rounds):
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=None)
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--quant", default=None, help="a quantized variant (int8, int4.g32, ...)")
    p.add_argument("--draft", default=str(gen.DEFAULT_HEAD), help="head directory, or 'random'")
    p.add_argument("--draft_quant", default="auto", help="the head's weights, as generate.py's --draft_quant")
    p.add_argument("--tree", default="dynamic", choices=["chain", "static", "dynamic"])
    # unset tree flags: generate.py's default for these weights here (gen.default_tree)
    p.add_argument("--depth", type=int, default=None)
    p.add_argument("--draft_top_k", type=int, default=None)
    p.add_argument("--total_tokens", type=int, default=None)
    p.add_argument("--speculate_k", type=int, default=None)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--cpp_wrapper", action=argparse.BooleanOptionalAction, default=True,
                   help="compiled graphs launch their kernels from C++ (as generate.py does on a CPU)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="then profile 30 cycles and 30 plain steps and print the N operators and Inductor kernels "
                        "with the most time a call (compiled with Inductor's kernel profiling: a cold compile)")
    args = p.parse_args()
    if args.rounds < 1 or args.profile < 0:
        gen.die("--rounds must be at least 1 and --profile 0 or more")
    gen.fill_tree_defaults(args, args.quant or args.dtype, "cpu")
    if (msg := gen.check_tree(args)) is not None:
        gen.die(msg)
    checkpoint = args.checkpoint or default_checkpoint()
    model = gen.load_model_or_die(checkpoint, "cpu", DTYPES[args.dtype], args.quant)
    dtype = model.norm.weight.dtype
    head = gen.random_head(model) if args.draft == "random" else gen.load_draft_head(args.draft, model, "cpu", dtype, args.draft_quant)
    drafter = gen.tree_drafter(head, args.tree, argparse.Namespace(**vars(args), tree_paths=None))
    config = model.checkpoint_config
    prompt = get_tokenizer(checkpoint).encode(apply_chat_template(
        [{"role": "user", "content": PROMPT}], config.get("chat_template"), config.get("default_system_prompt")))
    S = len(prompt) + 128 + drafter.headroom + 64
    model.setup_caches(1, S)

    draft_only = gen.compile_step(gen.draft_step)
    verify_only = gen.compile_step(gen.verify_step)
    forward_only = gen.compile_step(lambda tokens, slots, mask, rope_pos: model(
        tokens, slots, mask=mask, rope_pos=rope_pos, return_features=True))
    if args.profile:  # each C++ kernel of a compiled graph reports to the profiler under its own name
        torch._inductor.config.cpp.enable_kernel_profile = True
    gen.compile_steps(cpp_wrapper=args.cpp_wrapper)

    # a real state: the prompt and 64 generated tokens, then the inputs the next cycle gets
    ids = torch.tensor(prompt, dtype=torch.int)
    t0 = time.perf_counter()
    tokens, stats = gen.generate(model, ids, 64, draft=drafter, temperature=0)
    print(f"compile and warm-up: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    state = {}
    real_cycle = gen.eagle_cycle

    def capture(*a, **kw):
        state["args"], state["kwargs"] = a, kw
        return real_cycle(*a, **kw)

    gen.eagle_cycle = capture
    tokens, stats = gen.generate(model, ids, 128, draft=drafter, temperature=0)
    gen.eagle_cycle = real_cycle
    # a cycle inside generate(): the difference of a long and a short generation, so the prefill cancels out
    runs = {}
    for n in (32, 128, 32, 128):
        t0 = time.perf_counter()
        _, st = gen.generate(model, ids, n, draft=drafter, temperature=0)
        runs.setdefault(n, []).append(((time.perf_counter() - t0) * 1e3, st["verify_forwards"]))
    (short_ms, short_cycles), (long_ms, long_cycles) = min(runs[32]), min(runs[128])
    m, d, features, next_tokens, start, n_accepted = state["args"]
    tree_tokens, parents, L = gen.draft_step(d, features, next_tokens, start, n_accepted)
    N1 = tree_tokens.numel()
    anc, depth = tree_ancestors(parents, d.depth)
    verify_in = (tree_tokens[None].int(), L + torch.arange(N1), tree_attention_mask(L, S, anc), L + depth)
    plain_in = (model, torch.tensor([[int(tokens[-1])]], dtype=torch.int), torch.tensor([len(prompt) + len(tokens)]))

    parts = {
        "plain decode step": lambda: gen.decode_one_token(*plain_in, temperature=0),
        "draft (head update + tree)": lambda: draft_only(d, features, next_tokens, start, n_accepted),
        f"verification forward ({N1} tokens)": lambda: forward_only(*verify_in),
        "verification step (forward, acceptance, K/V compaction)":
            lambda: verify_only(model, tree_tokens, parents, L, d.depth, temperature=0),
        "whole cycle, compiled call + host sync": lambda: real_cycle(*state["args"], **state["kwargs"])[-1].tolist(),
    }
    with torch.no_grad():
        for fn in parts.values():  # compile and warm up the parts
            fn(), fn()
        times = {k: [] for k in parts}
        for _ in range(3):  # interleaved blocks of rounds, medians of all
            for k, fn in parts.items():
                with gen.guards_checked_once(1):
                    times[k].append(median_ms(fn, args.rounds // 3 or 1))
        guarded = median_ms(lambda: real_cycle(*state["args"], **state["kwargs"])[-1].tolist(), 10)
    ms = {k: statistics.median(v) for k, v in times.items()}
    plain, cycle = ms["plain decode step"], ms["whole cycle, compiled call + host sync"]
    per_cycle_loop = (long_ms - short_ms) / max(long_cycles - short_cycles, 1)
    launcher = " (C++ launcher)" if args.cpp_wrapper else ""
    print(f"{args.dtype}{', ' + args.quant if args.quant else ''}, compiled{launcher}, kernels {kernels.isa()}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}; tree {args.tree}, {N1 - 1} nodes, "
          f"prefix {int(L)} tokens")
    print("| part | ms | in plain steps |\n|---|---|---|")
    for k, v in ms.items():
        print(f"| {k} | {v:.2f} | {v / plain:.2f} |")
    fwd = ms[f"verification forward ({N1} tokens)"]
    print(f"| acceptance + K/V compaction (verification step - forward) | "
          f"{ms['verification step (forward, acceptance, K/V compaction)'] - fwd:.2f} | |")
    print(f"| Dynamo guard check, if every call were guarded | {guarded - cycle:.2f} | |")
    print(f"| a cycle inside generate() (Python loop, one sync; prefill excluded) | {per_cycle_loop:.2f} | "
          f"{per_cycle_loop / plain:.2f} |")
    print(f"\nτ on this prompt: {stats['mean_accepted']:.2f}. Speed-up over plain decoding that the measured cycle "
          f"({per_cycle_loop:.2f} ms in generate) gives at τ:")
    for tau in (stats["mean_accepted"], 2.0, 2.5, 3.0):
        print(f"  τ = {tau:.2f}: {tau * plain / per_cycle_loop:.2f}x")
    if args.profile:
        for name, fn in (("plain decode step", parts["plain decode step"]),
                         ("draft", parts["draft (head update + tree)"]),
                         ("whole cycle", parts["whole cycle, compiled call + host sync"])):
            print_profile(name, fn, args.profile)


def print_profile(name, fn, top, calls=30):
    """The profiler's operators and kernels by self CPU time, ms a call. Inductor's kernels are named for the ops
    they fuse ("graph_1_cpp_fused_..."); "## Call CompiledFxGraph" is the graph's Python launcher itself."""
    from torch.profiler import ProfilerActivity, profile
    with torch.no_grad(), gen.guards_checked_once(1), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) / 1e3 / calls
    print(f"\n{name}: {total:.2f} ms of self CPU time a call; the top {top}\n| ms a call | calls a call | name |\n|---|---|---|")
    for e in events[:top]:
        print(f"| {e.self_cpu_time_total / 1e3 / calls:.3f} | {e.count / calls:g} | {e.key[:100]} |")


if __name__ == "__main__":
    main()
