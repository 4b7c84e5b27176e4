"""Weight-only int8 and int4 quantization of a checkpoint or an EAGLE head, in the style of gpt-fast.

    python quantize.py --mode int8                                     # the default model
    python quantize.py --checkpoint checkpoints/MyModel --mode int4 --groupsize 32
    python quantize.py --checkpoint checkpoints/MyModel --mode int4 --quantize_head
    python quantize.py --draft heads/my-head --mode int8               # an EAGLE head (project layout)
    python generate.py --quant int4.g32 --dtype bfloat16 --compile     # load the quantized weights

The quantized weights go beside the float ones, which keep loading as float unless --quant asks otherwise.
A variant's name says what it holds; its file and an entry in config.json ("quantized": {name: {...}}) record it:

    int8             model_int8.safetensors            Linear layers of the blocks (wqkv, wo, w1, w2, w3) in int8
    int4.g32         model_int4.g32.safetensors        the same layers in int4, groups of 32 (or 64, 128, 256)
    int4i            model_int4i.safetensors           the same layers in int4i: int4 groups of 32 on an int8 grid
    int8.head8       model_int8.head8.safetensors      ... and the LM head (and a tied embedding) in int8
    int4.g32.head8   model_int4.g32.head8.safetensors
    heads:           head_int8.safetensors, head_int4.g32.safetensors, listed in head_config.json

File format (portable: packing for a kernel happens at load time, so a file does not depend on torch's layout):
    int8  NAME.weight int8 [N, K], NAME.scales float32 [N]:             w = weight * scale (per output channel)
    int4  NAME.weight uint8 [N, K/2], column 2j in the low nibble, 2j+1 in the high one, q in 0..15;
          NAME.scales, NAME.zeros float32 [N, K/groupsize]:              w = (q - 8) * scale + zero (per group)
          With --pad, a K the group size does not divide is stored zero-padded up to a multiple of it.
    int4i NAME.weight uint8 [N, K/2] nibbles q as int4's; NAME.scales float32 [N]; NAME.steps uint8 and NAME.bases
          int8 [N, K/32]:                                                w = (q * step + base) * scale, where
          q * step + base is within int8: int8 weights, stored in 4.5 bits each (quantize_int4i)
The loader swaps in the quantized modules that the tensors call for (a .zeros tensor means int4, .steps int4i, a
.scales tensor alone int8), so nothing but the file decides how it is run.
"""
import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels
from kernels import int4i_values  # the int8 weights an int4i file stands for (kernels.unpack reads them back too)
from model import (CheckpointError, ModelArgs, Transformer, default_checkpoint, load_checkpoint, load_safetensors,
                   load_state_dict_strict, read_config)

MODES = ("int8", "int4", "int4i")
INT4I_GROUP = 32  # int4i's group size (columns)
GROUPSIZES = (32, 64, 128, 256)  # what torch's int4 kernels accept


class QuantizeError(ValueError):
    """Bad input, with a one-line message (the command line prints it and exits 2)."""


# ---------------------------------------------------------------- quantize and dequantize tensors

def quantize_int8(w):
    """Symmetric per output channel: w[n] ~ q[n] * scales[n], q in -127..127 (-128 unused, to stay symmetric).
    Error per weight is at most scales[n] / 2."""
    w = w.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127
    q = (w / scales[:, None]).round_().clamp_(-127, 127).to(torch.int8)  # in place: 100M+ weights on 2 cores
    return q, scales


def dequantize_int8(q, scales):
    return q.float() * scales.float()[:, None]


def quantize_int4(w, groupsize: int):
    """Affine per group of `groupsize` input columns: q in 0..15 spans the group's [min, max], so the error per
    weight is at most that group's scale / 2. The zero is stored as min + 8 * scale because torch's int4 kernels
    compute (q - 8) * scale + zero (checked numerically in tests/test_quantize.py and at every load). The min and the
    scale are fp16 values (as Q4_1's m and d; the min rounded down and the scale up, so the grid still spans the
    group): kernels.py's tall blocks then read them in half the bytes."""
    N, K = w.shape
    if K % groupsize:
        raise QuantizeError(f"groupsize {groupsize} does not divide the input dim {K}")
    g = w.float().reshape(N, K // groupsize, groupsize)
    lo, hi = fp16_round(g.amin(-1), up=False), g.amax(-1)
    scales = fp16_round(((hi - lo) / 15).clamp(min=2.0 ** -24), up=True)  # (fp16's smallest: 2^-24)
    q = (g - lo[..., None]).div_(scales[..., None]).round_().clamp_(0, 15).to(torch.uint8)
    return q.reshape(N, K), scales, lo + 8 * scales


def fp16_round(t, up: bool):
    """fp32 t rounded up (or down) to an fp16 value; where fp16 cannot hold that (NaN, beyond +-65504), t itself."""
    h = t.half()
    off = h.float() < t if up else h.float() > t
    h = torch.where(off, torch.nextafter(h, torch.full_like(h, float("inf") if up else float("-inf"))), h)
    return torch.where(h.isfinite() & t.isfinite(), h.float(), t)


def quantize_int4i(w):
    """int4 on an int8 grid ("int4i"): per output channel an int8 scale s = max |w| / 127, and each group of 32 input
    columns takes 16 evenly spaced int8 values q * (0..15) + z (q in 1..17, z and every value within int8), the
    q and z of least squared error among a few around its range (which may clip a group's extremes). So w ~ s *
    (q * nibble + z): int8 weights that store in 4.5 bits each (a nibble, and 2 bytes a group), which the CPU's
    int8 tiles sum over the whole row with no per-group scaling (kernels.pack_int4i). On Gaussian weights the RMS
    error is ~7% below int4 g32's (tests/test_quantize.py); on a checkpoint made from Q4_1 blocks (the default
    model) int4.g32 is exact and this is not. Returns (nibbles packed (N, K/2), scales (N,), steps q uint8
    (N, K/32), bases z int8 (N, K/32))."""
    N, K = w.shape
    if K % INT4I_GROUP:
        raise QuantizeError(f"int4i groups {INT4I_GROUP} columns, which do not divide the input dim {K}")
    w = w.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127
    u = (w / scales[:, None]).reshape(N, K // INT4I_GROUP, INT4I_GROUP)  # within +-127
    lo, hi = u.amin(-1), u.amax(-1)
    q_fit = ((hi - lo) / 15).ceil().clamp(min=1)
    best = None
    for q in ((q_fit + d).clamp(1, 17) for d in (-1, 0, 1)):
        centred = ((lo + hi) / 2 - 7.5 * q).round()
        for dz in (-2, -1, 0, 1, 2):
            z = torch.minimum((centred + dz).clamp(min=-128), 127 - 15 * q)  # all 16 values within int8
            nib = ((u - z[..., None]) / q[..., None]).round_().clamp_(0, 15)
            err = (nib * q[..., None] + z[..., None] - u).square_().sum(-1)
            if best is None:
                best = [err, q, z, nib]
                continue
            better = err < best[0]
            best = [torch.where(better, err, best[0]), torch.where(better, q, best[1]), torch.where(better, z, best[2]),
                    torch.where(better[..., None], nib, best[3])]
    _, q, z, nib = best
    return pack_nibbles(nib.reshape(N, K)), scales, q.to(torch.uint8), z.to(torch.int8)


def dequantize_int4(q, scales, zeros):
    """q [N, K] in 0..15, scales and zeros [N, K/groupsize] -> float weights [N, K] (in the scales' dtype)."""
    N, K = q.shape
    g = q.reshape(N, scales.shape[1], -1).to(scales.dtype) - 8
    return (g * scales[..., None] + zeros[..., None]).reshape(N, K)


def pack_nibbles(q):
    """[N, K] values in 0..15 -> uint8 [N, K/2]: column 2j in the low nibble, 2j+1 in the high one."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(packed):
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


# ---------------------------------------------------------------- modules

class Int8Linear(nn.Module):
    """y = (x @ q.T) * scales (+ bias). On CPU, prepare() packs q for kernels.py's small-M kernel (one pass over
    the int8 weights, each row the same whatever the number of tokens; scales in fp32). Unpacked, Inductor turns
    this into one _weight_int8pack_mm call that reads 1 byte a weight; eager runs the plain (slower) ops."""

    def __init__(self, in_features, out_features, bias=False, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", self.file_weight(out_features, in_features, device))
        self.register_buffer("scales", torch.ones(out_features, device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)
        self.act_bits = 16  # 8: x rounded to 8 bits in groups of 32 for the packed kernel (a ".a8" name)

    @staticmethod
    def file_weight(N, K, device):  # the weight as the file holds it, zeros
        return torch.zeros(N, K, dtype=torch.int8, device=device)

    def forward(self, x, residual=None):
        if self.weight.dim() == 4:
            return kernels.linear(x, self.weight, self.bias, scales=self.scales, residual=residual,
                                  act_bits=self.act_bits)
        y = F.linear(x, self.weight.to(x.dtype)) * self.scales
        y = y if self.bias is None else y + self.bias
        return y if residual is None else residual + y


class Int4iLinear(Int8Linear):
    """int4i weights (quantize_int4i): the file form holds the nibbles, the scales (N,) and each group's step and
    base; prepare() packs them for the int8 tiles where the CPU has them (kernels.pack_int4i, 4.5 bits a weight),
    else makes them the int8 weights they stand for, which then run as an Int8Linear's do (the same integers)."""

    def __init__(self, in_features, out_features, bias=False, device=None):
        super().__init__(in_features, out_features, bias, device)
        G = in_features // INT4I_GROUP
        self.register_buffer("steps", torch.ones(out_features, G, dtype=torch.uint8, device=device))
        self.register_buffer("bases", torch.zeros(out_features, G, dtype=torch.int8, device=device))

    @staticmethod
    def file_weight(N, K, device):  # the nibbles
        return torch.zeros(N, K // 2, dtype=torch.uint8, device=device)

    def values(self):
        return int4i_values(self.weight, self.steps, self.bases)

    def forward(self, x, residual=None):
        if self.weight.dtype == torch.uint8 and self.weight.dim() == 2:  # the file form, before prepare()
            y = F.linear(x, self.values().to(x.dtype)) * self.scales.to(x.dtype)
            y = y if self.bias is None else y + self.bias
            return y if residual is None else residual + y
        return super().forward(x, residual)

    def prepare(self, pack=True):
        """Packed for the int8 tiles (pack and the CPU takes it: True), else the int8 weights (False). Steps or
        bases that do not keep every value within int8 (a file not written by quantize_int4i) are refused."""
        steps, bases = self.steps.int(), self.bases.int()
        if steps.numel() and (steps.min() < 1 or steps.max() > 17 or (bases + 15 * steps).max() > 127):
            raise QuantizeError("int4i weights need steps in 1..17 and base + 15 * step <= 127 (every value "
                                "within int8)")
        if pack and kernels.int4i_takes(self.weight):
            self.weight = kernels.pack_int4i(self.weight, self.steps, self.bases)
            self.scales = self.scales.float().contiguous()
            tiles = True
        else:
            self.weight, tiles = self.values(), False
        del self.steps, self.bases
        return tiles


class Int8Embedding(nn.Module):
    """A token embedding of int8 rows with a scale per row. With tied embeddings the LM head (an Int8Linear) holds
    the very same tensors, so the vocabulary is stored once, at 1 byte a weight (packed, when the head is)."""

    def __init__(self, num_embeddings, embedding_dim, device=None):
        super().__init__()
        self.register_buffer("weight", torch.zeros(num_embeddings, embedding_dim, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.ones(num_embeddings, device=device))
        self.out_dtype = None  # the activations' dtype (prepare); the scales' when None

    def forward(self, idx):
        rows = kernels.packed_rows(self.weight, idx) if self.weight.dim() == 4 else F.embedding(idx, self.weight)
        y = rows.to(self.scales.dtype) * self.scales[idx].unsqueeze(-1)
        return y if self.out_dtype is None else y.to(self.out_dtype)


class Int4Linear(nn.Module):
    """Grouped affine int4: w = (q - 8) * scale + zero per group of `groupsize` input columns.

    It holds the file form (nibbles, scales, zeros) until prepare() readies it for the weight's device: packed
    for torch's kernel (_weight_int4pack_mm_for_cpu on CPU, _weight_int4pack_mm on CUDA), or, where that kernel is
    missing, rejects the shapes or disagrees with plain dequantization, kept as is and dequantized in every
    forward (correct, slow). Move it to its device before prepare(), and save it only before.
    An input dim the group size does not divide is stored zero-padded to a multiple of it (quantize --pad)."""

    def __init__(self, in_features, out_features, groupsize, bias=False, device=None):
        super().__init__()
        if groupsize not in GROUPSIZES:
            raise QuantizeError(f"int4 groupsize must be one of {GROUPSIZES}, got {groupsize}")
        self.in_features, self.out_features, self.groupsize = in_features, out_features, groupsize
        self.padded = -(-in_features // groupsize) * groupsize
        G = self.padded // groupsize
        self.register_buffer("weight", torch.zeros(out_features, self.padded // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.ones(out_features, G, device=device))
        self.register_buffer("zeros", torch.zeros(out_features, G, device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)
        self.layout = "file"  # then "cpu" or "cuda" (packed for that kernel) or "dequant" (the fallback)
        self.act_bits = 16  # 8: x rounded to 8 bits in groups of 32 for the packed kernel (a ".a8" name)

    def dequantize(self):
        assert self.layout in ("file", "dequant"), "the packed layout cannot be dequantized"
        return dequantize_int4(unpack_nibbles(self.weight), self.scales, self.zeros)[:, :self.in_features]

    def forward(self, x, residual=None):
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        added = residual is not None and self.layout == "packed" and self.bias is None  # by kernels.py's op
        if self.layout in ("file", "dequant"):
            y = F.linear(x2, self.dequantize().to(x.dtype))
        else:
            if self.padded > self.in_features:  # zero columns of x meet the padding columns of the weight
                x2 = F.pad(x2, (0, self.padded - self.in_features))
            if self.layout == "packed":  # kernels.py: w = q * scale + offset, fp32 sums
                y = kernels.linear(x2, self.weight, None, self.scales, self.offsets, residual if added else None,
                                   self.act_bits)
            # torch's kernels run in bf16: CUDA's takes nothing else, and the CPU one, which in torch 2.13 also takes
            # fp32 with fp32 scales, ran a 256-token forward of the default model 10-50x slower in fp32 than in bf16
            elif self.layout == "cpu":
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16), self.weight, self.groupsize,
                                                                self.scales_and_zeros)
            else:
                y = torch.ops.aten._weight_int4pack_mm(x2.to(torch.bfloat16), self.weight, self.groupsize,
                                                       self.scales_and_zeros)
        y = y.to(x.dtype).reshape(*lead, self.out_features)
        y = y if self.bias is None else y + self.bias
        return y if residual is None or added else residual + y

    def prepare(self, dtype, use_kernel=True, pack=True):
        """Ready for this device: on CPU packed for kernels.py (pack), else for torch's int4 kernel; scales in
        `dtype` (fp32 for kernels.py). Returns None, or why it fell back to dequantizing in every forward."""
        if self.bias is not None:
            self.bias = self.bias.to(dtype)
        self.layout = "dequant"
        if not use_kernel:
            if self.act_bits == 8:
                raise QuantizeError("8-bit activations (.a8) run on the C++ kernels only")
            self.scales, self.zeros = self.scales.to(dtype), self.zeros.to(dtype)
            return "not asked for"
        device, saved = self.weight.device.type, self.weight
        scales, zeros = self.scales, self.zeros
        try:
            if device == "cpu" and pack and kernels.can_pack(saved):
                # w = (q - 8) * scale + zero = q * scale + offset, in fp32
                offsets = zeros.float() - 8 * scales.float()
                self.layout, self.weight = "packed", kernels.pack(saved, self.act_bits)
                self.scales, tiled_offsets = kernels.tile_groups(scales.float(), offsets, self.weight)
                self.register_buffer("offsets", tiled_offsets)
            else:
                self.scales, self.zeros = scales.to(dtype), zeros.to(dtype)
                packed, sz = _pack_int4(unpack_nibbles(saved), self.scales, self.zeros, device)
                self.layout, self.weight = device, packed
                self.register_buffer("scales_and_zeros", sz)
            # a few inputs through the kernel vs plain dequantization of 16 rows spread over the weight: catches a
            # kernel whose layout or zero-point convention is not this file's (off by about the output's own size).
            # x has a non-zero mean: a zero point off by c * scale shifts y by c * scale * sum(x) per group
            x = (0.5 + torch.sin(torch.arange(4 * self.in_features, device=saved.device))).view(4, -1).to(dtype)
            rows = torch.arange(0, self.out_features, max(1, self.out_features // 16), device=saved.device)
            w = dequantize_int4(unpack_nibbles(saved[rows]), scales[rows].float(), zeros[rows].float())
            ref = x.float() @ w[:, :self.in_features].t()
            bias, self.bias = self.bias, None
            try:
                err = (self.forward(x)[:, rows].float() - ref).abs().max().item()
            finally:
                self.bias = bias
            why = (None if err <= 0.05 * ref.abs().max().item() + 1e-3 else
                   f"the {self.layout} int4 kernel disagrees with dequantization (max error {err:.3g})")
        except Exception as e:  # a missing op (AttributeError), shapes or dtypes it rejects (RuntimeError), ...
            why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
        if self.act_bits == 8 and (why is not None or not kernels.a8_takes(self.weight, self.scales)):
            raise QuantizeError(f"8-bit activations (.a8) run int4 groups of 32 on the C++ kernels of an AVX2 or "
                                f"AVX-512 VNNI CPU (this one: {kernels.isa()}; {why or f'groups of {self.groupsize}'})")
        if why is not None:
            self.layout, self.weight = "dequant", saved
            self.scales, self.zeros = scales.to(dtype), zeros.to(dtype)
            self._buffers.pop("scales_and_zeros", None)
            self._buffers.pop("offsets", None)
            return why
        if self.layout == "packed":
            del self.zeros  # the offsets replace them
        else:
            del self.scales, self.zeros  # the packed form holds them; keeping both would cost memory
        return None


def _pack_int4(q, scales, zeros, device):
    """q [N, K] 0..15 -> (the kernel's packed weight, scales_and_zeros [K/groupsize, N, 2]) for `device`."""
    K = q.shape[1]
    tiles = next((t for t in (8, 4, 2) if K % (16 * t) == 0), 1)  # innerKTiles: CUDA needs K % (16 * tiles) == 0
    sz = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    if device == "cpu":  # int32 [N, K] in, uint8 [N, K/2] in the kernel's own order out; needs N % 16 == 0
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), tiles), sz
    if device == "cuda":  # uint8 [N, K/2] in, even column in the HIGH nibble (not this file's order)
        q = q.to(torch.uint8)
        return torch.ops.aten._convert_weight_to_int4pack(q[:, 0::2] << 4 | q[:, 1::2], tiles), sz
    raise NotImplementedError(f"no int4 kernel for device {device}")


# ---------------------------------------------------------------- swapping modules

def linear_layers(model):
    """The Linear layers quantized: all but the LM head, i.e. a Transformer's wqkv, wo, w1, w2, w3 in every block,
    or an EAGLE head's fc and its decoder layer's (the EAGLE head's embedding and LM head are the target's)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "output"]


def model_packed(model) -> bool:
    out = getattr(model, "output", None)
    return out is not None and getattr(out, "weight", None) is not None and out.weight.dim() == 4


def _set_module(root, name, module):
    parent, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, attr, module)


def check_groupsize(model, groupsize):
    """Refuse (one line, listing the layers) when the group size does not divide every layer's input dim, unless
    asked to pad: SmolLM2's dim 576 is a multiple of 32 and 64 only. Padding stores (and reads) the padded columns
    (576 -> 640 at g128, +11%; -> 768 at g256, +33%) and copies each input into a zero-padded one."""
    bad = {}
    for name, m in linear_layers(model):
        if m.in_features % groupsize:
            bad[re.sub(r"\.\d+\.", ".*.", name)] = m.in_features
    if bad:
        dims = {m.in_features for _, m in linear_layers(model)}
        fits = [g for g in GROUPSIZES if all(d % g == 0 for d in dims)]
        raise QuantizeError(f"--groupsize {groupsize} does not divide the input dim of "
                            f"{', '.join(f'{n} ({d})' for n, d in bad.items())}; group sizes that fit every layer: "
                            f"{', '.join(map(str, fits)) or 'none'} (or zero-pad those layers with --pad)")


def quantize_model(model, mode, groupsize=None, quantize_head=False, pad=False):
    """Swap the float Linear layers for quantized ones, in place (file form: call prepare() before running).
    quantize_head: the LM head in int8 too; with tied embeddings the embedding becomes the same int8 table.
    pad: zero-pad input dims the int4 group size does not divide (else that is refused)."""
    if mode not in MODES:
        raise QuantizeError(f"unknown mode {mode!r}; choose int8, int4 or int4i")
    if any(m.weight.dim() != 2 for _, m in linear_layers(model)) or model_packed(model):
        raise QuantizeError("these weights are packed for the CPU kernels: quantize the plain layout "
                            "(load_model(..., pack=False))")
    if mode == "int4" and not pad:
        check_groupsize(model, groupsize)
    if mode == "int4i":
        bad = sorted({m.in_features for _, m in linear_layers(model) if m.in_features % INT4I_GROUP})
        if bad:
            raise QuantizeError(f"int4i groups {INT4I_GROUP} input columns, which do not divide the input dims {bad}")
    for name, lin in linear_layers(model):
        w, device, has_bias = lin.weight.detach(), lin.weight.device, lin.bias is not None
        if mode == "int8":
            new = Int8Linear(lin.in_features, lin.out_features, has_bias, device)
            new.weight, new.scales = quantize_int8(w)
        elif mode == "int4i":
            new = Int4iLinear(lin.in_features, lin.out_features, has_bias, device)
            new.weight, new.scales, new.steps, new.bases = quantize_int4i(w)
        else:
            new = Int4Linear(lin.in_features, lin.out_features, groupsize, has_bias, device)
            q, new.scales, new.zeros = quantize_int4(F.pad(w, (0, new.padded - lin.in_features)), groupsize)
            new.weight = pack_nibbles(q)
        if has_bias:
            new.bias = lin.bias.detach().float()
        _set_module(model, name, new)
    if quantize_head:
        # int8 whatever the mode: the logits decide every greedy token and every verification, and int8 per row is
        # what also serves the embedding lookup (llama.cpp's Q4 files likewise keep the embedding at 8 bits)
        out = model.output
        head = Int8Linear(out.in_features, out.out_features, device=out.weight.device)
        head.weight, head.scales = quantize_int8(out.weight.detach())
        if model.config.tie_embeddings:
            emb = Int8Embedding(*head.weight.shape, device=head.weight.device)
            emb.weight, emb.scales = head.weight, head.scales
            model.tok_embeddings = emb
        model.output = head
    return model


def swap_modules(model, weights):
    """Before loading a quantized file: replace each Linear / Embedding whose tensors in `weights` are quantized
    by the empty quantized module of the same shape (on the same device, meta included)."""
    for name, m in list(model.named_modules()):
        if f"{name}.scales" not in weights:
            continue
        device = m.weight.device
        if isinstance(m, nn.Linear) and f"{name}.zeros" in weights:
            # the group size follows from the (maybe padded) stored width and the number of groups
            padded, G = 2 * weights[f"{name}.weight"].shape[-1], weights[f"{name}.zeros"].shape[-1]
            groupsize = padded // max(G, 1)
            if G < 1 or padded % G or groupsize not in GROUPSIZES or not 0 <= padded - m.in_features < groupsize:
                raise QuantizeError(f"{name}: {G} groups over {padded} columns do not fit input dim {m.in_features}")
            new = Int4Linear(m.in_features, m.out_features, groupsize, m.bias is not None, device)
        elif isinstance(m, nn.Linear) and f"{name}.steps" in weights:
            if m.in_features % INT4I_GROUP:
                raise QuantizeError(f"{name}: int4i weights need an input dim divisible by {INT4I_GROUP}, "
                                    f"not {m.in_features}")
            new = Int4iLinear(m.in_features, m.out_features, m.bias is not None, device)
        elif isinstance(m, nn.Linear):
            new = Int8Linear(m.in_features, m.out_features, m.bias is not None, device)
        elif isinstance(m, nn.Embedding):
            new = Int8Embedding(m.num_embeddings, m.embedding_dim, device)
        else:
            raise QuantizeError(f"{name}.scales given for a {type(m).__name__}, which cannot be quantized")
        _set_module(model, name, new)
    return model


def prepare(model, dtype, use_kernel=True, pack=True):
    """Ready the quantized modules for running on their current device: scales and biases in `dtype`, weights
    packed for kernels.py on CPU (pack; inference only) or for torch's int4 kernels. Returns {layer name: why it
    fell back to dequantizing} (empty when every int4 layer packed)."""
    packed, cast, fallbacks = {}, {}, {}
    for name, m in model.named_modules():
        if isinstance(m, Int8Linear) and m.weight.dim() == 4:
            continue  # packed by an earlier prepare(): its scales are the kernel's fp32 ones already
        if isinstance(m, Int4iLinear) and m.weight.dtype == torch.uint8 and m.weight.dim() == 2:
            if m.prepare(pack and use_kernel):  # packed for the int8 tiles; else int8 weights, prepared below
                if m.bias is not None:
                    m.bias = m.bias.to(dtype)
                continue
        if isinstance(m, Int8Linear):
            if pack and use_kernel and m.weight.dim() == 2 and kernels.can_pack(m.weight):
                packed[id(m.weight)] = m  # the kernel takes fp32 scales
                m.weight = kernels.pack(m.weight, m.act_bits)
                m.scales = cast.setdefault(id(m.scales), m.scales.float().contiguous())
            else:  # a tied head shares its scales with the embedding: cast each tensor once, keep them shared
                m.scales = cast.setdefault(id(m.scales), m.scales.to(dtype))
            if m.bias is not None:
                m.bias = m.bias.to(dtype)
            if m.act_bits == 8 and not (m.weight.dim() == 4 and kernels.a8_takes(m.weight, m.scales)):
                raise QuantizeError(f"8-bit activations (.a8) run int8 weights packed in 16-row lines (out and in "
                                    f"dims multiples of 16 and 64, q in -127..127) on an AVX2 CPU or an AVX-512 VNNI "
                                    f"one without AMX (this one: {kernels.isa()})")
        elif isinstance(m, Int4Linear) and m.layout == "file":
            if (why := m.prepare(dtype, use_kernel, pack)) is not None:
                fallbacks[name] = why
    for m in model.modules():  # an int8 embedding follows its tied LM head, and yields the activations' dtype
        if isinstance(m, Int8Embedding) and m.weight.dim() == 2:  # (packed: its head's, by an earlier prepare())
            head = packed.get(id(m.weight))
            m.weight, m.scales = (head.weight, head.scales) if head else (m.weight, cast.setdefault(id(m.scales),
                                                                                                     m.scales.to(dtype)))
            m.out_dtype = dtype
    freeze_as_parameters(model)
    if fallbacks and use_kernel:
        first = next(iter(fallbacks.items()))
        print(f"int4: {len(fallbacks)} layers run without the packed kernel (e.g. {first[0]}: {first[1]}); "
              f"they dequantize in every forward instead (same weights, slower)", file=sys.stderr)
    return fallbacks


def freeze_as_parameters(model):
    """The quantized modules' tensors (weights, scales, offsets, biases) as frozen Parameters, no longer buffers:
    before every compiled call Dynamo checks each tensor buffer that could alias another, which cost the default
    model ~0.9 ms a decode step in int8 and int4 (Zen 5: the profiler's "TorchDynamo Cache Lookup" 1.18 -> 0.30
    ms a call); parameters it leaves out of that check. Tied tensors (an int8 head and its embedding) stay one."""
    frozen = {}  # tensor id -> its Parameter
    for m in model.modules():
        if isinstance(m, (Int8Linear, Int8Embedding, Int4Linear)):
            for name, t in list(m._buffers.items()):
                if t is not None:
                    del m._buffers[name]
                    m.register_parameter(name, frozen.setdefault(id(t), nn.Parameter(t, requires_grad=False)))


# ---------------------------------------------------------------- names, files and loading

def quant_name(mode, groupsize=None, quantize_head=False):
    return mode + (f".g{groupsize}" if mode == "int4" else "") + (".head8" if quantize_head else "")


def parse_name(name):
    """'int4.g32.head8' -> ('int4', 32, True), 'int4i' -> ('int4i', None, False), 'int4.g32.a8.head8' (the same
    weights, activations rounded to 8 bits: act_bits) -> ('int4', 32, True); a one-line QuantizeError for anything
    else."""
    m = re.fullmatch(r"(int8|int4i|int4\.g(\d+))(\.a8)?(\.head8)?", name)
    if not m or (m.group(2) and int(m.group(2)) not in GROUPSIZES):
        raise QuantizeError(f"unknown quantization {name!r}: expected int8, int4i or int4.g32 (g64, g128, g256), "
                            f"optionally followed by .a8 (8-bit activations) and .head8")
    if m.group(3) and m.group(1) not in ("int8", "int4.g32"):
        raise QuantizeError(f"{name}: 8-bit activations (.a8) take int8 and int4 groups of 32 (int8.a8, int4.g32.a8)")
    mode = "int4" if m.group(2) else m.group(1)
    return mode, int(m.group(2)) if m.group(2) else None, bool(m.group(4))


def act_bits(name) -> int:
    """The bits a quantized variant's linears (int8 and int4, the LM head too) round x to: 8 for 'int8.a8' and
    'int4.g32.a8' (groups of 32, each with its own scale, as llama.cpp's q8_0: one integer product a weight and row
    where 16-bit rows take two), else 16."""
    return 8 if "a8" in name.split(".") else 16


def quantized_file(checkpoint_dir, config, name) -> Path:
    """The file holding variant `name` of a checkpoint (config.json's "quantized" entry, else the naming rule)."""
    try:
        mode, groupsize, head = parse_name(name)
    except QuantizeError as e:
        raise CheckpointError(str(e)) from None
    stored = quant_name(mode, groupsize, head)  # .a8 runs the same weights
    entry = config.get("quantized", {}).get(stored)
    path = Path(checkpoint_dir) / (entry["file"] if entry else f"model_{stored}.safetensors")
    if not path.is_file():
        have = ", ".join(config.get("quantized", {})) or "none"
        make = f"--mode {mode}" + (f" --groupsize {groupsize}" if groupsize else "")
        make += " --quantize_head" if head else ""
        raise CheckpointError(f"{checkpoint_dir} has no {name} weights ({path.name}; quantized there: {have}); "
                              f"make them with: python quantize.py --checkpoint {checkpoint_dir} {make}")
    return path


def load_quantized(checkpoint_dir, name, device="cpu", dtype=torch.bfloat16, pack=True, shard=None) -> Transformer:
    """The quantized variant `name` of a checkpoint ("int8", "int4.g32", ...), ready to run on `device`: the file's
    tensors decide the module swaps; `dtype` is that of the activations, scales and float weights. pack: packed for
    kernels.py on CPU (inference only). shard(model): cuts the file-form weights to a tensor-parallel share (tp.py)
    before they are packed."""
    config = read_config(checkpoint_dir)
    try:
        args = ModelArgs.from_json(Path(checkpoint_dir) / "config.json")
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"bad model config in {checkpoint_dir}: {e}") from None
    with torch.device("meta"):
        model = Transformer(args)
    path = quantized_file(checkpoint_dir, config, name)
    weights = load_safetensors(path)
    # scales and zeros stay fp32 until prepare(): the CPU kernels take fp32 ones, and rounding them to bf16 first cost
    # int8.head8 9% of its KL from fp32 (0.00559 -> 0.00512, scripts/quant_agreement.py), int4.g32.head8 12%
    keep = (".scales", ".zeros")
    weights = {k: v.to(device=device, dtype=dtype if v.is_floating_point() and not k.endswith(keep) else v.dtype)
               for k, v in weights.items()}
    if model.config.tie_embeddings:  # stored once, under the embedding's names
        for k in ("weight", "scales"):
            if f"tok_embeddings.{k}" in weights and f"output.{k}" not in weights:
                weights[f"output.{k}"] = weights[f"tok_embeddings.{k}"]
    try:
        swap_modules(model, weights)
    except QuantizeError as e:
        raise CheckpointError(f"quantized checkpoint {path}: {e}") from None
    mode, groupsize, _ = parse_name(name)
    held = {(type(m).__name__, getattr(m, "groupsize", None)) for n, m in model.named_modules()
            if isinstance(m, (Int8Linear, Int4Linear)) and n != "output"}
    expected = {"int8": ("Int8Linear", None), "int4i": ("Int4iLinear", None)}.get(mode, ("Int4Linear", groupsize))
    if held != {expected}:
        raise CheckpointError(f"{path} does not hold {name} weights (it holds {sorted(held, key=str) or 'float'})")
    load_state_dict_strict(model, weights, f"quantized checkpoint {path}")
    if model.config.tie_embeddings:  # one tensor, not two copies
        model.output.weight = model.tok_embeddings.weight
        if isinstance(model.tok_embeddings, Int8Embedding):
            model.output.scales = model.tok_embeddings.scales
    if shard is not None:
        shard(model)
    for m in model.modules():
        if isinstance(m, (Int8Linear, Int4Linear)):
            m.act_bits = act_bits(name)
    try:
        prepare(model, dtype, pack=pack)
    except QuantizeError as e:
        raise CheckpointError(f"{name}: {e}") from None
    model.checkpoint_config = config
    return model.eval()


def _write_atomic(path, write):
    fd, tmp = tempfile.mkstemp(dir=Path(path).parent, prefix=f".{Path(path).name}.")
    os.close(fd)
    try:
        write(tmp)
        # a rewritten config.json keeps its permissions; a new file gets the usual ones (mkstemp's are 0600)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, os.stat(path).st_mode & 0o777 if os.path.exists(path) else 0o666 & ~umask)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _save(module, path, entry, drop=()):
    from safetensors.torch import save_file
    state = {k: v.contiguous() for k, v in module.state_dict().items() if k not in drop}
    _write_atomic(path, lambda p: save_file(state, p, metadata={"quantization": json.dumps(entry)}))


def _add_entry(config_path, config, name, entry):
    config.setdefault("quantized", {})[name] = entry
    _write_atomic(config_path, lambda p: Path(p).write_text(json.dumps(config, indent=2) + "\n"))


def quantize_checkpoint(checkpoint_dir, mode, groupsize=None, quantize_head=False, pad=False) -> Path:
    """Write model_<name>.safetensors beside a checkpoint's float weights and list it in its config.json."""
    checkpoint_dir = Path(checkpoint_dir)
    config = read_config(checkpoint_dir)
    model = quantize_model(load_checkpoint(checkpoint_dir, "cpu", torch.float32), mode, groupsize, quantize_head, pad)
    name = quant_name(mode, groupsize, quantize_head)
    padded = sum(isinstance(m, Int4Linear) and m.padded > m.in_features for m in model.modules())
    entry = {"mode": mode, "groupsize": groupsize, "head": "int8" if quantize_head else None,
             "padded_layers": padded, "file": f"model_{name}.safetensors"}
    tied = {"output.weight", "output.scales"} if model.config.tie_embeddings else set()
    _save(model, checkpoint_dir / entry["file"], entry, drop=tied)
    _add_entry(checkpoint_dir / "config.json", config, name, entry)
    return checkpoint_dir / entry["file"]


HEAD_CONFIG, HEAD_FILE = "head_config.json", "head.safetensors"  # an EAGLE head in the project layout (eagle_head.py)


def quantize_head_weights(weights, mode, groupsize=None, pad=False) -> dict:
    """A head's tensors with each Linear weight (2-D: fc and the decoder layer's) quantized as a model's are, beside
    its scales (and zeros); norms and the vocabulary kept. What quantize_head_dir writes, and what load_head
    computes in memory when asked for a quantized head that was never written."""
    linears = [k[:-len(".weight")] for k, v in weights.items() if k.endswith(".weight") and v.dim() == 2]
    if mode == "int4" and not pad:
        bad = {n: weights[f"{n}.weight"].shape[1] for n in linears if weights[f"{n}.weight"].shape[1] % groupsize}
        if bad:
            raise QuantizeError(f"--groupsize {groupsize} does not divide the input dim of "
                                f"{', '.join(f'{n} ({d})' for n, d in bad.items())} (or zero-pad them with --pad)")
    state = dict(weights)
    for n in linears:
        w = weights[f"{n}.weight"].float()
        if mode == "int8":
            state[f"{n}.weight"], state[f"{n}.scales"] = quantize_int8(w)
        elif mode == "int4i":
            state[f"{n}.weight"], state[f"{n}.scales"], state[f"{n}.steps"], state[f"{n}.bases"] = quantize_int4i(w)
        else:
            padded = -(-w.shape[1] // groupsize) * groupsize
            q, state[f"{n}.scales"], state[f"{n}.zeros"] = quantize_int4(F.pad(w, (0, padded - w.shape[1])), groupsize)
            state[f"{n}.weight"] = pack_nibbles(q)
    return state


def quantize_head_dir(head_dir, mode, groupsize=None, pad=False) -> Path:
    """Write head_<name>.safetensors beside a project-layout EAGLE head and list it in its head_config.json: each
    Linear weight (2-D, fc and the decoder layer's) quantized as a model's are; norms and the vocabulary kept."""
    head_dir = Path(head_dir)
    if not (head_dir / HEAD_CONFIG).is_file():
        raise QuantizeError(f"{head_dir} is not a project-layout head directory (no {HEAD_CONFIG})")
    try:
        config = json.loads((head_dir / HEAD_CONFIG).read_text())
        weights = load_safetensors(head_dir / HEAD_FILE)
    except (CheckpointError, json.JSONDecodeError) as e:
        raise QuantizeError(f"{head_dir}: {e}") from None
    state = quantize_head_weights(weights, mode, groupsize, pad)
    name = quant_name(mode, groupsize)
    entry = {"mode": mode, "groupsize": groupsize, "file": f"head_{name}.safetensors"}
    from safetensors.torch import save_file
    state = {k: v.contiguous() for k, v in state.items()}
    _write_atomic(head_dir / entry["file"], lambda p: save_file(state, p, metadata={"quantization": json.dumps(entry)}))
    _add_entry(head_dir / HEAD_CONFIG, config, name, entry)
    return head_dir / entry["file"]


# ---------------------------------------------------------------- command line

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=None, help="checkpoint directory (default: the default model)")
    p.add_argument("--draft", type=Path, default=None, help="quantize this EAGLE head directory instead")
    p.add_argument("--mode", default="int8", help="int8 (per output channel), int4 (grouped, affine) or int4i (int4 "
                   "groups of 32 on a per-channel int8 grid: int8 arithmetic at 4.5 bits a weight)")
    p.add_argument("--groupsize", type=int, default=None, help="int4 group size: 32 (default), 64, 128 or 256")
    p.add_argument("--quantize_head", action="store_true",
                   help="also quantize the LM head (and a tied embedding) to int8; default: keep it float")
    p.add_argument("--pad", action="store_true",
                   help="int4: zero-pad input dims the group size does not divide (default: refuse)")
    args = p.parse_args(argv)

    def die(msg):
        print(f"error: {msg}", file=sys.stderr)
        sys.exit(2)

    if args.mode not in MODES:
        die(f"unknown --mode {args.mode!r}; choose int8, int4 or int4i")
    if args.mode != "int4" and args.pad:
        die(f"--pad applies to --mode int4 only ({args.mode} takes input dims as they are)")
    if args.mode != "int4" and args.groupsize is not None:
        die(f"--groupsize applies to --mode int4 only ({args.mode} has one scale per output channel"
            + (f", groups of {INT4I_GROUP})" if args.mode == "int4i" else ")"))
    groupsize = (32 if args.groupsize is None else args.groupsize) if args.mode == "int4" else None
    if groupsize is not None and groupsize not in GROUPSIZES:
        die(f"--groupsize must be one of {', '.join(map(str, GROUPSIZES))} (what torch's int4 kernels take), "
            f"got {groupsize}")
    if args.draft is not None and (args.checkpoint is not None or args.quantize_head):
        die("--draft quantizes a head on its own: drop --checkpoint and --quantize_head")
    try:
        if args.draft is not None:
            out = quantize_head_dir(args.draft, args.mode, groupsize, args.pad)
        else:
            out = quantize_checkpoint(args.checkpoint or default_checkpoint(), args.mode, groupsize,
                                      args.quantize_head, args.pad)
    except (QuantizeError, CheckpointError, OSError, ValueError) as e:  # (OSError: a read-only or full directory)
        die(e)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
