"""Python source from this interpreter's standard library as plain-text training data for a head (code the
target continues, as in HumanEval), with no download: JSONL records {"id", "text"} that `train.py extract --data`
reads. Each text is one top-level function or class (with the module's imports as context when they fit), so a
head learns the target's predictions over code it has not seen as chat.

    python scripts/make_code_texts.py --out runs/code_texts.jsonl --limit 1500
    python train.py extract --out runs/RUN --data runs/code_texts.jsonl --num_conversations 1500 \\
        --shard_prefix code_ --shard_size 64 --max_len 768 --fused

Tests, the IDE and the 2to3 fixers are left out (unlike the code users write); HumanEval's prompts are not in the
standard library, and `train.py` drops any record that contains a benchmark prompt anyway.
"""
import argparse
import ast
import os
import random
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from train import write_jsonl  # noqa: E402

SKIP_DIRS = {"idlelib", "lib2to3", "site-packages", "__pycache__", "turtledemo", "ensurepip"}


def source_files(root: Path):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("test"))  # test, tests
        for name in sorted(filenames):
            if name.endswith(".py") and not name.startswith("test"):
                yield Path(dirpath) / name


def pieces(path: Path, min_chars: int, max_chars: int):
    """(name, text) for each top-level def or class of min_chars..max_chars characters, after the module's
    imports where those fit too."""
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    lines = text.splitlines(keepends=True)
    imports = "".join("".join(lines[n.lineno - 1:n.end_lineno]) for n in tree.body
                      if isinstance(n, (ast.Import, ast.ImportFrom)))
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        body = "".join(lines[start - 1:node.end_lineno])
        if not min_chars <= len(body) <= max_chars:
            continue
        if imports and len(imports) + len(body) <= max_chars:
            body = imports + "\n\n" + body
        yield node.name, body


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/code_texts.jsonl")
    p.add_argument("--limit", type=int, default=1500, help="texts written (a seeded sample of all pieces)")
    p.add_argument("--min_chars", type=int, default=400)
    p.add_argument("--max_chars", type=int, default=3000, help="about 800 tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--root", default=sysconfig.get_paths()["stdlib"], help="source tree (default: the standard library)")
    args = p.parse_args()
    if args.limit <= 0 or not 0 < args.min_chars <= args.max_chars:
        sys.exit("error: --limit must be positive and 0 < --min_chars <= --max_chars")
    root = Path(args.root)
    tree_name = "stdlib" if args.root == sysconfig.get_paths()["stdlib"] else root.name  # ids: NAME/path.py:def
    found = [(f"{tree_name}/{path.relative_to(root)}:{name}", text)
             for path in source_files(root) for name, text in pieces(path, args.min_chars, args.max_chars)]
    if not found:
        sys.exit(f"error: no Python source found under {root}")
    random.Random(args.seed).shuffle(found)
    chosen = found[:args.limit]
    out = Path(args.out)
    write_jsonl(out, chosen)  # {"id", "text"} records, atomically
    chars = sum(len(t) for _, t in chosen)
    print(f"wrote {out}: {len(chosen)} of {len(found)} pieces of {root}, {chars / 1e6:.2f}M characters")


if __name__ == "__main__":
    main()
