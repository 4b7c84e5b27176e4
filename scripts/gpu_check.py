"""The GPU check: what this project does on one CUDA GPU, measured in a few minutes with nothing downloaded.

    python scripts/gpu_check.py                       # on a GPU: ~2 minutes, writes gpu_check.json and gpu_check.md
    python scripts/gpu_check.py --tiny --device cpu   # the same code at tiny shapes on the CPU (tests/test_gpu_check.py)

1. Plain decoding of a random-weight model of Llama-2-7B's shape (32 layers, dim 4096, vocabulary 32000) in bf16
   and in int4 (groups of 32, torch's CUDA kernel): tokens/s against the memory-bandwidth floor, the bandwidth
   measured in the same run (a device-to-device copy).
2. The verify-cost curve: one forward over T = 1..64 tokens with a tree mask, relative to T = 1; and the logits of a
   5-token forward against 5 one-token steps (where bf16 exactness is won or lost).
3. EAGLE at controlled acceptance, bf16 and fp32: an oracle drafter proposes the target's own greedy continuation as
   a chain and is wrong with probability p at each depth, so τ is set by p; tokens/s against τ, next to plain
   decoding, and how many tokens equal plain decoding's.
4. The EAGLE cycle with a random head for three trees, against a plain step (the break-even τ); then the same at a
   small shape (--small, SmolLM2-135M's), with an fp32 oracle check there.
5. The CUDA tests (pytest -m "not slow" -k cuda on the test files that have CUDA cases), skipped with --no_tests.

Every timed step is captured once as a CUDA graph and replayed (torch.cuda.CUDAGraph on the eager code, so there
is no compile time to wait for); on the CPU the same functions run as they are. Weights are random (nothing to
download): speed does not depend on their values, and the oracle makes acceptance independent of a trained head.
"""
import argparse
import contextlib
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import generate as gen  # noqa: E402
from eagle_head import random_head, tree_ancestors, tree_attention_mask  # noqa: E402
import model as model_module  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402

SHAPES = {"llama-2-7b": ModelArgs.from_name("llama-2-7b"),
          "tiny": ModelArgs(block_size=512, vocab_size=512, n_layer=2, n_head=4, n_local_heads=2, dim=128,
                            intermediate_size=256)}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


class Replay:
    """fn() captured as a CUDA graph on CUDA (replayed by calling this), or fn itself on the CPU."""

    def __init__(self, fn, device):
        self.fn, self.graph = fn, None
        if device.type == "cuda":
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up outside the graph (allocator, kernels' workspaces)
                    self.out = fn()
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = fn()

    def __call__(self):
        if self.graph is None:
            return self.fn()
        self.graph.replay()
        return self.out


class Graphed:
    """A step function (generate.decode_one_token, generate.eagle_cycle) run as CUDA graphs: one per input shape
    and sampling setting, its tensor arguments copied into the graph's own input buffers at each call (what
    torch.compile's mode="reduce-overhead" does, without the compile time)."""

    def __init__(self, fn, device):
        self.fn, self.device, self.graphs = fn, device, {}

    def __call__(self, *args, **kwargs):
        if self.device.type != "cuda":
            return self.fn(*args, **kwargs)
        tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        # one graph per input shape AND per non-tensor argument (the model, the drafter): a graph captured with one
        # drafter replays that drafter's kernels whatever object is passed later
        key = (tuple((i, args[i].shape, args[i].dtype) for i in tensors),
               tuple(id(a) for a in args if not isinstance(a, torch.Tensor)), tuple(sorted(kwargs.items())))
        if key not in self.graphs:
            static = list(args)
            for i in tensors:
                static[i] = args[i].clone()
            replay = Replay(lambda: self.fn(*static, **kwargs), self.device)
            self.graphs[key] = (replay, static)
        replay, static = self.graphs[key]
        for i in tensors:
            static[i].copy_(args[i])
        return replay()


@contextlib.contextmanager
def graphed_steps(device):
    """generate.py's decode step and EAGLE cycle as Graphed (CUDA graphs) while inside; restored after."""
    saved = gen.decode_one_token, gen.eagle_cycle
    gen.decode_one_token, gen.eagle_cycle = Graphed(gen.decode_one_token, device), Graphed(gen.eagle_cycle, device)
    try:
        yield
    finally:
        gen.decode_one_token, gen.eagle_cycle = saved


def time_ms(fn, device, rounds=20):
    fn()
    sync(device)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def copy_bandwidth(device, n_bytes):
    """Bytes a second the device moves in a large copy (read + write), and the read rate it implies (half)."""
    x = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    ms = time_ms(lambda: y.copy_(x), device, rounds=10)
    return 2 * n_bytes / (ms / 1e3)


def random_model(args: ModelArgs, device, dtype, quant=None, seed=0):
    """Random weights of the given shape, built in `dtype` directly on the device (no fp32 copy of 7B weights)."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Transformer(args).to(dtype)
    model = model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0, args.dim ** -0.5)
    model = model.eval()
    if quant == "int4":
        import quantize as Q
        Q.quantize_model(model, "int4", 32)
        Q.prepare(model.to(device), dtype, pack=device.type == "cpu")
    elif device.type == "cpu":
        from model import pack_weights
        pack_weights(model)
    return model


def decode_speed(model, device, prefix, steps):
    model.setup_caches(1, prefix + steps + 80)
    with torch.no_grad():
        model(torch.randint(0, 100, (1, prefix), device=device), torch.arange(prefix, device=device))
        tok = torch.zeros(1, 1, dtype=torch.int, device=device)
        pos = torch.tensor([prefix], device=device)
        step = Replay(lambda: gen.decode_one_token(model, tok, pos, temperature=0), device)
        ms = time_ms(step, device, rounds=steps)
    return ms


def verify_curve(model, device, prefix, sizes):
    S = prefix + max(sizes) + 8
    model.setup_caches(1, S)
    out = {}
    with torch.no_grad():
        model(torch.randint(0, 100, (1, prefix), device=device), torch.arange(prefix, device=device))
        for T in sizes:  # a random tree of T nodes (every parent before its children)
            g = torch.Generator().manual_seed(T)
            parents = torch.tensor([0] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, T)],
                                   device=device)
            anc, depth = tree_ancestors(parents, T)
            L = torch.tensor([prefix], device=device)
            tokens = torch.randint(0, 100, (1, T), device=device)
            slots, mask, rope = L + torch.arange(T, device=device), tree_attention_mask(L, S, anc), L + depth
            step = Replay(lambda: model(tokens, slots, mask=mask, rope_pos=rope), device)
            out[T] = time_ms(step, device)
    return out


def step_vs_verify(model, device, prefix, T=5, reps=8):
    """Why bf16 EAGLE can differ from plain decoding on a GPU: the logits of T positions from one T-token forward
    against T one-token steps (same cache, same positions). Returns the fraction of positions whose argmax agrees,
    the largest logit difference, and the median gap between the top two logits."""
    model.setup_caches(1, prefix + T + 8)
    agree, diffs, gaps = [], [], []
    with torch.no_grad():
        for r in range(reps):
            torch.manual_seed(r)
            model(torch.randint(0, 100, (1, prefix), device=device), torch.arange(prefix, device=device))
            toks = torch.randint(0, 100, (1, T), device=device)
            many = model(toks, prefix + torch.arange(T, device=device))[0].float()
            ones = torch.cat([model(toks[:, i:i + 1], torch.tensor([prefix + i], device=device))[0]
                              for i in range(T)]).float()
            agree += (many.argmax(-1) == ones.argmax(-1)).tolist()
            diffs.append(float((many - ones).abs().max()))
            top2 = ones.topk(2, dim=-1).values
            gaps += (top2[:, 0] - top2[:, 1]).tolist()
    return {"T": T, "argmax_agree": round(sum(agree) / len(agree), 3), "max_logit_diff": round(max(diffs), 4),
            "median_top2_gap": round(statistics.median(gaps), 4)}


class OracleChain(gen.Drafter):
    """Drafts the target's own greedy continuation (known in advance), each token replaced by a wrong one with
    probability p (drawn once per position, so the graph replays it): acceptance at every depth is 1 - p, and
    τ = sum over k <= depth of (1 - p)^k."""

    def __init__(self, head, future, depth, p, seed=0):
        super().__init__(head, "chain", depth=depth)
        g = torch.Generator().manual_seed(seed)
        self.future = future
        self.miss = (torch.rand(future.numel() + depth + 1, generator=g) < p).to(future.device)

    def draft(self, h_root, L):
        idx = (L + 1 + torch.arange(self.depth, device=L.device)).clamp(max=self.future.numel() - 1)
        tokens = self.future[idx]
        wrong = self.miss[L + 1 + torch.arange(self.depth, device=L.device)]
        return torch.where(wrong, (tokens + 1) % 100, tokens), torch.arange(self.depth, device=L.device)


def eagle_at_acceptance(model, device, prompt_len, new_tokens, depth, ps):
    """tokens/s of EAGLE with the oracle chain at each miss probability p, and of plain decoding, in one run, the
    steps graphed on CUDA; and how many of EAGLE's tokens equal plain decoding's."""
    prompt = torch.randint(0, 100, (prompt_len,), device=device, dtype=torch.int)
    cache = prompt_len + new_tokens + depth + 8
    with graphed_steps(device):
        model.setup_caches(1, cache)
        plain, _ = gen.generate(model, prompt, new_tokens, temperature=0)
        future = torch.cat([prompt, torch.tensor(plain, device=device, dtype=torch.int)]).long()
        head = random_head(model)
        t0 = time.perf_counter()
        gen.generate(model, prompt, new_tokens, temperature=0)
        sync(device)
        plain_tps = new_tokens / (time.perf_counter() - t0)
        rows = []
        for p in ps:
            drafter = OracleChain(head, future, depth, p)
            gen.generate(model, prompt, 8, temperature=0, draft=drafter)  # warm up (and capture)
            t0 = time.perf_counter()
            tokens, stats = gen.generate(model, prompt, new_tokens, temperature=0, draft=drafter)
            sync(device)
            tps = len(tokens) / (time.perf_counter() - t0)
            # recorded (tokens equal to plain decoding before the first difference), not asserted: bf16 on a GPU is
            # exact only while every kernel rounds a row alike whatever the rows (model.padded_query_rows), and a run
            # where that breaks should still report
            same = next((i for i, (a, b) in enumerate(zip(tokens, plain)) if a != b), len(tokens))
            rows.append({"p_miss": p, "tau": round(stats["mean_accepted"], 3), "tokens_per_s": round(tps, 1),
                         "speedup": round(tps / plain_tps, 3), "equal_prefix": same, "tokens": len(tokens)})
    return plain_tps, rows


def cycle_cost(model, device, prompt_len, new_tokens, trees):
    """ms of one EAGLE cycle (draft with a random head + verify + accept) for each tree, against one plain step:
    the break-even τ is their ratio (speed-up = τ x plain step / cycle). A random head is almost never right,
    so nearly every cycle commits one token and the time per cycle is the time per target forward."""
    prompt = torch.randint(0, 100, (prompt_len,), device=device, dtype=torch.int)
    head, rows = random_head(model), []
    with graphed_steps(device):
        model.setup_caches(1, prompt_len + new_tokens + 40)
        gen.generate(model, prompt, 8, temperature=0)
        t0 = time.perf_counter()
        gen.generate(model, prompt, new_tokens, temperature=0)
        sync(device)
        step_ms = (time.perf_counter() - t0) * 1e3 / new_tokens
        for name, tree in trees.items():
            drafter = gen.Drafter(head, tree["kind"], depth=tree["depth"], top_k=tree.get("top_k", 1),
                                  total_tokens=tree.get("total_tokens", tree["depth"]))
            gen.generate(model, prompt, 8, temperature=0, draft=drafter)
            t0 = time.perf_counter()
            _, stats = gen.generate(model, prompt, new_tokens, temperature=0, draft=drafter)
            sync(device)
            ms = (time.perf_counter() - t0) * 1e3 / stats["target_forwards"]
            rows.append({"tree": name, "cycle_ms": round(ms, 3), "break_even_tau": round(ms / step_ms, 3)})
    return round(step_ms, 3), rows


CYCLE_TREES = {"chain 4": dict(kind="chain", depth=4),
               "tree 4 nodes (depth 3, top 2)": dict(kind="dynamic", depth=3, top_k=2, total_tokens=4),
               "tree 8 nodes (depth 4, top 3)": dict(kind="dynamic", depth=4, top_k=3, total_tokens=8)}


def run_tests(device, timeout=240):
    files = ["tests/test_generate.py", "tests/test_eagle.py", "tests/test_quantize.py"]
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "not slow", "-k", "cuda", *files], cwd=ROOT,
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"returncode": None, "summary": f"timed out after {timeout} s"}
    lines = (r.stdout + r.stderr).strip().splitlines() or [""]
    return {"returncode": r.returncode, "summary": lines[-1], "tail": lines[-40:] if r.returncode else []}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU test); default Llama-2-7B's")
    p.add_argument("--small", default="smollm2-135m", help="a second, small shape: bf16 decoding, verify cost and "
                   "cycle cost only (launch-bound on a GPU: what CUDA graphs are for); 'none' skips it")
    p.add_argument("--no_tests", action="store_true")
    p.add_argument("--small_t", type=int, default=None,
                   help="model.SMALL_T: steps up to this many tokens use the matmul attention, and on CUDA every shorter "
                        "one is padded to it (model.padded_query_rows); default 32. To weigh the padding's cost: 16")
    p.add_argument("--out", type=Path, default=None, help="JSON results (default: gpu_check.json)")
    p.add_argument("--doc", type=Path, default=None, help="markdown report (default on CUDA: gpu_check.md)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA GPU here (run with --tiny --device cpu for the CPU version)", file=sys.stderr)
        return 2
    try:
        small = None if args.small == "none" else ModelArgs.from_name(args.small)
    except ValueError as e:
        print(f"error: --small: {e}", file=sys.stderr)
        return 2
    if args.small_t is not None:
        if args.small_t < 1:
            print("error: --small_t must be at least 1", file=sys.stderr)
            return 2
        model_module.SMALL_T = args.small_t
    shape = SHAPES["tiny" if args.tiny else "llama-2-7b"]
    prefix, steps = (32, 10) if args.tiny else (512, 50)
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
               "torch": torch.__version__, "shape": "tiny" if args.tiny else "llama-2-7b", "small_t": model_module.SMALL_T}
    t_start = time.perf_counter()
    out = args.out or ROOT / "gpu_check.json"
    doc = args.doc or (ROOT / "gpu_check.md" if device.type == "cuda" else None)
    for flag, path in (("--out", args.out), ("--doc", args.doc)):  # saved after every stage: checked first
        if (msg := gen.output_path_error(flag, path)) is not None:
            print(f"error: {msg}", file=sys.stderr)
            return 2

    def save():  # after every stage: a run cut short still leaves what it measured
        results["seconds"] = round(time.perf_counter() - t_start, 1)
        out.write_text(json.dumps(results, indent=2) + "\n")
        if doc:
            write_doc(results, doc)
        print(json.dumps(results), flush=True)

    bw = copy_bandwidth(device, 1 << (24 if args.tiny else 31))
    results["copy_bandwidth_GBps"] = round(bw / 1e9, 1)
    results["decode"] = decode = {}
    for quant in (None, "int4"):
        model = random_model(shape, device, torch.bfloat16, quant)
        weight_bytes = gen.model_size_bytes(model)
        ms = decode_speed(model, device, prefix, steps)
        floor_ms = weight_bytes / (bw / 2) * 1e3  # reading the weights once, at the copy's read rate
        decode[quant or "bf16"] = {"ms_per_token": round(ms, 3), "tokens_per_s": round(1e3 / ms, 1),
                                   "weights_GB": round(weight_bytes / 1e9, 2), "floor_ms": round(floor_ms, 3),
                                   "fraction_of_floor": round(floor_ms / ms, 3)}
        save()
        if quant is None:
            sizes = [1, 2, 4, 8, 16, 32, 64]
            curve = verify_curve(model, device, prefix, sizes)
            results["verify_cost"] = {T: {"ms": round(v, 3), "vs_T1": round(v / curve[1], 3)} for T, v in curve.items()}
            results["bf16_step_vs_verify"] = step_vs_verify(model, device, prefix)
            save()
            plain_tps, rows = eagle_at_acceptance(model, device, prefix, 24 if args.tiny else 96, depth=4,
                                                  ps=[0.0, 0.2, 0.4, 0.7])
            results["eagle_oracle"] = {"depth": 4, "plain_tokens_per_s": round(plain_tps, 1), "rows": rows}
            save()
            step_ms, rows = cycle_cost(model, device, prefix, 16 if args.tiny else 48, CYCLE_TREES)
            results["cycle_cost"] = {"plain_step_ms": step_ms, "rows": rows}
            save()
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if device.type == "cuda":  # the oracle in fp32, where the verify forward and the one-token step agree
        model = random_model(shape, device, torch.float32)
        plain_tps, rows = eagle_at_acceptance(model, device, prefix, 96, depth=4, ps=[0.0, 0.2, 0.4, 0.7])
        results["eagle_oracle_fp32"] = {"depth": 4, "plain_tokens_per_s": round(plain_tps, 1), "rows": rows}
        save()
        del model
        torch.cuda.empty_cache()
    if small is not None and not args.tiny:
        model = random_model(small, device, torch.bfloat16)
        ms = decode_speed(model, device, prefix, steps)
        curve = verify_curve(model, device, prefix, [1, 4, 8, 16])
        step_ms, rows = cycle_cost(model, device, prefix, 48, CYCLE_TREES)
        results["small"] = {"shape": args.small, "ms_per_token": round(ms, 3), "tokens_per_s": round(1e3 / ms, 1),
                            "verify_vs_T1": {T: round(v / curve[1], 3) for T, v in curve.items()},
                            "cycle_cost": {"plain_step_ms": step_ms, "rows": rows}}
        save()
        del model
        # exactness where rounding cannot differ by M as much: fp32 (TF32 off), the oracle at two miss rates
        model = random_model(small, device, torch.float32)
        plain_tps, rows = eagle_at_acceptance(model, device, prefix, 96, depth=4, ps=[0.0, 0.4])
        results["small_fp32_oracle"] = {"plain_tokens_per_s": round(plain_tps, 1), "rows": rows}
        save()
        del model
    if not args.no_tests and device.type == "cuda":
        results["tests"] = run_tests(device)
        save()
    return 0


def write_doc(r, path):
    """The markdown report of whatever stages have run."""
    lines = [f"# Measured on {r['device']} (scripts/gpu_check.py, torch {r['torch']}, {r['shape']} shape, random "
             f"weights, SMALL_T {r.get('small_t', 32)}, one run of {r['seconds']} s)", "",
             f"Copy bandwidth: {r['copy_bandwidth_GBps']} GB/s (read + write).", "",
             "| weights | ms/token | tokens/s | weights GB | floor ms | fraction of floor |", "|---|---|---|---|---|---|"]
    for k, d in r["decode"].items():
        lines.append(f"| {k} | {d['ms_per_token']} | {d['tokens_per_s']} | {d['weights_GB']} | {d['floor_ms']} | "
                     f"{d['fraction_of_floor']:.0%} |")
    if "verify_cost" in r:
        lines += ["", "| T | " + " | ".join(map(str, r["verify_cost"])) + " |",
                  "|---|" + "---|" * len(r["verify_cost"]),
                  "| verify cost vs T=1 | " + " | ".join(str(v["vs_T1"]) for v in r["verify_cost"].values()) + " |"]
    if "bf16_step_vs_verify" in r:
        d = r["bf16_step_vs_verify"]
        lines += ["", f"bf16, {d['T']}-token forward vs {d['T']} one-token steps: argmax agrees at {d['argmax_agree']:.0%} "
                  f"of positions; largest logit difference {d['max_logit_diff']}, median top-2 gap {d['median_top2_gap']}."]
    for key in ("eagle_oracle", "eagle_oracle_fp32"):
        if key not in r:
            continue
        o = r[key]
        lines += ["", f"EAGLE, oracle chain of {o['depth']}, {'fp32' if key.endswith('fp32') else 'bf16'} "
                  f"(plain {o['plain_tokens_per_s']} tokens/s):", "",
                  "| miss probability | τ | tokens/s | speed-up | tokens equal to plain decoding |", "|---|---|---|---|---|"]
        lines += [f"| {x['p_miss']} | {x['tau']} | {x['tokens_per_s']} | {x['speedup']}x | {x['equal_prefix']} of "
                  f"{x['tokens']} |" for x in o["rows"]]
    for title, c in [(r["shape"], r.get("cycle_cost")), (r.get("small", {}).get("shape"), r.get("small", {}).get("cycle_cost"))]:
        if c:
            lines += ["", f"EAGLE cycle with a random head, {title} (plain step {c['plain_step_ms']} ms):", "",
                      "| tree | cycle ms | break-even τ |", "|---|---|---|"]
            lines += [f"| {x['tree']} | {x['cycle_ms']} | {x['break_even_tau']} |" for x in c["rows"]]
    if "small" in r:
        sm = r["small"]
        lines += ["", f"{sm['shape']}, bf16: {sm['ms_per_token']} ms/token ({sm['tokens_per_s']} tokens/s); verify cost "
                  "vs T=1: " + ", ".join(f"T={T} {v}" for T, v in sm["verify_vs_T1"].items()) + "."]
    if "small_fp32_oracle" in r:
        lines += ["", f"{r['small']['shape']} in fp32, oracle chain of 4: " + "; ".join(
            f"miss {x['p_miss']}: τ {x['tau']}, {x['equal_prefix']} of {x['tokens']} tokens equal to plain decoding"
            for x in r["small_fp32_oracle"]["rows"]) + "."]
    if "tests" in r:
        lines += ["", f"CUDA tests: {r['tests']['summary']} (exit code {r['tests']['returncode']})."]
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
