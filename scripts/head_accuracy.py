"""How often heads agree with their target on a run's held-out conversations: top-1 agreement at the first draft
step and when drafting on their own outputs for k more steps (the EAGLE papers' 0-α, 1-α, ... curves).

    python scripts/head_accuracy.py --run runs/smollm2-selfdistill --heads heads/smollm2-135m-eagle runs/smollm2-selfdistill/head
    python scripts/head_accuracy.py --replies docs/benchmark/mt_bench_bf16.json --heads heads/smollm2-135m-eagle

--run: the run's held-out split (`train.py extract` keeps a stable 2% of conversations out of training). --replies: a
benchmark.py result instead: its prompts and plain decoding's replies to them, teacher-forced (MT-bench first turns
for the README's table). Every head is scored on the same positions (same seed), so rows compare directly.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmark import load_prompts  # noqa: E402
from eagle_head import EagleHead, default_feature_layers, load_head  # noqa: E402
from generate import ROOT, CheckpointError, default_checkpoint, die, load_model  # noqa: E402
from tokenizer import get_tokenizer  # noqa: E402
from train import load_features, multi_step_accuracy, run_checkpoint, ttt_accuracy, ttt_trainer  # noqa: E402


@torch.no_grad()
def benchmark_sequences(result_path: Path, target, checkpoint: Path) -> list:
    """A benchmark.py result -> one sequence a prompt: the prompt and plain decoding's reply (the loss mask on the
    reply), with the target's features as train.py extract stores them (final, fused, top-1)."""
    result = json.loads(result_path.read_text())
    plain = next((m for name, m in result["methods"].items() if name.startswith("plain")), None)
    if plain is None:
        raise ValueError(f"{result_path} has no plain decoding run to take the replies from")
    path = Path(result["prompts"])
    prompts = dict(load_prompts(path if path.is_absolute() else ROOT / path,
                                get_tokenizer(checkpoint), target.checkpoint_config, 0))
    layers = (*default_feature_layers(target.config.n_layer), target.config.n_layer)
    seqs = []
    for row in plain["per_prompt"]:
        prompt = prompts[row["id"]]
        full = torch.tensor(prompt + row["token_ids"])
        target.setup_caches(1, len(full) + 8)
        logits, hidden = target(full[None], torch.arange(len(full)), return_features=True, feature_layers=layers)
        mask = torch.zeros(len(full), dtype=torch.uint8)
        mask[len(prompt):] = 1
        seqs.append((full, hidden[-1][0].to(torch.bfloat16), mask, torch.cat(hidden[:3], -1)[0].to(torch.bfloat16),
                     logits[0].argmax(-1)))
    return seqs


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--run", type=Path, help="a train.py run directory (its feature shards)")
    where.add_argument("--replies", type=Path, help="a benchmark.py result: its prompts and plain decoding's replies")
    p.add_argument("--heads", nargs="+", required=True, help="head directories to score")
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="the target (default: the run's, or the default model)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--starts_per_seq", type=int, default=32)
    args = p.parse_args()
    try:
        checkpoint = run_checkpoint(args.checkpoint, args.run) if args.run else args.checkpoint or default_checkpoint()
        target = load_model(checkpoint, "cpu", torch.float32, pack=False)
    except (FileNotFoundError, CheckpointError) as e:
        die(str(e))
    heads = {}
    for d in args.heads:
        try:
            heads[d] = load_head(d, target, "cpu", torch.float32)
        except (FileNotFoundError, ValueError, KeyError) as e:
            die(f"{d}: {e}")
        fed = tuple(default_feature_layers(target.config.n_layer))  # the layers extract --fused stores
        if not isinstance(heads[d], EagleHead) and tuple(heads[d].feature_layers) != fed:
            die(f"{d} reads target layers {list(heads[d].feature_layers)}; the features scored here are layers "
                f"{list(fed)}")
    try:  # the fused features only where an EAGLE-3 head reads them (three quarters of a --fused shard's bytes)
        val = (load_features(args.run, fused=any(not isinstance(h, EagleHead) for h in heads.values()))[1]
               if args.run else benchmark_sequences(args.replies, target, checkpoint))
    except json.JSONDecodeError as e:
        die(f"{args.replies}: not a benchmark.py result ({e})")
    except (FileNotFoundError, ValueError, KeyError) as e:
        die(str(e))
    if not val:
        die(f"{args.run or args.replies} has no {'held-out conversations' if args.run else 'replies'}")
    print(f"{len(val)} {'held-out conversations' if args.run else 'benchmark replies'}, "
          f"{sum(int(s[2].sum()) for s in val)} assistant tokens; top-1 agreement with the target at draft step k")
    print("| head | " + " | ".join(f"{k}-α" for k in range(args.steps + 1)) + " |")
    print("|---|" + "---|" * (args.steps + 1))
    with torch.no_grad():
        for d, head in heads.items():
            head.setup_caches(max(len(s[0]) for s in val) + 64)
            for layer in head.layers():
                layer.attention.kv_cache = None  # whole sequences, as in training
            if isinstance(head, EagleHead):
                acc = multi_step_accuracy(head, val, args.steps, args.starts_per_seq)
            else:
                if len(val[0]) < 5:
                    die(f"{args.run or args.replies} has no fused features for the EAGLE-3 head {d} (extract --fused)")
                acc = ttt_accuracy(ttt_trainer(head, target, args.steps + 1), val)
            print(f"| {d} | " + " | ".join(f"{a:.3f}" for a in acc) + " |")


if __name__ == "__main__":
    main()
