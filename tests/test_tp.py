"""Tensor parallelism (tp.py): 2 gloo CPU processes give exactly 1 process's tokens (fp32); the Inductor fix."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

import quantize as Q
import tp
from conftest import ROOT, free_port, make_tiny_model
from generate import load_model

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, default_checkpoint):
    """A tiny random model with the real vocabulary (so the real tokenizer fits), int8 and int4i weights beside it."""
    path = tmp_path_factory.mktemp("tp") / "ckpt"
    path.mkdir()
    model = make_tiny_model(vocab_size=49152, dim=128, intermediate_size=256)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({**model.config.to_dict(), "stop_token_ids": [],
                                                  "chat_template": "chatml"}))
    shutil.copy(default_checkpoint / "tokenizer.json", path)
    Q.main(["--checkpoint", str(path), "--mode", "int8"])
    Q.main(["--checkpoint", str(path), "--mode", "int4i"])
    return path


def run_generate(checkpoint, out, processes, *flags):
    cmd = [sys.executable] + (["-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port",
                               str(free_port())] if processes > 1 else [])
    cmd += ["generate.py", "--checkpoint", str(checkpoint), "--prompt", "Hello there, how are", "--temperature", "0",
            "--max_new_tokens", "24", "--dtype", "float32", "--no-compile", "--metrics-json", str(out), *flags]
    result = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    # the processes' own lines come first, the launcher's report of which one failed after them
    assert result.returncode == 0, result.stderr[:3000] + " ... " + result.stderr[-800:]
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.parametrize("flags", [["--draft", "none"], ["--draft", "random"], ["--draft", "none", "--quant", "int8"],
                                   ["--draft", "random", "--quant", "int8"], ["--draft", "random", "--quant", "int4i"]])
def test_two_processes_give_one_process_tokens(checkpoint, tmp_path, flags):
    one = run_generate(checkpoint, tmp_path / "one.jsonl", 1, *flags)
    two = run_generate(checkpoint, tmp_path / "two.jsonl", 2, *flags)
    assert len(one) == len(two) == 1  # rank 1 computes too, but only rank 0 writes
    assert two[0]["token_ids"] == one[0]["token_ids"] and len(one[0]["token_ids"]) == 24


def test_shards_are_this_process_share_and_refused_when_uneven(checkpoint):
    full = load_model(checkpoint, pack=False)
    c = full.config
    hd = c.head_dim
    q, k, v = full.layers[0].attention.wqkv.weight.split([c.n_head * hd, c.n_local_heads * hd, c.n_local_heads * hd])
    for rank in (0, 1):
        part = load_model(checkpoint, pack=False)
        for block in part.layers:  # shard without the all-reduce hooks (no process group here)
            a, ff = block.attention, block.feed_forward
            splits = [a.n_head * hd, a.n_local_heads * hd, a.n_local_heads * hd]
            tp._shard_linear(a.wqkv, rank, 2, "rows", splits)
            tp._shard_linear(a.wo, rank, 2, "cols")
            tp._shard_linear(ff.w2, rank, 2, "cols")
        att = part.layers[0].attention
        want = torch.cat([t.chunk(2)[rank] for t in (q, k, v)])
        assert torch.equal(att.wqkv.weight, want)  # whole heads of q, k and v, not a cut through the fused rows
        assert torch.equal(att.wo.weight, full.layers[0].attention.wo.weight.chunk(2, 1)[rank])
    with pytest.raises(ValueError, match="3 processes cannot share 4 attention heads"):
        tp.check_shardable(c, 3)


@pytest.mark.compile
def test_kernels_read_an_all_reduced_sum_after_its_all_reduce(monkeypatch):
    """tp.keep_reads_after_all_reduces: Inductor re-shapes a kernel's loops to fuse it with one of another shape and,
    in torch 2.13, dropped its reads' link to the in-place all-reduce before it; the kernel could then run on the
    partial sum (compiled bf16 EAGLE under torchrun did). A graph like a sharded model's (a residual stream of
    all-reduced outputs, two of its states concatenated as EAGLE-3 features; one process over gloo): every kernel
    re-shaped there still reads the all-reduced buffers (without the fix some read the partial sums' names)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch._inductor.scheduler import SchedulerNode

    monkeypatch.setattr(SchedulerNode, "recompute_size_and_body", SchedulerNode.recompute_size_and_body)  # restored
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)  # compile here, not from a cache
    monkeypatch.setattr(torch._inductor.config, "emulate_precision_casts", True)  # as generate.py compiles
    tp.keep_reads_after_all_reduces()
    tp.keep_reads_after_all_reduces()  # twice: patched once
    fixed = SchedulerNode.recompute_size_and_body
    renamed, stale = [], []

    def watched(self, *args, **kwargs):
        fixed(self, *args, **kwargs)
        reads = {dep.name for dep in self.read_writes.reads}
        renamed.append(bool(self.mutation_renames))
        stale.extend(name for name in self.mutation_renames if name in reads)

    monkeypatch.setattr(SchedulerNode, "recompute_size_and_body", watched)
    T, D = 9, 576
    weights = [torch.randn(D, D, dtype=torch.bfloat16) / 24 for _ in range(4)]

    def norm(x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)

    def forward(h):
        features = []
        for i, w in enumerate(weights):
            h = h + funcol.all_reduce(torch.mm(norm(h).view(T, D), w).view(1, T, D), "sum", dist.group.WORLD)
            if i in (1, 3):
                features.append(h)
        return norm(h), torch.cat(features, -1)

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        torch._dynamo.reset()
        x = torch.randn(1, T, D, dtype=torch.bfloat16)
        with torch.no_grad():
            got, want = torch.compile(forward, fullgraph=True)(x), forward(x)
    finally:
        torch._dynamo.reset()
        if started:
            dist.destroy_process_group()
    assert any(renamed), "no kernel that reads an all-reduced sum was re-shaped: the test no longer reaches the bug"
    assert stale == []
    assert torch.equal(got[1], want[1])
