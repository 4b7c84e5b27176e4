"""train.py: data loading and masking, batching, the loss, validation metrics, and `fit` end to end on a tiny
target (features, checkpoints, resume after a real kill, DDP with two processes, bad inputs, --help)."""
import gzip
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import train
from conftest import ROOT, free_port, make_tiny_model
from eagle_head import EagleHead, head_config_from_target, load_head, random_head, save_head, target_info
from generate import Drafter, load_model
from tokenizer import apply_chat_template

# subprocess runs: one thread each, so two runs of the same computation are bit-identical
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors gain nothing from threads, and on busy cores they make each op far slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------- data

def test_iter_json_list_truncated_file_and_small_chunks(tmp_path):
    records = [{"id": str(i), "text": f"record {i}, with [brackets], {{braces}}, \"quotes\" and ünïcode " * (i + 1)}
               for i in range(8)] + [17, [1, 2], "s"]
    full = json.dumps(records, indent=1, ensure_ascii=False)
    path = tmp_path / "list.json"
    path.write_text("\n  " + full, encoding="utf-8")
    for chunk in (1, 7, 64, 1 << 20):
        assert list(train.iter_json_list(path, chunk_chars=chunk)) == records
    cut = full.index('"record 6')  # inside record 6's string: records 0-5 complete, 6 cut off
    path.write_text(full[:cut], encoding="utf-8")
    for chunk in (1, 7, 64, 1 << 20):
        assert list(train.iter_json_list(path, chunk_chars=chunk)) == records[:6]
    path.write_text('{"not": "a list"}')
    with pytest.raises(ValueError, match="not a JSON list"):
        list(train.iter_json_list(path))


def test_normalise_formats():
    sharegpt = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"},
                                  {"from": "human", "value": "dangling question"}]}
    assert train.normalise(sharegpt) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    chat = {"messages": [{"role": "system", "content": "be brief"}, {"role": "User", "content": "q"},
                         {"role": "assistant", "content": "a"}]}
    assert [m["role"] for m in train.normalise(chat)] == ["system", "user", "assistant"]
    assert train.normalise({"text": "plain"}) == "plain"
    for bad in ({}, {"text": 3}, {"conversations": "x"}, {"conversations": [{"from": "human", "value": "only q"}]},
                {"conversations": [{"from": "alien", "value": "?"}, {"from": "gpt", "value": "a"}]},
                {"conversations": [{"from": "human", "value": None}, {"from": "gpt", "value": "a"}]}):
        assert train.normalise(bad) is None, bad


def test_load_examples_from_jsonl_drops_benchmark_prompts(tmp_path, monkeypatch):
    bench = "Compose an engaging travel blog post about a recent trip to Hawaii"
    monkeypatch.setattr(train, "benchmark_prompts", lambda: [bench])
    rows = [{"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
            {"id": "bench", "conversations": [{"from": "human", "value": bench.replace(" ", "\n  ", 3) + "!"},
                                              {"from": "gpt", "value": "ok"}]},
            {"id": "bad", "conversations": [{"from": "human", "value": "unanswered"}]},
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}]},
            {"text": "just text"}]
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    got = train.load_examples(str(data), 100)
    assert [i for i, _ in got] == ["a", "1", "2"]  # records without an id are numbered as kept
    assert got[2][1] == "just text"
    assert [i for i, _ in train.load_examples(str(data), 2)] == ["a", "1"]
    assert [i for i, _ in train.load_examples(str(data), 100, skip=2)] == ["2"]
    with pytest.raises(ValueError, match="has 3 usable records .* none left after --skip_conversations 3"):
        train.load_examples(str(data), 100, skip=3)  # past the end: an error, not an empty pass
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="has 0 usable records"):
        train.load_examples(str(tmp_path / "empty.jsonl"), 10)
    packed = tmp_path / "d.jsonl.gz"  # committed data is gzipped: read as it is
    with gzip.open(packed, "wt", encoding="utf-8") as f:
        f.write(data.read_text())
    assert train.load_examples(str(packed), 100) == got
    (tmp_path / "bad.jsonl.gz").write_text("not gzip")  # a bad file: one clear error naming it
    with pytest.raises(ValueError, match="bad.jsonl.gz: not a JSONL file"):
        train.load_examples(str(tmp_path / "bad.jsonl.gz"), 10)
    with pytest.raises(FileNotFoundError, match="--data"):
        train.load_examples(str(tmp_path / "missing.jsonl"), 10)


def test_make_code_texts_writes_whole_definitions_that_load_as_texts(tmp_path, monkeypatch):
    """scripts/make_code_texts.py: each text is one whole top-level def or class within the size bounds, after the
    module's imports; test directories and unparsable files are skipped; train.load_examples reads them as texts."""
    src = tmp_path / "lib"
    (src / "pkg").mkdir(parents=True)
    (src / "test").mkdir()
    body = "    '''Add.'''\n" + "    x = a + b\n" * 20 + "    return x\n"
    (src / "pkg" / "mod.py").write_text("import os\nfrom math import pi\n\nX = 1\n\n\n@staticmethod\ndef add(a, b):\n"
                                        + body + "\n\ndef tiny():\n    pass\n\n\nclass Big:\n" + "    y = 2\n" * 400)
    (src / "pkg" / "broken.py").write_text("def oops(:\n" + "    pass\n" * 50)
    (src / "test" / "mod.py").write_text("def test_add(a, b):\n" + body)
    out = tmp_path / "code.jsonl"
    proc = subprocess.run([sys.executable, "scripts/make_code_texts.py", "--root", str(src), "--out", str(out),
                           "--min_chars", "100", "--max_chars", "1000"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["lib/pkg/mod.py:add"]  # tiny() too short, Big too long, tests skipped
    text = rows[0]["text"]
    assert text.startswith("import os\nfrom math import pi\n\n\n@staticmethod\ndef add(a, b):\n")
    assert text.endswith("    return x\n")
    compile(text, "t", "exec")  # whole: it parses
    monkeypatch.setattr(train, "benchmark_prompts", lambda: [])
    assert train.load_examples(str(out), 10) == [("lib/pkg/mod.py:add", text)]
    bad = subprocess.run([sys.executable, "scripts/make_code_texts.py", "--root", str(src / "test" / "none"),
                          "--out", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode != 0 and bad.stderr.strip().startswith("error: no Python source found")


def test_benchmark_prompts_found_when_flexeval_installed():
    import importlib.util
    if importlib.util.find_spec("flexeval") is None:
        pytest.skip("flexeval not installed")
    prompts = train.benchmark_prompts()
    assert prompts and all(isinstance(p, str) and 20 <= len(p) <= 120 for p in prompts)


def test_is_validation_is_stable_and_near_the_fraction():
    ids = [f"conv-{i}" for i in range(2000)]
    first = [train.is_validation(i, 0.1) for i in ids]
    assert first == [train.is_validation(i, 0.1) for i in reversed(ids)][::-1]
    assert 0.07 < sum(first) / len(ids) < 0.13
    assert not any(train.is_validation(i, 0.0) for i in ids)
    # a larger fraction only adds ids: the validation set of a run is never moved to training by another
    assert all(train.is_validation(i, 0.3) for i, v in zip(ids, first) if v)
    # ShareGPT's pieces of one conversation ("ID_0", "ID_15", ...) stay on one side of the split
    assert all(train.is_validation(f"{i}_0", 0.1) == train.is_validation(f"{i}_{k}", 0.1) == train.is_validation(i, 0.1)
               for i in ids[:300] for k in (1, 15, 23))


def test_a_shorter_pass_leaves_its_last_shard_to_be_redone(tmp_path):
    path = tmp_path / "shard_00002.safetensors"
    assert not train.shard_done(path, 50)
    train.atomic_save({"tokens": torch.zeros(3)}, path, metadata={"conversations": "50"})
    assert train.shard_done(path, 50) and not train.shard_done(path, 100)  # a longer pass fills it up
    train.atomic_save({"tokens": torch.zeros(3)}, path)  # written before the count was kept: done
    assert train.shard_done(path, 100)


# ---------------------------------------------------------------- tokenization and masks

def masked_runs(tok, ids, mask):
    """Decoded text of each maximal run of masked tokens."""
    runs, cur = [], []
    for i, m in zip(ids + [None], mask + [0]):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs


@pytest.mark.parametrize("first", ["user", "system", "assistant"])
def test_tokenize_masks_exactly_the_assistant_replies(real_tokenizer, first):
    tok, system = real_tokenizer, "You are a helpful assistant"
    ex = [{"role": "user", "content": "What is 2+2? Answer briefly."},
          {"role": "assistant", "content": "It is 4."},
          {"role": "user", "content": "And 3 + 3?"},
          {"role": "assistant", "content": "6, of course.\nAnything else?"}]
    if first == "system":
        ex = [{"role": "system", "content": "Talk like a pirate."}] + ex
    if first == "assistant":  # ShareGPT has conversations that open with the model's turn
        ex = [{"role": "assistant", "content": "Ahoy, ask me anything."}] + ex
    ids, mask = train.tokenize_example(ex, tok, "chatml", system, 10_000)
    assert len(ids) == len(mask)
    replies = [m["content"] + "<|im_end|>\n" for m in ex if m["role"] == "assistant"]
    assert masked_runs(tok, ids, mask) == replies
    # nothing is lost: the tokens are the whole rendered conversation minus the next assistant header
    assert tok.decode(ids) + "<|im_start|>assistant\n" == apply_chat_template(ex, "chatml", system)

    short_ids, short_mask = train.tokenize_example(ex, tok, "chatml", system, 20)
    assert len(short_ids) == len(short_mask) == 20
    assert short_ids == ids[:20] and short_mask == mask[:20]


def test_tokenize_plain_text_masks_everything(real_tokenizer):
    ids, mask = train.tokenize_example("Once upon a time, a tokenizer.", real_tokenizer, "chatml", "sys", 1000)
    assert ids == real_tokenizer.encode("Once upon a time, a tokenizer.") and mask == [1] * len(ids)
    ids, mask = train.tokenize_example("Once upon a time, a tokenizer.", real_tokenizer, "chatml", "sys", 3)
    assert len(ids) == len(mask) == 3


# ---------------------------------------------------------------- batches

def test_batches_for_epoch_deterministic_disjoint_full():
    lengths = torch.randint(5, 300, (103,), generator=torch.Generator().manual_seed(1)).tolist()
    a = train.batches_for_epoch(lengths, 8, 0, seed=3)
    assert a == train.batches_for_epoch(lengths, 8, 0, seed=3)
    assert a != train.batches_for_epoch(lengths, 8, 1, seed=3)
    assert a != train.batches_for_epoch(lengths, 8, 0, seed=4)
    for epoch in range(3):
        batches = train.batches_for_epoch(lengths, 8, epoch, seed=3)
        flat = [i for b in batches for i in b]
        assert len(batches) == 103 // 8 and all(len(b) == 8 for b in batches)
        assert len(set(flat)) == len(flat) and set(flat) <= set(range(103))
    assert train.batches_for_epoch(lengths[:5], 8, 0, seed=0) == []
    # the sequences left out of an epoch's batches are random ones, not always the longest
    longest = max(range(103), key=lambda i: lengths[i])
    assert any(longest in {i for b in train.batches_for_epoch(lengths, 8, e, seed=3) for i in b} for e in range(8))


def random_seq(n, dim=6, g=None):
    g = g or torch.Generator().manual_seed(n)
    return (torch.randint(0, 50, (n,), generator=g), torch.randn(n, dim, generator=g).to(torch.bfloat16),
            (torch.rand(n, generator=g) < 0.6).to(torch.uint8))


def test_make_batch_alignment_and_padding():
    seqs = [random_seq(n) for n in (7, 12, 4)]
    tokens, inputs, targets, mask = train.make_batch(seqs)
    assert tokens.shape == mask.shape == (3, 11) and inputs.shape == targets.shape == (3, 11, 6)
    for b, (tok, feat, m) in enumerate(seqs):
        n = len(tok) - 1
        for t in range(n):
            assert tokens[b, t] == tok[t + 1]
            assert torch.equal(inputs[b, t], feat[t].float()) and torch.equal(targets[b, t], feat[t + 1].float())
            assert mask[b, t] == m[t + 1]
        assert not mask[b, n:].any() and not inputs[b, n:].any() and not tokens[b, n:].any()


# ---------------------------------------------------------------- loss and metrics

def tiny_head(target, seed=0):
    torch.manual_seed(seed)
    head = EagleHead(head_config_from_target(target.config)).attach(target)
    head.setup_caches(128)
    head.layer.attention.kv_cache = None  # as fit() trains: whole sequences, no cache
    return head


def target_features(model, tokens):
    """The tiny target's real features (final normed hidden states) for a 1-D token sequence."""
    model.setup_caches(1, len(tokens))
    with torch.no_grad():
        _, feats = model(tokens[None], torch.arange(len(tokens)), return_features=True)
    return feats[0]


def test_eagle_loss_decreases_when_training_on_a_fixed_batch():
    target = make_tiny_model()
    g = torch.Generator().manual_seed(0)
    seqs = []
    for n in (20, 24, 17, 24):
        tok = torch.randint(0, 96, (n,), generator=g)
        seqs.append((tok, target_features(target, tok), torch.ones(n, dtype=torch.uint8)))
    batch = train.make_batch(seqs)
    target.requires_grad_(False)  # as fit() does
    head = tiny_head(target)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    losses, accs = [], []
    for _ in range(40):
        loss, count, correct = train.eagle_loss(head, head, *batch, noise=0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        accs.append(correct.item() / count.item())
    assert count == batch[3].sum()
    assert losses[-1] < 0.5 * losses[0] and accs[-1] > accs[0]
    # the target's embedding and LM head are shared, not part of the head (the optimizer never moves them)
    assert not {id(p) for p in head.parameters()} & {id(p) for p in target.parameters()}
    # --ce_weight: the token loss beside the feature regression, linear in its weight
    with torch.no_grad():
        l0, l1, l2 = (train.eagle_loss(head, head, *batch, noise=0, ce_weight=w)[0] for w in (0.0, 1.0, 2.0))
    assert l1 > l0 and torch.allclose(l2 - l1, l1 - l0, rtol=1e-4)


def head_trajectory(head, tok, f0):
    """Features that are the head's own predictions: f_{t+1} = head(f_<=t, x_<=t+1)."""
    feats = torch.zeros(len(tok), f0.numel())
    feats[0] = f0
    with torch.no_grad():
        for t in range(len(tok) - 1):
            feats[t + 1] = train.head_forward(head, tok[1:t + 2][None], feats[None, :t + 1])[0, t]
    return feats


def rollout_hits(head, tok, feat, start, steps):
    """Reference for one start: step k predicts f_{start+k+1} with the head's own predictions fed back in
    place of the features after start, and hits when its LM-head argmax equals the true feature's."""
    f, hits = feat[:-1].float().clone(), []
    with torch.no_grad():
        for k in range(steps + 1):
            p = start + k
            pred = train.head_forward(head, tok[1:p + 2][None], f[None, :p + 1])[0, p]
            hits.append(int(head.lm_head(pred).argmax() == head.lm_head(feat[p + 1].float()).argmax()))
            if k < steps:
                f[p + 1] = pred
    return hits


def test_multi_step_accuracy_matches_a_direct_rollout():
    target, g = make_tiny_model(), torch.Generator().manual_seed(1)
    head = tiny_head(target, seed=3)
    seqs = []
    for n in (30, 9, 40):  # the target's real features: the untrained head is mostly wrong
        tok = torch.randint(0, 96, (n,), generator=g)
        seqs.append((tok, target_features(target, tok).to(torch.bfloat16), torch.ones(n, dtype=torch.uint8)))
    for n in (25, 32):  # the head's own trajectory, perturbed: mostly right, and feedback matters
        tok = torch.randint(0, 96, (n,), generator=g)
        feats = head_trajectory(head, tok, target_features(target, tok)[0])
        seqs.append((tok, feats + 0.5 * torch.randn(feats.shape, generator=g), torch.ones(n, dtype=torch.uint8)))
    seqs.append((seqs[0][0], seqs[0][1], torch.zeros(30, dtype=torch.uint8)))  # no assistant tokens: skipped
    steps = 3
    acc = train.multi_step_accuracy(head, seqs, steps=steps, starts_per_seq=1000)  # every start
    hits = [rollout_hits(head, tok, feat, s, steps) for tok, feat, m in seqs if m.any()
            for s in range(len(tok) - steps - 2)]  # every start that leaves room for `steps` more predictions
    want = [sum(h[k] for h in hits) / len(hits) for k in range(steps + 1)]
    assert acc == pytest.approx(want, abs=1e-12)
    assert 0 < want[0] < 1 and len(set(want)) > 1  # informative numbers, not all 0 or all 1


def test_multi_step_accuracy_is_perfect_on_the_heads_own_trajectory():
    """Oracle: features that are the head's own predictions, f_{t+1} = head(f_<=t, x_<=t+1), make every step
    right, since feeding back a prediction then changes nothing."""
    target = make_tiny_model()
    head = tiny_head(target, seed=5)
    tok = torch.randint(0, 96, (24,), generator=torch.Generator().manual_seed(2))
    feats = head_trajectory(head, tok, target_features(target, tok)[0])
    acc = train.multi_step_accuracy(head, [(tok, feats, torch.ones(24, dtype=torch.uint8))], steps=4)
    assert acc == [1.0] * 5
    real = train.multi_step_accuracy(head, [(tok, target_features(target, tok), torch.ones(24, dtype=torch.uint8))])
    assert real[0] < 1.0  # an untrained head on the target's own features is not an oracle


def test_validation_tau_on_chats_and_plain_texts():
    target = make_tiny_model()
    head = random_head(target)
    tok = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(4))
    chat = torch.tensor([0] * 5 + [1] * 15, dtype=torch.uint8)
    for mask in (chat, torch.ones(20, dtype=torch.uint8)):  # a plain text is masked from its first token
        tau = train.validation_tau(head, target, [(tok, None, mask)], set(), max_new_tokens=24)
        assert 1.0 <= tau <= Drafter(head).depth + 1


# ---------------------------------------------------------------- fit end to end, tiny target

N_TRAIN, N_VAL = 24, 4


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny checkpoint and a run directory of feature shards made by that target on random tokens."""
    root = tmp_path_factory.mktemp("tiny")
    ckpt = root / "ckpt"
    ckpt.mkdir()
    model = make_tiny_model()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text(json.dumps({**model.config.to_dict(), "stop_token_ids": [],
                                                  "chat_template": "none"}))
    target = load_model(ckpt)
    g = torch.Generator().manual_seed(0)
    run = root / "run"
    (run / "features").mkdir(parents=True)
    split = [0] * N_TRAIN + [1] * N_VAL
    split = [split[i] for i in torch.randperm(len(split), generator=g)]
    for shard, rows in enumerate((split[:13], split[13:])):
        toks, feats, masks, offsets = [], [], [], [0]
        for _ in rows:
            n = int(torch.randint(12, 40, (1,), generator=g))
            tok = torch.randint(0, 96, (n,), generator=g)
            mask = torch.ones(n, dtype=torch.uint8)
            mask[:4] = 0  # a prompt, then the "reply"
            toks.append(tok.int())
            feats.append(target_features(target, tok).to(torch.bfloat16))
            masks.append(mask)
            offsets.append(offsets[-1] + n)
        train.atomic_save({"tokens": torch.cat(toks), "features": torch.cat(feats), "loss_mask": torch.cat(masks),
                           "offsets": torch.tensor(offsets), "split": torch.tensor(rows, dtype=torch.uint8)},
                          run / "features" / f"shard_{shard:05d}.safetensors")
    (run / "extract_config.json").write_text(json.dumps({"checkpoint": str(ckpt)}))
    return ckpt, run


def fresh_run(tiny_run, tmp_path, name):
    out = tmp_path / name
    shutil.copytree(tiny_run[1], out)
    return out


def head_weights(out):
    return load_file(str(out / "head" / "head.safetensors"))


def assert_same_weights(a, b, atol=0.0):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=0, atol=atol), (k, (a[k] - b[k]).abs().max().item())


def run_fit(out, *args, torchrun=False, timeout=300):
    cmd = [sys.executable] + (["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                               str(free_port())] if torchrun else []) + ["train.py", "fit", "--out", str(out), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_tiny_checkpoint_loads_and_shards_read_back(tiny_run):
    ckpt, run = tiny_run
    model = load_model(ckpt)
    assert model.config.vocab_size == 96 and model.checkpoint_config["stop_token_ids"] == []
    train_seqs, val_seqs = train.load_features(run)
    assert (len(train_seqs), len(val_seqs)) == (N_TRAIN, N_VAL)
    tok, feat, mask = train_seqs[0]
    assert tok.dtype == torch.long and feat.shape == (len(tok), 64) and mask.shape == tok.shape
    assert torch.allclose(feat.float(), target_features(model, tok), atol=0.05)  # bf16 of the real features


def test_fit_writes_a_loadable_head_summary_and_state(tiny_run, tmp_path):
    out = fresh_run(tiny_run, tmp_path, "fit")  # checkpoint from extract_config.json
    train.main(["fit", "--out", str(out), "--epochs", "2", "--batch_size", "4", "--save_every", "3",
                "--warmup", "2", "--eval_prompts", "2", "--ce_weight", "0.2"])
    steps = 2 * (N_TRAIN // 4)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == steps and summary["train_sequences"] == N_TRAIN and summary["ce_weight"] == 0.2
    acc = summary["val_accuracy_by_step"]
    assert len(acc) == 5 and all(0 <= a <= 1 for a in acc)
    assert summary["val_tau_dynamic"] >= 1.0
    state = torch.load(out / "train_state.pt", weights_only=True)
    assert state["step"] == steps
    config = json.loads((out / "head" / "head_config.json").read_text())
    assert config["trained_steps"] == steps and config["target"]["vocab_size"] == 96
    target = load_model(tiny_run[0], pack=False)  # the head's weights as saved, not packed for the kernels
    head = load_head(out / "head", target)
    assert_same_weights(head.state_dict(), state["head"])
    assert not torch.equal(head.state_dict()["fc.weight"], tiny_head(target).state_dict()["fc.weight"])


def test_fit_can_start_from_a_trained_head(tiny_run, tmp_path, capsys):
    args = ["fit", "--epochs", "1", "--batch_size", "4", "--warmup", "1", "--no_eval"]
    first = fresh_run(tiny_run, tmp_path, "first")
    train.main([*args, "--out", str(first)])
    # learning rate 0: the weights it ends with are the weights it started from
    again = fresh_run(tiny_run, tmp_path, "again")
    train.main([*args, "--out", str(again), "--lr", "0", "--init_head", str(first / "head")])
    assert_same_weights(head_weights(again), head_weights(first))
    fresh = fresh_run(tiny_run, tmp_path, "fresh")
    train.main([*args, "--out", str(fresh), "--lr", "0"])
    assert not torch.equal(head_weights(fresh)["fc.weight"], head_weights(first)["fc.weight"])
    with pytest.raises(SystemExit):
        train.main([*args, "--out", str(fresh), "--init_head", str(tmp_path / "nothing")])
    assert "--init_head" in capsys.readouterr().err
    # --head_ffn grows the MLP: the trained units first, the new ones with a zero down-projection, so at learning
    # rate 0 the wider head predicts exactly what the narrower one does
    target = load_model(tiny_run[0], pack=False)
    narrow = load_head(first / "head", target)
    width = narrow.config.intermediate_size
    wide_run = fresh_run(tiny_run, tmp_path, "wide")
    train.main([*args, "--out", str(wide_run), "--lr", "0", "--init_head", str(first / "head"),
                "--head_ffn", str(2 * width)])
    wide = load_head(wide_run / "head", target)
    assert wide.layer.feed_forward.w2.weight.shape == (narrow.config.dim, 2 * width)
    assert wide.layer.feed_forward.w1.weight[width:].abs().sum() > 0  # new units are initialised, not dead
    seq = train.load_features(first)[1][0]
    for h in (narrow, wide):
        h.setup_caches(128)
        h.layer.attention.kv_cache = None
    with torch.no_grad():
        outs = [train.head_forward(h, seq[0][None], seq[1][None].float()) for h in (narrow, wide)]
    assert torch.allclose(outs[0], outs[1], atol=1e-5)
    with pytest.raises(SystemExit):  # resuming it at the default width: one line, not a state-dict traceback
        train.main([*args, "--out", str(wide_run), "--resume"])
    assert "--head_ffn" in capsys.readouterr().err


def test_head_accuracy_script_scores_heads_on_the_held_out_split(tiny_run, tmp_path):
    ckpt, run = tiny_run
    target = load_model(ckpt, pack=False)
    head = tiny_head(target, seed=3)
    save_head(head, tmp_path / "head", target_info(target))
    proc = subprocess.run([sys.executable, "scripts/head_accuracy.py", "--run", str(run), "--heads",
                           str(tmp_path / "head")], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = [line for line in proc.stdout.splitlines() if line.startswith(f"| {tmp_path / 'head'} |")][0]
    printed = [float(x) for x in row.strip("|").split("|")[1:]]
    _, val = train.load_features(run)
    loaded = load_head(tmp_path / "head", target)
    loaded.setup_caches(128)
    loaded.layer.attention.kv_cache = None
    with torch.no_grad():
        expected = train.multi_step_accuracy(loaded, val, 4, 32)
    assert printed == [round(a, 3) for a in expected]


def test_head_accuracy_script_scores_heads_on_benchmark_replies(tmp_path, default_checkpoint, real_tokenizer):
    """--replies: a benchmark result's prompts and plain decoding's replies, teacher-forced, scored like the
    held-out split (the README's MT-bench agreement row)."""
    from eagle_head import EagleHead
    from tokenizer import apply_chat_template
    prompts = tmp_path / "prompts.jsonl"
    turns = ["Name three colours.", "What is the capital of France?"]
    prompts.write_text("".join(json.dumps({"id": i, "turns": [t]}) + "\n" for i, t in enumerate(turns)))
    replies = [real_tokenizer.encode("Red, green and blue are three colours that people like."),
               real_tokenizer.encode("The capital of France is Paris, a city on the Seine.")]
    result = {"prompts": str(prompts), "methods": {"plain@bfloat16": {"per_prompt": [
        {"id": i, "token_ids": r} for i, r in enumerate(replies)]}}}
    (tmp_path / "result.json").write_text(json.dumps(result))
    target = load_model(default_checkpoint, pack=False)
    head = EagleHead(train.head_config_from_target(target.config)).attach(target)
    save_head(head, tmp_path / "head", target_info(target))
    proc = subprocess.run([sys.executable, "scripts/head_accuracy.py", "--replies", str(tmp_path / "result.json"),
                           "--heads", str(tmp_path / "head"), "--starts_per_seq", "1000"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "2 benchmark replies" in proc.stdout
    row = [line for line in proc.stdout.splitlines() if line.startswith(f"| {tmp_path / 'head'} |")][0]
    printed = [float(x) for x in row.strip("|").split("|")[1:]]
    seqs = []
    config = target.checkpoint_config
    for turn, reply in zip(turns, replies):
        text = apply_chat_template([{"role": "user", "content": turn}], config.get("chat_template"),
                                   config.get("default_system_prompt"))
        ids = real_tokenizer.encode(text)
        full = torch.tensor(ids + reply)
        mask = torch.zeros(len(full), dtype=torch.uint8)
        mask[len(ids):] = 1
        seqs.append((full, target_features(target, full).to(torch.bfloat16), mask))
    loaded = load_head(tmp_path / "head", target)
    loaded.setup_caches(256)
    loaded.layer.attention.kv_cache = None
    with torch.no_grad():
        expected = train.multi_step_accuracy(loaded, seqs, 4, 1000)
    assert printed == pytest.approx([round(a, 3) for a in expected], abs=1.001e-3)
    bad = subprocess.run([sys.executable, "scripts/head_accuracy.py", "--replies", str(prompts), "--heads",
                          str(tmp_path / "head")], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_resume_after_a_kill_matches_an_uninterrupted_run(tiny_run, tmp_path):
    args = ["--epochs", "20", "--batch_size", "4", "--save_every", "2", "--warmup", "5", "--no_eval"]
    total = 20 * (N_TRAIN // 4)
    full = fresh_run(tiny_run, tmp_path, "full")
    run_fit(full, *args)

    out = fresh_run(tiny_run, tmp_path, "killed")
    state_path = out / "train_state.pt"
    proc = subprocess.Popen([sys.executable, "train.py", "fit", "--out", str(out), *args], cwd=ROOT, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while proc.poll() is None and time.time() < deadline:
            # written with os.replace, so never seen half-written
            if state_path.is_file() and torch.load(state_path, weights_only=True)["step"] >= 4:
                break
            time.sleep(0.01)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode != 0, "the run finished before it could be killed"
    saved = torch.load(state_path, weights_only=True)["step"]
    assert 4 <= saved < total  # killed mid-run

    resumed = run_fit(out, *args, "--resume")
    assert f"resumed from step {saved}" in resumed.stderr
    assert torch.load(state_path, weights_only=True)["step"] == total
    assert_same_weights(head_weights(out), head_weights(full))
    # a resume with other settings would cut other batches and another schedule from the same step: refused
    proc = subprocess.run([sys.executable, "train.py", "fit", "--out", str(out), *args, "--lr", "0.5", "--resume"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "continues a run started with --lr 0.001" in proc.stderr, proc.stderr[-500:]


@pytest.mark.slow
def test_ddp_two_processes_match_one_process(tiny_run, tmp_path):
    args = ["--epochs", "1", "--batch_size", "4", "--warmup", "2", "--no_eval", "--no-bf16"]  # fp32: exact sums
    single, ddp = fresh_run(tiny_run, tmp_path, "single"), fresh_run(tiny_run, tmp_path, "ddp")
    run_fit(single, *args)
    run_fit(ddp, *args, torchrun=True)
    # rank 0 saves; its weights equal the one-process run's only if rank 1's gradients (over its half of
    # every batch) were right and averaged in, and both ranks then apply the same update
    assert_same_weights(head_weights(ddp), head_weights(single), atol=1e-5)


def exit_code_and_stderr(argv, capsys):
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    return e.value.code, capsys.readouterr().err


def test_bad_inputs_exit_2_with_one_line(tiny_run, tmp_path, capsys, default_checkpoint):
    ckpt, _ = tiny_run
    code, err = exit_code_and_stderr(["fit", "--out", str(tmp_path / "empty"), "--checkpoint", str(ckpt)], capsys)
    assert code == 2 and err.count("\n") == 1 and "no feature shards" in err
    code, err = exit_code_and_stderr(["extract", "--out", str(tmp_path / "x"), "--checkpoint", str(default_checkpoint),
                                      "--data", str(tmp_path / "missing.jsonl")], capsys)
    assert code == 2 and err.count("\n") == 1 and "missing.jsonl" in err
    out = fresh_run(tiny_run, tmp_path, "small")
    code, err = exit_code_and_stderr(["fit", "--out", str(out), "--batch_size", str(N_TRAIN + 1)], capsys)
    assert code == 2 and err.count("\n") == 1 and "fewer than one batch" in err


# ---------------------------------------------------------------- command line

def test_vocab_takes_an_eagle_head_only(tmp_path, capsys):
    code, err = exit_code_and_stderr(["vocab", "--out", str(tmp_path / "run")], capsys)
    assert code == 2 and err.count("\n") == 1 and "holds no trained head" in err
    (tmp_path / "run" / "head").mkdir(parents=True)
    (tmp_path / "run" / "head" / "head_config.json").write_text(json.dumps({"kind": "eagle3"}))
    code, err = exit_code_and_stderr(["vocab", "--out", str(tmp_path / "run")], capsys)
    assert code == 2 and err.count("\n") == 1 and "is an EAGLE-3 head" in err


@pytest.mark.parametrize("argv, message", [
    (["extract", "--device", "gpu"], "unknown --device 'gpu'"),
    (["extract", "--shard_size", "0"], "--shard_size must be at least 1, got 0"),
    (["extract", "--skip_conversations", "-1"], "--skip_conversations must be at least 0"),
    (["extract", "--val_fraction", "1"], "--val_fraction must be in [0, 1)"),
    (["extract", "--regen_batch", "4"], "--regen_batch shapes the replies of --regenerate"),
    (["extract", "--no-compile"], "--no-compile shapes the replies of --regenerate"),
    (["extract", "--regenerate", "--regen_temperature", "-1"], "--regen_temperature must be >= 0"),
    (["fit", "--save_every", "0"], "--save_every must be at least 1, got 0"),
    (["fit", "--epochs", "-1"], "--epochs must be at least 1"),
    (["fit", "--eval_seqs", "0"], "--eval_seqs must be at least 1"),
    (["fit", "--ttt_steps", "0"], "--ttt_steps must be at least 1"),
    (["vocab", "--size", "-1"], "--size must be at least 0"),
])
def test_bad_numbers_are_one_line_before_loading(argv, message, tmp_path, capsys):
    code, err = exit_code_and_stderr([argv[0], "--out", str(tmp_path / "run"), *argv[1:]], capsys)
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "run").exists()  # nothing written

def test_help_lists_the_options(capsys):
    capsys.readouterr()
    top = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert top.returncode == 0 and "extract" in top.stdout and "fit" in top.stdout
    for command, options in (("fit", ["--out", "--checkpoint", "--epochs", "--batch_size", "--lr", "--warmup",
                                      "--save_every", "--resume", "--bf16", "--no_eval", "--eval_prompts"]),
                             ("export", ["--run", "--out", "--dtype"]),
                             ("extract", ["--out", "--checkpoint", "--data", "--num_conversations", "--max_len",
                                          "--shard_size", "--val_fraction", "--regenerate", "--regen_tokens"])):
        with pytest.raises(SystemExit) as e:
            train.main([command, "--help"])
        text = capsys.readouterr().out
        assert e.value.code == 0
        assert all(o in text for o in options), [o for o in options if o not in text]


def test_frequent_tokens_counts_assistant_tokens_only():
    seqs = [(torch.tensor([1, 2, 2, 3, 3, 3]), None, torch.tensor([0, 1, 1, 0, 0, 0], dtype=torch.uint8)),
            (torch.tensor([4, 4, 2, 5]), None, torch.tensor([1, 1, 1, 0], dtype=torch.uint8))]
    assert train.frequent_tokens(seqs, 2).tolist() == [2, 4]  # 3 is frequent but never an assistant token


def test_regenerate_replaces_each_reply_with_the_targets_own(real_model, real_tokenizer):
    """Self-distillation, batched over conversations and turn by turn: user turns stay, every assistant turn
    becomes the target's greedy reply to the conversation so far (its own earlier replies included), the same as
    one conversation generated alone; plain texts pass through."""
    import argparse
    from generate import generate
    from tokenizer import apply_chat_template
    convs = [[{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Red."},
              {"role": "user", "content": "Another one?"}, {"role": "assistant", "content": "Blue."}],
             [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "5"}],
             [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hello."}]]
    # a split conversation that starts with the assistant: that turn answers nothing and is dropped
    split = [{"role": "assistant", "content": "...and so on."}, {"role": "user", "content": "Name a colour."},
             {"role": "assistant", "content": "Red."}]
    examples = [("a", convs[0]), ("b", convs[1]), ("t", "a plain text"), ("c", convs[2]), ("s", split)]
    # a batch of 2 for 3 conversations: the second round answers a's second turn beside c's first
    args = argparse.Namespace(regen_batch=2, regen_tokens=6, regen_temperature=0.0, max_len=256, regen_turns=0,
                              regen_max_prompt=0)
    config = real_model.checkpoint_config
    out = train.regenerate(real_model, real_tokenizer, examples, "chatml", None, config, args)
    assert [i for i, _ in out] == ["a", "b", "t", "c", "s"] and out[2][1] == "a plain text"
    assert out[4][1] == out[0][1][:2]  # the leading assistant turn gone, the rest answered as conversation a
    stop = set(config["stop_token_ids"])
    for (_, new), old in zip([out[0], out[1], out[3]], convs):
        assert [m["role"] for m in new] == [m["role"] for m in old]
        assert [m["content"] for m in new if m["role"] == "user"] == [m["content"] for m in old if m["role"] == "user"]
        for k, m in enumerate(new):  # each reply: what the target says alone, given the regenerated history
            if m["role"] == "assistant":
                ids = real_tokenizer.encode(apply_chat_template(new[:k], "chatml", None))
                real_model.setup_caches(1, len(ids) + 16)
                reply, _ = generate(real_model, torch.tensor(ids), 6, stop, temperature=0)
                assert m["content"] == real_tokenizer.decode([t for t in reply if t not in stop])
    assert out[1][1][1]["content"] != "5"  # really regenerated
    args.regen_turns = 1  # first turns only: the rest of a conversation is dropped
    first = train.regenerate(real_model, real_tokenizer, examples, "chatml", None, config, args)
    assert first[0][1] == out[0][1][:2] and first[1] == out[1] and first[3] == out[3] and first[4] == out[4]


def test_regenerate_batches_prompts_of_like_length(real_model, real_tokenizer, monkeypatch):
    """A batch is prefilled padded to its longest prompt: each round takes the shortest prompts left."""
    import argparse
    calls = []

    def fake_generate_batch(model, prompts, max_new_tokens, stop_ids=(), **sampling):
        calls.append([len(p) for p in prompts])
        return [[1] for _ in prompts]
    monkeypatch.setattr(train, "generate_batch", fake_generate_batch)
    words = [12, 1, 30, 5, 20, 3]  # prompt lengths out of order
    examples = [(f"e{i}", [{"role": "user", "content": "word " * n}, {"role": "assistant", "content": "x"}])
                for i, n in enumerate(words)]
    args = argparse.Namespace(regen_batch=2, regen_tokens=4, regen_temperature=0.0, max_len=256, regen_turns=1,
                              regen_max_prompt=0)
    out = train.regenerate(real_model, real_tokenizer, examples, "chatml", None, real_model.checkpoint_config, args)
    assert [i for i, _ in out] == [i for i, _ in examples]  # the conversations keep their order
    lengths = [n for call in calls for n in call]
    assert len(calls) == 3 and lengths == sorted(lengths)
    # --regen_max_prompt: a prompt over the cap is not answered, and its conversation (no reply left) is dropped
    args.regen_max_prompt = sorted(lengths)[3]
    calls.clear()
    capped = train.regenerate(real_model, real_tokenizer, examples, "chatml", None, real_model.checkpoint_config, args)
    assert [n for call in calls for n in call] == sorted(lengths)[:4]
    assert [i for i, _ in capped] == [i for i, n in zip([i for i, _ in examples], words) if n <= 12]


def test_map_shard_reads_what_safetensors_wrote(tmp_path):
    """The memory-mapped reader gives every tensor of a shard with its dtype, shape and values, as views of one map
    of the file (not copies: a run's features need not fit in memory)."""
    from safetensors.torch import load_file
    tensors = {"features": torch.randn(7, 5).to(torch.bfloat16), "tokens": torch.arange(7, dtype=torch.int32),
               "offsets": torch.tensor([0, 3, 7]), "loss_mask": torch.tensor([0, 1, 1, 0, 1, 1, 1], dtype=torch.uint8),
               "scale": torch.rand(3), "split": torch.tensor([1, 0], dtype=torch.uint8)}
    path = tmp_path / "shard_00000.safetensors"
    train.atomic_save(tensors, path)
    mapped, read = train.map_shard(path), load_file(str(path))
    assert mapped.keys() == read.keys()
    for k in read:
        assert mapped[k].dtype == read[k].dtype and torch.equal(mapped[k], read[k]), k
    assert mapped["features"].untyped_storage().nbytes() == path.stat().st_size  # a view of the whole file's map
    mapped["features"].add_(1)  # copy-on-write: the file keeps its bytes
    assert torch.equal(load_file(str(path))["features"], tensors["features"])


def test_extract_regenerate_end_to_end(tmp_path, default_checkpoint):
    """extract --regenerate --fused on the real target: replies regenerated (written as JSONL), then features and
    fused features of the regenerated conversations in resumable shards."""
    data = tmp_path / "chats.jsonl"
    chats = [[{"role": "user", "content": q}, {"role": "assistant", "content": "x"}]
             for q in ("Name a colour.", "What is 2 + 2?", "Say hi.")]
    data.write_text("".join(json.dumps({"id": f"c{i}", "conversations": c}) + "\n" for i, c in enumerate(chats)))
    out = tmp_path / "run"
    args = ["extract", "--out", str(out), "--data", str(data), "--regenerate", "--regen_tokens", "5",
            "--regen_batch", "2", "--no-compile", "--fused", "--shard_size", "2", "--dtype", "float32"]
    train.main(args)
    regenerated = [json.loads(line) for f in sorted((out / "regenerated").glob("*.jsonl")) for line in open(f)]
    assert len(regenerated) == 3 and all(r["conversations"][1]["content"] != "x" for r in regenerated)
    train_seqs, val_seqs = train.load_features(out)
    assert len(train_seqs) + len(val_seqs) == 3
    tok, feat, mask, fused, top1 = (train_seqs + val_seqs)[0]
    assert feat.shape == (len(tok), 576) and fused.shape == (len(tok), 3 * 576) and top1.shape == tok.shape
    assert mask.sum() > 0 and not mask[0]
    lean = train.load_features(out, fused=False)  # an EAGLE-1/2 run reads the same sequences without the fused states
    assert [len(s) for s in lean[0] + lean[1]] == [3] * 3
    assert all(torch.equal(a[1], b[1]) for a, b in zip(lean[0] + lean[1], train_seqs + val_seqs))
    files = sorted((out / "features").iterdir())
    train.main(args)  # resumes: every shard is there, nothing is redone
    assert [f.stat().st_mtime_ns for f in sorted((out / "features").iterdir())] == [f.stat().st_mtime_ns for f in files]
    # a rerun with settings that would cut other shards is refused (it would have counted them all done)
    for changed, flag in (("--shard_size", "3"), ("--max_len", "64"), ("--regen_tokens", "6")):
        with pytest.raises(SystemExit) as e:
            train.main([*args, changed, flag])
        assert e.value.code == 2
    assert [f.stat().st_mtime_ns for f in sorted((out / "features").iterdir())] == [f.stat().st_mtime_ns for f in files]


# ---------------------------------------------------------------- EAGLE-3: training-time test

def eagle3_sequence(target, n=20, seed=0):
    """(tokens, final features, loss mask, fused features, target top-1) of one random sequence, as extract --fused."""
    from eagle_head import default_feature_layers
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, target.config.vocab_size, (n,), generator=g)
    layers = default_feature_layers(target.config.n_layer)
    target.setup_caches(1, n)
    with torch.no_grad():
        logits, hidden = target(tok[None], torch.arange(n), return_features=True,
                                feature_layers=(*layers, target.config.n_layer))
    mask = torch.ones(n, dtype=torch.uint8)
    mask[:3] = 0
    return tok, hidden[-1][0], mask, torch.cat(hidden[:3], -1)[0], logits[0].argmax(-1)


def assert_unrolled_as_drafted(head, tokens, features, outs):
    """Each unrolled step k (outs[k], (1, T, dim)) equals the head run with its KV cache (set up for len(outs) x T
    slots) on its own step k-1 output, at RoPE position t + k, seeing the real pairs up to t and its own earlier
    steps at t (the drafting mask). tokens (T,), features (T, in_dim): the first step's inputs."""
    T = len(tokens)
    slots, pos = torch.arange(head.max_seq_length), torch.arange(T)
    seen = slots[None, :] <= pos[:, None]  # (T, S): the real pairs up to t
    f = features
    for k in range(len(outs)):
        if k:
            seen = seen | (slots[None, :] == (k * T + pos)[:, None])  # and this step's own slot at t
        tok_k = torch.cat([tokens[k:], torch.zeros(k, dtype=torch.long)])
        out = head(tok_k[None], f[None], k * T + pos, seen, rope_pos=pos + k)[0]
        torch.testing.assert_close(out, outs[k][0], atol=1e-4, rtol=1e-4)
        f = out


@pytest.mark.parametrize("layers", [1, 3])
def test_training_time_test_unrolls_exactly_as_the_head_drafts(layers):
    """Step k of the unrolled training forward, at every position t, equals what drafting computes there: the head
    run with its KV cache on its own step k-1 output, at RoPE position t + k, seeing the real features up to t and
    its own earlier steps at t (the drafting mask). This is what makes training-time test train the drafter that
    runs; a deeper head (--head_layers) too."""
    import argparse
    target = make_tiny_model(n_layer=4)
    seq = eagle3_sequence(target)
    head = train.eagle3_head(target, [seq], argparse.Namespace(draft_vocab=64, device="cpu"), layers=layers)
    trainer = train.ttt_trainer(head, target, 3)
    T = len(seq[0]) - 1
    head.setup_caches(4 * T + 8)
    tokens, fused, _, _, _ = train.make_batch3([seq])
    with torch.no_grad():
        assert_unrolled_as_drafted(head, tokens[0], fused[0], trainer.unroll(tokens, fused))


def test_eagle2_training_time_test_unrolls_exactly_as_the_head_drafts():
    """EagleTTT step k at every position t equals the EAGLE-1/2 head run with its KV cache on its own step k-1
    output, at RoPE position t + k, seeing the real features up to t and its own earlier steps at t."""
    target = make_tiny_model()
    head = tiny_head(target, seed=4)
    tok = torch.randint(0, 96, (21,), generator=torch.Generator().manual_seed(6))
    tokens, inputs, _, _ = train.make_batch([(tok, target_features(target, tok), torch.ones(21, dtype=torch.uint8))])
    T = tokens.shape[1]
    head.setup_caches(4 * T + 8)
    cache, head.layer.attention.kv_cache = head.layer.attention.kv_cache, None  # training runs without the cache
    with torch.no_grad():
        outs = train.EagleTTT(head, 3)(tokens, inputs)
        torch.testing.assert_close(outs[0], train.head_forward(head, tokens, inputs), atol=1e-5, rtol=1e-5)
        head.layer.attention.kv_cache = cache
        assert_unrolled_as_drafted(head, tokens[0], inputs[0], outs)


def test_eagle2_training_time_test_loss_trains_the_later_steps():
    """eagle_loss through EagleTTT: the step-0 counts are plain training's, and training on it raises the agreement
    of the head drafting on its own outputs (1-alpha) on the batch it trained on."""
    target = make_tiny_model()
    g = torch.Generator().manual_seed(0)
    seqs = []
    for n in (20, 24, 17, 24):
        tok = torch.randint(0, 96, (n,), generator=g)
        seqs.append((tok, target_features(target, tok), torch.ones(n, dtype=torch.uint8)))
    batch = train.make_batch(seqs)
    target.requires_grad_(False)
    head = tiny_head(target)
    head.setup_caches(64)
    head.layer.attention.kv_cache = None
    ttt = train.EagleTTT(head, 2)
    plain = train.eagle_loss(head, head, *batch, noise=0)
    unrolled = train.eagle_loss(ttt, head, *batch, noise=0)
    assert unrolled[1] == plain[1] and unrolled[2] == plain[2] and unrolled[0] > plain[0]
    before = train.multi_step_accuracy(head, seqs, steps=1, starts_per_seq=1000)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    first = None
    for _ in range(40):
        loss, _, _ = train.eagle_loss(ttt, head, *batch, noise=0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = first if first is not None else loss.item()
    after = train.multi_step_accuracy(head, seqs, steps=1, starts_per_seq=1000)
    assert loss.item() < 0.5 * first and after[1] > before[1]


def test_eagle3_loss_falls_and_fit_writes_a_loadable_head(tmp_path):
    import argparse
    from eagle_head import Eagle3Head
    target = make_tiny_model(n_layer=4)
    seqs = [eagle3_sequence(target, n=24, seed=s) for s in range(8)]
    head, trainer = train.eagle3_setup(target, seqs, argparse.Namespace(draft_vocab=64, device="cpu", ttt_steps=3))
    head.setup_caches(64)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    batch = train.make_batch3(seqs)
    first = None
    for _ in range(40):
        loss, counts, correct = trainer(*batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = first if first is not None else loss.item()
    assert loss.item() < 0.5 * first and (counts > 0).all()
    accuracy = train.ttt_accuracy(trainer, seqs)
    assert len(accuracy) == 3 and accuracy[0] > 0.5  # it learned the fixed batch
    save = train.save_head(head, tmp_path / "head", train.target_info(target))
    loaded = load_head(save, target)
    assert isinstance(loaded, Eagle3Head) and torch.equal(loaded.d2t, head.d2t)


def test_export_casts_the_weights_keeps_the_token_maps_and_loads_as_the_run_does(tmp_path, capsys):
    target = make_tiny_model(n_layer=4)
    run = tmp_path / "run"
    save_head(random_head(target, kind="eagle3", draft_vocab_size=64, extra_layers=1), run / "head",
              target_info(target), {"trained_steps": 7})
    (run / "summary.json").write_text(json.dumps({"steps": 7}))
    train.main(["export", "--run", str(run), "--out", str(tmp_path / "ship")])
    raw, shipped = load_file(run / "head" / "head.safetensors"), load_file(tmp_path / "ship" / "head.safetensors")
    assert raw.keys() == shipped.keys() and any(not v.is_floating_point() for v in raw.values())
    for k, v in raw.items():
        assert torch.equal(shipped[k], v.bfloat16() if v.is_floating_point() else v), k
    assert (tmp_path / "ship" / "head_config.json").read_text() == (run / "head" / "head_config.json").read_text()
    assert json.loads((tmp_path / "ship" / "train_summary.json").read_text()) == {"steps": 7}
    assert oct((tmp_path / "ship" / "head.safetensors").stat().st_mode & 0o777) == "0o644"
    # loaded in bf16, the shipped head is the run's head loaded in bf16, extra layers and token maps included
    a, b = (load_head(d, target, dtype=torch.bfloat16) for d in (run / "head", tmp_path / "ship"))
    assert len(b.blocks) == 1 and all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                                         b.state_dict().values()))
    # quantized for shipping (quantize.py --draft), then exported over: the old head's int8 file goes with it
    from quantize import quantize_head_dir
    quantize_head_dir(tmp_path / "ship", "int8")
    assert "quantized" in json.loads((tmp_path / "ship" / "head_config.json").read_text())
    train.main(["export", "--run", str(run), "--out", str(tmp_path / "ship")])
    assert not (tmp_path / "ship" / "head_int8.safetensors").exists()
    assert "quantized" not in json.loads((tmp_path / "ship" / "head_config.json").read_text())
    other = tmp_path / "other"  # and save_head over a quantized head does the same
    save_head(random_head(target), other, target_info(target))
    quantize_head_dir(other, "int8")
    listed = json.loads((other / "head_config.json").read_text())  # its "quantized" entry, passed on as extra
    save_head(random_head(target, seed=1), other, target_info(target), listed)
    assert not (other / "head_int8.safetensors").exists()
    assert "quantized" not in json.loads((other / "head_config.json").read_text())
    train.main(["export", "--run", str(run / "head"), "--out", str(tmp_path / "f32"), "--dtype", "float32"])
    assert all(torch.equal(v, raw[k]) for k, v in load_file(tmp_path / "f32" / "head.safetensors").items())
    assert not (tmp_path / "f32" / "train_summary.json").exists()  # a bare head directory has no summary
    capsys.readouterr()
    for argv, words in ((["--run", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")], "no trained head"),
                        (["--run", str(run), "--out", str(run / "head")], "is the head being exported")):
        code, err = exit_code_and_stderr(["export", *argv], capsys)
        assert code == 2 and err.count("\n") == 1 and words in err


def test_eagle3_loss_scores_each_step_at_the_right_positions():
    """The training-time test's loss takes only the scored positions through the LM head; it must equal the loss
    written over every position: step k's output at pair t against the target's distribution at t + k, masked.
    Agreement counts every assistant position, those whose target top-1 lies outside the draft vocabulary as misses
    (a draft never proposes them), so it compares with an EAGLE-1/2 head's and with what decoding accepts."""
    import argparse
    import torch.nn.functional as F
    target = make_tiny_model(n_layer=4)
    seqs = [eagle3_sequence(target, n=20 + 3 * s, seed=s) for s in range(4)]
    head, trainer = train.eagle3_setup(target, seqs, argparse.Namespace(draft_vocab=64, device="cpu", ttt_steps=3))
    head.setup_caches(64)
    with torch.no_grad():  # a head that agrees with the target sometimes, so the hit counts are not all zero
        head.lm_head.weight.copy_(trainer.target_rows)
    tokens, fused, finals, top1, mask = train.make_batch3(seqs)
    loss, counts, correct = trainer(tokens, fused, finals, top1, mask)
    with torch.no_grad():
        target_p = torch.softmax(finals @ trainer.target_rows.t(), -1)  # (B, T, V_d)
        scored = mask * trainer.in_vocab[top1].float()
        assert 0 < scored.sum() < mask.sum()  # some assistant positions lie outside the draft vocabulary
        want_loss, want_correct = 0.0, []
        for k, out in enumerate(trainer.unroll(tokens, fused)):
            logp = F.log_softmax(head.draft_logits(out), -1)
            m, p = train.shift(scored, k), train.shift(target_p, k)
            assert counts[k] == train.shift(mask, k).sum()
            want_loss += 0.8 ** k * (-(p * logp).sum(-1) * m).sum() / m.sum()
            want_correct.append(((logp.argmax(-1) == p.argmax(-1)).float() * m).sum())
    assert torch.allclose(loss, want_loss, rtol=1e-5)
    assert torch.equal(correct, torch.stack(want_correct)) and correct.sum() > 0


def fused_run(root, target, ckpt, seeds):
    """A run directory of --fused shards of random sequences from the target (one shard, the last one held out)."""
    seqs = [eagle3_sequence(target, n=16 + s % 7, seed=s) for s in seeds]
    (root / "features").mkdir(parents=True)
    cat = lambda i: torch.cat([s[i] for s in seqs])  # noqa: E731
    train.atomic_save({"tokens": cat(0).int(), "features": cat(1).to(torch.bfloat16), "loss_mask": cat(2),
                       "fused": cat(3).to(torch.bfloat16), "top1": cat(4).int(),
                       "offsets": torch.tensor([0] + [len(s[0]) for s in seqs]).cumsum(0),
                       "split": torch.tensor([0] * (len(seqs) - 1) + [1], dtype=torch.uint8)},
                      root / "features" / "shard_00000.safetensors")
    (root / "extract_config.json").write_text(json.dumps({"checkpoint": str(ckpt)}))
    return root


def two_fused_runs(tmp_path):
    """A tiny target's checkpoint and two fused runs over different sequences: (target, first run, more run)."""
    model = make_tiny_model(n_layer=4)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text(json.dumps({**model.config.to_dict(), "stop_token_ids": [],
                                                  "chat_template": "none"}))
    target = load_model(ckpt, pack=False)
    first, more = fused_run(tmp_path / "first", target, ckpt, range(9)), fused_run(tmp_path / "more", target, ckpt, range(9, 30))
    return target, first, more


def test_eagle3_fit_continues_a_head_over_its_own_vocabulary(tmp_path):
    """--init_head with an EAGLE-3 head on new data: the head's LM head rows are its draft vocabulary, so the run
    keeps the head's vocabulary (d2t) rather than the one counted on the new data, and trains over those rows."""
    from eagle_head import Eagle3Head
    target, first, more = two_fused_runs(tmp_path)
    args = ["fit", "--kind", "eagle3", "--epochs", "1", "--batch_size", "4", "--warmup", "1", "--no_eval",
            "--draft_vocab", "16"]
    train.main([*args, "--out", str(first)])
    counted = train.frequent_tokens(train.load_features(more)[0], 16)
    start = load_head(first / "head", target)
    assert isinstance(start, Eagle3Head) and not torch.equal(start.to_target(torch.arange(16)), counted)
    train.main([*args, "--out", str(more), "--lr", "0", "--init_head", str(first / "head")])
    assert_same_weights(head_weights(more), head_weights(first))  # d2t too: the started head's vocabulary
    train.main([*args, "--out", str(more), "--init_head", str(first / "head")])  # it trains over those rows
    trained = load_head(more / "head", target)
    assert torch.equal(trained.d2t, start.d2t) and not torch.equal(trained.lm_head.weight, start.lm_head.weight)


def test_eagle3_fit_grows_a_heads_vocabulary(tmp_path, capsys):
    """--init_head with a larger --draft_vocab: the started head's tokens all stay, with their LM head rows, so over
    them the grown head scores exactly as the started one; the added tokens are this run's most frequent others, with
    rows mapped from the target's. A smaller --draft_vocab is one clear error."""
    target, first, more = two_fused_runs(tmp_path)
    args = ["fit", "--kind", "eagle3", "--epochs", "1", "--batch_size", "4", "--warmup", "1", "--no_eval"]
    train.main([*args, "--out", str(first), "--draft_vocab", "16"])
    train.main([*args, "--out", str(more), "--lr", "0", "--init_head", str(first / "head"), "--draft_vocab", "40"])
    start, grown = load_head(first / "head", target), load_head(more / "head", target)
    old_ids, new_ids = start.to_target(torch.arange(16)), grown.to_target(torch.arange(40))
    assert len(set(new_ids.tolist())) == 40 and set(old_ids.tolist()) <= set(new_ids.tolist())
    added = [t for t in new_ids.tolist() if t not in set(old_ids.tolist())]
    seqs = train.load_features(more)[0]
    counts = torch.bincount(torch.cat([s[0][s[2].bool()] for s in seqs]).long(), minlength=target.config.vocab_size)
    assert counts[added].min() >= counts[[t for t in range(target.config.vocab_size) if t not in new_ids]].max()
    hidden = torch.randn(5, grown.config.dim)
    rows = torch.searchsorted(new_ids, old_ids)
    torch.testing.assert_close(grown.draft_logits(hidden)[:, rows], start.draft_logits(hidden))
    assert grown.lm_head.weight.isfinite().all() and not (grown.lm_head.weight == 0).all(-1).any()
    code, err = exit_code_and_stderr([*args, "--out", str(tmp_path / "more"), "--init_head", str(more / "head"),
                                      "--draft_vocab", "16"], capsys)
    assert code == 2 and err.count("\n") == 1 and "can grow, not shrink" in err


def test_eagle3_fit_deepens_a_head(tmp_path, capsys):
    """--init_head with a larger --head_layers: the started head's weights are kept and each added layer starts as
    an identity (its attention and MLP outputs at zero), so the deeper head drafts exactly as the started one; then
    training moves the new layers. Fewer layers than the started head's is one clear error."""
    target, first, more = two_fused_runs(tmp_path)
    args = ["fit", "--kind", "eagle3", "--epochs", "1", "--batch_size", "4", "--warmup", "1", "--no_eval",
            "--draft_vocab", "16"]
    train.main([*args, "--out", str(first)])
    train.main([*args, "--out", str(more), "--lr", "0", "--init_head", str(first / "head"), "--head_layers", "2"])
    start, deeper = load_head(first / "head", target), load_head(more / "head", target)
    assert len(start.layers()) == 1 and len(deeper.layers()) == 2
    assert json.loads((more / "head" / "head_config.json").read_text())["extra_layers"] == 1
    seq = train.load_features(more)[0][0]
    T = len(seq[0]) - 1
    def drafted(head):  # the head over the sequence's real pairs, with its KV cache, as drafting runs it
        head.setup_caches(T + 8)
        with torch.no_grad():
            causal = torch.ones(T, T + 8).tril().bool()
            return head(seq[0][None, 1:], seq[3][None, :-1].float(), torch.arange(T), causal)
    torch.testing.assert_close(drafted(deeper), drafted(start))
    train.main([*args, "--out", str(more), "--init_head", str(first / "head"), "--head_layers", "2"])
    trained = load_head(more / "head", target)
    assert trained.blocks[0].feed_forward.w2.weight.abs().sum() > 0
    code, err = exit_code_and_stderr([*args, "--out", str(tmp_path / "more"), "--init_head", str(more / "head"),
                                      "--head_layers", "1"], capsys)
    assert code == 2 and err.count("\n") == 1 and "can gain layers, not lose them" in err
    code, err = exit_code_and_stderr(["fit", "--out", str(first), "--head_layers", "2"], capsys)
    assert code == 2 and err.count("\n") == 1 and "--kind eagle3" in err


def test_fit_eagle3_needs_fused_features(tiny_run, tmp_path, capsys):
    out = fresh_run(tiny_run, tmp_path, "e3")
    code, err = exit_code_and_stderr(["fit", "--out", str(out), "--kind", "eagle3"], capsys)
    assert code == 2 and "extract them with `train.py extract --fused`" in err
    # EAGLE-3 trains on the token loss alone: a --ce_weight for it is an error, not silently ignored
    code, err = exit_code_and_stderr(["fit", "--out", str(out), "--kind", "eagle3", "--ce_weight", "0.5"], capsys)
    assert code == 2 and err.count("\n") == 1 and "--ce_weight" in err
