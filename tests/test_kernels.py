"""kernels.py: the C++ small-M linear and attention against their pure-PyTorch references, row independence (each
output row the same whatever the number of rows), the input gradient through a frozen packed weight, and that an
inference call runs no Python."""
import gc
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kernels
import quantize as Q

pytestmark = pytest.mark.skipif(not kernels.load(), reason="the C++ kernels are not available here")


def packed_weight(kind, N=64, K=256, G=64, seed=0):
    """(packed, scales, offsets, dense fp32 equivalent) for a float, int8 or int4 weight."""
    g = torch.Generator().manual_seed(seed)
    if kind in ("float32", "bfloat16"):
        w = (torch.randn(N, K, generator=g) / K ** 0.5).to(getattr(torch, kind))
        return kernels.pack(w), None, None, w.float()
    if kind == "int8":
        q = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
        scales = torch.rand(N, generator=g) / 127
        return kernels.pack(q), scales, None, q.float() * scales[:, None]
    nibbles = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
    scales, offsets = torch.rand(N, K // G, generator=g) / 15, -torch.rand(N, K // G, generator=g)
    return kernels.pack(nibbles), scales, offsets, kernels.dequantize(nibbles, scales, offsets)


ACT_DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.bfloat16, "int4": torch.bfloat16}


@pytest.mark.parametrize("N", [64, 68])  # 68: an odd number of 4-row blocks (a one-row call takes 8 rows a time)
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8", "int4"])
def test_linear_matches_reference_and_rows_are_independent(kind, N):
    packed, scales, offsets, dense = packed_weight(kind, N=N)
    bias = torch.randn(N)
    x = torch.randn(70, 256).to(ACT_DTYPE[kind])  # 70: past a 64-row panel
    y = kernels.linear(x, packed, bias, scales, offsets)
    ref = kernels.linear_reference(x, packed, bias, scales, offsets)
    assert y.shape == (70, N) and y.dtype == x.dtype
    # the reference is F.linear over the dense weight: a wrong block layout or nibble order is off by ~100%
    assert torch.allclose(ref.float(), (F.linear(x.float(), dense) + bias).to(x.dtype).float(), rtol=1e-2, atol=1e-2)
    tol = 1e-5 if kind == "float32" else 2e-2  # bf16 outputs (and BF16 dot products) round at ~3 digits
    assert (y.float() - ref.float()).abs().max() <= tol * ref.float().abs().max()
    # bit for bit the rows of a bigger call (int8/int4: in-register conversion up to 6 rows, a converted block
    # buffer above): what makes bf16 EAGLE exact
    for M in (1, 2, 5, 6, 7, 9, 16, 17, 33, 64):
        assert torch.equal(kernels.linear(x[:M], packed, bias, scales, offsets), y[:M]), M
        assert torch.equal(kernels.linear(x[M - 1:M + 3], packed, bias, scales, offsets), y[M - 1:M + 3]), M
    # a residual added by the op: the output rounded to x's dtype, then the sum rounded, as eager's residual + y
    residual = torch.randn(70, N).to(x.dtype)
    with_residual = kernels.linear(x, packed, bias, scales, offsets, residual=residual)
    assert torch.equal(with_residual, residual + y)
    assert torch.equal(kernels.linear_reference(x, packed, bias, scales, offsets, residual), residual + ref)
    for M in (1, 5, 17, 65):
        assert torch.equal(kernels.linear(x[:M], packed, bias, scales, offsets, residual=residual[:M]), with_residual[:M])
    with pytest.raises(RuntimeError, match="the residual must be a contiguous"):
        torch.ops.eagle_fast.linear(x, packed, scales, offsets, bias, residual[:, :N - 4])


def test_int8_on_avx2_and_avx512_bf16_matches_integer_sums_of_rows_rounded_to_16_bits():
    """The AVX2 and AVX-512-BF16 builds (4-row blocks) multiply int8 weights by x rounded to 16-bit integers a row
    (exact integer sums): their outputs are those of round_rows16(x) to fp32's rounding, past 4096 columns (where the
    lanes go to fp32) and at the largest products (no integer overflow), with a row of zeros and rows holding a NaN
    or an inf."""
    if kernels.isa() not in kernels.INT16_ROW_BUILDS:
        pytest.skip("the AVX2 and AVX-512-BF16 builds' int8 path (EAGLE_KERNELS=avx2, avx2_vnni or avx512_bf16 "
                    "runs it on an AMX machine)")
    g = torch.Generator().manual_seed(2)
    N, K = 8, 4096 + 512
    q = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    scales = torch.rand(N, generator=g) / 127
    x = torch.randn(6, K, generator=g) * torch.logspace(-3, 3, K)  # a wide range: the rounding matters
    x[1] = torch.where(q[0] >= 0, 1.0, -1.0)  # every product of row 1 and weight row 0 at its largest, one sign
    q[0] = torch.where(q[0] >= 0, 127, -128).to(torch.int8)
    x[2], x[3, 7], x[4, 9] = 0.0, float("nan"), float("inf")
    y = kernels.linear(x, kernels.pack(q), None, scales)
    ref = F.linear(kernels.round_rows16(x).double(), q.double() * scales.double()[:, None]).float()
    assert torch.equal(kernels.linear_reference(x, kernels.pack(q), None, scales).isnan(), ref.isnan())
    ok = ~ref.isnan()
    assert torch.allclose(y[ok], ref[ok], rtol=1e-5, atol=1e-5 * ref[ok].abs().max().item())
    assert y[1, 0] == pytest.approx(K * 127.5 * scales[0].item(), rel=1e-3)  # 4608 products, none wrapped around
    assert torch.equal(y[2], torch.zeros(N)) and y[3].isnan().all() and y[4].isnan().all()
    # not the float sums: x rounded to 16 bits is a different (and, here, visible) result
    assert not torch.allclose(y[0], F.linear(x[0:1].double(), q.double() * scales.double()[:, None]).float()[0],
                              rtol=1e-7, atol=0)


def extreme_int8_case(seed, N, K, rows, scale_range, dtype):
    """int8 weights (N, K) with their scales, and x (rows, K) in dtype spanning 10^-r..10^r: row 1 meets weight row 0
    at its largest products, one sign; row 2 zeros; rows 3 and 4 hold a NaN and an inf."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    scales = torch.rand(N, generator=g) / 127
    x = torch.randn(rows, K, generator=g) * torch.logspace(-scale_range, scale_range, K)
    x[1] = torch.where(q[0] >= 0, 1.0, -1.0)
    q[0] = torch.where(q[0] >= 0, 127, -128).to(torch.int8)
    x[2], x[3, 7], x[4, 9] = 0.0, float("nan"), float("inf")
    return q, scales, x.to(dtype)


def assert_int8_rows_equal(packed, scales, x, ref, sizes):
    """kernels.linear on the first M rows, for each M, equals ref bit for bit (NaN where ref is); no sum wrapped
    around (extreme_int8_case's row 1), zeros and NaN rows as they should be."""
    for M in sizes:
        y = kernels.linear(x[:M], packed, None, scales)
        assert torch.equal(y.isnan(), ref[:M].isnan()), M
        assert torch.equal(y[~y.isnan()], ref[:M][~y.isnan()]), M
    assert y[1, 0].float() == pytest.approx(x.shape[1] * 127.5 * scales[0].item(), rel=1e-2)
    assert torch.equal(y[2], torch.zeros_like(y[2])) and y[3].isnan().all() and y[4].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_in_16_row_blocks_on_avx512_bf16_sums_high_and_low_bytes_exactly(dtype):
    """The AVX-512-BF16 build without AMX multiplies int8 weights in 16-row blocks (_vnni_lines) by x rounded to
    16-bit integers a row (qmax 32639) split into two signed bytes, x = 256 hi + lo: each output is fl(fl(H) * 256 +
    fl(L)), H and L the exact integer dot products of the high and the low bytes, times the row's and the weight row's
    scales, whatever M is, at the largest products (-128 weights too), with a row of zeros and rows holding a NaN or
    an inf."""
    if kernels.isa() != "avx512_bf16":
        pytest.skip("the AVX-512-BF16 build's int8 path (EAGLE_KERNELS=avx512_bf16 runs it on an AMX machine)")
    N, K = 96, 4608 + 64  # past 4096 columns
    q, scales, x = extreme_int8_case(5, N, K, 20, 2, dtype)
    ints, row_scales = kernels.rows16(x, 32639)
    hi = torch.floor((ints + 128) / 256)
    H, L = hi.double() @ q.double().T, (ints - 256 * hi).double() @ q.double().T
    ref = ((H.float() * 256 + L.float()) * row_scales * scales).to(dtype)
    packed = kernels.pack(q)
    assert packed.shape == (N // 16, K // 64, 16, 64) and packed.dtype == torch.uint8
    assert_int8_rows_equal(packed, scales, x, ref, (1, 2, 5, 6, 7, 13, 20))


def test_int8_lines_layout_on_avx512_bf16():
    """On AVX-512-BF16 CPUs without AMX, pack() lays int8 weights out in _vnni_tiles' order with each byte + 128, as
    uint8 (N/16, K/64, 16, 64): a 64-byte line is 4 columns of 16 rows; unpack() and packed_rows() read them back;
    N % 16 != 0 keeps 4-row blocks."""
    if kernels.isa() != "avx512_bf16":
        pytest.skip("the int8 line layout is the AVX-512-BF16 build's")
    g = torch.Generator().manual_seed(6)
    q = torch.randint(-128, 128, (48, 320), generator=g, dtype=torch.int8)
    lines = kernels.pack(q)
    assert lines.shape == (3, 5, 16, 64) and lines.dtype == torch.uint8 and torch.equal(kernels.unpack(lines), q)
    view = lines.view(3, 80, 16, 4)  # (block, 4 columns r, row n, j)
    for blk, r, n, j in [(0, 0, 0, 0), (1, 13, 5, 1), (2, 79, 15, 3), (1, 40, 0, 2)]:
        assert view[blk, r, n, j].item() == q[16 * blk + n, 4 * r + j].item() + 128
    idx = torch.tensor([[0, 15, 16], [47, 33, -1]])
    assert torch.equal(kernels.packed_rows(lines, idx), q[idx])
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.packed_rows(lines, torch.tensor([48]))
    assert kernels.pack(q[:44]).shape == (11, 10, 4, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_on_amx_is_the_exact_integer_dot_product(dtype):
    """The AMX build multiplies int8 weights (tall blocks) by x rounded to 16-bit integers a row, by the int8 tiles (a
    high and a low byte and a row of ones a panel): each output is the exact integer dot product rounded to fp32 once,
    times the row's and the weight row's scales, whatever M is (one panel of up to 7 rows, two, three, several
    21-row passes), at the largest products, with a row of zeros and rows holding a NaN or an inf."""
    if kernels.isa() != "amx":
        pytest.skip("the AMX build's int8 path (a Xeon with AMX tiles)")
    q, scales, x = extreme_int8_case(3, 256, 1536, 70, 2, dtype)  # 256 rows: enough weight blocks for both threads
    ints, row_scales = kernels.rows16(x)
    ref = ((ints.double() @ q.double().T).float() * row_scales * scales).to(dtype)
    assert_int8_rows_equal(kernels.pack(q), scales, x, ref, (1, 2, 3, 5, 7, 8, 15, 16, 17, 21, 22, 70))


def test_int8_tiles_layout_on_amx():
    """On AMX, pack() lays int8 weights out as the int8 tiles' B operand (16 rows x 64 columns in 1 KB, VNNI order;
    block_rows, _vnni_tiles), which unpack() and packed_rows() read back; N % 16 != 0 or K % 64 != 0 keep 4-row
    blocks, which the vector path takes (x not rounded: the reference's float sums); tall blocks of another dtype
    are one clear error."""
    if kernels.isa() != "amx":
        pytest.skip("the int8 tile layout is the AMX build's")
    g = torch.Generator().manual_seed(4)
    q = torch.randint(-128, 128, (48, 320), generator=g, dtype=torch.int8)
    scales = torch.rand(48, generator=g) / 127
    tall = kernels.pack(q)
    assert tall.shape == (3, 10, 16, 32) and torch.equal(kernels.unpack(tall), q)
    tiles = tall.view(3, 5, 16, 16, 4)  # (block, 64 columns, quad r, row n, j)
    for blk, kp, r, n, j in [(0, 0, 0, 0, 0), (1, 2, 3, 5, 1), (2, 4, 15, 15, 3), (1, 4, 6, 0, 2)]:
        assert tiles[blk, kp, r, n, j].item() == q[16 * blk + n, 64 * kp + 4 * r + j].item()
    idx = torch.tensor([[0, 15, 16], [47, 33, -1]])  # an op (tile_rows), as torch indexing wraps -1
    assert torch.equal(kernels.packed_rows(tall, idx), q[idx])
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.packed_rows(tall, torch.tensor([48]))
    assert kernels.pack(q[:44]).shape == (11, 10, 4, 32) and kernels.pack(q[:, :288]).shape == (12, 9, 4, 32)
    x = torch.randn(17, 320, generator=g).bfloat16()
    short = kernels.pack(q[:44])
    ref = kernels.linear_reference(x, short, None, scales[:44])  # float x: no rounding to 16 bits
    assert torch.allclose(kernels.linear(x, short, None, scales[:44]).float(), ref.float(), rtol=2e-2, atol=2e-2)
    with pytest.raises(RuntimeError, match="tall blocks"):
        kernels.linear(x.float(), torch.zeros(3, 10, 16, 32))


def test_bf16_tiles_layout_on_amx():
    """On AMX, pack() lays bf16 weights out as the bf16 tiles' B operand (16 rows x 32 columns in 1 KB, VNNI pairs;
    _vnni_tiles), which unpack() and packed_rows() read back; the op's outputs are those of the 4-row blocks bit for
    bit (the same pair products in the same order, the tiles' roles swapped) at every M, with a bias and a residual;
    N % 16 != 0 or K % 64 != 0 keep 4-row blocks."""
    if kernels.isa() != "amx":
        pytest.skip("the bf16 tile layout is the AMX build's")
    g = torch.Generator().manual_seed(5)
    w = torch.randn(48, 320, generator=g).bfloat16()
    tall = kernels.pack(w)
    assert tall.shape == (3, 10, 16, 32) and torch.equal(kernels.unpack(tall), w)
    tiles = tall.view(3, 10, 16, 16, 2)  # (block, 32 columns, pair p, row n, j)
    for blk, kb, pr, n, j in [(0, 0, 0, 0, 0), (1, 2, 3, 5, 1), (2, 9, 15, 15, 1), (1, 4, 6, 0, 0)]:
        assert tiles[blk, kb, pr, n, j].item() == w[16 * blk + n, 32 * kb + 2 * pr + j].item()
    idx = torch.tensor([[0, 15, 16], [47, 33, -1]])
    assert torch.equal(kernels.packed_rows(tall, idx), w[idx])
    rows4 = w.reshape(12, 4, 10, 32).transpose(1, 2).contiguous()  # the 4-row layout the AMX tiles took before
    bias, residual = torch.randn(48, generator=g), torch.randn(70, 48, generator=g).bfloat16()
    x = torch.randn(70, 320, generator=g).bfloat16()
    x[3] = 0.0
    for M in (1, 2, 3, 5, 9, 15, 16, 17, 33, 64, 65, 70):
        for b, r in ((None, None), (bias, residual[:M])):
            y = torch.ops.eagle_fast.linear(x[:M], tall, None, None, b, r)
            assert torch.equal(y, torch.ops.eagle_fast.linear(x[:M], rows4, None, None, b, r)), M
    assert torch.equal(y[:5], kernels.linear(x[:5], tall, bias, residual=residual[:5]))  # rows alone = rows together
    assert kernels.pack(w[:44]).shape == (11, 10, 4, 32) and kernels.pack(w[:, :288]).shape == (12, 9, 4, 32)


@pytest.mark.parametrize("G", [32, 256])
def test_int4_in_tall_blocks_sums_rows_rounded_to_16_bits(G):
    """The AMX and AVX-512-BF16 builds multiply int4 weights (tall blocks) by x rounded to 16-bit integers a row, exact
    integer sums a group, then scale and offset: the outputs are those of round_rows16(x, 32639) @ the dequantized
    weight, to fp32's rounding, at every M (AMX: 32-column groups up to 4 rows two groups a product, each in its own
    half of K; one tile of 2c rows up to 7 rows, two tiles of up to 16 above; AVX-512-BF16: KernelI4v16, 32-column
    groups two a step, 256-column ones one at a time, one row in two chains of sums, blocks of up to 5 rows), at the
    largest products (no integer overflow; x = +-32639 splits into signed bytes), with a row of zeros and rows
    holding a NaN or an inf."""
    if kernels.isa() not in ("amx", "avx512_bf16"):
        pytest.skip("the int4 tall blocks of the AMX and AVX-512-BF16 builds")
    g = torch.Generator().manual_seed(5)
    N, K = 96, 1536  # 6 blocks of 16 rows: both threads, one block left over for the two-block steps
    nibbles = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
    nibbles[0] = 255  # weight row 0: q = 15 everywhere
    scales, offsets = torch.rand(N, K // G, generator=g) / 15, -torch.rand(N, K // G, generator=g)
    x = torch.randn(70, K, generator=g) * torch.logspace(-2, 2, K)
    x[1] = -1.0  # every product of row 1 and weight row 0 at its largest
    x[5, ::2] = 1.0  # +-32639 in one row: the high byte at its largest both ways
    x[5, 1::2] = -1.0
    x[2], x[3, 7], x[4, 9] = 0.0, float("nan"), float("inf")
    packed = kernels.pack(nibbles)
    assert packed.shape == (N // 16, K // 64, 16, 32)
    dense = kernels.dequantize(nibbles, scales, offsets).double()
    ref = F.linear(kernels.round_rows16(x, 32639).double(), dense).float()
    y = kernels.linear(x, packed, None, scales, offsets)
    assert torch.equal(y.isnan(), ref.isnan())
    ok = ~ref.isnan()
    assert torch.allclose(y[ok], ref[ok], rtol=1e-5, atol=1e-5 * ref[ok].abs().max().item())
    assert torch.equal(y[2], torch.zeros(N)) and y[3].isnan().all() and y[4].isnan().all()
    assert y[1, 0].item() == pytest.approx(-(15 * scales[0] + offsets[0]).sum().item() * G, rel=1e-4)
    # not the float sums: x rounded to 16 bits is a different (and, here, visible) result
    assert not torch.allclose(y[0], F.linear(x[0:1].double(), dense).float()[0], rtol=1e-7, atol=0)
    for M in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33):  # bit for bit (NaN rows: NaN)
        torch.testing.assert_close(kernels.linear(x[:M], packed, None, scales, offsets), y[:M], rtol=0, atol=0,
                                   equal_nan=True, msg=f"M={M}")
    # the scales and offsets laid out as the tiles read them (what quantize.py keeps): the same outputs
    tiled_scales, tiled_offsets = kernels.tile_groups(scales, offsets, packed)
    assert tiled_scales.shape == (N // 16, K // G, 16) and torch.equal(kernels.plain_groups(tiled_offsets), offsets)
    assert tiled_scales[1, 2, 3] == scales[16 + 3, 2] and tiled_scales.dtype == torch.float32  # not exact in fp16
    for M in (1, 5, 17):
        torch.testing.assert_close(kernels.linear(x[:M], packed, None, tiled_scales, tiled_offsets), y[:M], rtol=0,
                                   atol=0, equal_nan=True, msg=f"tiled, M={M}")
    # values exact in fp16 (as a Q4_1 checkpoint's) are tiled as fp16 and give the outputs of their fp32 selves
    s16, o16 = scales.half().float(), offsets.half().float()
    half_scales, half_offsets = kernels.tile_groups(s16, o16, packed)
    assert half_scales.dtype == half_offsets.dtype == torch.float16
    assert torch.equal(kernels.plain_groups(half_offsets).float(), o16)
    y16 = kernels.linear(x[:17], packed, None, s16, o16)
    assert not torch.equal(y16[0], y[0])  # (the rounded values are other weights)
    for M in (1, 2, 5, 9, 17):
        torch.testing.assert_close(kernels.linear(x[:M], packed, None, half_scales, half_offsets), y16[:M], rtol=0,
                                   atol=0, equal_nan=True, msg=f"fp16, M={M}")
    with pytest.raises(RuntimeError, match="fp32 or fp16"):  # one in fp16, the other fp32
        kernels.linear(x[:1], packed, None, half_scales, tiled_offsets)
    torch.testing.assert_close(kernels.linear_reference(x[:5], packed, None, tiled_scales, tiled_offsets),
                               kernels.linear_reference(x[:5], packed, None, scales, offsets), rtol=0, atol=0,
                               equal_nan=True)
    with pytest.raises(RuntimeError, match="tile_groups"):  # a tiled layout that does not fit the weight
        kernels.linear(x[:1], packed, None, tiled_scales[:-1].contiguous(), tiled_offsets[:-1].contiguous())


def test_int4_with_8_bit_activations_matches_x_rounded_to_bytes():
    """act_bits=8 (KernelI4a8, int4.g32.a8; KernelI4a8x256 on AVX2): x rounded to signed bytes in groups of 32
    columns, each with its scale (round_groups8), exact integer sums a group, then the weight's and the group's scales
    and the offset: the outputs are round_groups8's x @ the dequantized weight to fp32's rounding, at every M bit for
    bit (one pass of up to 24 rows: both groups of a piece at once up to 8, one after the other above; one row in two
    chains of sums; AVX2: 8 rows a pass, both halves of a line up to 5), with a group of zeros, NaN and inf rows, and
    the largest products; a8_takes says where it runs, and other weights get one error."""
    if kernels.isa() not in ("amx", "avx512_bf16", "avx2", "avx2_vnni"):
        pytest.skip("8-bit activations run on the AMX, AVX-512-BF16 and AVX2 builds' int4 tall blocks")
    g = torch.Generator().manual_seed(7)
    N, K = 96, 1536
    nibbles = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
    nibbles[0] = 255  # weight row 0: q = 15 everywhere
    scales, offsets = torch.rand(N, K // 32, generator=g) / 15, -torch.rand(N, K // 32, generator=g)
    x = torch.randn(40, K, generator=g) * torch.logspace(-2, 2, K)
    x[1] = -1.0  # every product of row 1 and weight row 0 at its largest: q = -127
    x[2, 64:96], x[3, 7], x[4, 9] = 0.0, float("nan"), float("inf")
    packed = kernels.pack(nibbles, act_bits=8)
    tiled_scales, tiled_offsets = kernels.tile_groups(scales, offsets, packed)
    assert kernels.a8_takes(packed, tiled_scales) and kernels.a8_takes(packed, scales)
    q, s = kernels.round_groups8(x)
    assert q.abs().max() <= 127 and torch.equal(q, q.round()) and (q[0].view(-1, 32).abs().amax(-1) == 127).all()
    assert torch.equal(s[2, 2:3], torch.zeros(1)) and s[3, 0].isnan() and s[4, 0].isnan()
    dense = kernels.dequantize(nibbles, scales, offsets).double()
    ref = F.linear((q * s.repeat_interleave(32, -1)).double(), dense).float()
    y = kernels.linear(x, packed, None, tiled_scales, tiled_offsets, act_bits=8)
    assert y[3].isnan().all() and y[4].isnan().all() and not y[[0, 1, 2, 5]].isnan().any()
    ok = ~ref.isnan()
    assert torch.allclose(y[ok], ref[ok], rtol=1e-5, atol=1e-5 * ref[ok].abs().max().item())
    assert y[1, 0].item() == pytest.approx(-(15 * scales[0] + offsets[0]).sum().item() * 32, rel=1e-5)
    torch.testing.assert_close(kernels.linear_reference(x, packed, None, scales, offsets, act_bits=8), y, rtol=1e-5,
                               atol=1e-5 * ref[ok].abs().max().item(), equal_nan=True)
    if kernels.isa() in ("amx", "avx512_bf16"):  # not the 16-bit rows: a different (and, here, visible) result
        assert not torch.allclose(y[0], kernels.linear(x[:1], packed, None, tiled_scales, tiled_offsets)[0], rtol=1e-6)
    else:  # AVX2: these blocks are for 8-bit activations only, and 16-bit ones a 4-row layout
        with pytest.raises(RuntimeError, match="tall blocks"):
            kernels.linear(x[:1], packed, None, tiled_scales, tiled_offsets)
        assert kernels.pack(nibbles).shape[2] == 4
    for M in (1, 2, 3, 5, 6, 7, 8, 9, 12, 13, 17, 24, 25, 40):  # bit for bit (NaN rows: NaN)
        torch.testing.assert_close(kernels.linear(x[:M], packed, None, scales, offsets, act_bits=8), y[:M], rtol=0,
                                   atol=0, equal_nan=True, msg=f"M={M}")
    xb = x[:7].bfloat16()
    yb = kernels.linear(xb, packed, None, tiled_scales, tiled_offsets, act_bits=8)
    assert yb.dtype == torch.bfloat16 and torch.equal(yb[6:], kernels.linear(xb[6:], packed, None, scales, offsets,
                                                                                act_bits=8))
    # scales and offsets exact in fp16, tiled so: the outputs of their fp32 selves, every M
    s16, o16 = scales.half().float(), offsets.half().float()
    half_scales, half_offsets = kernels.tile_groups(s16, o16, packed)
    assert half_scales.dtype == torch.float16 and kernels.a8_takes(packed, half_scales)
    y16 = kernels.linear(x, packed, None, s16, o16, act_bits=8)
    for M in (1, 2, 5, 9, 17, 25):
        torch.testing.assert_close(kernels.linear(x[:M], packed, None, half_scales, half_offsets, act_bits=8), y16[:M],
                                   rtol=0, atol=0, equal_nan=True, msg=f"fp16, M={M}")
    # groups of 64: not taken, one error
    assert not kernels.a8_takes(packed, scales[:, ::2].contiguous())
    with pytest.raises(RuntimeError, match="8-bit activations"):
        kernels.linear(x[:2], packed, None, scales[:, ::2].contiguous(), offsets[:, ::2].contiguous(), act_bits=8)


def test_int8_with_8_bit_activations_matches_x_rounded_to_bytes():
    """act_bits=8 on int8 lines (KernelI8a8, int8.a8; AVX-512-BF16 without AMX; KernelI8a8x256 on AVX2): the
    integer sums of a group of 32 columns (each weight byte q + 128, the +128 taken back out by the group's sum of x's
    bytes; AVX2: |x| times q with x's sign), times the group's scale, then the channel's: round_groups8's x @ the
    weight to fp32's rounding, every M bit for bit (one pass of up to 24 rows, two above; AVX2 6 rows a pass), at the
    largest products (q = -128 on AVX-512, which AVX2 refuses); int8 in 4-row blocks or the AMX tiles is one error."""
    g = torch.Generator().manual_seed(8)
    N, K = 64, 1536
    q = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    avx2 = kernels.isa() in ("avx2", "avx2_vnni")
    if avx2:  # |x| times q with x's sign: -128 would come back as -128
        q[0] = -128
        assert not kernels.a8_takes(kernels.pack(q, act_bits=8), torch.rand(N, generator=g) / 127)
    lowest = -127 if avx2 else -128
    q[0] = lowest  # every product of row 1 and weight row 0 at its largest
    scales = torch.rand(N, generator=g) / 127
    packed = kernels.pack(q, act_bits=8)
    if not kernels.a8_takes(packed, scales):
        assert kernels.isa() != "avx512_bf16" and not avx2
        with pytest.raises(RuntimeError, match="8-bit activations"):
            kernels.linear(torch.randn(2, K), packed, None, scales, None, act_bits=8)
        pytest.skip("int8 with 8-bit activations runs on the AVX-512-BF16 and AVX2 builds' int8 lines")
    x = torch.randn(30, K, generator=g) * torch.logspace(-2, 2, K)
    x[1] = -1.0
    x[2, 32:64], x[3, 7] = 0.0, float("nan")
    xq, s = kernels.round_groups8(x)
    ref = F.linear((xq * s.repeat_interleave(32, -1)).double(), q.double() * scales.double()[:, None]).float()
    y = kernels.linear(x, packed, None, scales, None, act_bits=8)
    assert y[3].isnan().all() and not y[[0, 1, 2, 4]].isnan().any()
    ok = ~ref.isnan()
    assert torch.allclose(y[ok], ref[ok], rtol=1e-5, atol=1e-5 * ref[ok].abs().max().item())
    assert y[1, 0].item() == pytest.approx(-lowest * K * scales[0].item(), rel=1e-5)
    torch.testing.assert_close(kernels.linear_reference(x, packed, None, scales, None, act_bits=8), y, rtol=1e-5,
                               atol=1e-5 * ref[ok].abs().max().item(), equal_nan=True)
    for M in (1, 2, 3, 4, 5, 6, 7, 9, 13, 17, 24, 25):
        torch.testing.assert_close(kernels.linear(x[:M], packed, None, scales, None, act_bits=8), y[:M], rtol=0,
                                   atol=0, equal_nan=True, msg=f"M={M}")


def test_int4_tiles_layout_on_amx_and_avx512_bf16():
    """On AMX and AVX-512-BF16, pack() lays int4 weights out as B tiles (16 rows x 64 columns in 512 bytes;
    _int4_tiles), which unpack() and packed_rows() read back; N % 16 != 0 keeps the 4-row layout; group sizes above
    256 are one error."""
    if kernels.isa() not in ("amx", "avx512_bf16"):
        pytest.skip("the int4 tile layout is the AMX and AVX-512-BF16 builds'")
    g = torch.Generator().manual_seed(6)
    nibbles = torch.randint(0, 256, (48, 320), generator=g, dtype=torch.uint8)
    tall = kernels.pack(nibbles)
    assert tall.shape == (3, 10, 16, 32) and torch.equal(kernels.unpack(tall), nibbles)
    q = torch.stack([nibbles & 15, nibbles >> 4], -1).reshape(48, 640).tolist()  # the int4 values
    tiles = tall.view(3, 10, 8, 16, 4)  # (block, 64 columns, quad r, row n, j)
    for blk, kp, r, n, j in [(0, 0, 0, 0, 0), (1, 2, 3, 5, 1), (2, 9, 7, 15, 3), (1, 4, 6, 0, 2)]:
        row, col = 16 * blk + n, 64 * kp + 4 * r + j  # low nibble: column 4r + j of the first 32, high: of the next
        assert tiles[blk, kp, r, n, j].item() == q[row][col] | q[row][col + 32] << 4
    idx = torch.tensor([[0, 15, 16], [47, 33, 2]])
    assert torch.equal(kernels.packed_rows(tall, idx), nibbles[idx])
    assert kernels.pack(nibbles[:44]).shape == (11, 10, 4, 32)
    with pytest.raises(RuntimeError, match="group sizes up to 256"):  # one group of 1024 columns
        kernels.linear(torch.randn(3, 1024), kernels.pack(torch.zeros(48, 512, dtype=torch.uint8)), None,
                       torch.ones(48, 1), torch.zeros(48, 1))


@pytest.mark.parametrize("M", [1, 5])  # one row (block) and three to six (pairs: both passes' lanes summed once)
def test_bf16_outputs_round_as_torch_does(M):
    """Each fp32 sum to bf16 as torch's own conversion: ties to even, a NaN, infinities, the largest finite values
    rounding up to inf, subnormals: outputs x, -x, x + x / 256 (a tie for many x) and 2x. The native bf16 builds
    (AMX tiles, AVX-512-BF16 dot products) read subnormal bf16 inputs as zero, as those instructions always do."""
    native_bf16 = kernels.isa() in ("amx", "avx512_bf16")
    values = torch.tensor([0.0, -0.0, 1.0, -1.0, 1.00390625, 1.01171875, 3.3895e38, -3.3895e38, 1e-40, -2.5e-39,
                           float("inf"), -float("inf"), float("nan"), 65504.0, 3.0e-39, 7.1e-3])
    w = torch.zeros(4, 32)
    w[0, 0], w[1, 0], w[2, 0], w[2, 1], w[3, 0] = 1.0, -1.0, 1.0, 1.0, 2.0
    packed = kernels.pack(w.bfloat16())
    for v in values:
        x = torch.zeros(M, 32)
        x[:, 0], x[:, 1] = v, v / 256
        x = x.bfloat16()
        y = kernels.linear(x, packed)
        x_read = torch.where((x != 0) & (x.abs() < torch.finfo(torch.float32).tiny), 0, x) if native_bf16 else x
        ref = F.linear(x_read.float(), w).bfloat16()
        assert torch.equal(y.view(torch.int16)[ref.isnan()], torch.full_like(y.view(torch.int16)[ref.isnan()], 0x7fc0))
        assert torch.equal(y.view(torch.int16)[~ref.isnan()], ref.view(torch.int16)[~ref.isnan()]), (v, y, ref)


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="2 MB pages are asked for on Linux only")
def test_on_huge_pages_copies_tensors_each_on_its_own_storage():
    """on_huge_pages: copies with the same numbers side by side in one mapping from a 2 MB boundary, each with its own
    storage (no tensor aliases another), 64-byte aligned, alive as long as one of them is; what it does not take
    (not contiguous, another dtype) or has moved already comes back as it is."""
    ts = [torch.randn(300, 7), torch.randint(-127, 128, (1000,), dtype=torch.int8), torch.randn(64, 64).bfloat16(),
          torch.randn(8, 8).t(), torch.zeros(5, dtype=torch.complex64)]
    out = kernels.on_huge_pages(ts)
    assert out[3] is ts[3] and out[4] is ts[4]
    for t, u in zip(ts[:3], out[:3]):
        assert u is not t and u.dtype == t.dtype and u.shape == t.shape and torch.equal(u, t)
        assert u.data_ptr() % 64 == 0 and u.untyped_storage().data_ptr() == u.data_ptr()
        assert u.untyped_storage().nbytes() == u.nbytes  # its own storage, not a view of the mapping's
    assert out[0].data_ptr() % kernels.HUGE_PAGE == 0
    assert all(a is b for a, b in zip(kernels.on_huge_pages(out), out))
    kept, expected = out[1], ts[1].clone()
    del ts, out
    gc.collect()
    assert torch.equal(kept, expected)


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 2), (3, 3)])
def test_attention_matches_reference_and_rows_are_independent(heads, kv_heads):
    """Many query rows go 3 or 2 heads of a KV head at a time (V read once for them), one row alone: each row the
    same either way, whatever T is."""
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        T = kernels.MAX_M
        q = torch.randn(1, heads, T, 64, generator=g).to(dtype)
        k, v = (torch.randn(1, kv_heads, 40, 64, generator=g).to(dtype) for _ in range(2))
        mask = torch.rand(1, T, 40, generator=g) < 0.7
        mask[..., 0] = True
        y = kernels.attention(q, k, v, mask)
        ref = kernels.attention_reference(q, k, v, mask)
        assert (y.float() - ref.float()).abs().max() <= (1e-5 if dtype == torch.float32 else 2e-2)
        for t in (0, 1, 4, T - 1):
            assert torch.equal(kernels.attention(q[:, :, t:t + 1], k, v, mask[:, t:t + 1]), y[:, :, t:t + 1])


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (6, 2), (4, 4)])
def test_attention_rows_over_a_shared_prefix_equal_each_row_alone(heads, kv_heads):
    """A verification's rows all see the causal prefix, then their own tree slots: every row bit for bit what it gets
    alone (where its own prefix may run longer), for 1..MAX_M rows and prefixes odd and even. Guards any attention
    that shares work across the rows of a step (one that shared the prefix's K and V loads was tried: docs)."""
    g = torch.Generator().manual_seed(4)
    for dtype in (torch.float32, torch.bfloat16):
        for L, T in ((37, 5), (40, 9), (3, kernels.MAX_M), (0, 3), (130, 17), (97, kernels.MAX_M)):  # AMX: V by tiles past 64
            S = L + T + 8
            q = torch.randn(1, heads, T, 64, generator=g).to(dtype)
            k, v = (torch.randn(1, kv_heads, S, 64, generator=g).to(dtype) for _ in range(2))
            mask = torch.zeros(1, T, S, dtype=torch.bool)
            mask[..., :L] = True
            mask[..., L:] = torch.rand(1, T, S - L, generator=g) < 0.5  # each row's own tree slots
            mask[0, 0, L:L + 6] = True  # one row's prefix runs on past the shared one
            mask[..., 0] = True
            y = kernels.attention(q, k, v, mask)
            ref = kernels.attention_reference(q, k, v, mask)
            assert (y.float() - ref.float()).abs().max() <= (1e-5 if dtype == torch.float32 else 2e-2)
            for t in range(T):
                assert torch.equal(kernels.attention(q[:, :, t:t + 1], k, v, mask[:, t:t + 1]), y[:, :, t:t + 1]), (L, T, t)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (16, 4, 128), (4, 2, 80)])
def test_attention_rows_that_see_different_slots_past_64(heads, kv_heads, head_dim):
    """Rows that do not share the prefix (a batch row's left padding hidden, a random mask) over 150-200 slots, where
    AMX's tiles take most of a row's V sums: each row as the reference computes it, and bit for bit what it gets
    alone (the default model's shape, a Llama-3-8B-like one, and head_dim 80: V's last 16 columns a short pass)."""
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16):
        S, T = 200, 9
        q = torch.randn(2, heads, T, head_dim, generator=g).to(dtype)
        k, v = (torch.randn(2, kv_heads, S, head_dim, generator=g).to(dtype) for _ in range(2))
        masks = [torch.rand(2, T, S, generator=g) < 0.75]  # every row its own slots
        pad = torch.tensor([0, 37])  # left padding: row 1 sees slots 37.. only, as generate's batch_mask says
        slots = torch.arange(S)
        masks.append((slots[None, None] >= pad[:, None, None]) & (slots[None, None] <= (150 + torch.arange(T))[None, :, None]))
        for mask in masks:
            y = kernels.attention(q, k, v, mask)
            ref = kernels.attention_reference(q, k, v, mask)
            assert (y.float() - ref.float()).abs().max() <= (1e-5 if dtype == torch.float32 else 2e-2)
            for t in (0, 3, T - 1):
                assert torch.equal(kernels.attention(q[:, :, t:t + 1], k, v, mask[:, t:t + 1]), y[:, :, t:t + 1])


def test_attention_reads_nothing_past_a_rows_visible_slots():
    """A row's slots go in pairs for some paths (BF16 dot products sum two slots' V rows at once): an odd count's
    last slot must pair with nothing, so a NaN or an inf in a slot the row does not see changes nothing."""
    g = torch.Generator().manual_seed(6)
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1, 7, 33, 65, 101):
            q = torch.randn(1, 9, 2, 64, generator=g).to(dtype)
            k, v = (torch.randn(1, 3, n + 3, 64, generator=g).to(dtype) for _ in range(2))
            mask = torch.zeros(1, 2, n + 3, dtype=torch.bool)
            mask[..., :n] = True
            clean = kernels.attention(q, k, v, mask)
            for bad in (float("nan"), float("inf")):
                k2, v2 = k.clone(), v.clone()
                k2[:, :, n:], v2[:, :, n:] = bad, bad
                assert torch.equal(kernels.attention(q, k2, v2, mask), clean), (dtype, n, bad)
            ref = kernels.attention_reference(q, k, v, mask)
            assert (clean.float() - ref.float()).abs().max() <= (1e-5 if dtype == torch.float32 else 2e-2)


def test_the_compiled_graphs_see_what_the_ops_return():
    """torch.compile plans with the ops' fake kernels: shapes, strides and dtypes must be the real ones (the
    attention writes (B, H, T, D) laid out as (B, T, H, D), a transposed q is read where it lies)."""
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(1, 5, 6, 64, generator=g).to(dtype).transpose(1, 2)  # (B, H, T, D) as the model makes it
        k, v = (torch.randn(1, 2, 24, 64, generator=g).to(dtype) for _ in range(2))
        mask = torch.rand(1, 5, 24, generator=g) < 0.8
        torch.library.opcheck(torch.ops.eagle_fast.attention.default, (q, k, v, mask),
                              test_utils=("test_schema", "test_faketensor"))
        assert torch.equal(kernels.attention(q, k, v, mask), kernels.attention(q.contiguous(), k, v, mask))
        packed, scales, offsets, _ = packed_weight(str(dtype)[6:], N=64, K=64)
        x = torch.randn(3, 64, generator=g).to(dtype)
        torch.library.opcheck(torch.ops.eagle_fast.linear.default, (x, packed, scales, offsets, None),
                              test_utils=("test_schema", "test_faketensor"))


def test_a_tree_row_equals_the_decode_row_over_the_compacted_cache():
    """What keeps EAGLE exact: a verified node sees the prefix and its ancestors at scattered slots; once accepted,
    their K/V move to contiguous slots and the next decode step's row sees them there. Both rows must agree bit for
    bit, so the kernel may go by a slot's rank among the visible ones, never by its index."""
    g = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        for S, L in ((64, 37), (160, 120)):  # and a row long enough for AMX's tiles to sum V (from 64 slots on)
            q = torch.randn(1, 6, 1, 64, generator=g).to(dtype)
            k, v = (torch.randn(1, 2, S, 64, generator=g).to(dtype) for _ in range(2))
            seen = list(range(L)) + [L + 1, L + 4, L + 5]  # the prefix, then three ancestors scattered in the tree
            mask = torch.zeros(1, 1, S, dtype=torch.bool)
            mask[..., seen] = True
            compact_k, compact_v = torch.zeros_like(k), torch.zeros_like(v)
            compact_k[:, :, :len(seen)], compact_v[:, :, :len(seen)] = k[:, :, seen], v[:, :, seen]
            compact_mask = torch.zeros_like(mask)
            compact_mask[..., :len(seen)] = True
            tree_row = kernels.attention(q, k, v, mask)
            assert torch.equal(tree_row, kernels.attention(q, compact_k, compact_v, compact_mask))
            ref = kernels.attention_reference(q, k, v, mask)
            assert (tree_row.float() - ref.float()).abs().max() <= (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("kind", ["float32", "int4"])
def test_input_gradient_through_a_frozen_packed_weight(kind):
    packed, scales, offsets, dense = packed_weight(kind)
    x = torch.randn(3, 4, 256).to(ACT_DTYPE[kind]).requires_grad_()
    kernels.linear(x, packed, None, scales, offsets).float().square().sum().backward()
    x2 = x.detach().float().requires_grad_()
    F.linear(x2, dense).square().sum().backward()
    assert x.grad.shape == x.shape
    assert (x.grad.float() - x2.grad).abs().max() <= 0.05 * x2.grad.abs().max()
    y = kernels.linear(torch.randn(2, 256), packed_weight("float32")[0].requires_grad_())
    with pytest.raises(RuntimeError, match="frozen"):
        y.sum().backward()


def test_an_inference_call_runs_no_python():
    """A Python autograd kernel on the op ran on every call, no_grad or not; where CPython's frame stack then
    crossed a chunk boundary, each call mapped and unmapped memory (a decode step 40-60% slower)."""
    packed = packed_weight("bfloat16")[0]
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    torch.ops.eagle_fast.linear.default(x, packed, None, None, None)  # first call: torch's lazy set-up
    calls = []
    profile = lambda frame, event, arg: calls.append(frame.f_code) if event == "call" else None  # noqa: E731
    for grad_mode in (False, True):  # grad mode on: nothing requires a gradient, no graph is recorded
        with torch.set_grad_enabled(grad_mode):
            sys.setprofile(profile)
            try:
                torch.ops.eagle_fast.linear.default(x, packed, None, None, None)  # as Inductor's code calls it
            finally:
                sys.setprofile(None)
    python_frames = [c.co_name for c in calls if not c.co_filename.endswith("_ops.py")]  # the op's own __call__
    assert python_frames == [], python_frames
    assert len(calls) == 2


RANK = {"fallback": 0, **{name: level for level, name in kernels.ISA_NAMES.items()}}  # kernels.isa() names by level


def cpu_has_avx_vnni() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.is_file() and "avx_vnni" in cpuinfo.read_text()


@pytest.mark.parametrize("isa", ["avx2", "avx2_vnni", "avx512", "avx512_bf16"])
def test_each_lower_instruction_set_passes_the_same_checks(isa):
    """EAGLE_KERNELS=avx2 / avx2_vnni / avx512 / avx512_bf16 runs the lower builds on this CPU (most users' CPUs
    have AVX2 only, recent Intel ones AVX-VNNI beside it; avx512_bf16 is the vector build on a CPU with AMX tiles)."""
    if RANK[kernels.isa()] <= RANK[isa]:
        pytest.skip(f"this machine runs {kernels.isa()}: the default run covers it")
    if isa == "avx2_vnni" and not cpu_has_avx_vnni():
        pytest.skip("this CPU has no AVX-VNNI")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                        "-k", "matches or forced"], env={**os.environ, "EAGLE_KERNELS": isa},
                       cwd=Path(__file__).parent.parent, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]


def test_a_forced_instruction_set_is_the_one_that_runs():
    forced = os.environ.get("EAGLE_KERNELS")
    if forced not in RANK:
        pytest.skip("EAGLE_KERNELS not set")
    assert kernels.isa() == forced


INT8_OUTPUTS = """
import sys, torch, kernels
g = torch.Generator().manual_seed(3)
q = torch.randint(-128, 128, (64, 4096 + 512), generator=g, dtype=torch.int8)
scales = torch.rand(64, generator=g) / 127
x = torch.randn(17, q.shape[1], generator=g).to(torch.bfloat16)
packed = kernels.pack(q)
torch.save({"isa": kernels.isa(), "y": [kernels.linear(x[:m], packed, None, scales) for m in (1, 2, 5, 6, 9, 17)]},
           sys.argv[1])
"""


A8_OUTPUTS = """
import sys, torch, kernels
g = torch.Generator().manual_seed(4)
N, K = 64, 1536
nibbles = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
scales, offsets = torch.rand(N, K // 32, generator=g) / 15, -torch.rand(N, K // 32, generator=g)
q = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
qs = torch.rand(N, generator=g) / 127
x = torch.randn(17, K, generator=g) * torch.logspace(-2, 2, K)
p4, p8 = kernels.pack(nibbles, act_bits=8), kernels.pack(q, act_bits=8)
y = []
for m in (1, 2, 5, 6, 9, 17):
    for xm in (x[:m], x[:m].bfloat16()):
        s4, o4 = kernels.tile_groups(scales, offsets, p4)
        h4, f4 = kernels.tile_groups(scales.half().float(), offsets.half().float(), p4)  # fp16
        y += [kernels.linear(xm, p4, None, s4, o4, act_bits=8), kernels.linear(xm, p8, None, qs, None, act_bits=8),
              kernels.linear(xm, p4, None, h4, f4, act_bits=8)]
torch.save({"isa": kernels.isa(), "y": y}, sys.argv[1])
"""


def outputs_of_builds(script, isas, tmp_path) -> dict:
    """{isa: the outputs `script` saved} from one process per forced build (EAGLE_KERNELS), each checked to run it."""
    out = {}
    for isa in isas:
        r = subprocess.run([sys.executable, "-c", script, str(tmp_path / isa)],
                           env={**os.environ, "EAGLE_KERNELS": isa}, cwd=Path(__file__).parent.parent,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        out[isa] = torch.load(tmp_path / isa, weights_only=True)
        assert out[isa]["isa"] == isa
    return out


def test_avx2_8_bit_activations_equal_avx512s_bit_for_bit(tmp_path):
    """The .a8 kernels of the AVX2 build (KernelI4a8x256, KernelI8a8x256) sum the same integers a group and take the
    same fp32 steps as the AVX-512-BF16 build's: the same bits at every M, fp32 and bf16 x, int4's scales in fp32
    and in fp16."""
    if RANK[kernels.isa()] < RANK["avx512_bf16"]:
        pytest.skip("needs a CPU that runs both builds (AVX-512-BF16)")
    out = outputs_of_builds(A8_OUTPUTS, ("avx2", "avx512_bf16"), tmp_path)
    assert len(out["avx2"]["y"]) == 36  # int4 (fp32 and fp16 scales) and int8, 6 sizes, fp32 and bf16 x
    for a, b in zip(out["avx2"]["y"], out["avx512_bf16"]["y"]):
        assert torch.equal(a, b)


def test_avx_vnni_int8_outputs_equal_avx2s_bit_for_bit(tmp_path):
    """KernelI8 with AVX-VNNI (vpdpwssd) sums the same integers as vpmaddwd + vpaddd: the same bits at every M."""
    if RANK[kernels.isa()] < RANK["avx2_vnni"] or not cpu_has_avx_vnni():
        pytest.skip("this CPU has no AVX-VNNI")
    out = outputs_of_builds(INT8_OUTPUTS, ("avx2", "avx2_vnni"), tmp_path)
    for a, b in zip(out["avx2"]["y"], out["avx2_vnni"]["y"]):
        assert torch.equal(a, b)


def test_c_shims_are_this_extensions_and_no_one_elses():
    # compiled launchers call the ops' C functions by name (kernels.c_shims): each must be declared for its op,
    # exported by this build, and absent from libtorch (an aten shim of the same name would take the call)
    import ctypes
    shims = kernels.c_shims()
    assert sorted(op.name() for op in shims) == ["eagle_fast::attention", "eagle_fast::linear", "eagle_fast::tile_rows"]
    lib = Path(torch.__file__).parent / "lib"
    libtorch = [ctypes.CDLL(str(p)) for p in (lib / "libtorch_cpu.so", lib / "libtorch.so") if p.exists()]
    assert libtorch
    glob = ctypes.CDLL(None)  # the process's global scope, where kernels.load() put this build
    for op, (decl,) in shims.items():
        name = decl.split("(")[0].split()[-1]
        assert name == "aoti_torch_cpu_" + op.name().split("::")[1]
        assert hasattr(glob, name)
        assert not any(hasattr(t, name) for t in libtorch), name


def test_int4i_on_amx_runs_the_int8_weights_it_stands_for():
    """int4i (quantize.quantize_int4i) packed for the int8 tiles (pack_int4i: the nibbles as int4's tiles, then each
    group's step and base) gives, bit for bit, what the int8 weights q * nibble + z give packed as int8, for every
    M (one panel, two, three, several passes), at the extreme steps and bases; unpack() reads those int8 weights
    back and linear_reference agrees."""
    if kernels.isa() != "amx":
        pytest.skip("int4i's tile layout is the AMX build's")
    g = torch.Generator().manual_seed(7)
    N, K = 64, 576  # 9 steps of 64 columns, 18 groups
    nibbles = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
    steps = torch.randint(1, 18, (N, K // 32), generator=g, dtype=torch.uint8)
    room = 255 - 15 * steps.int()  # bases that keep the 16 values q * nibble + z within int8
    bases = (-128 + (torch.rand(N, K // 32, generator=g) * (room + 1)).floor().int()).to(torch.int8)
    steps[0, 0], bases[0, 0], steps[1, 1], bases[1, 1] = 17, -128, 17, 127 - 15 * 17  # both ends of int8
    values = Q.int4i_values(nibbles, steps, bases)
    assert values.min() == -128 and values.max() == 127
    packed, scales = kernels.pack_int4i(nibbles, steps, bases), torch.rand(N, generator=g) / 127
    assert packed.shape == (N // 16, K // 64, 16, 36) and torch.equal(kernels.unpack(packed), values)
    as_int8 = kernels.pack(values)
    x = torch.randn(70, K, generator=g).bfloat16()
    for M in (1, 2, 5, 7, 8, 16, 17, 21, 22, 70):
        y = kernels.linear(x[:M], packed, None, scales)
        assert torch.equal(y, kernels.linear(x[:M], as_int8, None, scales)), M
        torch.testing.assert_close(y, kernels.linear_reference(x[:M], packed, None, scales), rtol=0.02, atol=0.02)
    assert torch.equal(kernels.linear(x[5:6], packed, None, scales), y[5:6])  # a row alone is that row
    with pytest.raises(RuntimeError, match="weight does not match x"):
        kernels.linear(x[:1, :512].contiguous(), packed, None, scales)


def test_an_unknown_forced_build_is_said_not_silently_ignored():
    env = {**os.environ, "EAGLE_KERNELS": "avx512bf16"}  # a typo of avx512_bf16
    proc = subprocess.run([sys.executable, "-c", "import kernels; kernels.load()"], env=env, capture_output=True,
                          text=True, timeout=600, cwd=Path(__file__).parent.parent)
    assert proc.returncode == 0 and "EAGLE_KERNELS='avx512bf16' is none of off, avx2" in proc.stderr, proc.stderr
