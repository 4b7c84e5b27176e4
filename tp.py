"""Tensor parallelism, as gpt-fast does it: one model over N processes (GPUs, or CPU processes over gloo).

    torchrun --nproc_per_node 2 generate.py --checkpoint checkpoints/Llama-2-7b --prompt "..."

Each process holds 1/N of every attention block's heads (q, k and v rows of wqkv, and the matching columns of wo)
and of every MLP's hidden units (rows of w1 and w3, columns of w2), and the KV cache of its own heads. A block's
attention output and its MLP output are partial sums over the processes' shares: one all-reduce after each, two a
layer. The token embedding and the LM head are replicated: every process then computes the full logits and picks
the same token from them (same seed, same numbers), with no gather of a vocabulary-wide tensor at each step; they
are ~4% of a 7B model's weights. An EAGLE head is replicated too (it is small); its verification forward is the
sharded target's. Quantized weights shard the same way, before they are packed for a kernel.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

from model import Transformer
from quantize import INT4I_GROUP, Int4iLinear, Int4Linear, Int8Linear


def init_distributed(device: str):
    """(rank, world size) under torchrun (WORLD_SIZE > 1): joins the process group (NCCL on CUDA, gloo on CPU) and
    pins this process to its GPU; (0, 1) otherwise."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world == 1:
        return 0, 1
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return dist.get_rank(), dist.get_world_size()


def finish_distributed():
    """End a process of a tensor-parallel run: wait for the others, then leave without the interpreter's teardown.
    Gloo's worker threads free a finished collective's tensors when they get to it; if that falls in the
    interpreter's teardown, taking the GIL kills the process (SIGABRT, "terminate called without an active
    exception"), destroy_process_group() or not: two-process gloo runs (scripts/tp_exit_check.py) died 7 times in
    40 left to the teardown, 7 in 165 after destroy_process_group(), none in 110 this way."""
    if dist.is_initialized():
        dist.barrier()  # no process closes its sockets while another still waits on them
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def check_shardable(config, world: int):
    """One clear line when the model cannot be split over `world` processes."""
    for name, n in (("attention heads", config.n_head), ("KV heads", config.n_local_heads),
                    ("MLP hidden units", config.intermediate_size)):
        if n % world:
            raise ValueError(f"{world} processes cannot share {n} {name}: use a number of processes that divides it")


def _rows(t, rank, world):  # a column-parallel layer keeps its share of the output features (weight rows)
    return t.chunk(world, 0)[rank].contiguous()


def _cols(t, rank, world):  # a row-parallel layer keeps its share of the input features (weight columns)
    return t.chunk(world, 1)[rank].contiguous()


def _shard_linear(lin, rank, world, parallel: str, head_splits=None):
    """Cut a Linear / Int8Linear / Int4Linear / Int4iLinear (file form: before prepare) to this process's share, in place.
    head_splits: for wqkv, the sizes of q, k and v, each cut by heads rather than the whole weight in N pieces."""
    def cut(t):
        if t is None:
            return None
        if parallel == "rows":
            if head_splits:
                return torch.cat([_rows(part, rank, world) for part in t.split(head_splits)])
            return _rows(t, rank, world)
        return _cols(t, rank, world) if t.dim() == 2 else t  # per-row scales and biases are whole in each process

    if isinstance(lin, Int4Linear):
        if parallel == "cols" and (lin.scales.shape[1] % world or lin.padded > lin.in_features):
            raise ValueError(f"int4 group size {lin.groupsize} does not split {lin.in_features} input features over "
                             f"{world} processes")
        lin.weight, lin.scales, lin.zeros = cut(lin.weight), cut(lin.scales), cut(lin.zeros)
    elif isinstance(lin, Int4iLinear):
        if parallel == "cols" and lin.steps.shape[1] % world:
            raise ValueError(f"int4i groups of {INT4I_GROUP} do not split {lin.in_features} input features over "
                             f"{world} processes")
        lin.weight, lin.steps, lin.bases = cut(lin.weight), cut(lin.steps), cut(lin.bases)
        lin.scales = cut(lin.scales) if parallel == "rows" else lin.scales
    elif isinstance(lin, Int8Linear):
        lin.weight = cut(lin.weight)
        lin.scales = cut(lin.scales) if parallel == "rows" else lin.scales
    else:
        lin.weight = nn.Parameter(cut(lin.weight.detach()), requires_grad=False)
    if lin.bias is not None:  # a row-parallel bias would be added N times by the all-reduce: keep it on one process
        lin.bias = cut(lin.bias) if parallel == "rows" else (lin.bias if rank == 0 else torch.zeros_like(lin.bias))
    dims = ("out_features", "in_features")
    name = dims[0] if parallel == "rows" else dims[1]
    setattr(lin, name, getattr(lin, name) // world)
    if isinstance(lin, Int4Linear) and parallel == "cols":
        lin.padded //= world


def keep_reads_after_all_reduces():
    """Work around an Inductor bug (torch 2.13) that ran a kernel on a partial sum before its all-reduce.

    Inductor lowers each all-reduce in place (all_reduce_ on the partial sum's buffer) and makes the kernels that read
    the result depend on that mutation by renaming their reads. SchedulerNode.recompute_size_and_body, which the C++
    backend calls to give two kernels of equal size one loop shape before it fuses them, derives a kernel's reads
    from its loop body again and puts the renames back only when the kernel also has hand-made dependencies. A
    fused kernel then looked free of the all-reduce and the memory-saving reordering ran it first: under torchrun
    bf16 EAGLE added one MLP's unreduced partial sum to the residual stream, so each process drafted from other
    features until their collectives parted (docs/performance.md, "Forty-ninth session"). Here the renames are
    always put back. Safe to call more than once."""
    try:
        from torch._inductor.scheduler import SchedulerNode
        recompute = SchedulerNode.recompute_size_and_body
    except (ImportError, AttributeError):  # another torch: nothing to patch
        return
    if getattr(recompute, "keeps_mutation_renames", False):
        return

    def recompute_keeping_renames(self, *args, **kwargs):
        recompute(self, *args, **kwargs)
        if getattr(self, "mutation_renames", None):
            self.set_read_writes(self.read_writes.rename(self.mutation_renames))

    recompute_keeping_renames.keeps_mutation_renames = True
    SchedulerNode.recompute_size_and_body = recompute_keeping_renames


def _all_reduce(module, inputs, output):
    # the partial sums of every process's share; functional collectives trace under torch.compile
    import torch.distributed._functional_collectives as funcol
    return funcol.all_reduce(output, "sum", dist.group.WORLD)


def shard_model(model: Transformer, rank: int, world: int) -> Transformer:
    """This process's share of a model (float weights, or quantized in file form), in place; then register the
    all-reduces. Call before pack_weights / quantize.prepare."""
    if world == 1:
        return model
    c = model.config
    check_shardable(c, world)
    keep_reads_after_all_reduces()
    for block in model.layers:
        att, ff = block.attention, block.feed_forward
        splits = [att.n_head * att.head_dim, att.n_local_heads * att.head_dim, att.n_local_heads * att.head_dim]
        _shard_linear(att.wqkv, rank, world, "rows", splits)
        _shard_linear(att.wo, rank, world, "cols")
        att.n_head, att.n_local_heads = att.n_head // world, att.n_local_heads // world
        for lin in (ff.w1, ff.w3):
            _shard_linear(lin, rank, world, "rows")
        _shard_linear(ff.w2, rank, world, "cols")
        att.register_forward_hook(_all_reduce)
        ff.register_forward_hook(_all_reduce)
        block.residual_inside = False  # the residual goes after the all-reduce, not into wo and w2's partial sums
    model.tp = (rank, world)
    return model
