"""How often heads agree with their target on a run's held-out conversations: top-1 agreement at the first draft
step and when drafting on their own outputs for k more steps (the EAGLE papers' 0-α, 1-α, ... curves).

    python scripts/head_accuracy.py --run runs/smollm2-selfdistill --heads heads/smollm2-135m-eagle runs/smollm2-selfdistill/head

The held-out split is the run's (`train.py extract` keeps a stable 2% of conversations out of training). Every head
is scored on the same positions (same seed), so rows compare directly.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from eagle_head import EagleHead, load_head  # noqa: E402
from generate import CheckpointError, die, load_model  # noqa: E402
from train import load_features, multi_step_accuracy, run_checkpoint, ttt_accuracy, ttt_trainer  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, required=True, help="a train.py run directory (its feature shards)")
    p.add_argument("--heads", nargs="+", required=True, help="head directories to score")
    p.add_argument("--checkpoint", type=Path, default=None, help="the target (default: the run's)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--starts_per_seq", type=int, default=32)
    args = p.parse_args()
    try:
        _, val = load_features(args.run)
        target = load_model(run_checkpoint(args.checkpoint, args.run), "cpu", torch.float32, pack=False)
    except (FileNotFoundError, CheckpointError) as e:
        die(str(e))
    if not val:
        die(f"{args.run} has no held-out conversations")
    print(f"{len(val)} held-out conversations, {sum(int(s[2].sum()) for s in val)} assistant tokens; "
          f"top-1 agreement with the target at draft step k")
    print("| head | " + " | ".join(f"{k}-α" for k in range(args.steps + 1)) + " |")
    print("|---|" + "---|" * (args.steps + 1))
    with torch.no_grad():
        for d in args.heads:
            try:
                head = load_head(d, target, "cpu", torch.float32)
            except (FileNotFoundError, ValueError, KeyError) as e:
                die(f"{d}: {e}")
            head.setup_caches(max(len(s[0]) for s in val) + 64)
            head.layer.attention.kv_cache = None  # whole sequences, as in training
            if isinstance(head, EagleHead):
                acc = multi_step_accuracy(head, val, args.steps, args.starts_per_seq)
            else:
                if len(val[0]) < 5:
                    die(f"{args.run} has no fused features for the EAGLE-3 head {d} (extract --fused)")
                acc = ttt_accuracy(ttt_trainer(head, target, args.steps + 1), val)
            print(f"| {d} | " + " | ".join(f"{a:.3f}" for a in acc) + " |")


if __name__ == "__main__":
    main()
