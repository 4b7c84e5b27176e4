"""How close each weight variant stays to the fp32 model on real text: mean NLL of the next token, top-1 agreement with
fp32's argmax, and mean KL(fp32 || variant) per position, teacher-forced over the prompts' own tokens.

    python scripts/quant_agreement.py --configs bfloat16,int8.head8,int4.g32.head8,int4i.head8

Text: the first --mt_bench MT-bench first turns and --humaneval HumanEval prompts (data/), each its own sequence of
at most 256 tokens. Quantized variants run with bf16 activations through the CPU kernels, as generate.py runs them
(not compiled: the same kernels); missing variants are written beside the checkpoint first (quantize.py's files).
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from generate import DTYPES, ROOT, default_checkpoint, die, load_model_or_die  # noqa: E402
from model import CheckpointError  # noqa: E402
from quantize import QuantizeError, parse_name  # noqa: E402
from scripts.quant_report import ensure_quantized  # noqa: E402
from tokenizer import get_tokenizer  # noqa: E402


@torch.no_grad()
def log_probs(model, sequences):
    out = []
    for ids in sequences:
        model.setup_caches(1, len(ids))
        out.append(F.log_softmax(model(torch.tensor([ids]), torch.arange(len(ids)))[0].float(), -1))
    return out


def scores(sequences, lp, ref):
    """(mean NLL of the next token, top-1 agreement with ref, mean KL(ref || lp)) over every position."""
    positions = sum(len(s) for s in sequences)
    nll = sum(-l[:-1].gather(1, torch.tensor(s[1:])[:, None]).sum().item() for s, l in zip(sequences, lp))
    agree = sum((l.argmax(-1) == r.argmax(-1)).sum().item() for l, r in zip(lp, ref))
    kl = sum((r.exp() * (r - l)).sum().item() for l, r in zip(lp, ref))
    return nll / (positions - len(sequences)), agree / positions, kl / positions


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=None)
    p.add_argument("--configs", default="bfloat16,int8.head8,int4.g32.head8,int4i.head8",
                   help="comma-separated: float dtypes or quantized variants' names")
    p.add_argument("--mt_bench", type=int, default=20, help="MT-bench first turns (of 80)")
    p.add_argument("--humaneval", type=int, default=40, help="HumanEval prompts (of 164)")
    args = p.parse_args(argv)
    if args.mt_bench < 0 or args.humaneval < 0 or args.mt_bench + args.humaneval == 0:
        die("--mt_bench and --humaneval must be >= 0, and not both 0")
    checkpoint = args.checkpoint or default_checkpoint()
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    try:
        for c in configs:
            if c in DTYPES:
                continue
            parse_name(c)
            ensure_quantized(checkpoint, c)
    except (QuantizeError, CheckpointError, FileNotFoundError) as e:
        die(str(e))
    data = ROOT / "data"
    texts = [json.loads(line)["turns"][0] for line in (data / "mt_bench.jsonl").open()][:args.mt_bench]
    texts += [json.loads(line)["prompt"] for line in (data / "humaneval.jsonl").open()][:args.humaneval]
    tok = get_tokenizer(checkpoint)
    sequences = [ids for ids in (tok.encode(t)[:256] for t in texts) if len(ids) > 1]
    positions = sum(len(s) for s in sequences)
    print(f"{len(sequences)} sequences, {positions} tokens; against fp32")
    ref = log_probs(load_model_or_die(checkpoint, "cpu", torch.float32), sequences)
    print("| weights | mean NLL | top-1 = fp32 | KL(fp32 \\|\\| it) |\n|---|---|---|---|")
    for c in ["float32"] + configs:
        dtype, quant = (DTYPES[c], None) if c in DTYPES else (torch.bfloat16, c)
        lp = ref if c == "float32" else log_probs(load_model_or_die(checkpoint, "cpu", dtype, quant), sequences)
        nll, agree, kl = scores(sequences, lp, ref)
        print(f"| {c} | {nll:.4f} | {agree:.4f} | {kl:.5f} |")


if __name__ == "__main__":
    main()
