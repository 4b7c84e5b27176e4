"""Small-M kernels: the linears and the attention of a forward over 1..16 query tokens, one pass over the weights.

Decoding at batch 1 and verifying a draft tree both multiply a few rows of activations (M = 1..16) by every weight
matrix. That is bound by reading the weights, but the library kernels are not: oneDNN reads bf16 weights at 10-20
GB/s at M = 1..16 (docs/performance.md), and Inductor's multiply-sums are fast at M = 1 only. The C++ below reads
each weight once for all M rows (blocks of 4 weight rows x up to 4 activation rows; the weight rows stay in L1
while the next activation rows pass over them), so M = 5 costs about what M = 1 does.

It also computes every output element the same way whatever M is: one accumulator per (row, column), the same
sequence of vector multiply-adds over K, the same horizontal sum; attention likewise per query row, over the
cache slots the row sees, in slot order (on AMX, bf16 attention's scores and the V sums of all but a row's last
32-63 slots go through the tiles, up to 16 rows at a time, in an order set by the row's own count of visible
slots: the same for a tree row and the decode row that later sees those slots compacted; with BF16 dot products and
no AMX, bf16 attention's scores and V sums by dot products of pairs, two slots a product in rank order). So each row of a
verification over a draft tree equals, bit for bit, the one-token decode step that would have computed it, in
bf16, int8 and int4 as in fp32: this is what makes greedy EAGLE output equal plain decoding token for token in
every precision.

Three builds of the same loops, chosen at run time from what the CPU has: AVX-512 with BF16 dot products (Zen 4,
Zen 5, Sapphire Rapids), AVX-512F, and AVX2 + FMA (most desktop CPUs); and where the CPU has AMX tiles (Xeons from Sapphire
Rapids on), bf16 weights go through the tiles, which make 16 rows cost about what one does (the tiles sum in their
own order, so there every bf16 linear takes them, whatever M is; the tiles and the BF16 dot products read
subnormal bf16 inputs, below 1.2e-38, as zero, which no model's activations come near). On the AVX2 build int8 weights meet activations
rounded to 16-bit integers (a scale per row: max |x| / 32767) in integer dot products, twice the multiply-adds an
instruction of fp32 FMAs there, summed exactly (perplexity on the default model 9.55, bf16 9.51, within the
text's noise of the float activations' 9.50-9.56); the AVX-512-BF16 build without AMX likewise (within +-32639,
two signed bytes a value), by vpdpbusd on weights that pack lays out 16 rows to a register, each byte + 128; on AMX
the same integers go through the int8 tiles, a high and a low byte, against int8 and int4 weights that pack lays out
as the tiles' B operand: int8 outputs are the exact integer dot products rounded to fp32 once, int4 ones exact
integer sums a group, then scale and offset (on AVX-512-BF16 without AMX int4 the same way, its tile bytes read by
vpdpbusd: the AMX build's bits). With 8-bit activations (act_bits 8, the .a8 variants) int8 and int4 weights take the
AVX-512-BF16 build's 16-row layouts wherever they run, the AVX2 builds included (vpmaddubsw there), to the same
bits. EAGLE_KERNELS=avx2, avx512 or avx512_bf16 forces
a lower one (tests run each here), EAGLE_KERNELS=off turns the C++ off. It is built at first use with torch's cpp_extension
(the C++ compiler torch.compile already needs on CPU; about a minute, then cached in ~/.cache/torch_extensions).
Where it cannot build, or for what it does not take (CUDA, float16, M > MAX_M, K not a multiple of 32), the model
runs plain PyTorch (model.linear's F.linear, SDPA or model.small_attention): greedy EAGLE equals plain decoding
in fp32 there (the tests' tiny models run unpacked), but in bf16 a multi-row product may round otherwise than one
row's, so greedy EAGLE can part from plain decoding there (the benchmark's "= plain" column says so).
linear_reference and attention_reference below are what the tests compare the C++ with.

    torch.ops.eagle_fast.linear(x, w, scales, offsets, bias, residual=None)
        x (M, K) float32 or bfloat16; w (N, K) in x's dtype, or int8 with scales (N,) (w = q * scale; the AVX2
        and AVX-512-BF16 builds and AMX's tall blocks round x to 16 bits a row for these: round_rows16; pack's
        int8 lines for AVX-512-BF16 are uint8 q + 128), or uint8 int4 nibbles (N, K/2)
        with scales and offsets (N, K/G) (w = q * scale + offset; tall blocks (AMX, AVX-512-BF16): x rounded
        likewise, and the scales and offsets may come as tile_groups lays them out, in fp32 or fp16); -> (M, N)
        in x's dtype, plus residual (M, N) in x's dtype if given (the sum rounded again, as eager adds)
    torch.ops.eagle_fast.attention(q, k, v, mask)
        q (B, H, T, D) any strides, k and v (B, n_kv, S, D) in q's dtype, mask (1 or B, T, S) bool -> (B, H, T, D)
        in q's dtype, laid out as (B, T, H, D); softmax in fp32
"""
import mmap
import os
import sys
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

MAX_M = 32  # query rows the attention kernel takes (decode, draft and verify steps); prefill goes to SDPA
# What the ops return (shapes, strides, dtypes): compiled graphs check it, so generate.py's compile cache is kept per
# version, and a change to an op's output must bump it (a graph cached before the attention's output became
# (B, T, H, D)-strided failed its stride assertion; 3: the linear of tall int8 blocks, N = 16 x blocks; their
# layout changed since, not what the op returns; 4: their row lookup became an op, tile_rows; 5: graphs call
# the ops' C functions, c_shims; 6: the linear takes a residual; 7: bf16 in tall blocks on AMX; 8: the linear's
# act_bits)
OPS_VERSION = 8

CPP = r"""
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/EmptyTensor.h>
#include <immintrin.h>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>
#include <cpuid.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <sys/syscall.h>
#include <unistd.h>

// the AMX intrinsics came with GCC 11 and Clang 12 (and AVX-VNNI with their assemblers); an older compiler builds
// everything else
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)
#define EAGLE_AMX 1
#else
#define EAGLE_AMX 0
#endif

namespace {

enum Isa { SCALAR = 0, AVX2 = 1, AVX2VNNI = 2, AVX512 = 3, AVX512BF16 = 4, AMX = 5 };

// AMX-BF16 and AMX-INT8 tiles (Sapphire Rapids and later Xeons), and Linux's leave for this process to use them
bool amx_usable() {
  if (!EAGLE_AMX) return false;
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24)) || !(d & (1u << 25)))
    return false;
  return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
}

// AVX-VNNI (Alder Lake and later Intel cores, Zen 5): vpdpwssd in the VEX encoding, on AVX2's 256-bit registers
bool has_avx_vnni() {
  unsigned a, b, c, d;
  return EAGLE_AMX && __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 4));
}

int detect_isa() {
  __builtin_cpu_init();
  int isa = SCALAR;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) isa = AVX2;
  // AVX2VNNI: the AVX2 build with the int8 kernel's multiply and add in one instruction. Above it only for the
  // order of the levels: every AVX-512 level runs its own int8 paths
  if (isa == AVX2 && has_avx_vnni()) isa = AVX2VNNI;
  if (isa >= AVX2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    isa = AVX512;
  if (isa == AVX512 && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni")) isa = AVX512BF16;
  if (isa == AVX512BF16 && amx_usable()) isa = AMX;
  const char* want = std::getenv("EAGLE_KERNELS");
  if (want && !std::strcmp(want, "avx512_bf16") && isa > AVX512BF16) isa = AVX512BF16;
  if (want && !std::strcmp(want, "avx2") && isa > AVX2) isa = AVX2;
  if (want && !std::strcmp(want, "avx2_vnni") && isa > AVX2VNNI) isa = has_avx_vnni() ? AVX2VNNI : AVX2;
  if (want && !std::strcmp(want, "avx512") && isa > AVX512) isa = AVX512;
  return isa;
}

int isa() {
  static int value = detect_isa();
  return value;
}

// A thread's scratch buffer v, kept between calls: grown to at least n elements, never shrunk or refilled (an
// allocation, or a zero-fill, a call cost the attention op a few percent at one token)
template <typename T>
T* scratch(std::vector<T>& v, int64_t n) {
  if ((int64_t)v.size() < n) v.resize(n);
  return v.data();
}

// the same, 64-byte aligned (malloc aligns to 16): a tile's 64-byte row then loads one cache line, not two
template <typename T>
T* scratch64(std::vector<T>& v, int64_t n) {
  return (T*)(((uintptr_t)scratch(v, n + 64 / sizeof(T)) + 63) & ~(uintptr_t)63);
}

enum WType { W_F32 = 0, W_BF16 = 1, W_I8 = 2, W_I4 = 3 };

// A packed weight (kernels.pack): blocks of 4 rows x 32 columns, each block's rows one after another (32 values,
// or 16 bytes of int4 nibbles, a row), blocks in order along K then along N. A block's 4 rows are read as one
// sequential stream: reading 4 rows of the plain layout side by side streamed DRAM at half the speed here.
struct Lin {
  int64_t M, N, K, G;      // G: int4 group size (a power of two, 32..256)
  int gshift;              // log2(G)
  int64_t groups;          // K / G
  const float* xf;         // (M, K) activations in fp32 (int4: each 32 columns permuted to evens, then odds)
  const int16_t* xq;       // (M, K) activations as 16-bit integers, x ~ xq * xs (int8 weights on AVX2)
  const float* xs;         // (M,) their scales
  const uint16_t* xb;      // (M, K) activations in bf16, for the BF16 dot products (same permutation for int4)
  const char* w;           // packed weights
  int64_t block_bytes;     // bytes of one block row: 32 columns (float, int8) or 64 (int4: 32 bytes)
  const float* scales;     // int8 (N,), int4 (N, K/G), or tall int4 (N / 16, K/G, 16) (fp16 where half_groups)
  const float* offsets;    // int4, as scales
  const float* bias;       // (N,) or null
  void* out;               // (M, N) fp32 or bf16
  bool out_bf16;
  const void* res = nullptr;  // (M, N) in out's dtype, added to the outputs (or null)
  int64_t n_base = 0;      // the first row of the weights at w (a dequantized block's buffer starts at its block)
  int64_t ahead_lines = 0; // cache lines of the weight stream one 32-column step reads, prefetched ahead (0: none)
  bool int4i = false;      // int4i in tall blocks (pack_int4i): int8 weights q * nibble + z, stored as nibbles
  bool half_groups = false;  // int4 in tall blocks: scales and offsets in fp16 (tile_groups, where all are exact)
  uint16_t* wbuf = nullptr;  // run_dequantized: where a block's weights converted to bf16 go (64-byte aligned)
  const char* row(int64_t n, int64_t kb) const {  // row n's 32 columns from column 32 * kb
    n -= n_base;
    if (offsets) {  // int4: blocks of 64 columns, 16 bytes for each 32
      return w + (((n >> 2) * (K >> 6) + (kb >> 1)) * 4 + (n & 3)) * block_bytes + (kb & 1) * 16;
    }
    return w + (((n >> 2) * (K >> 5) + kb) * 4 + (n & 3)) * block_bytes;
  }
};

// With 2+ activation rows a block does enough arithmetic per weight byte that the core's own cache misses no longer
// keep DRAM busy: the multiply-adds and the memory wait took turns (576 x 1536 bf16 at M = 5: 79 us, at M = 1: 56;
// hot in cache 35). Asking for the stream 16 KB ahead into L2 overlaps them (50 us; the LM head 1446 -> 1074 us).
// At M = 1 on a Zen 4 the misses already stream and the prefetches only cost (49 -> 60 us), so there it runs for
// M >= 2 only; on Intel it pays at M = 1 too (Emerald Rapids: a bf16 decode step 14.3-14.9 -> 8.6-11.9 ms), on
// a Zen 5 (the linears of one bf16 forward, one row: 9.2 -> 8.2 ms) and on a Zen 3 (below).
constexpr int64_t PREFETCH_AHEAD = 16384;

int amd_family() {  // the CPU family where it is AMD's (0x19: Zen 3 and Zen 4, 0x1A: Zen 5), 0 elsewhere
  static int value = [] {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx) || ebx != 0x68747541u) return 0;  // "Auth" of AuthenticAMD
    __get_cpuid(1, &eax, &ebx, &ecx, &edx);
    const int family = (eax >> 8) & 0xf;
    return family == 0xf ? family + (int)((eax >> 20) & 0xff) : family;
  }();
  return value;
}
// Zen 3 (family 0x19 without AVX-512) is like Intel and Zen 5 here: one bf16 forward's linears at one row, three
// interleaved A/B runs, 19.4 -> 16.7, 21.2 -> 17.6, 19.8 -> 19.0 ms with it (int8 about even); only the Zen 4 runs
// faster without
bool prefetch_one_row() {
  static const bool value = amd_family() != 0x19 || (__builtin_cpu_init(), !__builtin_cpu_supports("avx512f"));
  return value;
}
// One activation row against 8 weight rows at a time (Kernel::WIDE) fed Emerald Rapids' dot products (a one-row
// LM head 2,143 -> 1,100-1,280 us); a Zen 5 runs 4-row blocks faster (one bf16 forward's linears 9.8 -> 8.2 ms,
// with the prefetch), so they are Intel's only.
bool wide_one_row() { return amd_family() == 0; }

// blocks are one stream: block n0 / 4, step kb
__attribute__((always_inline)) inline void prefetch_ahead(const Lin& a, int64_t n0, int64_t kb) {
  const char* p = a.w + ((n0 - a.n_base) / 4 * (a.K / 32) + kb) * 64 * a.ahead_lines + PREFETCH_AHEAD;
  for (int64_t l = 0; l < a.ahead_lines; l++) _mm_prefetch(p + 64 * l, _MM_HINT_T1);
}

// four floats rounded to bf16 as torch does (to nearest even; NaN -> 0x7fc0), in SSE2, in the low 8 bytes (the
// linears' outputs and attention's rows; the linears rounded each float alone before, 20 an int8 block at 5 rows)
__attribute__((always_inline)) inline __m128i to_bf16x4(__m128 v) {
  const __m128i u = _mm_castps_si128(v);
  const __m128i odd = _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1));
  __m128i r = _mm_srli_epi32(_mm_add_epi32(u, _mm_add_epi32(odd, _mm_set1_epi32(0x7fff))), 16);
  const __m128i nan = _mm_castps_si128(_mm_cmpunord_ps(v, v));
  r = _mm_or_si128(_mm_andnot_si128(nan, r), _mm_and_si128(nan, _mm_set1_epi32(0x7fc0)));
  r = _mm_srai_epi32(_mm_slli_epi32(r, 16), 16);  // each 16 bits as a signed value, which the signed pack keeps
  return _mm_packs_epi32(r, r);
}

// the last step for four output columns n..n+3 of row m: int8 scale, bias, store. Always inlined, so that its SSE
// is encoded as the AVX kernel around it: called as a function (plain SSE after the kernel's 256-bit code) it doubled
// a one-row int8 pass on a Zen 3 (384 x 576 from L2, one thread: 31.9 -> 17.4 us)
__attribute__((always_inline)) inline void finish4(const Lin& a, int64_t m, int64_t n, __m128 v) {
  if (a.xs) v = _mm_mul_ps(v, _mm_set1_ps(a.xs[m]));  // KernelI8: the row's scale first
  if (a.scales && !a.offsets) v = _mm_mul_ps(v, _mm_loadu_ps(a.scales + n));
  if (a.bias) v = _mm_add_ps(v, _mm_loadu_ps(a.bias + n));
  if (a.out_bf16) {
    __m128i r = to_bf16x4(v);
    if (a.res) {  // residual + the rounded output, rounded again: what x + linear(x) gives in bf16 (SSE2 widening)
      const __m128i z = _mm_setzero_si128(), res = _mm_loadl_epi64((const __m128i*)((const uint16_t*)a.res + m * a.N + n));
      r = to_bf16x4(_mm_add_ps(_mm_castsi128_ps(_mm_unpacklo_epi16(z, res)), _mm_castsi128_ps(_mm_unpacklo_epi16(z, r))));
    }
    _mm_storel_epi64((__m128i*)((uint16_t*)a.out + m * a.N + n), r);
  } else {
    if (a.res) v = _mm_add_ps(_mm_loadu_ps((const float*)a.res + m * a.N + n), v);
    _mm_storeu_ps((float*)a.out + m * a.N + n, v);
  }
}

// Every block of 4 weight rows meets the activation rows in blocks of at most max_mb rows, split evenly (17 rows and
// 6 at most: 6, 6, 5); its 32-column pieces stay in L1 while they pass. Activations go in panels of 64 rows, so a
// long input (prefill) keeps its panel in L2.
template <class Kernel>
void run_linear(const Lin& a, int max_mb) {
  const int64_t blocks = a.N / 4;
  const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(a.K, 1));
  for (int64_t p0 = 0; p0 < a.M; p0 += 64) {
    const int64_t rows = std::min<int64_t>(64, a.M - p0);
    const int64_t n_mb = (rows + max_mb - 1) / max_mb;
    const int nb = rows == 1 && wide_one_row() && blocks % Kernel::WIDE == 0 ? Kernel::WIDE : 1;
    at::parallel_for(0, blocks / nb, std::max<int64_t>(1, grain / nb), [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; b++)
        for (int64_t i = 0, m0 = p0; i < n_mb; i++) {
          const int mb = (int)((p0 + rows - m0) / (n_mb - i));
          Kernel::rows(a, m0, mb, 4 * nb * b, nb);
          m0 += mb;
        }
    });
  }
}

// int4's group sums of M rows of 16-bit integers xq (K columns, a.G a group) into out (M, groups), exact: at most
// 256 x 32767 a sum (the AMX tiles add offset x this a group; KernelI4v16 gets the same from rows_to_words16)
inline void group_sums(const Lin& a, const int16_t* xq, int64_t M, float* out) {
  for (int64_t m = 0; m < M; m++)
    for (int64_t g = 0; g < a.groups; g++) {
      int32_t t = 0;
      for (int64_t k = g * a.G; k < (g + 1) * a.G; k++) t += xq[m * a.K + k];
      out[m * a.groups + g] = (float)t;
    }
}

// 1-MAX (5, 6 or 24) activation rows against a block of weight rows in one pass (the AVX-512 kernels' rows(), and
// the 16-row blocks' runners, which pass their activation words on in `more`): block<mb>, found by counting down
template <class Kernel, int MAX = 6, typename... More>
inline void one_block(const Lin& a, int64_t m0, int mb, int64_t n0, const More&... more) {
  if constexpr (MAX > 1)
    if (mb < MAX) return one_block<Kernel, MAX - 1>(a, m0, mb, n0, more...);
  Kernel::template block<MAX>(a, m0, n0, more...);
}

// ------------------------------------------------------------------------------------------------ AVX-512
// four vectors summed lane-wise into four floats, each by the same tree of shuffles (the linears' four columns,
// attention's four slots); plain AVX-512, so both the BF16 and the plain AVX-512 code inline it
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
inline __m128 reduce4_512(__m512 a, __m512 b, __m512 c, __m512 d) {
  __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  s = _mm512_add_ps(s, _mm512_shuffle_ps(s, s, 0x4E));
  s = _mm512_add_ps(s, _mm512_shuffle_ps(s, s, 0xB1));
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0), s));
}

// reduce4_512 for 4 activation rows at once: row r's 4 sums in quarter r, each by reduce4_512's adds in its order
// (its last two levels, within a 128-bit quarter, here across rows by a 4 x 4 transpose), so the same bits
inline __m512 reduce16_512(const __m512 (&v)[4][4]) {
  __m512 s[4];
  for (int r = 0; r < 4; r++) {  // quarter j: the 4 partial sums of output j
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(v[r][0], v[r][1], 0x44),
                                    _mm512_shuffle_f32x4(v[r][0], v[r][1], 0xEE));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(v[r][2], v[r][3], 0x44),
                                    _mm512_shuffle_f32x4(v[r][2], v[r][3], 0xEE));
    s[r] = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  }
  const __m512 t0 = _mm512_unpacklo_ps(s[0], s[1]), t1 = _mm512_unpackhi_ps(s[0], s[1]);
  const __m512 t2 = _mm512_unpacklo_ps(s[2], s[3]), t3 = _mm512_unpackhi_ps(s[2], s[3]);
  const __m512 p0 = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t2)));  // partial 0
  const __m512 p1 = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t2)));
  const __m512 p2 = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t1), _mm512_castps_pd(t3)));
  const __m512 p3 = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t1), _mm512_castps_pd(t3)));
  const __m512 sum = _mm512_add_ps(_mm512_add_ps(p0, p2), _mm512_add_ps(p1, p3));  // (output j, row r) in lane 4j + r
  return _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), sum);
}

// finish4 for rows m..m+3 (quarter r: row m + r's columns n..n+3): the same operations on each value in the same
// order, the same rounding to bf16 (the signed pack works within quarters, as SSE's does), so the same bits
inline void finish4x4(const Lin& a, int64_t m, int64_t n, __m512 v) {
  if (a.xs) v = _mm512_mul_ps(v, _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                                                       _mm512_castps128_ps512(_mm_loadu_ps(a.xs + m))));
  if (a.scales && !a.offsets) v = _mm512_mul_ps(v, _mm512_broadcast_f32x4(_mm_loadu_ps(a.scales + n)));
  if (a.bias) v = _mm512_add_ps(v, _mm512_broadcast_f32x4(_mm_loadu_ps(a.bias + n)));
  if (a.out_bf16) {
    auto round = [](__m512 f) {  // to_bf16x4 in each quarter
      const __m512i u = _mm512_castps_si512(f);
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
      r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
      r = _mm512_srai_epi32(_mm512_slli_epi32(r, 16), 16);
      return _mm512_packs_epi32(r, r);
    };
    __m512i r = round(v);
    uint16_t* out = (uint16_t*)a.out + m * a.N + n;
    if (a.res) {
      const uint16_t* res = (const uint16_t*)a.res + m * a.N + n;
      __m512i rv = _mm512_castsi128_si512(_mm_loadl_epi64((const __m128i*)res));
      for (int q = 1; q < 4; q++) rv = _mm512_inserti32x4(rv, _mm_loadl_epi64((const __m128i*)(res + q * a.N)), q);
      const __m512i z = _mm512_setzero_si512();
      r = round(_mm512_add_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(z, rv)),
                              _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, r))));
    }
    _mm_storel_epi64((__m128i*)out, _mm512_castsi512_si128(r));
    _mm_storel_epi64((__m128i*)(out + a.N), _mm512_extracti32x4_epi32(r, 1));
    _mm_storel_epi64((__m128i*)(out + 2 * a.N), _mm512_extracti32x4_epi32(r, 2));
    _mm_storel_epi64((__m128i*)(out + 3 * a.N), _mm512_extracti32x4_epi32(r, 3));
  } else {
    float* out = (float*)a.out + m * a.N + n;
    if (a.res) {
      const float* res = (const float*)a.res + m * a.N + n;
      __m512 rv = _mm512_castps128_ps512(_mm_loadu_ps(res));
      rv = _mm512_insertf32x4(rv, _mm_loadu_ps(res + a.N), 1);
      rv = _mm512_insertf32x4(rv, _mm_loadu_ps(res + 2 * a.N), 2);
      rv = _mm512_insertf32x4(rv, _mm_loadu_ps(res + 3 * a.N), 3);
      v = _mm512_add_ps(rv, v);
    }
    _mm_storeu_ps(out, _mm512_castps512_ps128(v));
    _mm_storeu_ps(out + a.N, _mm512_extractf32x4_ps(v, 1));
    _mm_storeu_ps(out + 2 * a.N, _mm512_extractf32x4_ps(v, 2));
    _mm_storeu_ps(out + 3 * a.N, _mm512_extractf32x4_ps(v, 3));
  }
}
#pragma GCC pop_options

// plain AVX-512 (no FMA, no BF16): both the AMX code and KernelI8v16 / KernelI4v16 inline it
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
// a tall block's 16 scales (or offsets) of a group, element i of tile_groups' (N / 16, groups, 16): fp32, or fp16
// where every one of them is exact in it (the same values, half the bytes a one-row step streams for them)
__attribute__((always_inline)) inline __m512 group16(const float* p, int64_t i, bool half) {
  return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)p + i))) : _mm512_loadu_ps(p + i);
}

// one (row, group) of int4 sums into its accumulator: the group's exact integer dot product (256 hi + lo, hi and lo
// the sums of the high and the low bytes' products) times the scale, plus the offset times the group's sum of x;
// every int4 path in tall blocks (the AMX tiles, KernelI4v16) adds its groups through this, in group order, so
// every M gives the same bits, and both builds the same ones
__attribute__((always_inline)) inline __m512 add_group(__m512 acc, __m512i hi, __m512i lo, __m512 scale, __m512 offset,
                                                       float xsum) {
  const __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo);
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc);
  return _mm512_fmadd_ps(offset, _mm512_set1_ps(xsum), acc);
}
// finish4 for 16 columns n..n+15 at once (the int8 and int4 tiles' outputs): the same operations on each value, in
// the same order, and the same rounding to bf16 (vpmovdw keeps the 16 bits finish4's signed pack keeps), so the same
// bits; a quarter of the instructions, which at 5 rows were ~70 a row and block of 16 weight rows
inline void finish16(const Lin& a, int64_t m, int64_t n, __m512 v) {
  if (a.xs) v = _mm512_mul_ps(v, _mm512_set1_ps(a.xs[m]));
  if (a.scales && !a.offsets) v = _mm512_mul_ps(v, _mm512_loadu_ps(a.scales + n));
  if (a.bias) v = _mm512_add_ps(v, _mm512_loadu_ps(a.bias + n));
  if (a.out_bf16) {
    auto round = [](__m512 f) {  // each lane's bf16 bits in its low 16, as to_bf16x4
      const __m512i u = _mm512_castps_si512(f);
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
      return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    };
    __m512i r = round(v);
    if (a.res) {  // as finish4
      const __m512i res = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)a.res + m * a.N + n)));
      r = round(_mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(res, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(r, 16))));
    }
    _mm256_storeu_si256((__m256i*)((uint16_t*)a.out + m * a.N + n), _mm512_cvtepi32_epi16(r));
  } else {
    if (a.res) v = _mm512_add_ps(_mm512_loadu_ps((const float*)a.res + m * a.N + n), v);
    _mm512_storeu_ps((float*)a.out + m * a.N + n, v);
  }
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")

// 32 weights of row n from column 32 * kb as two fp32 vectors (int4: evens then odds, dequantized)
template <int WT>
inline void wload512(const Lin& a, int64_t n, int64_t kb, __m512& lo, __m512& hi) {
  const char* p = a.row(n, kb);
  if (WT == W_F32) {
    lo = _mm512_loadu_ps((const float*)p);
    hi = _mm512_loadu_ps((const float*)p + 16);
  } else if (WT == W_BF16) {  // bf16 -> fp32 is a 16-bit shift
    __m512i v = _mm512_loadu_si512(p);
    lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
    hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
  } else if (WT == W_I8) {
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 16))));
  } else {  // 16 bytes: even columns in the low nibbles, odd ones in the high nibbles
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
    const int64_t g = n * a.groups + ((32 * kb) >> a.gshift);
    const __m512 s = _mm512_set1_ps(a.scales[g]), o = _mm512_set1_ps(a.offsets[g]);
    lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15))), s, o);
    hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), s, o);
  }
}

// How a 32-column step multiplies: fp32 multiply-adds (F32) or BF16 dot products, pairs summed in fp32 (BF16: bf16
// weights as they are, int8 converted exactly, int4 dequantized and rounded to bf16).
template <int WT>
struct F32Step {
  struct W { __m512 lo, hi; };
  struct X { __m512 lo, hi; };
  static inline void load(const Lin& a, int64_t n, int64_t kb, W& w) { wload512<WT>(a, n, kb, w.lo, w.hi); }
  static inline void xload(const Lin& a, int64_t m, int64_t kb, X& x) {
    x.lo = _mm512_loadu_ps(a.xf + m * a.K + 32 * kb);
    x.hi = _mm512_loadu_ps(a.xf + m * a.K + 32 * kb + 16);
  }
  static inline __m512 madd(__m512 acc, const X& x, const W& w) {
    return _mm512_fmadd_ps(x.hi, w.hi, _mm512_fmadd_ps(x.lo, w.lo, acc));
  }
};

// STORE: the converted weights also go to a.wbuf, laid out as a block of bf16 rows (run_dequantized)
template <int WT, bool STORE = false>
struct Bf16Step {
  struct W { __m512bh v; };
  struct X { __m512bh v; };
  static inline void load(const Lin& a, int64_t n, int64_t kb, W& w) {
    if (WT == W_BF16) {
      w.v = (__m512bh)_mm512_loadu_si512(a.row(n, kb));
    } else {
      __m512 lo, hi;
      wload512<WT>(a, n, kb, lo, hi);
      w.v = _mm512_cvtne2ps_pbh(hi, lo);
      if (STORE) _mm512_store_si512(a.wbuf + (kb * 4 + (n & 3)) * 32, (__m512i)w.v);
    }
  }
  static inline void xload(const Lin& a, int64_t m, int64_t kb, X& x) {
    x.v = (__m512bh)_mm512_loadu_si512(a.xb + m * a.K + 32 * kb);
  }
  static inline __m512 madd(__m512 acc, const X& x, const W& w) { return _mm512_dpbf16_ps(acc, x.v, w.v); }
};

// activation rows m0..m0+MB-1 x weight rows n0..n0+3: one accumulator each, summed over K in one fixed order
template <class Step>
struct Kernel512 {
  template <int MB, int NB = 1>
  static inline void block(const Lin& a, int64_t m0, int64_t n0) {
    __m512 acc[MB][4 * NB];
    for (int i = 0; i < MB; i++)
      for (int j = 0; j < 4 * NB; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < a.K / 32; kb++) {
      typename Step::W w[4 * NB];
      if (a.ahead_lines)
        for (int b = 0; b < NB; b++) prefetch_ahead(a, n0 + 4 * b, kb);
      for (int j = 0; j < 4 * NB; j++) Step::load(a, n0 + j, kb, w[j]);
      for (int i = 0; i < MB; i++) {
        typename Step::X x;
        Step::xload(a, m0 + i, kb, x);
        for (int j = 0; j < 4 * NB; j++) acc[i][j] = Step::madd(acc[i][j], x, w[j]);
      }
    }
    int i = 0;
    if constexpr (MB >= 4 && NB == 1) {  // rows 0-3 reduced and finished together
      const __m512 f[4][4] = {{acc[0][0], acc[0][1], acc[0][2], acc[0][3]},
                              {acc[1][0], acc[1][1], acc[1][2], acc[1][3]},
                              {acc[2][0], acc[2][1], acc[2][2], acc[2][3]},
                              {acc[3][0], acc[3][1], acc[3][2], acc[3][3]}};
      finish4x4(a, m0, n0, reduce16_512(f));
      i = 4;
    }
    for (; i < MB; i++)
      for (int b = 0; b < NB; b++)
        finish4(a, m0 + i, n0 + 4 * b, reduce4_512(acc[i][4 * b], acc[i][4 * b + 1], acc[i][4 * b + 2], acc[i][4 * b + 3]));
  }
  static constexpr int WIDE = 2;
  static void rows(const Lin& a, int64_t m0, int mb, int64_t n0, int nb) {
    if (nb == 2) return block<1, 2>(a, m0, n0);  // one activation row: 8 weight rows
    one_block<Kernel512>(a, m0, mb, n0);
  }
};

#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")
// int8 weights on AVX-512 with VNNI, no AMX (Zen 4, Zen 5), in 4-row blocks (the shapes KernelI8v16's 16-row
// blocks do not take: N % 16 or K % 64): KernelI8's integer sums on 512-bit registers, the
// activations rounded to 16-bit integers a row (quantize_rows16), the weights sign-extended once for all rows, one
// vpdpwssd a 32 products; 32 registers hold 4 weight rows x up to 6 activation rows. Each lane goes to fp32 after
// at most 4096 columns, the lanes to one sum by reduce4_512: the same for a row whatever M is
struct KernelI8x512 {
  static constexpr int64_t CHUNK = 128;  // 32-column steps summed as integers at a time (no overflow: as KernelI8)
  // named accumulators, each product added by an asm (as KernelI8: in an array GCC copied them through the stack
  // every step, 5 rows 1.3x KernelI8's time)
#define I8X_MADD(acc, x, w) asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w))
  template <int MB>
  static inline void block(const Lin& a, int64_t m0, int64_t n0) {
    alignas(64) float sum[MB][4][16];  // in memory: with the accumulators, 40 registers at 5 rows
    const char* w0 = a.row(n0, 0);
    const int16_t* x = a.xq + m0 * a.K;
    const int64_t KB = a.K / 32, K = a.K;
    for (int64_t c0 = 0; c0 < KB; c0 += CHUNK) {
      const __m512i z = _mm512_setzero_si512();
      __m512i a00 = z, a01 = z, a02 = z, a03 = z, a10 = z, a11 = z, a12 = z, a13 = z, a20 = z, a21 = z, a22 = z,
              a23 = z, a30 = z, a31 = z, a32 = z, a33 = z, a40 = z, a41 = z, a42 = z, a43 = z, a50 = z, a51 = z,
              a52 = z, a53 = z;
      for (int64_t kb = c0; kb < std::min(KB, c0 + CHUNK); kb++) {
        if (a.ahead_lines) prefetch_ahead(a, n0, kb);
        const char* p = w0 + kb * 128;
        const __m512i w0v = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p));
        const __m512i w1v = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(p + 32)));
        const __m512i w2v = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(p + 64)));
        const __m512i w3v = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(p + 96)));
#define I8X_ROW(i)                                                                   \
        if (MB > i) {                                                                \
          __m512i xv = _mm512_load_si512(x + i * K + 32 * kb);                       \
          asm("" : "+v"(xv));                                                        \
          I8X_MADD(a##i##0, xv, w0v); I8X_MADD(a##i##1, xv, w1v);                    \
          I8X_MADD(a##i##2, xv, w2v); I8X_MADD(a##i##3, xv, w3v);                    \
        }
        I8X_ROW(0) I8X_ROW(1) I8X_ROW(2) I8X_ROW(3) I8X_ROW(4) I8X_ROW(5)
#undef I8X_ROW
      }
      const __m512i acc[6][4] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21, a22, a23},
                                 {a30, a31, a32, a33}, {a40, a41, a42, a43}, {a50, a51, a52, a53}};
      if (MB >= 4 && KB <= CHUNK) {  // one chunk (K <= 4096): rows 0-3 reduced and finished together from registers
        __m512 f[4][4];
        for (int i = 0; i < 4; i++)
          for (int j = 0; j < 4; j++) f[i][j] = _mm512_cvtepi32_ps(acc[i][j]);
        finish4x4(a, m0, n0, reduce16_512(f));
        for (int i = 4; i < MB; i++)
          finish4(a, m0 + i, n0, reduce4_512(_mm512_cvtepi32_ps(acc[i][0]), _mm512_cvtepi32_ps(acc[i][1]),
                                             _mm512_cvtepi32_ps(acc[i][2]), _mm512_cvtepi32_ps(acc[i][3])));
        return;
      }
      for (int i = 0; i < MB; i++)
        for (int j = 0; j < 4; j++) {
          const __m512 f = _mm512_cvtepi32_ps(acc[i][j]);
          _mm512_store_ps(sum[i][j], c0 ? _mm512_add_ps(_mm512_load_ps(sum[i][j]), f) : f);
        }
    }
    for (int i = 0; i < MB; i++)
      finish4(a, m0 + i, n0, reduce4_512(_mm512_load_ps(sum[i][0]), _mm512_load_ps(sum[i][1]),
                                         _mm512_load_ps(sum[i][2]), _mm512_load_ps(sum[i][3])));
  }
#undef I8X_MADD
  static constexpr int WIDE = 1;
  static void rows(const Lin& a, int64_t m0, int mb, int64_t n0, int nb) {
    one_block<KernelI8x512>(a, m0, mb, n0);
  }
};

// int8 weights on AVX-512 with VNNI, no AMX (Zen 4, Zen 5), in 16-row blocks (pack: the AMX tiles' byte order, 64
// bytes = 4 columns of 16 weight rows, each byte + 128, uint8): 16 output columns in a register, no horizontal sums.
// The activations are rounded to 16-bit integers a row (rows_to_words16, qmax 32639) and split into two signed
// bytes, x = 256 hi + lo (hi = (x + 128) >> 8); one vpdpbusd multiplies 4 columns of the 16 weight rows by 4 bytes
// of a row, broadcast from memory (rows_to_words16's layout), so a 64-byte weight line costs 2 instructions a row and
// no conversion, where KernelI8x512 sign-extends 2 x 32 weights and spends 2 vpdpwssd a row. Each (row, block) sums
// the high and the low bytes' products as int32, H and L, exact for K <= 65536; they start at -128 x the row's sum
// of high (low) bytes, which takes the weights' +128 back out; the output is fl(fl(H) * 256 + fl(L)), then
// finish16. One lane per output, in the same order whatever M is. (In L2, one thread, 768 x 576 at 5 rows: 19.7
// against 22.7 us for KernelI8x512's loop, the vpdpbusd at 3.51 G/s of a 3.65 peak; docs/performance.md.)
// acc += the weight line w (64 unsigned bytes) times 4 signed bytes of a row broadcast from memory, in 16 int32 lanes
#define V16_MADD(acc, w, word) asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(word))
struct KernelI8v16 {
  static constexpr int MOST = 6;  // rows a block: 12 chains of sums
  // rows m0..m0+MB-1 against the block of 16 weight rows from n0; xw: rows_to_words16's (K/4, M, 2) words, corr: (M, 2)
  // the sums' starting values
  template <int MB>
  static void block(const Lin& a, int64_t m0, int64_t n0, const int32_t* xw, const int32_t* corr) {
    const int64_t G = a.K / 4, step = 2 * a.M;  // words from one 4 columns' to the next
    const char* w = a.w + n0 * a.K;  // block n0 / 16: 16 K bytes
    const int32_t* x = xw + 2 * m0;
    __m512i h0, l0, h1, l1, h2, l2, h3, l3, h4, l4, h5, l5;
#define V16_INIT(i) \
    if (MB > i) h##i = _mm512_set1_epi32(corr[2 * (m0 + i)]), l##i = _mm512_set1_epi32(corr[2 * (m0 + i) + 1]);
    V16_INIT(0) V16_INIT(1) V16_INIT(2) V16_INIT(3) V16_INIT(4) V16_INIT(5)
#undef V16_INIT
    // the stream 16 KB ahead into L2, at every M (the Zen 4 too, unlike run_linear: here one row ran 2% faster so)
    if (MB == 1) {  // two chains of sums (even and odd g), added at the end (integers: the same sums); one chain
      h1 = l1 = _mm512_setzero_si512();  // waited on the vpdpbusd's latency (a forward's linears in L3: 1.2x the time)
      for (int64_t g = 0; g < G; g += 2) {  // G = K / 4: even
        _mm_prefetch(w + 64 * g + PREFETCH_AHEAD, _MM_HINT_T1);
        const __m512i wa = _mm512_load_si512(w + 64 * g), wb = _mm512_load_si512(w + 64 * g + 64);
        V16_MADD(h0, wa, x[0]); V16_MADD(l0, wa, x[1]);
        V16_MADD(h1, wb, x[step]); V16_MADD(l1, wb, x[step + 1]);
        x += 2 * step;
      }
      h0 = _mm512_add_epi32(h0, h1), l0 = _mm512_add_epi32(l0, l1);
    } else {
      for (int64_t g = 0; g < G; g++) {
        _mm_prefetch(w + 64 * g + PREFETCH_AHEAD, _MM_HINT_T1);
        const __m512i wv = _mm512_load_si512(w + 64 * g);
#define V16_ROW(i) if (MB > i) { V16_MADD(h##i, wv, x[2 * i]); V16_MADD(l##i, wv, x[2 * i + 1]); }
        V16_ROW(0) V16_ROW(1) V16_ROW(2) V16_ROW(3) V16_ROW(4) V16_ROW(5)
#undef V16_ROW
        x += step;
      }
    }
    const __m512 s256 = _mm512_set1_ps(256.0f);
#define V16_OUT(i) \
    if (MB > i) finish16(a, m0 + i, n0, _mm512_fmadd_ps(_mm512_cvtepi32_ps(h##i), s256, _mm512_cvtepi32_ps(l##i)));
    V16_OUT(0) V16_OUT(1) V16_OUT(2) V16_OUT(3) V16_OUT(4) V16_OUT(5)
#undef V16_OUT
  }
};

// int4 weights on AVX-512 with VNNI, no AMX (Zen 4, Zen 5), in the AMX build's tall blocks (pack: _int4_tiles, 16
// weight rows x 64 columns in 512 bytes, byte (r, n, j) holding column 4r + j in its low nibble and 32 + 4r + j in
// its high one): a 64-byte line masked (or shifted, then masked) is 4 columns of 16 weight rows, the unsigned operand
// of vpdpbusd as in KernelI8v16, with no +128 to take out. Per (row, group) the high and low bytes' sums H and L
// start at 0 (exact: at most 128 x 15 x 256); then add_group, the AMX tiles' own step, in group order: the same bits
// as the AMX build. 32-column groups go two at a time (a piece's low and high nibbles, one load a line: 5 rows 0.94x
// the time of a group at a time, 1 row 0.93-0.99x), blocks of up to 5 rows (20 sums and 5 accumulators in
// registers); larger groups one at a time, one row in two chains of sums (even and odd lines), as KernelI8v16.
struct KernelI4v16 {
  static constexpr int MOST = 5;  // rows a block: 20 sums and 5 accumulators
  // rows m0..m0+MB-1 against the block of 16 weight rows from n0; xw: rows_to_words16's (K/4, M, 2) words, xsum: (M,
  // groups) the rows' group sums of their 16-bit integers
  template <int MB>
  static void block(const Lin& a, int64_t m0, int64_t n0, const int32_t* xw, const float* xsum) {
    const int64_t per = a.G / 32, step = 2 * a.M;  // 32-column steps a group; words from 4 columns to the next
    const char* w = a.w + (n0 / 16) * (a.K / 64) * 512;
    const int64_t gb = (n0 / 16) * a.groups * 16;  // the block's (groups, 16) scales and offsets from here
    const __m512i nibble = _mm512_set1_epi8(15);
    __m512 c0, c1, c2, c3, c4;
    __m512i h0, l0, h1, l1, h2, l2, h3, l3, h4, l4;
#define I4_ZERO(i) if (MB > i) c##i = _mm512_setzero_ps();
    I4_ZERO(0) I4_ZERO(1) I4_ZERO(2) I4_ZERO(3) I4_ZERO(4)
#undef I4_ZERO
    if (per == 1) {  // 32-column groups: both groups of a 512-byte piece from one load of each line
      __m512i g0, k0, g1, k1, g2, k2, g3, k3, g4, k4;  // the odd group's high and low sums
      for (int64_t g = 0; g < a.groups; g += 2) {
        h0 = l0 = h1 = l1 = h2 = l2 = h3 = l3 = h4 = l4 = _mm512_setzero_si512();
        g0 = k0 = g1 = k1 = g2 = k2 = g3 = k3 = g4 = k4 = _mm512_setzero_si512();
        const char* p = w + (g >> 1) * 512;
        for (int l = 0; l < 8; l++) _mm_prefetch(p + 64 * l + PREFETCH_AHEAD, _MM_HINT_T1);
        const int32_t* x = xw + 8 * g * step + 2 * m0;
        const int32_t* y = x + 8 * step;
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++) {
          const __m512i v = _mm512_load_si512(p + 64 * r);
          const __m512i wa = _mm512_and_si512(v, nibble), wb = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
#define I4_PAIR(i, hh, ll) if (MB > i) { V16_MADD(h##i, wa, x[2 * i]); V16_MADD(l##i, wa, x[2 * i + 1]); \
                                         V16_MADD(hh, wb, y[2 * i]); V16_MADD(ll, wb, y[2 * i + 1]); }
          I4_PAIR(0, g0, k0) I4_PAIR(1, g1, k1) I4_PAIR(2, g2, k2) I4_PAIR(3, g3, k3) I4_PAIR(4, g4, k4)
#undef I4_PAIR
          x += step, y += step;
        }
        __m512 sc = group16(a.scales, gb + 16 * g, a.half_groups), of = group16(a.offsets, gb + 16 * g, a.half_groups);
#define I4_GROUP(i, hh, ll, gg) if (MB > i) c##i = add_group(c##i, hh, ll, sc, of, xsum[(m0 + i) * a.groups + gg]);
        I4_GROUP(0, h0, l0, g) I4_GROUP(1, h1, l1, g) I4_GROUP(2, h2, l2, g) I4_GROUP(3, h3, l3, g) I4_GROUP(4, h4, l4, g)
        sc = group16(a.scales, gb + 16 * (g + 1), a.half_groups);
        of = group16(a.offsets, gb + 16 * (g + 1), a.half_groups);
        I4_GROUP(0, g0, k0, g + 1) I4_GROUP(1, g1, k1, g + 1) I4_GROUP(2, g2, k2, g + 1) I4_GROUP(3, g3, k3, g + 1)
        I4_GROUP(4, g4, k4, g + 1)
#undef I4_GROUP
      }
    } else {
      for (int64_t g = 0; g < a.groups; g++) {
        h0 = l0 = h1 = l1 = h2 = l2 = h3 = l3 = h4 = l4 = _mm512_setzero_si512();
        for (int64_t s = 0; s < per; s++) {
          const int64_t kb = g * per + s;  // 32 columns: the low nibbles of a 512-byte piece, then its high ones
          const char* p = w + (kb >> 1) * 512;
          if (!(kb & 1))
            for (int l = 0; l < 8; l++) _mm_prefetch(p + 64 * l + PREFETCH_AHEAD, _MM_HINT_T1);
          const int32_t* x = xw + 8 * kb * step + 2 * m0;
#pragma GCC unroll 8
          for (int r = 0; r < 8; r++) {
            __m512i v = _mm512_load_si512(p + 64 * r);
            if (kb & 1) v = _mm512_srli_epi16(v, 4);
            const __m512i wv = _mm512_and_si512(v, nibble);
            if (MB == 1) {
              if (r & 1) { V16_MADD(h1, wv, x[0]); V16_MADD(l1, wv, x[1]); }
              else { V16_MADD(h0, wv, x[0]); V16_MADD(l0, wv, x[1]); }
            }
#define I4_ROW(i) if (MB > i && MB > 1) { V16_MADD(h##i, wv, x[2 * i]); V16_MADD(l##i, wv, x[2 * i + 1]); }
            I4_ROW(0) I4_ROW(1) I4_ROW(2) I4_ROW(3) I4_ROW(4)
#undef I4_ROW
            x += step;
          }
        }
        if (MB == 1) h0 = _mm512_add_epi32(h0, h1), l0 = _mm512_add_epi32(l0, l1);
        const __m512 sc = group16(a.scales, gb + 16 * g, a.half_groups);
        const __m512 of = group16(a.offsets, gb + 16 * g, a.half_groups);
#define I4_GROUP(i) if (MB > i) c##i = add_group(c##i, h##i, l##i, sc, of, xsum[(m0 + i) * a.groups + g]);
        I4_GROUP(0) I4_GROUP(1) I4_GROUP(2) I4_GROUP(3) I4_GROUP(4)
#undef I4_GROUP
      }
    }
#define I4_OUT(i) if (MB > i) finish16(a, m0 + i, n0, c##i);
    I4_OUT(0) I4_OUT(1) I4_OUT(2) I4_OUT(3) I4_OUT(4)
#undef I4_OUT
  }
};

// int4 groups of 32 with 8-bit activations (".a8", as llama.cpp's q8_0 blocks): each row's 32 columns of a group are
// rounded to signed bytes q against their own scale s = max |x| / 127 (quantize_groups8), so a line and row take one
// vpdpbusd, not the 16-bit rows' two. Per (row, group) the exact integer sum S, then acc += fl(S) x fl(scale x s) and
// offset x fl(s x sum q), in group order: every M the same bits. A piece of 8 lines holds two groups (low and high
// nibbles): up to 8 rows take both in one pass over the lines (two sums a row in registers); more, up to 24, one group
// at a time (the second reads the lines again, from L1), so that all of a verification's rows run in one pass over the
// weights (as KernelI8a8). One row: two chains of sums a group (even and odd lines)
struct KernelI4a8 {
  static constexpr int MOST = 24;
  // rows m0..m0+MB-1 against the block of 16 weight rows from n0; xw: quantize_groups8's (K/4, M) words, gs and
  // gsum (groups, M): the groups' scales s and s x sum q
  template <int MB>
  static void block(const Lin& a, int64_t m0, int64_t n0, const int32_t* xw, const float* gs, const float* gsum) {
    constexpr int P = MB <= 8 ? 2 : 1, CH = MB == 1 ? 2 : 1;  // groups a pass over the lines; chains a group and row
    const int64_t M = a.M;
    const char* w = a.w + (n0 / 16) * (a.K / 64) * 512;
    const int64_t gb = (n0 / 16) * a.groups * 16;  // the block's (groups, 16) scales and offsets from here
    const __m512i nibble = _mm512_set1_epi8(15);
    alignas(64) float c[MB][16] = {};
    __m512i s[P][CH][MB];
    const int32_t* x = xw + m0;  // group g's words from 8 g M: its 8 lines' M rows
    for (int64_t g = 0; g < a.groups; g += P) {
#pragma GCC unroll 2
      for (int q = 0; q < P; q++)
#pragma GCC unroll 2
        for (int j = 0; j < CH; j++)
#pragma GCC unroll 24
          for (int i = 0; i < MB; i++) s[q][j][i] = _mm512_setzero_si512();
      const char* p = w + (g >> 1) * 512;
      // CH lines an iteration, not all 8: unrolled, GCC kept each (line, row)'s address apart and spilled them
#pragma GCC unroll 1
      for (int r = 0; r < 8; r += CH) {
#pragma GCC unroll 2
        for (int j = 0; j < CH; j++) {
          if (!(g & 1)) _mm_prefetch(p + 64 * (r + j) + PREFETCH_AHEAD, _MM_HINT_T1);  // each line once
          const __m512i v = _mm512_load_si512(p + 64 * (r + j));
#pragma GCC unroll 2
          for (int q = 0; q < P; q++) {  // the low nibbles are the even group's
            const int shift = P == 2 ? 4 * q : 4 * (int)(g & 1);
            const __m512i wq = _mm512_and_si512(shift ? _mm512_srli_epi16(v, shift) : v, nibble);
#pragma GCC unroll 24
            for (int i = 0; i < MB; i++) V16_MADD(s[q][j][i], wq, x[8 * q * M + i]);
          }
          x += M;
        }
      }
      if (P == 2) x += 8 * M;  // past the high group's words
#pragma GCC unroll 2
      for (int q = 0; q < P; q++) {
        const __m512 sc = group16(a.scales, gb + 16 * (g + q), a.half_groups);
        const __m512 of = group16(a.offsets, gb + 16 * (g + q), a.half_groups);
#pragma GCC unroll 24
        for (int i = 0; i < MB; i++) {
          const __m512i sum = CH == 2 ? _mm512_add_epi32(s[q][0][i], s[q][CH - 1][i]) : s[q][0][i];
          const int64_t at = (g + q) * M + m0 + i;
          const __m512 acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(sc, _mm512_set1_ps(gs[at])),
                                             _mm512_load_ps(c[i]));
          _mm512_store_ps(c[i], _mm512_fmadd_ps(of, _mm512_set1_ps(gsum[at]), acc));
        }
      }
    }
#pragma GCC unroll 24
    for (int i = 0; i < MB; i++) finish16(a, m0 + i, n0, _mm512_load_ps(c[i]));
  }
};

// int8 lines (KernelI8v16's, each byte q + 128) with 8-bit activations: one vpdpbusd a line and row; a group's sum
// starts at -128 x its sum of q (taking the +128 back out), then acc += fl(S) x s in group order, and finish16 the
// channel's scale: every M the same bits (S is an exact integer, whichever chains summed it). All of a verification's
// rows in one pass over the block (up to 24: 24 chains of sums in registers, the fp32 accumulators in L1), so the
// weight stream overlaps all their dot products: blocks of 6 ran 17 rows as 5 + 6 + 6, and the later passes, from
// L1, added their time to the stream's. Up to 3 rows, two chains a row (even and odd lines): one chain waits on
// each sum's latency
struct KernelI8a8 {
  static constexpr int MOST = 24;
  // rows m0..m0+MB-1 against the block of 16 weight rows from n0; xw: quantize_groups8's (K/4, M) words, gs (groups,
  // M) the groups' scales, gcorr (groups, M) -128 x their sums of q
  template <int MB>
  static void block(const Lin& a, int64_t m0, int64_t n0, const int32_t* xw, const float* gs, const int32_t* gcorr) {
    constexpr int CH = MB <= 3 ? 2 : 1;
    const int64_t M = a.M, groups = a.K / 32;
    const char* w = a.w + n0 * a.K;  // block n0 / 16: 16 K bytes, a line 4 columns of its 16 rows
    alignas(64) float c[MB][16] = {};
    __m512i s[CH][MB];
    const int32_t* x = xw + m0;
    for (int64_t g = 0; g < groups; g++) {
#pragma GCC unroll 24
      for (int i = 0; i < MB; i++) {
        s[0][i] = _mm512_set1_epi32(gcorr[g * M + m0 + i]);
        if (CH == 2) s[CH - 1][i] = _mm512_setzero_si512();
      }
      const char* p = w + 512 * g;
      // CH lines an iteration, not all 8: unrolled, GCC kept each (line, row)'s address apart and spilled them
#pragma GCC unroll 1
      for (int r = 0; r < 8; r += CH) {
#pragma GCC unroll 2
        for (int j = 0; j < CH; j++) {
          if (MB > 1 || j == 0) _mm_prefetch(p + 64 * (r + j) + PREFETCH_AHEAD, _MM_HINT_T1);  // (as KernelI8v16)
          const __m512i wv = _mm512_load_si512(p + 64 * (r + j));
#pragma GCC unroll 24
          for (int i = 0; i < MB; i++) V16_MADD(s[j][i], wv, x[i]);
          x += M;
        }
      }
#pragma GCC unroll 24
      for (int i = 0; i < MB; i++) {
        const __m512i sum = CH == 2 ? _mm512_add_epi32(s[0][i], s[CH - 1][i]) : s[0][i];
        _mm512_store_ps(c[i], _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(gs[g * M + m0 + i]),
                                              _mm512_load_ps(c[i])));
      }
    }
#pragma GCC unroll 24
    for (int i = 0; i < MB; i++) finish16(a, m0 + i, n0, _mm512_load_ps(c[i]));
  }
};

// x (M, K), fp32 or bf16, in groups of 32 columns as KernelI4a8 and KernelI8a8 read it: per (row, group) s = max
// |x| / 127 and q = x x (127 / max |x|) rounded to nearest even (|q| <= 127), as (K/4, M) words of 4 signed bytes;
// gs (groups, M) s, gsum s x sum q, gcorr -128 x sum q (a group's rows side by side, as the kernels read them).
// A group of zeros: s = 0; one with an inf or a NaN: s = NaN (the row's outputs NaN)
template <typename E>
inline __m512 xload512(const E* p) {  // attention's vload512 here: one definition was not inlined there
  if (sizeof(E) == 4) return _mm512_loadu_ps((const float*)p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
template <typename E>
void quantize_groups8(const E* x, int64_t M, int64_t K, int32_t* xw, float* gs, float* gsum, int32_t* gcorr) {
  const int64_t groups = K / 32;
  for (int64_t m = 0; m < M; m++)
    for (int64_t g = 0; g < groups; g++) {
      const __m512 u = xload512(x + m * K + 32 * g), v = xload512(x + m * K + 32 * g + 16);
      const bool bad = _mm512_cmp_ps_mask(u, u, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(u), _mm512_abs_ps(v)));
      alignas(64) int32_t words[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (bad || std::isinf(amax) || amax == 0.0f) {
        gs[g * M + m] = gsum[g * M + m] = amax == 0.0f && !bad ? 0.0f : NAN;
        gcorr[g * M + m] = 0;
      } else {
        const __m512 inv = _mm512_set1_ps(127.0f / amax);
        const __m512i qu = _mm512_cvtps_epi32(_mm512_mul_ps(u, inv)), qv = _mm512_cvtps_epi32(_mm512_mul_ps(v, inv));
        const float s = amax / 127.0f;
        gs[g * M + m] = s;
        const int32_t qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(qu, qv));
        gsum[g * M + m] = s * (float)qsum;
        gcorr[g * M + m] = -128 * qsum;
        _mm_store_si128((__m128i*)words, _mm512_cvtepi32_epi8(qu));
        _mm_store_si128((__m128i*)words + 1, _mm512_cvtepi32_epi8(qv));
      }
      for (int j = 0; j < 8; j++) xw[(8 * g + j) * M + m] = words[j];
    }
}

// x's rows as KernelI8v16 and KernelI4v16 read them, in one AVX-512 pass over each row: q = x / scale rounded to
// nearest even, scale = max |x| / 32639 (a row of zeros 0, one with an inf or a NaN NaN, as quantize_rows16), as
// (K/4, M, 2) 32-bit words, for each 4 columns and row their 4 high bytes (hi = (q + 128) >> 8), then their 4 low
// ones (q - 256 hi), both signed: a block of rows then reads one pointer at fixed offsets (rows apart, (M, K/4, 2) had
// GCC copy the accumulators between registers every step); corr (M, 2): -128 x the row's sum of the high bytes, and
// of the low ones; with gsum (M, K / G), each group's exact sum of q (KernelI4v16's offsets)
template <typename E>
void rows_to_words16(const E* x, int64_t M, int64_t K, int32_t* xw, int32_t* corr, float* scale, float* gsum,
                     int64_t G) {
  const float qmax = 32639.0f;  // |q| <= 32639: q + 128 and every byte below stay in range
  const int64_t groups = gsum ? K / G : 0;
  int64_t* const words = (int64_t*)xw;  // (K/4, M) pairs: 4 columns' high bytes, then their low bytes
  for (int64_t m = 0; m < M; m++) {
    const E* r = x + m * K;
    __m512 mx = _mm512_setzero_ps();
    __mmask16 bad = 0;
    for (int64_t k = 0; k < K; k += 16) {
      const __m512 v = _mm512_abs_ps(xload512(r + k));
      bad |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      mx = _mm512_max_ps(mx, v);
    }
    const float amax = _mm512_reduce_max_ps(mx);
    const bool finite = !bad && !std::isinf(amax);
    if (!finite || amax == 0.0f) {  // q = 0 (scale 0, or NaN: the row's outputs NaN)
      scale[m] = finite ? 0.0f : NAN;
      for (int64_t k = 0; k < K; k += 4) words[(k / 4) * M + m] = 0;
      corr[2 * m] = corr[2 * m + 1] = 0;
      for (int64_t g = 0; g < groups; g++) gsum[m * groups + g] = 0.0f;
      continue;
    }
    scale[m] = amax / qmax;
    const __m512 inv = _mm512_set1_ps(qmax / amax);
    __m512i sh = _mm512_setzero_si512(), sl = sh, gs = sh;
    for (int64_t k = 0; k < K; k += 16) {  // cvtps rounds to nearest even, as quantize_rows16
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(xload512(r + k), inv));
      const __m512i hi = _mm512_srai_epi32(_mm512_add_epi32(q, _mm512_set1_epi32(128)), 8);
      const __m512i lo = _mm512_sub_epi32(q, _mm512_slli_epi32(hi, 8));
      sh = _mm512_add_epi32(sh, hi), sl = _mm512_add_epi32(sl, lo);
      if (groups) {
        gs = _mm512_add_epi32(gs, q);
        if ((k + 16) % G == 0) {
          gsum[m * groups + k / G] = (float)_mm512_reduce_add_epi32(gs);
          gs = _mm512_setzero_si512();
        }
      }
      const __m128i hb = _mm512_cvtepi32_epi8(hi), lb = _mm512_cvtepi32_epi8(lo);  // 4 words of 4 columns each
      const __m128i p0 = _mm_unpacklo_epi32(hb, lb), p1 = _mm_unpackhi_epi32(hb, lb);  // (high, low) pairs
      int64_t* dst = words + (k / 4) * M + m;
      if (M == 1) {
        _mm_storeu_si128((__m128i*)dst, p0);
        _mm_storeu_si128((__m128i*)(dst + 2), p1);
      } else {
        dst[0] = _mm_cvtsi128_si64(p0), dst[M] = _mm_extract_epi64(p0, 1);
        dst[2 * M] = _mm_cvtsi128_si64(p1), dst[3 * M] = _mm_extract_epi64(p1, 1);
      }
    }
    corr[2 * m] = -128 * _mm512_reduce_add_epi32(sh);
    corr[2 * m + 1] = -128 * _mm512_reduce_add_epi32(sl);
  }
}

// x rounded for the 16-row-block kernels, in the calling thread's own buffers: 16-bit (rows_to_words16: words, corr,
// the int4 group sums; the scales into t.xs) or 8-bit groups (quantize_groups8: words, gcorr, gsum, gs)
struct RoundedX {
  const int32_t* words;
  const int32_t* ints;  // corr (M, 2) or gcorr (K/32, M)
  const float* sums;    // int4's group sums (M, groups) or gsum (K/32, M)
  const float* gs;      // 8-bit: each group's scale (K/32, M)
};
template <typename E>
RoundedX round_x_here(const E* x, Lin& t, int act_bits, bool group_sums) {
  static thread_local std::vector<int32_t> words, ints;
  static thread_local std::vector<float> xs, sums, gs;
  const int64_t M = t.M, K = t.K;
  if (act_bits == 8) {
    int32_t* w = scratch64(words, M * K / 4);
    gs.resize(M * K / 32), sums.resize(M * K / 32), ints.resize(M * K / 32);
    quantize_groups8(x, M, K, w, gs.data(), sums.data(), ints.data());
    return {w, ints.data(), sums.data(), gs.data()};
  }
  int32_t* w = scratch64(words, M * K / 2);
  ints.resize(2 * M), xs.resize(M);
  if (group_sums) sums.resize(M * t.groups);
  rows_to_words16(x, M, K, w, ints.data(), xs.data(), group_sums ? sums.data() : nullptr, t.G);
  t.xs = xs.data();
  return {w, ints.data(), group_sums ? sums.data() : nullptr, nullptr};
}

// Weights in 16-row blocks on AVX-512 VNNI: KernelI8v16 and KernelI4v16 (x rounded to 16 bits a row), KernelI8a8 and
// KernelI4a8 (8-bit groups). Each block meets the activation rows in blocks of at most MOST (8-bit: 24, all of a
// verification's rows in one pass; KernelI8v16 6, KernelI4v16 5: two sums a row, and KernelI8v16 gained nothing
// from 9 rows in one pass), split evenly (as run_linear); the threads take contiguous runs of blocks (grain blocks at
// least; an atomic counter handing out chunks of N/256 rows instead cost 3-5 rows 1.2x the time: the streams lose their
// order). Each thread first rounds x itself, into its own buffers: rounded once, by one thread while the other waited,
// the words were written into lines the other core had read in the last call, and every store missed (~80% of the
// rounding's time, 2.5-3.5% of a 5-to-17-token forward); now both round the same rows at once, each into lines only it
// reads.
template <typename E>
void run_blocks16(const Lin& a, const E* x, int act_bits, bool int8) {
  const int most = act_bits == 8 ? (int8 ? KernelI8a8::MOST : KernelI4a8::MOST)
                                  : (int8 ? KernelI8v16::MOST : KernelI4v16::MOST);
  const int64_t grain = std::max<int64_t>(1, (int8 ? 2048 : 4096) / std::max<int64_t>(a.K, 1));
  const int64_t n_mb = (a.M + most - 1) / most;
  at::parallel_for(0, a.N / 16, grain, [&](int64_t b0, int64_t b1) {
    Lin t = a;  // with this thread's scales
    const RoundedX r = round_x_here(x, t, act_bits, !int8);
    for (int64_t b = b0; b < b1; b++)
      for (int64_t i = 0, m0 = 0; i < n_mb; i++) {
        const int mb = (int)((a.M - m0) / (n_mb - i));
        if (act_bits == 8 && int8) one_block<KernelI8a8, KernelI8a8::MOST>(t, m0, mb, 16 * b, r.words, r.gs, r.ints);
        else if (act_bits == 8) one_block<KernelI4a8, KernelI4a8::MOST>(t, m0, mb, 16 * b, r.words, r.gs, r.sums);
        else if (int8) one_block<KernelI8v16, KernelI8v16::MOST>(t, m0, mb, 16 * b, r.words, r.ints);
        else one_block<KernelI4v16, KernelI4v16::MOST>(t, m0, mb, 16 * b, r.words, r.sums);
        m0 += mb;
      }
  });
}
#undef V16_MADD
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")

// int8 and int4 weights with BF16 dot products, more than one block of activation rows: the first block converts
// the weights in registers as it streams them (as up to 6 rows do) and also stores them, converted, into a small
// buffer (int8 exactly, its scale applied at the end; int4 dequantized, q * scale + offset, and rounded), which
// the other blocks then read from L1: the conversion is paid once per weight, and the weight stream overlaps the
// first block's dot products. Converting a whole block first and then running every activation block from the
// buffer left the stream alone in its phase: 9 rows of int8 cost 1.4x bf16 weights' time on a Zen 4.
template <int WT>
void run_dequantized(const Lin& a) {
  Lin b = a;  // reads the buffer: plain bf16 rows of one block
  b.block_bytes = 64;
  b.ahead_lines = 0;  // the weights stream (and are prefetched) in the first activation block
  b.offsets = nullptr;
  if (WT == W_I4) b.scales = nullptr;  // already in the weights
  const int64_t blocks = a.N / 4;
  const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(a.K, 1));
  for (int64_t p0 = 0; p0 < a.M; p0 += 64) {
    const int64_t rows = std::min<int64_t>(64, a.M - p0), n_mb = (rows + 5) / 6;
    at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
      static thread_local std::vector<uint16_t> store;
      uint16_t* const buf = scratch64(store, 4 * a.K);
      Lin first = a, c = b;
      first.wbuf = buf;
      c.w = (const char*)buf;
      for (int64_t blk = b0; blk < b1; blk++) {
        const int64_t n0 = 4 * blk;
        c.n_base = n0;
        for (int64_t i = 0, m0 = p0; i < n_mb; i++) {
          const int mb = (int)((p0 + rows - m0) / (n_mb - i));
          if (i == 0) Kernel512<Bf16Step<WT, true>>::rows(first, m0, mb, n0, 1);
          else Kernel512<Bf16Step<W_BF16>>::rows(c, m0, mb, n0, 1);
          m0 += mb;
        }
      }
    });
  }
}

// ------------------------------------------------------------------------------------------------ AMX
// AMX multiplies tiles: C (rows x cols fp32) += A (rows x 16 pairs of bf16) . B (16 pairs x cols), each C element
// summed over its own row of A and column of B only. A block of 4 weight rows is A as it is packed (4 rows of 32
// columns, 64 bytes apart); the activations are B: for each 32 columns, 16 rows (one per column pair) of up to 16
// activation rows' pairs. So C is the block's outputs transposed, 4 x M, and each output is computed by the same
// instructions whatever M is. One tile instruction does the work of 4 x M vector dot products: verifying 16 tokens
// costs about what one does (the weights' reading), where the vector units made it compute-bound.
#if EAGLE_AMX
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16,amx-int8")

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// GCC does not see that ldtilecfg reads the whole 64 bytes and dropped some of the stores that fill them (a
// garbage configuration, a fault): the empty asm tells it that the memory is read
inline void load_tile_config(const TileConfig& c) {
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

// tiles: 0 activations (B), 1-2 weight blocks (A), 3-4 outputs (C), for cols activation rows
inline void configure_tiles(int cols) {
  TileConfig c;
  c.rows[0] = 16, c.colsb[0] = 4 * cols;
  for (int t = 1; t <= 2; t++) c.rows[t] = 4, c.colsb[t] = 64;
  for (int t = 3; t <= 4; t++) c.rows[t] = 4, c.colsb[t] = 4 * cols;
  load_tile_config(c);
}

// the activations as B tiles, cols rows a panel: (panels, K/32, 16 pairs, cols) 32-bit pairs, zeros past row M
// (a padded column is computed and thrown away: no output depends on another one)
std::vector<uint32_t> pair_layout(const Lin& a, int cols) {
  const int64_t KB = a.K / 32, panels = (a.M + cols - 1) / cols;
  std::vector<uint32_t> xt(panels * KB * 16 * cols, 0);
  for (int64_t m = 0; m < a.M; m++) {
    const uint32_t* row = (const uint32_t*)(a.xb + m * a.K);
    uint32_t* panel = xt.data() + (m / cols) * KB * 16 * cols + m % cols;
    for (int64_t i = 0; i < 16 * KB; i++) panel[i * cols] = row[i];
  }
  return xt;
}

// weight rows n0..n0+4*NB-1 x the panel of cols activation rows at xt, the sums stored into c (NB, 4, 16)
template <int NB>
inline void amx_panel(const Lin& a, const uint32_t* xt, int cols, int64_t n0, bool ahead, float (*c)[4][16]) {
  const int64_t KB = a.K / 32;
  _tile_zero(3);
  if (NB == 2) _tile_zero(4);
  for (int64_t kb = 0; kb < KB; kb++) {
    if (ahead)
      for (int b = 0; b < NB; b++) prefetch_ahead(a, n0 + 4 * b, kb);
    _tile_loadd(0, xt + kb * 16 * cols, 4 * cols);
    _tile_loadd(1, a.row(n0, kb), 64);
    _tile_dpbf16ps(3, 1, 0);
    if (NB == 2) {
      _tile_loadd(2, a.row(n0 + 4, kb), 64);
      _tile_dpbf16ps(4, 2, 0);
    }
  }
  _tile_stored(3, c[0], 64);
  if (NB == 2) _tile_stored(4, c[1], 64);
}

template <int NB>
inline void amx_finish(const Lin& a, const float (*c)[4][16], int cols, int64_t m0, int64_t n0) {
  const int mp = (int)std::min<int64_t>(cols, a.M - m0);
  for (int b = 0; b < NB; b++)
    for (int m = 0; m < mp; m++)
      finish4(a, m0 + m, n0 + 4 * b, _mm_setr_ps(c[b][0][m], c[b][1][m], c[b][2][m], c[b][3][m]));
}

// blocks b0..b1 of 4 * NB weight rows x every activation row, a panel of cols at a time (the tiles configured for
// cols). One panel (up to 16 rows): a block's outputs are finished after the next block's products, when its tile
// store has reached L1 (read right after the store, each load waited for it)
template <int NB>
inline void amx_blocks(const Lin& a, const uint32_t* xt, int cols, int64_t b0, int64_t b1) {
  const int64_t KB = a.K / 32, panels = (a.M + cols - 1) / cols;
  alignas(64) float c[2][2][4][16];
  for (int64_t b = b0; b < b1; b++) {
    const int64_t n0 = 4 * NB * b;
    if (panels == 1) {
      amx_panel<NB>(a, xt, cols, n0, a.ahead_lines, c[b & 1]);
      if (b > b0) amx_finish<NB>(a, c[(b & 1) ^ 1], cols, 0, n0 - 4 * NB);
      continue;
    }
    for (int64_t pn = 0; pn < panels; pn++) {
      amx_panel<NB>(a, xt + pn * KB * 16 * cols, cols, n0, a.ahead_lines && pn == 0, c[0]);
      amx_finish<NB>(a, c[0], cols, pn * cols, n0);
    }
  }
  if (panels == 1 && b1 > b0) amx_finish<NB>(a, c[(b1 - 1) & 1], cols, 0, 4 * NB * (b1 - 1));
}

// bf16 weights: blocks of 8 weight rows (4 where the count is odd) meet every activation row
// (a long input, prefill, goes 64 rows at a time, so that its tiles stay in L2 while all the weights pass)
void run_amx(const Lin& a) {
  const int64_t blocks = a.N / 4, nb = blocks % 2 == 0 ? 2 : 1;
  const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(a.K, 1) / nb);
  const int cols = (int)std::min<int64_t>(16, a.M);
  for (int64_t p0 = 0; p0 < a.M; p0 += 64) {
    Lin p = a;  // rows p0.. of the input and the output
    p.M = std::min<int64_t>(64, a.M - p0);
    p.xb = a.xb + p0 * a.K;
    p.out = (char*)a.out + p0 * a.N * (a.out_bf16 ? 2 : 4);
    if (a.res) p.res = (const char*)a.res + p0 * a.N * (a.out_bf16 ? 2 : 4);
    const std::vector<uint32_t> xt = pair_layout(p, cols);
    at::parallel_for(0, blocks / nb, grain, [&](int64_t b0, int64_t b1) {
      configure_tiles(cols);
      if (nb == 2) amx_blocks<2>(p, xt.data(), cols, b0, b1);
      else amx_blocks<1>(p, xt.data(), cols, b0, b1);
      _tile_release();
    });
  }
}

// bf16 weights in tall blocks (pack on an AMX CPU, _vnni_tiles), the int8 way round: each 16 weight rows x 32
// columns (1 KB) are the tiles' B operand as packed (16 column pairs x 16 rows' pairs), read straight from the
// weight stream; the activations are A as they lie in x (up to 16 rows of 32 columns a tile, 2K bytes apart). One
// product per 512 weights whatever M is up to 16, where the weights as A (4 rows a product) took 4; and C (rows x 16
// outputs) gets, for each output, the same pair products in the same order as the weights-as-A tiles gave it (the
// operands' roles swapped: a . b = b . a, exact in fp32), so the same bits.
inline void configure_tiles_bf16_tall(int rows) {
  TileConfig c;
  c.rows[0] = 16, c.colsb[0] = 64;                                 // B: a weight block's 32 columns
  for (int t = 2; t <= 3; t++) c.rows[t] = rows, c.colsb[t] = 64;  // A: a panel's 32 columns (two, alternating)
  for (int t = 4; t <= 7; t++) c.rows[t] = rows, c.colsb[t] = 64;  // C: up to 4 panels' sums
  load_tile_config(c);
}

// panel pn's sums from C tile 4 + pn (the tall bf16 and int8 paths; the tile numbers are immediates)
inline void store_sums(int pn, void* sums) {
  if (pn == 0) _tile_stored(4, sums, 64);
  else if (pn == 1) _tile_stored(5, sums, 64);
  else if (pn == 2) _tile_stored(6, sums, 64);
  else _tile_stored(7, sums, 64);
}

// one block of 16 weight rows (n0) x P panels of c rows of x (xb: (rows, K) bf16), the sums left in tiles 4..3+P
template <int P>
inline void bf16_tall_products(const Lin& a, const uint16_t* xb, int c, int64_t n0) {
  const int64_t KB = a.K / 32, stride = 2 * a.K, panel = c * a.K;
  const char* w = a.w + (n0 / 16) * KB * 1024;
  _tile_zero(4);
  if (P > 1) _tile_zero(5);
  if (P > 2) _tile_zero(6);
  if (P > 3) _tile_zero(7);
  for (int64_t kb = 0; kb < KB; kb++) {
    const char* p = w + kb * 1024;
    if (a.ahead_lines)
      for (int l = 0; l < 16; l++) _mm_prefetch(p + PREFETCH_AHEAD + 64 * l, _MM_HINT_T1);
    _tile_loadd(0, p, 64);
    _tile_loadd(2, xb + 32 * kb, stride);
    _tile_dpbf16ps(4, 2, 0);
    if (P > 1) {
      _tile_loadd(3, xb + panel + 32 * kb, stride);
      _tile_dpbf16ps(5, 3, 0);
    }
    if (P > 2) {
      _tile_loadd(2, xb + 2 * panel + 32 * kb, stride);
      _tile_dpbf16ps(6, 2, 0);
    }
    if (P > 3) {
      _tile_loadd(3, xb + 3 * panel + 32 * kb, stride);
      _tile_dpbf16ps(7, 3, 0);
    }
  }
}

void run_amx_bf16_tall(const Lin& a) {
  const int64_t blocks = a.N / 16;
  const int64_t grain = std::max<int64_t>(1, 65536 / 32 / std::max<int64_t>(a.K, 1));
  static thread_local std::vector<uint16_t> xpad;
  for (int64_t p0 = 0; p0 < a.M; p0 += 64) {  // up to 64 rows (4 panels of 16) a pass over the weights
    const int64_t rows = std::min<int64_t>(64, a.M - p0), panels = (rows + 15) / 16;
    const int c = (int)((rows + panels - 1) / panels);  // 17 rows: panels of 9 and 8, not 16 and 1
    const uint16_t* xb = a.xb + p0 * a.K;
    if (panels * c > rows) {  // the last panel's tile would read rows past x: a copy with zero rows
      xpad.assign(panels * c * a.K, 0);
      std::memcpy(xpad.data(), xb, rows * a.K * 2);
      xb = xpad.data();
    }
    at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
      configure_tiles_bf16_tall(c);
      // one panel: a block's outputs are finished after the next block's products, when its tile store has reached
      // L1 (as run_amx_i8_tall); more panels store and finish panel by panel
      alignas(64) float sums[2][16][16];
      auto finish = [&](const float (*s)[16], int pn, int64_t n0) {
        const int64_t m0 = p0 + pn * c, mp = std::min<int64_t>(c, p0 + rows - m0);
        for (int64_t m = 0; m < mp; m++) finish16(a, m0 + m, n0, _mm512_load_ps(s[m]));
      };
      for (int64_t b = b0; b < b1; b++) {
        if (panels == 1) {
          bf16_tall_products<1>(a, xb, c, 16 * b);
          _tile_stored(4, sums[b & 1], 64);
          if (b > b0) finish(sums[(b & 1) ^ 1], 0, 16 * (b - 1));
          continue;
        }
        if (panels == 2) bf16_tall_products<2>(a, xb, c, 16 * b);
        else if (panels == 3) bf16_tall_products<3>(a, xb, c, 16 * b);
        else bf16_tall_products<4>(a, xb, c, 16 * b);
        for (int pn = 0; pn < panels; pn++) {
          store_sums(pn, &sums[0][0][0]);
          finish(sums[0], pn, 16 * b);
        }
      }
      if (panels == 1 && b1 > b0) finish(sums[(b1 - 1) & 1], 0, 16 * (b1 - 1));
      _tile_release();
    });
  }
}

// int4 weights on AMX, the other way round: the activations are A, the weights B. pack lays int4 out for the tiles
// (16 weight rows x 64 columns in 512 bytes; byte (r, n, j) holds column 4r + j of the first 32 columns in its low
// nibble and of the next 32 in its high one: two B tiles, a mask or a shift away). The activations are rounded to
// 16-bit integers a row (quantize_rows16, as for int8, but within +-32639) and split into two signed bytes, x = 256
// hi + lo with hi = (x + 128) >> 8 and lo the low byte read as a signed one; a panel of c rows is one A tile of 2c
// rows, the c high bytes then the c low ones (x . q = 256 hi . q + lo . q, each exact in int32: TDPBSUD; a row of
// ones that put back the 128 of an unsigned low byte cost a tile row and an add a row and group, 3% at 5 rows). One product
// and one store of its sums a group of 32 columns and 16 weight rows, whatever c is; then each (row, group) adds
// sum * scale + offset * (the group's sum of x) in fp32, in group order, the same instructions whatever M is.
// (The high and low bytes as two tiles cost twice the products and the stores, and the stores, ~20 cycles each
// whatever the rows, were the bound: 30 layers' linears at one row 4.8 ms, 3.7 with one tile.) Up to 4 rows, 32-column
// groups share a product two at a time (amx_i4_pairs). The B bytes are written a step before a tile loads them and
// the sums read a step after their tile store: a tile load does not take data from stores still in flight, and the
// one-row path waited on that chain for most of its time (85% of it with the weights in L2).
constexpr int PANEL_ROWS = 7;  // activation rows a panel (int4: 2 x 7 = 14 tile rows; int8: 2 x 7 + 1 = 15)

inline void configure_tiles_i4(int rows) {  // rows: the A tile's, 2c
  TileConfig c;
  for (int t = 0; t <= 1; t++) c.rows[t] = rows, c.colsb[t] = 32;  // A: a panel's bytes, 32 columns (two groups)
  for (int t = 2; t <= 3; t++) c.rows[t] = 8, c.colsb[t] = 64;     // B: 32 columns of the weight block
  for (int t = 4; t <= 5; t++) c.rows[t] = rows, c.colsb[t] = 64;  // C: the sums
  load_tile_config(c);
}

// rows m of xq as int4's panels of c: (panels, 2c, K) bytes, the high bytes, then the low ones, zeros past M; x
// within +-32639 (qmax), both bytes signed, x = 256 hi + lo with hi = (x + 128) >> 8 and lo the low byte read as signed
void panel_bytes(const int16_t* xq, int64_t M, int64_t c, int64_t K, int8_t* out) {
  const int64_t panels = (M + c - 1) / c, rows = 2 * c;
  std::memset(out, 0, panels * rows * K);
  const __m512i round = _mm512_set1_epi16(128);
  for (int64_t m = 0; m < M; m++) {
    int8_t* hi = out + ((m / c) * rows + m % c) * K;
    int8_t* lo = hi + c * K;
    for (int64_t k = 0; k < K; k += 32) {
      const __m512i v = _mm512_loadu_si512(xq + m * K + k);
      _mm256_storeu_si256((__m256i*)(hi + k), _mm512_cvtepi16_epi8(_mm512_srai_epi16(_mm512_add_epi16(v, round), 8)));
      _mm256_storeu_si256((__m256i*)(lo + k), _mm512_cvtepi16_epi8(v));
    }
  }
}

// quantize_rows16's integers in AVX-512, 32 values a step, bit for bit: a row's maximum on the bits of |x| (for
// floats that are not NaN the larger value has the larger bits; inf and NaN have the largest), then its integers,
// rounded to nearest even and saturated to 16 bits as packs does. For bf16 x the even values are the 32-bit lanes
// shifted up and the odd ones the lanes masked: the integers come out in order with no shuffle. int8 on AMX takes
// them straight into its tiles' bytes (panel_bytes_x): against quantize_rows16 and a pass over its integers, 30
// layers' linears ran 0-2% faster at one row and 6-9% at five (docs/performance.md, forty-third session). int4 done
// so (its quantize_rows16, or its bytes and group sums straight from x) ran no faster: not kept.
template <typename E>
inline float row_scale(const E* r, int64_t K, __m512* inv) {  // the row's scale; 0: zeros; NaN: an inf or a NaN
  const __m512i abs_bits = _mm512_set1_epi32(0x7fffffff), odd_bits = _mm512_set1_epi32(0x7fff0000);
  __m512i mx = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 32) {
    const __m512i v = _mm512_loadu_si512(r + k);
    if (sizeof(E) == 4) {
      mx = _mm512_max_epu32(mx, _mm512_and_si512(v, abs_bits));
      mx = _mm512_max_epu32(mx, _mm512_and_si512(_mm512_loadu_si512(r + k + 16), abs_bits));
    } else {
      mx = _mm512_max_epu32(mx, _mm512_and_si512(_mm512_slli_epi32(v, 16), abs_bits));
      mx = _mm512_max_epu32(mx, _mm512_and_si512(v, odd_bits));
    }
  }
  const uint32_t bits = _mm512_reduce_max_epu32(mx);
  if (bits == 0 || bits >= 0x7f800000u) return bits ? NAN : 0.0f;
  float amax;
  std::memcpy(&amax, &bits, 4);
  *inv = _mm512_set1_ps(32767.0f / amax);
  return amax / 32767.0f;
}
template <typename E>
inline __m512i q16x32(const E* p, __m512 inv) {  // 32 values' 16-bit integers, in order
  const float* f = (const float*)p;
  if (sizeof(E) == 4) {
    const __m256i a = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(f), inv)));
    const __m256i b = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(f + 16), inv)));
    return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
  }
  const __m512i v = _mm512_loadu_si512(p), top = _mm512_set1_epi32(32767), bottom = _mm512_set1_epi32(-32768);
  const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
  const __m512i qe = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(even, inv)), top), bottom);
  const __m512i qo = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(odd, inv)), top), bottom);
  return _mm512_or_si512(_mm512_and_si512(qe, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32(qo, 16));
}

// int8's panels of c straight from x, each row's scale into xs: (panels, 2c + 1, K) bytes, a panel's c' rows (c, the
// last one's the rows left) as the high bytes of their 16-bit integers (quantize_rows16's, not written out), then
// the low ones less 128, and in the first panel a row of ones, whose sum q . 1 puts the 128 back (the same sums for
// every panel): tiles of 2c' + 1 rows, then 2c', each configured to its rows (the tiles' time grows with their rows:
// 9 to 17 rows 2-6% faster than with every panel 2c + 1 rows). Two shuffles split 32 integers into their bytes.
inline void split_bytes(__m512i q16, int8_t* hi, int8_t* lo) {  // 32 16-bit integers in order: high bytes, low ^ 128
  const __m512i within = _mm512_set4_epi32(0x0e0c0a08, 0x06040200, 0x0f0d0b09, 0x07050301);  // a lane: high, low
  const __m512i b = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7),
                                             _mm512_shuffle_epi8(q16, within));
  _mm256_storeu_si256((__m256i*)hi, _mm512_castsi512_si256(b));
  _mm256_storeu_si256((__m256i*)lo, _mm256_xor_si256(_mm512_extracti64x4_epi64(b, 1), _mm256_set1_epi8(-128)));
}
inline int64_t panel_rows(int64_t c, int64_t M, int64_t pn) {  // activation rows in panel pn of M rows in panels of c
  return std::max<int64_t>(0, std::min(c, M - pn * c));
}
template <typename E>
void panel_bytes_x(const E* x, int64_t M, int64_t c, int64_t K, float* xs, int8_t* out) {  // out: (panels, 2c + 1, K)
  const int64_t rows = 2 * c + 1;  // the bytes the tiles read are written below
  for (int64_t m = 0; m < M; m++) {
    const int64_t pn = m / c, cp = panel_rows(c, M, pn);
    int8_t* hi = out + (pn * rows + m % c) * K;
    int8_t* lo = hi + cp * K;
    __m512 inv;
    xs[m] = row_scale(x + m * K, K, &inv);
    if (!(xs[m] > 0.0f)) {  // a row of zeros, or with an inf or a NaN: integers 0
      std::memset(hi, 0, K), std::memset(lo, -128, K);
      continue;
    }
    for (int64_t k = 0; k < K; k += 32) split_bytes(q16x32(x + m * K + k, inv), hi + k, lo + k);
  }
  std::memset(out + 2 * panel_rows(c, M, 0) * K, 1, K);
}

// the B tile of 32 columns kb of a block from its 512 bytes at p (two tiles' nibbles): the low nibbles for an even kb,
// the high ones for an odd kb; the bytes 16 KB on are asked for at the first of the two
inline void int4_b_tile(const char* p, int64_t kb, uint8_t* dst) {
  if (!(kb & 1))
    for (int l = 0; l < 8; l++) _mm_prefetch(p + PREFETCH_AHEAD + 64 * l, _MM_HINT_T1);
  for (int l = 0; l < 8; l++) {
    __m512i v = _mm512_loadu_si512(p + 64 * l);
    if (kb & 1) v = _mm512_srli_epi16(v, 4);
    _mm512_store_si512(dst + 64 * l, _mm512_and_si512(v, _mm512_set1_epi8(15)));
  }
}

// add_group on the tiles' stored sums
__attribute__((always_inline)) inline __m512 add_group(__m512 acc, const int32_t* hi, const int32_t* lo, __m512 scale,
                                                       __m512 offset, float xsum) {
  return add_group(acc, _mm512_load_si512(hi), _mm512_load_si512(lo), scale, offset, xsum);
}

// one weight block (16 rows from n0) x the C activation rows m0.. of one panel (xb: its 2C + 1 rows of bytes, xsum:
// its group sums), the sums in registers; rows past M are zeros, computed and thrown away. Two groups at a time,
// each with its own A, B and C tiles: a group's chain (B's bytes stored, loaded, multiplied, the sums stored and
// read) is long, and tiles are not renamed, so one set of tiles ran the groups one after another
template <int C>
inline void amx_i4_panel(const Lin& a, const int8_t* xb, const float* xsum, int64_t m0, int64_t n0) {
  const int64_t KB = a.K / 32, per = a.G / 32;
  const char* w = a.w + (n0 / 16) * (KB / 2) * 512;  // the block: K / 64 pieces of 512 bytes
  // two groups' B tiles (G <= 256: 8 steps of 32 columns), two pairs of groups: the next pair's bytes are stored
  // before this pair's tiles load theirs, so a tile load never waits for the stores just before it to reach L1
  alignas(64) uint8_t bt[2][2][8][512];
  alignas(64) int32_t sums[2][2][16][16];  // two pairs' sums
  __m512 acc[C];
  for (int m = 0; m < C; m++) acc[m] = _mm512_setzero_ps();
  const int64_t gb = (n0 / 16) * a.groups * 16;  // the block's (groups, 16) scales and offsets from here
  auto prepare = [&](int64_t g0, uint8_t (*dst)[8][512]) {
    for (int j = 0; j < 2 && g0 + j < a.groups; j++)
      for (int64_t s = 0; s < per; s++) {
        const int64_t kb = (g0 + j) * per + s;
        int4_b_tile(w + kb / 2 * 512, kb, dst[j][s]);
      }
  };
  // the sums of a pair of groups into acc, scaled, in group order; a pair's sums are read after the next pair's
  // products are stored, when they have long reached L1 (read right after their tile store, each waited for it)
  auto scale = [&](int64_t g0, int J) {
    for (int j = 0; j < J; j++) {
      const int64_t g = g0 + j;
      const __m512 sc = group16(a.scales, gb + 16 * g, a.half_groups);
      const __m512 of = group16(a.offsets, gb + 16 * g, a.half_groups);
      for (int m = 0; m < C; m++)
        acc[m] = add_group(acc[m], sums[(g0 / 2) & 1][j][m], sums[(g0 / 2) & 1][j][C + m], sc, of, xsum[m * a.groups + g]);
    }
  };
  prepare(0, bt[0]);
  for (int64_t g0 = 0; g0 < a.groups; g0 += 2) {
    const int J = a.groups - g0 >= 2 ? 2 : 1;
    uint8_t (*cur)[8][512] = bt[(g0 / 2) & 1];
    if (g0 + 2 < a.groups) prepare(g0 + 2, bt[((g0 / 2) & 1) ^ 1]);
    _tile_zero(4);
    if (J == 2) _tile_zero(5);
    for (int64_t s = 0; s < per; s++) {
      _tile_loadd(0, xb + 32 * (g0 * per + s), a.K);
      _tile_loadd(2, cur[0][s], 64);
      _tile_dpbsud(4, 0, 2);
      if (J == 2) {
        _tile_loadd(1, xb + 32 * ((g0 + 1) * per + s), a.K);
        _tile_loadd(3, cur[1][s], 64);
        _tile_dpbsud(5, 1, 3);
      }
    }
    _tile_stored(4, sums[(g0 / 2) & 1][0], 64);
    if (J == 2) _tile_stored(5, sums[(g0 / 2) & 1][1], 64);
    if (g0 >= 2) scale(g0 - 2, 2);
  }
  const int64_t last = (a.groups - 1) / 2 * 2;
  scale(last, (int)(a.groups - last));
  const int mp = (int)std::min<int64_t>(C, a.M - m0);
  for (int m = 0; m < mp; m++) finish16(a, m0 + m, n0, acc[m]);
}

// Up to 4 rows and 32-column groups: two groups in one product. A pair of groups' A tile is 4c rows of 64 bytes, the
// c rows' high then low bytes of the first group in its first 32 columns and zeros in the next 32, the second group's
// the other way round; B is both groups' bytes, 16 rows (the 512 packed bytes' low nibbles, then their high ones),
// so one product sums each group apart (the zeros meet the other group's bytes): half the products, tile loads and
// stores of amx_i4_panel, the same integers, the same instructions after them, so the same outputs
inline void configure_tiles_i4_pairs(int c) {
  TileConfig t;
  t.rows[0] = 4 * c, t.colsb[0] = 64;  // A: a pair of groups
  t.rows[2] = 16, t.colsb[2] = 64;     // B: both groups' bytes
  t.rows[4] = 4 * c, t.colsb[4] = 64;  // C: the sums
  load_tile_config(t);
}

// rows of xq (M <= 4) as pairs of groups: (K / 64, 4M, 64) bytes, as above
void pair_bytes(const int16_t* xq, int64_t M, int64_t K, int8_t* out) {
  const int64_t rows = 4 * M;
  std::memset(out, 0, K / 64 * rows * 64);
  const __m512i round = _mm512_set1_epi16(128);
  for (int64_t m = 0; m < M; m++)
    for (int64_t k = 0; k < K; k += 32) {
      const int j = (int)((k / 32) & 1);
      const __m512i v = _mm512_loadu_si512(xq + m * K + k);
      int8_t* hi = out + ((k / 64) * rows + 2 * M * j + m) * 64 + 32 * j;
      _mm256_storeu_si256((__m256i*)hi, _mm512_cvtepi16_epi8(_mm512_srai_epi16(_mm512_add_epi16(v, round), 8)));
      _mm256_storeu_si256((__m256i*)(hi + M * 64), _mm512_cvtepi16_epi8(v));
    }
}

// one weight block (16 rows from n0) x the C <= 4 activation rows (xp: pair_bytes'), pairs of groups in turn: the
// next pair's B bytes stored and a pair's sums scaled a pair later, as in amx_i4_panel
template <int C>
inline void amx_i4_pairs(const Lin& a, const int8_t* xp, const float* xsum, int64_t n0) {
  const int64_t pairs = a.K / 64;
  const char* w = a.w + (n0 / 16) * pairs * 512;
  alignas(64) uint8_t bt[2][1024];
  alignas(64) int32_t sums[2][16][16];
  __m512 acc[C];
  for (int m = 0; m < C; m++) acc[m] = _mm512_setzero_ps();
  const int64_t gb = (n0 / 16) * a.groups * 16;
  auto prepare = [&](int64_t p, uint8_t* dst) {
    const char* src = w + p * 512;
    for (int l = 0; l < 8; l++) _mm_prefetch(src + PREFETCH_AHEAD + 64 * l, _MM_HINT_T1);
    for (int l = 0; l < 8; l++) {
      const __m512i v = _mm512_loadu_si512(src + 64 * l);
      _mm512_store_si512(dst + 64 * l, _mm512_and_si512(v, _mm512_set1_epi8(15)));
      _mm512_store_si512(dst + 512 + 64 * l, _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)));
    }
  };
  auto scale = [&](int64_t p) {
    for (int j = 0; j < 2; j++) {
      const int64_t g = 2 * p + j;
      const __m512 sc = group16(a.scales, gb + 16 * g, a.half_groups);
      const __m512 of = group16(a.offsets, gb + 16 * g, a.half_groups);
      for (int m = 0; m < C; m++)
        acc[m] = add_group(acc[m], sums[p & 1][2 * C * j + m], sums[p & 1][2 * C * j + C + m], sc, of,
                           xsum[m * a.groups + g]);
    }
  };
  prepare(0, bt[0]);
  for (int64_t p = 0; p < pairs; p++) {
    if (p + 1 < pairs) prepare(p + 1, bt[(p + 1) & 1]);
    _tile_zero(4);
    _tile_loadd(0, xp + p * 4 * C * 64, 64);
    _tile_loadd(2, bt[p & 1], 64);
    _tile_dpbsud(4, 0, 2);
    _tile_stored(4, sums[p & 1], 64);
    if (p > 0) scale(p - 1);
  }
  scale(pairs - 1);
  for (int m = 0; m < C && m < a.M; m++) finish16(a, m, n0, acc[m]);
}

// More than 7 rows: the high and the low bytes as two A tiles of up to 16 rows each (no row of ones: the low bytes
// as they are, unsigned, TDPBUUD), two blocks a step, the sums in memory; the same integers, the same instructions
// after them, so the same outputs as amx_i4_panel. (Panels of 7 in registers re-read the weights for every panel:
// 9 rows 1.2x, 17 rows 1.2x the time of this)
inline void configure_tiles_i4_wide(int cols) {
  TileConfig c;
  for (int t = 0; t <= 1; t++) c.rows[t] = cols, c.colsb[t] = 32;  // A: the high and the low bytes
  for (int t = 2; t <= 3; t++) c.rows[t] = 8, c.colsb[t] = 64;     // B: 32 columns of two weight blocks
  for (int t = 4; t <= 7; t++) c.rows[t] = cols, c.colsb[t] = 64;  // C: the high and low sums of each block
  load_tile_config(c);
}

// the activations' high (signed) and low (unsigned) bytes, (padded, K) each, zero rows past `rows`
void byte_planes(const int16_t* xq, int64_t rows, int64_t padded, int64_t K, int8_t* hi, uint8_t* lo) {
  std::memset(hi, 0, padded * K), std::memset(lo, 0, padded * K);
  for (int64_t i = 0; i < rows * K; i += 32) {
    const __m512i v = _mm512_loadu_si512(xq + i);
    _mm256_storeu_si256((__m256i*)(hi + i), _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)));
    _mm256_storeu_si256((__m256i*)(lo + i), _mm512_cvtepi16_epi8(v));
  }
}

// NB blocks of 16 weight rows from n0 x every activation row (panels of cols); acc: (M, NB, 16) fp32 sums
template <int NB>
inline void amx_i4_wide(const Lin& a, const int8_t* hi, const uint8_t* lo, const float* xsum, int cols, int64_t n0, float* acc) {
  const int64_t KB = a.K / 32, per = a.G / 32, panels = (a.M + cols - 1) / cols;
  alignas(64) uint8_t bt[2][NB][8][512];  // this group's B tiles and the next one's (stored a group ahead, as above)
  alignas(64) int32_t c[2][16][16];
  std::memset(acc, 0, a.M * NB * 16 * sizeof(float));
  auto prepare = [&](int64_t g, uint8_t (*dst)[8][512]) {
    for (int b = 0; b < NB; b++)
      for (int64_t s = 0; s < per; s++) {
        const int64_t kb = g * per + s;
        int4_b_tile(a.w + ((n0 / 16 + b) * (KB / 2) + kb / 2) * 512, kb, dst[b][s]);
      }
  };
  prepare(0, bt[0]);
  for (int64_t g = 0; g < a.groups; g++) {
    uint8_t (*cur)[8][512] = bt[g & 1];
    if (g + 1 < a.groups) prepare(g + 1, bt[(g & 1) ^ 1]);
    __m512 sc[NB], of[NB];
    for (int b = 0; b < NB; b++) {
      sc[b] = group16(a.scales, ((n0 / 16 + b) * a.groups + g) * 16, a.half_groups);
      of[b] = group16(a.offsets, ((n0 / 16 + b) * a.groups + g) * 16, a.half_groups);
    }
    for (int64_t pn = 0; pn < panels; pn++) {
      const int64_t m0 = pn * cols;
      _tile_zero(4);
      _tile_zero(5);
      if (NB == 2) {
        _tile_zero(6);
        _tile_zero(7);
      }
      for (int64_t s = 0; s < per; s++) {
        const int64_t kb = g * per + s;
        _tile_loadd(0, hi + m0 * a.K + 32 * kb, a.K);
        _tile_loadd(1, lo + m0 * a.K + 32 * kb, a.K);
        _tile_loadd(2, cur[0][s], 64);
        _tile_dpbsud(4, 0, 2);
        _tile_dpbuud(5, 1, 2);
        if (NB == 2) {
          _tile_loadd(3, cur[NB - 1][s], 64);
          _tile_dpbsud(6, 0, 3);
          _tile_dpbuud(7, 1, 3);
        }
      }
      const int64_t mp = std::min<int64_t>(cols, a.M - m0);
      for (int b = 0; b < NB; b++) {
        if (b == 0) {  // the tile numbers are immediates
          _tile_stored(4, c[0], 64);
          _tile_stored(5, c[1], 64);
        } else {
          _tile_stored(6, c[0], 64);
          _tile_stored(7, c[1], 64);
        }
        for (int64_t m = 0; m < mp; m++) {
          float* r = acc + ((m0 + m) * NB + b) * 16;
          _mm512_store_ps(r, add_group(_mm512_load_ps(r), c[0][m], c[1][m], sc[b], of[b], xsum[(m0 + m) * a.groups + g]));
        }
      }
    }
  }
  for (int64_t m = 0; m < a.M; m++)
    for (int b = 0; b < NB; b++) finish16(a, m, n0 + 16 * b, _mm512_load_ps(acc + (m * NB + b) * 16));
}

// a weight block x every panel
inline void amx_i4_block(const Lin& a, const int8_t* xb, const float* xsum, int c, int64_t n0) {
  const int64_t panels = (a.M + c - 1) / c;
  for (int64_t pn = 0; pn < panels; pn++) {
    const int8_t* x = xb + pn * 2 * c * a.K;
    const float* s = xsum + pn * c * a.groups;
    switch (c) {
      case 1: amx_i4_panel<1>(a, x, s, pn * c, n0); break;
      case 2: amx_i4_panel<2>(a, x, s, pn * c, n0); break;
      case 3: amx_i4_panel<3>(a, x, s, pn * c, n0); break;
      case 4: amx_i4_panel<4>(a, x, s, pn * c, n0); break;
      case 5: amx_i4_panel<5>(a, x, s, pn * c, n0); break;
      case 6: amx_i4_panel<6>(a, x, s, pn * c, n0); break;
      default: amx_i4_panel<7>(a, x, s, pn * c, n0); break;
    }
  }
}

void run_amx_i4(const Lin& a) {  // int4 in tall blocks; a.xq, a.xs: the rows rounded to 16 bits, columns in order
  const int64_t blocks = a.N / 16;
  const int64_t grain = std::max<int64_t>(1, 65536 / 8 / std::max<int64_t>(a.K, 1));
  static thread_local std::vector<int8_t> xbytes;
  static thread_local std::vector<uint8_t> xlow;
  static thread_local std::vector<float> xsum;
  for (int64_t p0 = 0; p0 < a.M; p0 += 64) {
    Lin p = a;  // rows p0.. of the input and the output
    p.M = std::min<int64_t>(64, a.M - p0);
    p.xs = a.xs + p0;
    p.out = (char*)a.out + p0 * a.N * (a.out_bf16 ? 2 : 4);
    if (a.res) p.res = (const char*)a.res + p0 * a.N * (a.out_bf16 ? 2 : 4);
    const bool wide = p.M > PANEL_ROWS;
    const int64_t most = wide ? 16 : PANEL_ROWS, panels = (p.M + most - 1) / most;
    const int c = (int)((p.M + panels - 1) / panels);  // 17 rows: panels of 9 and 8, not 16 and 1
    const bool in_pairs = a.G == 32 && p.M <= 4;  // two groups a product (amx_i4_pairs)
    // this thread's buffers (a worker's would be its own), 64-byte aligned
    int8_t* const xb = scratch64(xbytes, wide ? panels * c * a.K : in_pairs ? 4 * p.M * a.K : (p.M + c - 1) / c * 2 * c * a.K);
    uint8_t* const xl = wide ? scratch64(xlow, panels * c * a.K) : nullptr;
    if (wide) byte_planes(a.xq + p0 * a.K, p.M, panels * c, a.K, xb, xl);
    else if (in_pairs) pair_bytes(a.xq + p0 * a.K, p.M, a.K, xb);
    else panel_bytes(a.xq + p0 * a.K, p.M, c, a.K, xb);
    xsum.assign(panels * c * a.groups, 0.0f);  // padding rows: zeros
    group_sums(a, a.xq + p0 * a.K, p.M, xsum.data());
    const float* xs = xsum.data();
    if (in_pairs) {
      at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
        configure_tiles_i4_pairs(c);
        for (int64_t b = b0; b < b1; b++) {
          switch (c) {
            case 1: amx_i4_pairs<1>(p, xb, xs, 16 * b); break;
            case 2: amx_i4_pairs<2>(p, xb, xs, 16 * b); break;
            case 3: amx_i4_pairs<3>(p, xb, xs, 16 * b); break;
            default: amx_i4_pairs<4>(p, xb, xs, 16 * b); break;
          }
        }
        _tile_release();
      });
      continue;
    }
    if (!wide) {
      at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
        configure_tiles_i4(2 * c);
        for (int64_t b = b0; b < b1; b++) amx_i4_block(p, xb, xs, c, 16 * b);
        _tile_release();
      });
      continue;
    }
    const int64_t nb = blocks % 2 == 0 ? 2 : 1;
    at::parallel_for(0, blocks / nb, std::max<int64_t>(1, grain / nb), [&](int64_t b0, int64_t b1) {
      configure_tiles_i4_wide(c);
      alignas(64) float acc[64 * 2 * 16];
      for (int64_t b = b0; b < b1; b++) {
        if (nb == 2) amx_i4_wide<2>(p, xb, xl, xs, c, 32 * b, acc);
        else amx_i4_wide<1>(p, xb, xl, xs, c, 16 * b, acc);
      }
      _tile_release();
    });
  }
}

inline void configure_tiles_i8_tall(const int* rows) {  // rows: each panel's A tile's (panel_bytes_x)
  TileConfig c;
  c.rows[0] = 16, c.colsb[0] = 64;  // B: 64 columns of 16 weight rows
  for (int t = 1; t <= 3; t++) c.rows[t] = rows[t - 1], c.colsb[t] = 64;  // A: up to 3 panels
  for (int t = 4; t <= 6; t++) c.rows[t] = rows[t - 4], c.colsb[t] = 64;  // C: their sums
  load_tile_config(c);
}

// int8 weights in tall blocks take the tiles the int4 way round: pack lays them out as B tiles (16 weight rows x 64
// columns, 1 KB: byte (r, n, j) is column 4r + j of row n, the VNNI order), read straight from the weight stream;
// a panel of c <= 7 activation rows is one A tile of 2c + 1 rows (high bytes, low bytes less 128, a row of ones:
// panel_bytes_x) and up to 3 panels go in one pass over the weights. No groups: the sums stay in the tiles for the
// whole of K, one TDPBSSD per 64 columns and panel, one store per block and panel at the end; x . w = 256 hi . w +
// lo' . w + 128 w . 1 in double (exact), rounded to fp32 once: the exact integer dot product, as before. With the
// weights as A (16 rows a product whatever M, two products per 32 columns) the products were the bound.
// int4i weights (pack_int4i) in tall blocks: int8 weights whose 32-column groups each hold 16 evenly spaced values,
// w = q * nibble + z (q 1..17, z and w within int8), times one scale a row. A block's 64 columns are 576 bytes: the
// nibbles as int4's tiles (512 bytes: the first 32 columns in the low nibbles, the next 32 in the high ones), then
// each group's 16 q's and 16 z's. Each step's B tile (1 KB of int8, the VNNI order) is made in L1 a step before its
// tile load reads it, then multiplied as int8 weights are: the same integers as the int8 weights q * nibble + z
// packed as int8 (tests/test_kernels.py), a sum over the whole of K in the tiles, no per-group scaling. The 4 bytes
// of a 32-bit lane are one weight row's, so one 16-bit multiply by q scales both of a lane half's nibbles (q *
// nibble <= 255 stays in its byte).
inline void int4i_b_tile(const char* p, uint8_t* dst) {
  const __m128i* qz = (const __m128i*)(p + 512);
  __m512i step[2], base[2];
  for (int h = 0; h < 2; h++) {
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(qz + 2 * h));
    const __m512i z = _mm512_cvtepu8_epi32(_mm_loadu_si128(qz + 2 * h + 1));
    step[h] = _mm512_or_si512(q, _mm512_slli_epi32(q, 16));
    const __m512i z2 = _mm512_or_si512(z, _mm512_slli_epi32(z, 8));
    base[h] = _mm512_or_si512(z2, _mm512_slli_epi32(z2, 16));
  }
  const __m512i low = _mm512_set1_epi8(15);
  for (int l = 0; l < 8; l++) {
    const __m512i v = _mm512_loadu_si512(p + 64 * l);
    const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    _mm512_store_si512(dst + 64 * l, _mm512_add_epi8(_mm512_mullo_epi16(lo, step[0]), base[0]));
    _mm512_store_si512(dst + 64 * (8 + l), _mm512_add_epi8(_mm512_mullo_epi16(hi, step[1]), base[1]));
  }
}

// P panels' sums in C tiles 4..3+P: zeroed, then one 64-column step kp of each panel (A tiles 1..3) times the B tile 0
template <int P>
inline void zero_panel_sums() {
  _tile_zero(4);
  if (P > 1) _tile_zero(5);
  if (P > 2) _tile_zero(6);
}
template <int P>
inline void panel_products(const Lin& a, const int8_t* xb, int64_t prow, int64_t kp) {
  _tile_loadd(1, xb + 64 * kp, a.K);
  _tile_dpbssd(4, 1, 0);
  if (P > 1) {
    _tile_loadd(2, xb + prow + 64 * kp, a.K);
    _tile_dpbssd(5, 2, 0);
  }
  if (P > 2) {
    _tile_loadd(3, xb + 2 * prow + 64 * kp, a.K);
    _tile_dpbssd(6, 3, 0);
  }
}

template <int P>
inline void amx_i4i_products(const Lin& a, const int8_t* xb, int c, int64_t n0) {
  const int64_t KP = a.K / 64, prow = (2 * c + 1) * a.K;
  const char* w = a.w + (n0 / 16) * KP * 576;
  alignas(64) uint8_t bt[2][1024];  // this step's B tile and the next one's
  zero_panel_sums<P>();
  int4i_b_tile(w, bt[0]);
  for (int64_t kp = 0; kp < KP; kp++) {
    if (kp + 1 < KP) int4i_b_tile(w + (kp + 1) * 576, bt[(kp + 1) & 1]);
    if (a.ahead_lines)
      for (int l = 0; l < 9; l++) _mm_prefetch(w + kp * 576 + PREFETCH_AHEAD + 64 * l, _MM_HINT_T1);
    _tile_loadd(0, bt[kp & 1], 64);
    panel_products<P>(a, xb, prow, kp);
  }
}

template <int P>
inline void amx_i8_tall_products(const Lin& a, const int8_t* xb, int c, int64_t n0) {
  if (a.int4i) return amx_i4i_products<P>(a, xb, c, n0);
  const int64_t KP = a.K / 64, prow = (2 * c + 1) * a.K;
  const char* w = a.w + (n0 / 16) * KP * 1024;
  zero_panel_sums<P>();
  for (int64_t kp = 0; kp < KP; kp++) {
    const char* p = w + kp * 1024;
    if (a.ahead_lines)
      for (int l = 0; l < 16; l++) _mm_prefetch(p + PREFETCH_AHEAD + 64 * l, _MM_HINT_T1);
    _tile_loadd(0, p, 64);
    panel_products<P>(a, xb, prow, kp);
  }
}

// panel pn's outputs of block n0 from its sums (its mp rows' high bytes', low bytes') and the first panel's sums of
// the row of ones, each rounded once
inline void amx_i8_tall_finish(const Lin& a, const int32_t (*sums)[16], const int32_t* ones_sums, int c, int64_t m0,
                               int pn, int64_t n0) {
  const int64_t mp = panel_rows(c, a.M - m0, pn);
  __m512d ones[2];  // 128 w . 1, the block's for every row; each sum exact in double (below 2^53), in any order
  for (int h = 0; h < 2; h++)
    ones[h] = _mm512_mul_pd(_mm512_cvtepi32_pd(_mm256_load_si256((const __m256i*)(ones_sums + 8 * h))),
                            _mm512_set1_pd(128.0));
  for (int64_t m = 0; m < mp; m++) {
    __m256 t[2];
    for (int h = 0; h < 2; h++) {
      const __m512d hi = _mm512_cvtepi32_pd(_mm256_load_si256((const __m256i*)(sums[m] + 8 * h)));
      const __m512d lo = _mm512_cvtepi32_pd(_mm256_load_si256((const __m256i*)(sums[mp + m] + 8 * h)));
      t[h] = _mm512_cvtpd_ps(_mm512_add_pd(_mm512_fmadd_pd(hi, _mm512_set1_pd(256.0), lo), ones[h]));
    }
    finish16(a, m0 + pn * c + m, n0, _mm512_insertf32x8(_mm512_castps256_ps512(t[0]), t[1], 1));
  }
}

template <typename E>
void run_amx_i8_tall(const Lin& a, const E* x, float* xs) {  // x (M, K) fp32 or bf16; xs: the rows' scales, a.xs
  const int64_t blocks = a.N / 16;
  const int64_t grain = std::max<int64_t>(1, 65536 / 16 / std::max<int64_t>(a.K, 1));
  static thread_local std::vector<int8_t> xbytes;
  for (int64_t p0 = 0; p0 < a.M; p0 += 3 * PANEL_ROWS) {  // up to 21 rows a pass over the weights
    const int64_t rows = std::min<int64_t>(3 * PANEL_ROWS, a.M - p0);
    const int64_t panels = (rows + PANEL_ROWS - 1) / PANEL_ROWS;
    const int c = (int)((rows + panels - 1) / panels);  // 9 rows: panels of 5 and 4, not 7 and 2
    int8_t* const xb = scratch64(xbytes, panels * (2 * c + 1) * a.K);  // this thread's (a worker's would be its own)
    panel_bytes_x(x + p0 * a.K, rows, c, a.K, xs + p0, xb);
    int tile_rows[3];  // panel_bytes_x's: 2c' + 1 in the first panel, 2c' after it (unused panels: a valid 2)
    for (int pn = 0; pn < 3; pn++) tile_rows[pn] = 2 * (int)std::max<int64_t>(1, panel_rows(c, rows, pn)) + (pn == 0);
    at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
      configure_tiles_i8_tall(tile_rows);
      // one panel: a block's outputs are finished after the next block's products, when its tile store has reached
      // L1 (read right after the store, each load waited for it: 5 rows 3-8% slower); 2-3 panels (9+ rows) store
      // and finish panel by panel, as before (finished a block later, 17 rows measured 1-14% slower in one run)
      alignas(64) int32_t sums[2][16][16];
      alignas(64) int32_t ones_sums[16];  // the first panel's, for the others
      for (int64_t b = b0; b < b1; b++) {
        if (panels == 1) {
          amx_i8_tall_products<1>(a, xb, c, 16 * b);
          store_sums(0, &sums[b & 1][0][0]);
          if (b > b0) amx_i8_tall_finish(a, sums[(b & 1) ^ 1], sums[(b & 1) ^ 1][2 * c], c, p0, 0, 16 * (b - 1));
          continue;
        }
        if (panels == 2) amx_i8_tall_products<2>(a, xb, c, 16 * b);
        else amx_i8_tall_products<3>(a, xb, c, 16 * b);
        for (int pn = 0; pn < panels; pn++) {
          store_sums(pn, &sums[0][0][0]);
          if (pn == 0) std::memcpy(ones_sums, sums[0][2 * c], sizeof(ones_sums));
          amx_i8_tall_finish(a, sums[0], ones_sums, c, p0, pn, 16 * b);
        }
      }
      if (panels == 1 && b1 > b0)
        amx_i8_tall_finish(a, sums[(b1 - 1) & 1], sums[(b1 - 1) & 1][2 * c], c, p0, 0, 16 * (b1 - 1));
      _tile_release();
    });
  }
}
#pragma GCC pop_options
#else
void run_amx(const Lin&) {}  // never called: amx_usable() is false
void run_amx_bf16_tall(const Lin&) {}
void run_amx_i4(const Lin&) {}
template <typename E>
void run_amx_i8_tall(const Lin&, const E*, float*) {}
#endif

// exp of a vector: Cody-Waite range reduction and a degree-6 polynomial (~1 ulp); large negatives go to ~0
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

inline float softmax_numerators512(float* s, int64_t n) {  // s[i] = exp(s[i] - max); returns their sum
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < n; i += 16) {
    __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
    mx = _mm512_mask_max_ps(mx, m, mx, _mm512_maskz_loadu_ps(m, s + i));
  }
  const __m512 vmax = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
    __m512 e = _mm512_maskz_mov_ps(m, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + i), vmax)));
    _mm512_mask_storeu_ps(s + i, m, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

#pragma GCC pop_options

// ------------------------------------------------------------------------------------------------ AVX2
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

// 8 weights of the row at p (its 32 columns from some 32 * kb): piece s (0..3) as fp32 (bf16 and int4: pieces 0-1
// evens, 2-3 odds; bf16 pairs split in place, the even one of each 32-bit lane by a shift, the odd one by a mask: one
// instruction per 8 weights, where widening 8 bf16 to 8 lanes took two, one of them a lane-crossing shuffle; int4
// nibbles times the row's group scale plus its offset)
template <int WT>
inline __m256 wload256(const char* p, int s, __m256 scale, __m256 offset) {
  if (WT == W_F32) return _mm256_loadu_ps((const float*)p + 8 * s);
  if (WT == W_BF16) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)(p + 32 * (s & 1)));
    return _mm256_castsi256_ps(s < 2 ? _mm256_slli_epi32(v, 16) : _mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
  }
  __m128i b = _mm_loadl_epi64((const __m128i*)(p + 8 * (s & 1)));
  if (s >= 2) b = _mm_srli_epi16(b, 4);
  b = _mm_and_si128(b, _mm_set1_epi8(15));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), scale, offset);
}

inline __m128 reduce4_256(__m256 a, __m256 b, __m256 c, __m256 d) {
  __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));  // per 128-bit half: a, b, c, d
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

inline float max1_256(__m256 v) {  // the largest of the 8 lanes (any order: max is exact)
  float lanes[8], mx = -INFINITY;
  _mm256_storeu_ps(lanes, v);
  for (int j = 0; j < 8; j++) mx = std::max(mx, lanes[j]);
  return mx;
}

inline float reduce1_256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// the AVX2 kernels' rows of one block: 1-2 activation rows against its 4 weight rows at once (Kernel::block), 3-6
// against weight rows 0-1, then 2-3 (Kernel::pair), so that the accumulators fit the 16 registers; each vector's
// lanes are summed by reduce4_256's own tree whatever the other three are, so a row is the same as block<1>'s
template <class Kernel, int MB>
inline void pairs(const Lin& a, int64_t m0, int64_t n0) {
  __m256 lanes[MB][4];
  Kernel::template pair<MB>(a, m0, n0, 0, lanes);
  Kernel::template pair<MB>(a, m0, n0, 2, lanes);
  for (int i = 0; i < MB; i++) finish4(a, m0 + i, n0, reduce4_256(lanes[i][0], lanes[i][1], lanes[i][2], lanes[i][3]));
}
template <class Kernel>
inline void rows_of_block(const Lin& a, int64_t m0, int mb, int64_t n0) {
  switch (mb) {
    case 1: Kernel::template block<1>(a, m0, n0); break;
    case 2: Kernel::template block<2>(a, m0, n0); break;
    case 3: pairs<Kernel, 3>(a, m0, n0); break;
    case 4: pairs<Kernel, 4>(a, m0, n0); break;
    case 5: pairs<Kernel, 5>(a, m0, n0); break;
    default: pairs<Kernel, 6>(a, m0, n0); break;
  }
}

template <int WT>
struct Kernel256 {  // fp32 multiply-adds, 8 columns a step (16 registers: at most 2 activation rows x 4); int8: KernelI8
  // A block row's bytes (the next row of a block starts this far on), and where row n0's 32 columns from 32 * kb
  // start: a step from its first ones, so the loops below keep a pointer rather than redo Lin::row's arithmetic
  // (the compiler kept those products and spilled accumulators: one int8 row pass ran at half the speed)
  static constexpr int64_t BB = WT == W_F32 ? 128 : WT == W_BF16 ? 64 : 32;
  static inline int64_t step(int64_t kb) { return WT == W_I4 ? (kb >> 1) * 4 * BB + (kb & 1) * 16 : kb * 4 * BB; }
  static inline void group(const Lin& a, int64_t n, int64_t kb, __m256& scale, __m256& offset) {  // int4 only
    if (WT != W_I4) return;
    const int64_t g = n * a.groups + ((32 * kb) >> a.gshift);
    scale = _mm256_set1_ps(a.scales[g]), offset = _mm256_set1_ps(a.offsets[g]);
  }
  template <int MB>
  static inline void block(const Lin& a, int64_t m0, int64_t n0) {
    __m256 acc[MB][4], sc[4], of[4];
    for (int i = 0; i < MB; i++)
      for (int j = 0; j < 4; j++) acc[i][j] = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) sc[j] = of[j] = _mm256_setzero_ps();
    const char* w0 = a.row(n0, 0);
    const float* x = a.xf + m0 * a.K;
    for (int64_t kb = 0; kb < a.K / 32; kb++) {
      if (a.ahead_lines) prefetch_ahead(a, n0, kb);
      const char* p = w0 + step(kb);
      for (int j = 0; j < 4; j++) group(a, n0 + j, kb, sc[j], of[j]);
#pragma GCC unroll 4
      for (int s = 0; s < 4; s++) {
        __m256 w[4];
        for (int j = 0; j < 4; j++) w[j] = wload256<WT>(p + j * BB, s, sc[j], of[j]);
        for (int i = 0; i < MB; i++) {
          __m256 xv = _mm256_loadu_ps(x + i * a.K + 32 * kb + 8 * s);
          for (int j = 0; j < 4; j++) acc[i][j] = _mm256_fmadd_ps(xv, w[j], acc[i][j]);
        }
      }
    }
    for (int i = 0; i < MB; i++) finish4(a, m0 + i, n0, reduce4_256(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
  }
  // 2+ activation rows: weight rows j0, j0+1 of the block against MB rows (2 x MB accumulators), so each weight vector
  // is converted once for all of them. With 4 weight rows only 2 activation rows fit the 16 registers, and 5 rows
  // converted every weight 3 times: 2.7x one row's time (forced AVX2 on Emerald Rapids). Each output sums the same
  // products in the same order as block<1>, and pairs sums the two passes' lanes by one reduce4_256, as block<1>
  template <int MB>
  static inline void pair(const Lin& a, int64_t m0, int64_t n0, int j0, __m256 (*lanes)[4]) {
    __m256 acc[MB][2], sc0 = _mm256_setzero_ps(), of0 = sc0, sc1 = sc0, of1 = sc0;
    for (int i = 0; i < MB; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    const char* w0 = a.row(n0 + j0, 0);
    const float* x = a.xf + m0 * a.K;
    for (int64_t kb = 0; kb < a.K / 32; kb++) {
      if (a.ahead_lines && j0 == 0) prefetch_ahead(a, n0, kb);
      const char* p = w0 + step(kb);
      group(a, n0 + j0, kb, sc0, of0);
      group(a, n0 + j0 + 1, kb, sc1, of1);
#pragma GCC unroll 4
      for (int s = 0; s < 4; s++) {
        const __m256 w0v = wload256<WT>(p, s, sc0, of0), w1v = wload256<WT>(p + BB, s, sc1, of1);
#pragma GCC unroll 8
        for (int i = 0; i < MB; i++) {
          __m256 xv = _mm256_loadu_ps(x + i * a.K + 32 * kb + 8 * s);
          asm("" : "+x"(xv));  // a register: GCC folded the load into both multiply-adds, 12 loads for 10 of them
          acc[i][0] = _mm256_fmadd_ps(xv, w0v, acc[i][0]);
          acc[i][1] = _mm256_fmadd_ps(xv, w1v, acc[i][1]);
        }
      }
    }
    for (int i = 0; i < MB; i++) lanes[i][j0] = acc[i][0], lanes[i][j0 + 1] = acc[i][1];
  }
  static constexpr int WIDE = 1;  // 8 weight rows at one activation row were slower here (AVX2 build on Intel)
  static constexpr int MAX_MB = 6;
  static void rows(const Lin& a, int64_t m0, int mb, int64_t n0, int nb) { rows_of_block<Kernel256>(a, m0, mb, n0); }
};

// int8 weights on AVX2: the activations rounded to 16-bit integers, a scale per row (quantize_rows16), and each
// product summed exactly in 32-bit integer lanes by vpmaddwd, 16 multiply-adds an instruction where an fp32 FMA does
// 8 (the weights sign-extended once for all rows, not converted to fp32). Integer sums are exact, so a row's lanes
// are the same whatever M is; each lane goes to fp32 after at most 4096 columns (256 pairs of at most 2 x 32767 x
// 128: no overflow), and the lanes to one sum by reduce4_256, as the fp32 kernels do.
// The accumulators are named variables, each sum added by an asm of one vpaddd: in an array, or with the adds as
// intrinsics, GCC summed a step's two products first (integers may be regrouped), loaded a step ahead and kept
// the accumulators on the stack, a load and a store each a step (a Zen 3, 5 rows, weights hot in L1: 50 against 78
// GMAC/s a core).
#define I8_ADD(acc, p) asm("vpaddd %1, %0, %0" : "+x"(acc) : "x"(p))
// With AVX-VNNI (KernelI8<true>) one vpdpwssd does both: the same wrapping 32-bit integer sums, so the same bits, in
// half the instructions of the five-row steps (VEX-encoded by hand: no compiler flag, and CPUs with AVX-VNNI but no
// AVX-512 run it)
#define I8_MADD(acc, x, w)                                                          \
  do {                                                                              \
    if constexpr (VNNI && EAGLE_AMX) asm("%{vex%} vpdpwssd %2, %1, %0" : "+x"(acc) : "x"(x), "x"(w)); \
    else I8_ADD(acc, _mm256_madd_epi16(x, w));                                      \
  } while (0)
template <bool VNNI>
struct KernelI8 {
  static constexpr int64_t BB = 32, CHUNK = 128;  // a block row's bytes; 32-column steps summed as integers at a time
  // the weight stream 2 KB ahead into L1 rather than 16 KB into L2 (prefetch_ahead): the linears of an int8
  // forward on a Zen 3, 15 interleaved rounds: one row 6.35 -> 5.87 ms, five rows 8.79 -> 8.33
  static constexpr int64_t NEAR = 2048;
  static inline void prefetch_near(const Lin& a, int64_t n0, int64_t kb) {
    const char* p = a.w + ((n0 - a.n_base) / 4 * (a.K / 32) + kb) * 128 + NEAR;
    _mm_prefetch(p, _MM_HINT_T0), _mm_prefetch(p + 64, _MM_HINT_T0);
  }
  static inline void to_sum(float* sum, __m256i acc, int64_t c0) {  // a chunk's integer lanes into the fp32 ones
    const __m256 f = _mm256_cvtepi32_ps(acc);
    _mm256_store_ps(sum, c0 ? _mm256_add_ps(_mm256_load_ps(sum), f) : f);
  }
  // 1-2 rows against the block's 4 weight rows
  template <int MB>
  static inline void block(const Lin& a, int64_t m0, int64_t n0) {
    alignas(32) float sum[MB][4][8];
    const char* w0 = a.row(n0, 0);
    const int16_t* x = a.xq + m0 * a.K;
    const int64_t KB = a.K / 32;
    for (int64_t c0 = 0; c0 < KB; c0 += CHUNK) {
      const __m256i z = _mm256_setzero_si256();
      __m256i a00 = z, a01 = z, a02 = z, a03 = z, a10 = z, a11 = z, a12 = z, a13 = z;
      for (int64_t kb = c0; kb < std::min(KB, c0 + CHUNK); kb++) {
        if (a.ahead_lines) prefetch_near(a, n0, kb);
        const char* p = w0 + kb * 4 * BB;
#pragma GCC unroll 2
        for (int s = 0; s < 2; s++) {
          __m256i w[4];
          for (int j = 0; j < 4; j++) w[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(p + j * BB + 16 * s)));
          __m256i x0 = _mm256_loadu_si256((const __m256i*)(x + 32 * kb + 16 * s));
          asm("" : "+x"(x0));
          I8_MADD(a00, x0, w[0]); I8_MADD(a01, x0, w[1]); I8_MADD(a02, x0, w[2]); I8_MADD(a03, x0, w[3]);
          if (MB > 1) {
            __m256i x1 = _mm256_loadu_si256((const __m256i*)(x + a.K + 32 * kb + 16 * s));
            asm("" : "+x"(x1));
            I8_MADD(a10, x1, w[0]); I8_MADD(a11, x1, w[1]); I8_MADD(a12, x1, w[2]); I8_MADD(a13, x1, w[3]);
          }
        }
      }
      const __m256i acc[2][4] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}};
      for (int i = 0; i < MB; i++)
        for (int j = 0; j < 4; j++) to_sum(sum[i][j], acc[i][j], c0);
    }
    for (int i = 0; i < MB; i++)
      finish4(a, m0 + i, n0, reduce4_256(_mm256_load_ps(sum[i][0]), _mm256_load_ps(sum[i][1]),
                                         _mm256_load_ps(sum[i][2]), _mm256_load_ps(sum[i][3])));
  }
  // 3-6 rows: weight rows j0, j0 + 1 against MB rows, as Kernel256::pair (each output's lanes and their sum as block's)
  template <int MB>
  static inline void pair(const Lin& a, int64_t m0, int64_t n0, int j0, __m256 (*lanes)[4]) {
    alignas(32) float sum[MB][2][8];
    const char* w0 = a.row(n0 + j0, 0);
    const int16_t* x = a.xq + m0 * a.K;
    const int64_t KB = a.K / 32;
    // the block is read twice (weight rows 0-1, then 2-3, the second time from L1): one line a step of either pass
    // (half a block a pass), starting half a block + 2 KB past the block's start, keeps DRAM as busy in the second
    // pass as in the first. The pointer is set here: computed from Lin's fields each step, it was 14 of a step's 68
    // instructions (five rows 5% slower)
    const char* ahead = a.ahead_lines ? a.row(n0, 0) + (2 + j0) * KB * 32 + NEAR : nullptr;
    for (int64_t c0 = 0; c0 < KB; c0 += CHUNK) {
      const __m256i z = _mm256_setzero_si256();
      __m256i a00 = z, a01 = z, a10 = z, a11 = z, a20 = z, a21 = z, a30 = z, a31 = z, a40 = z, a41 = z, a50 = z, a51 = z;
      for (int64_t kb = c0; kb < std::min(KB, c0 + CHUNK); kb++) {
        if (ahead) _mm_prefetch(ahead + kb * 64, _MM_HINT_T0);
        const char* p = w0 + kb * 4 * BB;
#pragma GCC unroll 2
        for (int s = 0; s < 2; s++) {
          const __m256i w0v = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(p + 16 * s)));
          const __m256i w1v = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(p + BB + 16 * s)));
#define I8_ROW(i)                                                                                     \
          if (MB > i) {                                                                               \
            __m256i xv = _mm256_loadu_si256((const __m256i*)(x + i * a.K + 32 * kb + 16 * s));        \
            asm("" : "+x"(xv)); /* one load: GCC folded it into both products */                     \
            I8_MADD(a##i##0, xv, w0v); I8_MADD(a##i##1, xv, w1v);                                      \
          }
          I8_ROW(0) I8_ROW(1) I8_ROW(2) I8_ROW(3) I8_ROW(4) I8_ROW(5)
#undef I8_ROW
        }
      }
      const __m256i acc[6][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}};
      for (int i = 0; i < MB; i++)
        for (int j = 0; j < 2; j++) to_sum(sum[i][j], acc[i][j], c0);
    }
    for (int i = 0; i < MB; i++) lanes[i][j0] = _mm256_load_ps(sum[i][0]), lanes[i][j0 + 1] = _mm256_load_ps(sum[i][1]);
  }
  static constexpr int WIDE = 1;
  static constexpr int MAX_MB = 6;
  static void rows(const Lin& a, int64_t m0, int mb, int64_t n0, int nb) { rows_of_block<KernelI8>(a, m0, mb, n0); }
};
#undef I8_MADD
#undef I8_ADD

// Each row x ~ q * scale: scale = max |x| / 32767, q = x / scale rounded to nearest even (as torch.round); a row
// of zeros gets scale 0, a row with an inf or a NaN scale NaN (its outputs NaN, as the float sums would be).
// x (M, K) in fp32 or bf16 (E), read where it lies
template <typename E>
inline __m256 xload(const E* p) {
  if (sizeof(E) == 4) return _mm256_loadu_ps((const float*)p);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
template <typename E>
void quantize_rows16(const E* x, int64_t M, int64_t K, int16_t* q, float* scale, float qmax = 32767.0f) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t m = 0; m < M; m++) {
    const E* r = x + m * K;
    int16_t* qr = q + m * K;
    __m256 mx = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
      const __m256 v = _mm256_and_ps(xload(r + k), abs_mask);
      bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      mx = _mm256_max_ps(mx, v);
    }
    const float amax = max1_256(mx);
    const bool finite = !_mm256_movemask_ps(bad) && !std::isinf(amax);
    if (!finite || amax == 0.0f) {
      scale[m] = finite ? 0.0f : NAN;
      std::memset(qr, 0, K * sizeof(int16_t));
      continue;
    }
    scale[m] = amax / qmax;
    const __m256 inv = _mm256_set1_ps(qmax / amax);
    for (int64_t k = 0; k < K; k += 16) {  // cvtps rounds to nearest even; packs saturates at +-32767.x -> +-32767
      const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(xload(r + k), inv));
      const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(xload(r + k + 8), inv));
      _mm256_storeu_si256((__m256i*)(qr + k), _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8));
    }
  }
}

inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float softmax_numerators256(float* s, int64_t n) {
  __m256 vmx = _mm256_set1_ps(-INFINITY);  // the maximum 8 lanes at a time (a scalar loop was a tenth of a row's time)
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) vmx = _mm256_max_ps(vmx, _mm256_loadu_ps(s + i));
  float mx = max1_256(vmx);
  for (; i < n; i++) mx = std::max(mx, s[i]);
  const __m256 vmax = _mm256_set1_ps(mx);
  __m256 sum = _mm256_setzero_ps();
  for (i = 0; i + 8 <= n; i += 8) {  // whole vectors in place; the last few through a buffer, the rest masked off
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + i), vmax));
    _mm256_storeu_ps(s + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  if (i < n) {
    float buf[8];
    const int64_t len = n - i;
    for (int64_t j = 0; j < 8; j++) buf[j] = j < len ? s[i + j] : -INFINITY;
    __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(buf), vmax));
    const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)len), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    e = _mm256_and_ps(e, _mm256_castsi256_ps(lanes));
    _mm256_storeu_ps(buf, e);
    for (int64_t j = 0; j < len; j++) s[i + j] = buf[j];
    sum = _mm256_add_ps(sum, e);
  }
  return reduce1_256(sum);
}

// 8-bit activations on AVX2 (the .a8 variants, as KernelI4a8 and KernelI8a8 on AVX-512 VNNI): x rounded by
// quantize_groups8's rule, the same tall blocks (pack(..., act_bits=8) lays them out on these builds too), half a
// 64-byte line (8 weight rows x 4 columns) a register, the same integer sums S a (row, group) and the same fp32 steps
// on them in group order, so the same bits as the AVX-512 builds. AVX2 has no vpdpbusd: vpmaddubsw multiplies
// unsigned by signed bytes into pairs of 16-bit sums (saturating), and vpmaddwd by ones widens those to 32 bits.
// x rounded as quantize_groups8 does (the same words, scales and sums), with AVX2
template <typename E>
void quantize_groups8_256(const E* x, int64_t M, int64_t K, int32_t* xw, float* gs, float* gsum, int32_t* gcorr) {
  const int64_t groups = K / 32;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // packs' lanes back into column order
  for (int64_t m = 0; m < M; m++)
    for (int64_t g = 0; g < groups; g++) {
      const E* r = x + m * K + 32 * g;
      __m256 v[4], mx = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
      for (int j = 0; j < 4; j++) {
        v[j] = xload(r + 8 * j);
        const __m256 u = _mm256_and_ps(v[j], abs_mask);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(u, u, _CMP_UNORD_Q));
        mx = _mm256_max_ps(mx, u);
      }
      const float amax = max1_256(mx);
      const bool nan = _mm256_movemask_ps(bad) != 0;
      const int64_t at = g * M + m;
      alignas(32) int32_t words[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (nan || std::isinf(amax) || amax == 0.0f) {
        gs[at] = gsum[at] = amax == 0.0f && !nan ? 0.0f : NAN;
        gcorr[at] = 0;
      } else {
        const __m256 inv = _mm256_set1_ps(127.0f / amax);
        __m256i q[4];
        for (int j = 0; j < 4; j++) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));  // |q| <= 127
        const float s = amax / 127.0f;
        gs[at] = s;
        const __m256i t = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        alignas(32) int32_t lanes[8];
        _mm256_store_si256((__m256i*)lanes, t);
        int32_t qsum = 0;
        for (int j = 0; j < 8; j++) qsum += lanes[j];
        gsum[at] = s * (float)qsum;
        gcorr[at] = -128 * qsum;
        const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_store_si256((__m256i*)words, _mm256_permutevar8x32_epi32(b, order));
      }
      for (int j = 0; j < 8; j++) xw[(8 * g + j) * M + m] = words[j];
    }
}

// group16's 8 values from element i, on AVX2 (F16C)
__attribute__((always_inline)) inline __m256 group8(const float* p, int64_t i, bool half) {
  return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)p + i))) : _mm256_loadu_ps(p + i);
}

// int4 groups of 32 (_int4_tiles): a line's low nibbles are group g's 4 columns of 16 weight rows, its high ones
// group g + 1's. Per row and group, 8 lines of vpmaddubsw (nibble x signed byte: a pair at most 2 x 15 x 127) summed
// in 16 bits (8 pairs at most 30480: no saturation, exact), then vpmaddwd by ones: S. Up to 2 rows both groups and
// both halves of a line (weight rows 0-7 and 8-15) in one pass; up to 5 a group at a time (the line read again for
// the odd group, from L1), both halves with one broadcast of x; more one half at a time (8 rows a pass, one sum a
// row). Both groups and halves at 5 rows spilled sums (1.86x one row's time there)
struct KernelI4a8x256 {
  static constexpr int MOST = 8;
  template <int MB>
  static void block(const Lin& a, int64_t m0, int64_t n0, const int32_t* xw, const float* gs, const float* gsum) {
    constexpr int P = MB <= 2 ? 2 : 1, H = MB <= 5 ? 2 : 1;  // groups and halves a pass
    const int64_t M = a.M;
    const char* w = a.w + (n0 / 16) * (a.K / 64) * 512;
    const int64_t gb = (n0 / 16) * a.groups * 16;  // the block's (groups, 16) scales and offsets from here
    const __m256i nibble = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    alignas(32) float c[MB][16] = {};
    for (int64_t g = 0; g < a.groups; g += P) {
      const char* p = w + (g >> 1) * 512;
      const int32_t* x = xw + 8 * g * M + m0;  // group g's words: line r's x[r M + i]; group g + 1's 8 M on
      for (int h0 = 0; h0 < 2; h0 += H) {
        __m256i s[P][H][MB];
#pragma GCC unroll 2
        for (int q = 0; q < P; q++)
#pragma GCC unroll 2
          for (int h = 0; h < H; h++)
#pragma GCC unroll 8
            for (int i = 0; i < MB; i++) s[q][h][i] = _mm256_setzero_si256();
#pragma GCC unroll 2
        for (int r = 0; r < 8; r++) {
          if (h0 == 0 && !(g & 1)) _mm_prefetch(p + 64 * r + PREFETCH_AHEAD, _MM_HINT_T1);
          __m256i wq[P][H];
#pragma GCC unroll 2
          for (int h = 0; h < H; h++) {
            const __m256i v = _mm256_load_si256((const __m256i*)(p + 64 * r + 32 * (h0 + h)));
#pragma GCC unroll 2
            for (int q = 0; q < P; q++)  // the low nibbles are the even group's
              wq[q][h] = _mm256_and_si256(P == 2 ? (q ? _mm256_srli_epi16(v, 4) : v)
                                                 : _mm256_srli_epi16(v, 4 * (int)(g & 1)), nibble);
          }
#pragma GCC unroll 8
          for (int i = 0; i < MB; i++)
#pragma GCC unroll 2
            for (int q = 0; q < P; q++) {
              const __m256i xb = _mm256_set1_epi32(x[(8 * q + r) * M + i]);
#pragma GCC unroll 2
              for (int h = 0; h < H; h++) s[q][h][i] = _mm256_add_epi16(s[q][h][i], _mm256_maddubs_epi16(wq[q][h], xb));
            }
        }
#pragma GCC unroll 2
        for (int q = 0; q < P; q++)  // KernelI4a8's steps on each of these 8 outputs, group g then g + 1
#pragma GCC unroll 2
          for (int h = 0; h < H; h++) {
            const int o = 8 * (h0 + h);
            const __m256 sc = group8(a.scales, gb + 16 * (g + q) + o, a.half_groups);
            const __m256 of = group8(a.offsets, gb + 16 * (g + q) + o, a.half_groups);
#pragma GCC unroll 8
            for (int i = 0; i < MB; i++) {
              const int64_t at = (g + q) * M + m0 + i;
              const __m256 acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s[q][h][i], ones)),
                                                 _mm256_mul_ps(sc, _mm256_set1_ps(gs[at])), _mm256_load_ps(c[i] + o));
              _mm256_store_ps(c[i] + o, _mm256_fmadd_ps(of, _mm256_set1_ps(gsum[at]), acc));
            }
          }
      }
    }
    for (int i = 0; i < MB; i++)
      for (int j = 0; j < 16; j += 4) finish4(a, m0 + i, n0 + j, _mm_load_ps(c[i] + j));
  }
};

// int8 lines (_vnni_lines, each byte q + 128; q in -127..127, a8_takes checks): the top bit flipped back to q, then
// vpmaddubsw on |x| and q with x's sign (a pair at most 2 x 127 x 127: exact), vpmaddwd by ones, 32-bit sums: S =
// sum q x, the AVX-512 kernel's S; then acc += fl(S) x s in group order, the channel's scale in finish4
struct KernelI8a8x256 {
  static constexpr int MOST = 6;
  template <int MB>
  static void block(const Lin& a, int64_t m0, int64_t n0, const int32_t* xw, const float* gs, const int32_t*) {
    const int64_t M = a.M, groups = a.K / 32;
    const char* w = a.w + n0 * a.K;  // block n0 / 16: 16 K bytes, a line 4 columns of its 16 rows
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    alignas(32) float c[MB][16] = {};
    for (int64_t g = 0; g < groups; g++) {
      const char* p = w + 512 * g;
      for (int h = 0; h < 2; h++) {
        __m256i s[MB];
#pragma GCC unroll 8
        for (int i = 0; i < MB; i++) s[i] = _mm256_setzero_si256();
        const int32_t* x = xw + 8 * g * M + m0;
#pragma GCC unroll 2
        for (int r = 0; r < 8; r++) {
          if (h == 0) _mm_prefetch(p + 64 * r + PREFETCH_AHEAD, _MM_HINT_T1);
          const __m256i q = _mm256_xor_si256(_mm256_load_si256((const __m256i*)(p + 64 * r + 32 * h)), flip);
#pragma GCC unroll 8
          for (int i = 0; i < MB; i++) {
            const __m256i xb = _mm256_set1_epi32(x[r * M + i]);
            const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(xb), _mm256_sign_epi8(q, xb));
            s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(pairs, ones));
          }
        }
#pragma GCC unroll 8
        for (int i = 0; i < MB; i++)
          _mm256_store_ps(c[i] + 8 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i]), _mm256_set1_ps(gs[g * M + m0 + i]),
                                                        _mm256_load_ps(c[i] + 8 * h)));
      }
    }
    for (int i = 0; i < MB; i++)
      for (int j = 0; j < 16; j += 4) finish4(a, m0 + i, n0 + j, _mm_load_ps(c[i] + j));
  }
};

// run_blocks16 for these: each thread rounds x into its own buffers, then its run of blocks, rows split evenly
template <typename E>
void run_blocks16_256(const Lin& a, const E* x, bool int8) {
  const int most = int8 ? KernelI8a8x256::MOST : KernelI4a8x256::MOST;
  const int64_t grain = std::max<int64_t>(1, (int8 ? 2048 : 4096) / std::max<int64_t>(a.K, 1));
  const int64_t n_mb = (a.M + most - 1) / most;
  at::parallel_for(0, a.N / 16, grain, [&](int64_t b0, int64_t b1) {
    static thread_local std::vector<int32_t> words, ints;
    static thread_local std::vector<float> gs, sums;
    const int64_t M = a.M, K = a.K;
    int32_t* xw = scratch64(words, M * K / 4);
    gs.resize(M * K / 32), sums.resize(M * K / 32), ints.resize(M * K / 32);
    quantize_groups8_256(x, M, K, xw, gs.data(), sums.data(), ints.data());
    for (int64_t b = b0; b < b1; b++)
      for (int64_t i = 0, m0 = 0; i < n_mb; i++) {
        const int mb = (int)((M - m0) / (n_mb - i));
        if (int8) one_block<KernelI8a8x256, KernelI8a8x256::MOST>(a, m0, mb, 16 * b, xw, gs.data(), ints.data());
        else one_block<KernelI4a8x256, KernelI4a8x256::MOST>(a, m0, mb, 16 * b, xw, gs.data(), sums.data());
        m0 += mb;
      }
  });
}

#pragma GCC pop_options

// ------------------------------------------------------------------------------------------------ linear

// activations in the order int4 nibbles (and, on AVX2, split bf16 pairs) come in: each V columns as evens, then odds
template <typename E>
void permute_evens_odds(E* x, int64_t M, int64_t K, int V) {
  E tmp[64];
  for (int64_t m = 0; m < M; m++)
    for (int64_t k = 0; k < K; k += V) {
      E* p = x + m * K + k;
      for (int j = 0; j < V / 2; j++) { tmp[j] = p[2 * j]; tmp[V / 2 + j] = p[2 * j + 1]; }
      std::memcpy(p, tmp, V * sizeof(E));
    }
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& scales,
                  const c10::optional<at::Tensor>& offsets, const c10::optional<at::Tensor>& bias,
                  const c10::optional<at::Tensor>& residual, int64_t act_bits) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 4 && (w.size(2) == 4 || w.size(2) == 16), "eagle_fast::linear: x (M, K) and a packed weight");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "eagle_fast::linear: x must be fp32 or bf16");
  TORCH_CHECK(w.is_contiguous(), "eagle_fast::linear: the packed weight must be contiguous");
  // int4i in tall blocks (pack_int4i): uint8, 64 columns of 16 rows in 576 bytes (16 x 36); run as int8 weights
  const bool int4i = w.scalar_type() == at::kByte && w.size(2) == 16 && w.size(3) == 36;
  // int8 in 16-row blocks for VNNI without AMX (pack on a Zen 4 or 5): uint8 bytes q + 128, (N/16, K/64, 16, 64)
  const bool i8v16 = w.scalar_type() == at::kByte && w.size(2) == 16 && w.size(3) == 64;
  int wt;
  switch (int4i || i8v16 ? at::kChar : w.scalar_type()) {
    case at::kFloat: wt = W_F32; break;
    case at::kBFloat16: wt = W_BF16; break;
    case at::kChar: wt = W_I8; break;
    case at::kByte: wt = W_I4; break;
    default: TORCH_CHECK(false, "eagle_fast::linear: unsupported weight dtype");
  }
  const int64_t M = x.size(0), K = x.size(1), N = w.size(2) * w.size(0);
  TORCH_CHECK(K == (wt == W_I4 || int4i || i8v16 ? 64 : 32) * w.size(1) &&
              w.size(3) == (int4i ? 36 : i8v16 ? 64 : 32), "eagle_fast::linear: weight does not match x");
  TORCH_CHECK((wt == W_I8 || wt == W_I4) == scales.has_value() && (wt == W_I4) == offsets.has_value(),
              "eagle_fast::linear: int8 weights need scales, int4 weights scales and offsets");
  TORCH_CHECK(wt != W_F32 || x.scalar_type() == at::kFloat, "eagle_fast::linear: fp32 weights need fp32 x");
  TORCH_CHECK(wt != W_BF16 || x.scalar_type() == at::kBFloat16, "eagle_fast::linear: bf16 weights need bf16 x");
  const int level = isa();
  TORCH_CHECK(level >= AVX2, "eagle_fast::linear: this CPU has no AVX2");
  // (on AVX2 builds int8 lines and int4 tall blocks with 8-bit activations: pack(..., act_bits=8) made them)
  const bool avx2_a8 = act_bits == 8 && level < AVX512 && (i8v16 || wt == W_I4);
  TORCH_CHECK(w.size(2) == 4 || (K <= 65536 && (avx2_a8 || (i8v16 ? level == AVX512BF16
                                                     : wt == W_I4 ? level >= AVX512BF16 : level == AMX && wt != W_F32))),
              "eagle_fast::linear: tall blocks (16 rows) are for bf16, int8 and int4 weights on AMX CPUs, int8 and "
              "int4 on AVX-512 VNNI ones without AMX, and with act_bits 8 on AVX2 ones (kernels.pack made them here)");
  Lin a{M, N, K, 1, 0, 1, nullptr, nullptr, nullptr, nullptr, (const char*)w.data_ptr(), (int64_t)(w.size(3) * w.element_size()),
        nullptr, nullptr, nullptr, nullptr, x.scalar_type() == at::kBFloat16};
  a.int4i = int4i;
  at::Tensor sc, of, bs;
  if (scales) {
    const bool int4_half = offsets && scales->scalar_type() == at::kHalf;  // tiled only: checked with the offsets
    TORCH_CHECK((scales->scalar_type() == at::kFloat || int4_half) && scales->is_contiguous(),
                "eagle_fast::linear: scales must be contiguous fp32 (int4's tiled ones fp16 too)");
    sc = *scales;
    a.scales = (const float*)sc.data_ptr();  // fp16 where half_groups
  }
  // int4 in tall blocks: the AMX tiles (run_amx_i4), or KernelI4v16 on AVX-512 VNNI without AMX
  const bool tall = w.size(2) == 16, amx_i8 = wt == W_I8 && tall && !i8v16, tall_i4 = wt == W_I4 && tall;
  // int8 on AVX-512-BF16 without AMX (Zen 4, Zen 5): integer dot products (KernelI8v16 in 16-row blocks, else
  // KernelI8x512), as AVX2 and AMX do
  const bool int8_vnni = wt == W_I8 && level == AVX512BF16;
  if (offsets) {
    // (N, groups), or for tall int4 blocks also (N / 16, groups, 16): each block's scales for a group side by side
    // (tiled, they may be fp16: tile_groups keeps them so where every value is exact)
    const bool tiled = sc.dim() == 3, half = tiled && sc.scalar_type() == at::kHalf;
    TORCH_CHECK(offsets->scalar_type() == sc.scalar_type() && (half || sc.scalar_type() == at::kFloat) &&
                offsets->is_contiguous() && offsets->sizes() == sc.sizes() &&
                (tiled ? tall_i4 && sc.size(0) * 16 == N && sc.size(2) == 16 : sc.dim() == 2 && sc.size(0) == N) &&
                K % sc.size(1) == 0 && (K / sc.size(1)) % 32 == 0,
                "eagle_fast::linear: int4 scales and offsets must be fp32 (N, K / groupsize) (or tile_groups' "
                "(N / 16, K / groupsize, 16) for tall blocks, fp32 or fp16), groupsize a multiple of 32");
    of = *offsets;
    a.half_groups = half;
    if (tall_i4 && !tiled) {  // the tiles read a block's 16 scales of a group at once: laid out so, for this call
      sc = sc.view({N / 16, 16, sc.size(1)}).transpose(1, 2).contiguous();
      of = of.view({N / 16, 16, of.size(1)}).transpose(1, 2).contiguous();
      a.scales = sc.data_ptr<float>();
    }
    a.offsets = (const float*)of.data_ptr();  // fp16 where half_groups
    a.groups = sc.size(1);
    a.G = K / a.groups;
    while ((int64_t(1) << a.gshift) < a.G) a.gshift++;
    TORCH_CHECK((int64_t(1) << a.gshift) == a.G, "eagle_fast::linear: int4 group size must be a power of two");
  } else if (scales) {
    TORCH_CHECK(sc.numel() == N, "eagle_fast::linear: int8 scales must be (N,)");
  }
  if (bias) {
    bs = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bs.numel() == N, "eagle_fast::linear: bias must be (N,)");
    a.bias = bs.data_ptr<float>();
  }
  if (M > 1 || prefetch_one_row())  // the bytes of 4 rows x 32 columns (int4: 4 rows x 16 bytes), in 64-byte lines
    a.ahead_lines = std::max<int64_t>(1, 4 * a.block_bytes / (wt == W_I4 ? 2 : 1) / 64);
  if (residual) {  // y = residual + x @ W.T, the sum a transformer block's residual stream takes
    TORCH_CHECK(residual->scalar_type() == x.scalar_type() && residual->dim() == 2 && residual->size(0) == M &&
                residual->size(1) == N && residual->is_contiguous(),
                "eagle_fast::linear: the residual must be a contiguous (M, N) tensor of x's dtype");
    a.res = residual->data_ptr();
  }
  at::Tensor out = at::detail::empty_cpu({M, N}, x.scalar_type());  // not through the dispatcher (at::empty)
  a.out = out.data_ptr();
  if (M == 0) return out;
  // int8 and int4 in tall blocks (pack made them on an AMX CPU; int4 also on an AVX-512-BF16 one): integer dot
  // products, x rounded to 16 bits, any x dtype
  TORCH_CHECK(!tall_i4 || a.G <= 256, "eagle_fast::linear: int4 tall blocks take group sizes up to 256");
  TORCH_CHECK(!amx_i8 || K % 64 == 0, "eagle_fast::linear: int8 tall blocks take K % 64 == 0");
  TORCH_CHECK(act_bits == 16 || (act_bits == 8 && ((tall_i4 && a.G == 32) || i8v16)),
              "eagle_fast::linear: 8-bit activations are for int4 groups of 32 in tall blocks and int8 lines "
              "(AVX2, AVX-512 VNNI); act_bits is 16 otherwise");
  if (act_bits == 8) {  // KernelI4a8, KernelI8a8 (AVX2: their x256 forms): x in 8-bit groups of 32, each with its scale
    const at::Tensor xc = x.contiguous();
    if (level < AVX512) {
      if (xc.scalar_type() == at::kFloat) run_blocks16_256(a, xc.data_ptr<float>(), i8v16);
      else run_blocks16_256(a, (const uint16_t*)xc.data_ptr(), i8v16);
    } else if (xc.scalar_type() == at::kFloat) run_blocks16(a, xc.data_ptr<float>(), 8, i8v16);
    else run_blocks16(a, (const uint16_t*)xc.data_ptr(), 8, i8v16);
    return out;
  }
  at::Tensor xb;
  if (level >= AVX512BF16 && x.scalar_type() == at::kBFloat16 && wt != W_F32 && !amx_i8 && !tall_i4 && !int8_vnni) {  // BF16 dot products
    xb = x.contiguous();
    if (wt == W_I4) {  // x in the nibbles' order: each 32 columns as evens, then odds
      xb = xb.clone();
      permute_evens_odds((uint16_t*)xb.data_ptr(), M, K, 32);
    }
    a.xb = (const uint16_t*)xb.data_ptr();
    // bf16 weights, every M, through the tiles (they sum in another order than the vector dot products). int8 and
    // int4 in tall blocks take the integer tiles (run_amx_i8_tall, run_amx_i4), in 4-row blocks (shapes the tiles'
    // layouts do not take) these vectors; int4 dequantized to bf16 and stored for the bf16 tiles had cost one row
    // 2.5x the vectors' time (42 -> 104 us, 1536 x 576), 5 rows about the same
    if (level == AMX && wt == W_BF16) {
      if (tall) run_amx_bf16_tall(a);
      else run_amx(a);
      return out;
    }
    // up to 6 rows (one activation block) the weights are converted in registers, more rows read them converted
    // once into the block's buffer: the same bf16 values either way, so every row is the same whatever M is
    if (wt == W_BF16) run_linear<Kernel512<Bf16Step<W_BF16>>>(a, 6);
    else if (wt == W_I8 && M <= 6) run_linear<Kernel512<Bf16Step<W_I8>>>(a, 6);
    else if (wt == W_I8) run_dequantized<W_I8>(a);
    else if (M <= 6) run_linear<Kernel512<Bf16Step<W_I4>>>(a, 6);
    else run_dequantized<W_I4>(a);
    return out;
  }
  // fp32 activations, in the order the weight pieces come in (int4, and bf16 on AVX2: each 32 columns as evens, then
  // odds); bf16 ones are widened here, into a buffer of this call, rather than by a tensor op (~5 us a call)
  const bool permuted = wt == W_I4 || (wt == W_BF16 && level < AVX512);
  const at::Tensor xc = x.contiguous();
  // integer dot products (KernelI8, KernelI8x512, KernelI8v16, KernelI4v16, AMX tiles), x rounded straight
  if ((level < AVX512 && wt == W_I8) || int8_vnni || amx_i8 || tall_i4) {
    // (each thread rounds x into its own buffers: run_blocks16)
    if (i8v16 || (tall_i4 && level == AVX512BF16)) {  // KernelI8v16, KernelI4v16: x = 256 hi + lo, both bytes signed
      if (xc.scalar_type() == at::kFloat) run_blocks16(a, xc.data_ptr<float>(), 16, i8v16);
      else run_blocks16(a, (const uint16_t*)xc.data_ptr(), 16, i8v16);
      return out;
    }
    // kept from call to call (two allocations cost as much as the rounding), rows 64-byte aligned: with rows 16
    // bytes off, half the 32-byte loads of x crossed a cache line and 5 rows ran at 0.7x (54 against 75 GMAC/s)
    static thread_local std::vector<int16_t> xbuf;
    static thread_local std::vector<float> xs;
    xs.resize(M);
    a.xs = xs.data();
    if (amx_i8) {  // x straight into the tiles' bytes (panel_bytes_x), its rows' scales into xs
      if (xc.scalar_type() == at::kFloat) run_amx_i8_tall(a, xc.data_ptr<float>(), xs.data());
      else run_amx_i8_tall(a, (const uint16_t*)xc.data_ptr(), xs.data());
      return out;
    }
    xbuf.resize(M * K + 32);
    int16_t* xq = (int16_t*)(((uintptr_t)xbuf.data() + 63) & ~(uintptr_t)63);  // K % 32 == 0: every row aligned
    // int4 in tall blocks: x = 256 hi + lo with both bytes signed (panel_bytes)
    const float qmax = tall_i4 ? 32639.0f : 32767.0f;
    if (xc.scalar_type() == at::kFloat) quantize_rows16(xc.data_ptr<float>(), M, K, xq, xs.data(), qmax);
    else quantize_rows16((const uint16_t*)xc.data_ptr(), M, K, xq, xs.data(), qmax);
    a.xq = xq;
    if (tall_i4) run_amx_i4(a);
    else if (level == AVX512BF16) run_linear<KernelI8x512>(a, 6);
    else if (level == AVX2VNNI) run_linear<KernelI8<true>>(a, KernelI8<true>::MAX_MB);
    else run_linear<KernelI8<false>>(a, KernelI8<false>::MAX_MB);
    return out;
  }
  std::vector<float> xbuf;
  if (xc.scalar_type() == at::kFloat && !permuted) {
    a.xf = xc.data_ptr<float>();
  } else {
    xbuf.resize(M * K + 16);
    float* xf = (float*)(((uintptr_t)xbuf.data() + 63) & ~(uintptr_t)63);  // rows 64-byte aligned, as KernelI8's
    if (xc.scalar_type() == at::kFloat) {
      std::memcpy(xf, xc.data_ptr<float>(), M * K * sizeof(float));
    } else {
      const uint16_t* src = (const uint16_t*)xc.data_ptr();
      for (int64_t i = 0; i < M * K; i++) {
        const uint32_t u = (uint32_t)src[i] << 16;
        std::memcpy(&xf[i], &u, 4);
      }
    }
    if (permuted) permute_evens_odds(xf, M, K, 32);
    a.xf = xf;
  }
  if (level >= AVX512) {
    switch (wt) {
      case W_F32: run_linear<Kernel512<F32Step<W_F32>>>(a, 5); break;
      case W_BF16: run_linear<Kernel512<F32Step<W_BF16>>>(a, 5); break;
      case W_I8: run_linear<Kernel512<F32Step<W_I8>>>(a, 5); break;
      default: run_linear<Kernel512<F32Step<W_I4>>>(a, 5); break;
    }
  } else {
    switch (wt) {
      case W_F32: run_linear<Kernel256<W_F32>>(a, Kernel256<W_F32>::MAX_MB); break;
      case W_BF16: run_linear<Kernel256<W_BF16>>(a, Kernel256<W_BF16>::MAX_MB); break;
      default: run_linear<Kernel256<W_I4>>(a, Kernel256<W_I4>::MAX_MB); break;
    }
  }
  return out;
}

// ------------------------------------------------------------------------------------------------ attention

// the cache slots a query row sees, in slot order: every step after this goes by a slot's rank in this list
// (8 mask bytes a step: a causal row is a run of ones, then zeros to the end of the cache)
inline int64_t visible_slots(const bool* mask, int64_t S, int64_t* slots) {
  int64_t n = 0, s = 0;
  for (; s + 8 <= S; s += 8) {
    uint64_t m;
    std::memcpy(&m, mask + s, 8);
    if (m == 0x0101010101010101ull) {
      for (int j = 0; j < 8; j++) slots[n + j] = s + j;
      n += 8;
    } else if (m) {
      for (int j = 0; j < 8; j++)
        if (mask[s + j]) slots[n++] = s + j;
    }
  }
  for (; s < S; s++)
    if (mask[s]) slots[n++] = s;
  return n;
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
template <typename E>
inline __m512 vload512(const E* p) {
  if (sizeof(E) == 4) return _mm512_loadu_ps((const float*)p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// One query row's scores against the n cache slots it sees (listed in slot order), four slots at a time: one tree
// of shuffles sums four dot products (one horizontal sum each was most of the time), and the four accumulators
// stay in registers (kept in an array, they went through memory: 1.1-1.2x slower). scores has room for n + 3;
// past n the last slot is scored again and never read.
template <typename E>
void scores512(const float* q, const E* k, int64_t D, float scale, const int64_t* slots, int64_t n, float* scores) {
  for (int64_t i = 0; i < n; i += 4) {
    const E *k0 = k + slots[i] * D, *k1 = k + slots[std::min(i + 1, n - 1)] * D,
            *k2 = k + slots[std::min(i + 2, n - 1)] * D, *k3 = k + slots[std::min(i + 3, n - 1)] * D;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 qd = _mm512_loadu_ps(q + d);
      a0 = _mm512_fmadd_ps(qd, vload512(k0 + d), a0);
      a1 = _mm512_fmadd_ps(qd, vload512(k1 + d), a1);
      a2 = _mm512_fmadd_ps(qd, vload512(k2 + d), a2);
      a3 = _mm512_fmadd_ps(qd, vload512(k3 + d), a3);
    }
    _mm_storeu_ps(scores + i, _mm_mul_ps(reduce4_512(a0, a1, a2, a3), _mm_set1_ps(scale)));
  }
}

// 64 columns of a V row as 4 fp32 vectors: bf16 as pairs split in place (a 32-bit lane's low bf16 by a shift, its
// high one by a mask: columns 0, 2, .., 30, then 1, 3, .., 31, then the same of 32..63), one instruction a vector
// where widening took two, one of them a shuffle (4% of the op); fp32 and a short last pass (chunks < 4) in order
template <typename E, bool FULL>
inline void vload64(const E* p, int64_t chunks, __m512 (&x)[4]) {
  if (sizeof(E) == 2 && FULL) {
    for (int h = 0; h < 2; h++) {
      const __m512i w = _mm512_loadu_si512(p + 32 * h);
      x[2 * h] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
      x[2 * h + 1] = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xFFFF0000u)));
    }
  } else {
    for (int j = 0; j < 4; j++)
      if (j < chunks) x[j] = vload512(p + 16 * j);
  }
}

// softmax_v512's pass over the slots for 64 columns from d0 (FULL: all 64, else chunks of 16 < 4). V is summed in
// two accumulators a 16-column chunk (even and odd ranks): one chain of dependent multiply-adds a chunk waited on
// their latency.
template <typename E, int R, bool FULL>
void v_pass512(const E* v, int64_t D, float* const* scores, const int64_t* slots, int64_t n, const float* inv,
               int64_t d0, float* const* out) {
  const int64_t chunks = FULL ? 4 : (D - d0) / 16;
  __m512 acc[R][2][4];
#pragma GCC unroll 4
  for (int r = 0; r < R; r++)
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) acc[r][0][j] = acc[r][1][j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 2) {
    const bool odd = i + 1 < n;
    __m512 x0[4], x1[4];
    vload64<E, FULL>(v + slots[i] * D + d0, chunks, x0);
    vload64<E, FULL>(v + slots[odd ? i + 1 : i] * D + d0, chunks, x1);
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++)
      if (j < chunks)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
          acc[r][0][j] = _mm512_fmadd_ps(_mm512_set1_ps(scores[r][i]), x0[j], acc[r][0][j]);
          if (odd) acc[r][1][j] = _mm512_fmadd_ps(_mm512_set1_ps(scores[r][i + 1]), x1[j], acc[r][1][j]);
        }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; r++) {
    __m512 y[4];
    for (int j = 0; j < chunks; j++) y[j] = _mm512_mul_ps(_mm512_add_ps(acc[r][0][j], acc[r][1][j]), _mm512_set1_ps(inv[r]));
    if (sizeof(E) == 2 && FULL) {  // evens and odds back to column order
      const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
      const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
      for (int h = 0; h < 2; h++) {
        const __m512 ev = y[2 * h], od = y[2 * h + 1];
        y[2 * h] = _mm512_permutex2var_ps(ev, lo, od), y[2 * h + 1] = _mm512_permutex2var_ps(ev, hi, od);
      }
    }
    for (int j = 0; j < chunks; j++) _mm512_storeu_ps(out[r] + d0 + 16 * j, y[j]);
  }
}

// Softmax in fp32, then the weighted sums of the slots' V rows, for R query rows that see the same slots (the query
// heads of one KV head at one position): each V row is loaded and converted once for the R rows, and each row's sum
// is the one it gets alone.
template <typename E, int R>
void softmax_v512(const E* v, int64_t D, float* const* scores, const int64_t* slots, int64_t n, float* const* out) {
  float inv[R];
  for (int r = 0; r < R; r++) inv[r] = n ? 1.0f / softmax_numerators512(scores[r], n) : 0.0f;
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    if (D - d0 >= 64) v_pass512<E, R, true>(v, D, scores, slots, n, inv, d0, out);
    else v_pass512<E, R, false>(v, D, scores, slots, n, inv, d0, out);
  }
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")
// bf16 K on a CPU with BF16 dot products: each score by dot products of bf16 pairs summed in fp32, one instruction a
// 32 columns where scores512 converts and multiply-adds twice (q comes in bf16, so nothing new is rounded). R query
// rows (qstride apart) at once: each 4 slots' K rows are loaded once for them (a KV head's K is larger than L1 at
// a few hundred slots, so every row re-read it from L2), each row's scores the same multiply-adds and sums as alone
template <int R>
void scores512bf16(const uint16_t* q, int64_t qstride, const uint16_t* k, int64_t D, float scale, const int64_t* slots,
                   int64_t n, float* const* scores) {
  for (int64_t i = 0; i < n; i += 4) {
    const uint16_t *k0 = k + slots[i] * D, *k1 = k + slots[std::min(i + 1, n - 1)] * D,
                   *k2 = k + slots[std::min(i + 2, n - 1)] * D, *k3 = k + slots[std::min(i + 3, n - 1)] * D;
    __m512 a[R][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) a[r][0] = a[r][1] = a[r][2] = a[r][3] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 32) {
      const __m512bh x0 = (__m512bh)_mm512_loadu_si512(k0 + d), x1 = (__m512bh)_mm512_loadu_si512(k1 + d),
                     x2 = (__m512bh)_mm512_loadu_si512(k2 + d), x3 = (__m512bh)_mm512_loadu_si512(k3 + d);
#pragma GCC unroll 4
      for (int r = 0; r < R; r++) {
        const __m512bh qd = (__m512bh)_mm512_loadu_si512(q + r * qstride + d);
        a[r][0] = _mm512_dpbf16_ps(a[r][0], qd, x0);
        a[r][1] = _mm512_dpbf16_ps(a[r][1], qd, x1);
        a[r][2] = _mm512_dpbf16_ps(a[r][2], qd, x2);
        a[r][3] = _mm512_dpbf16_ps(a[r][3], qd, x3);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
      _mm_storeu_ps(scores[r] + i, _mm_mul_ps(reduce4_512(a[r][0], a[r][1], a[r][2], a[r][3]), _mm_set1_ps(scale)));
  }
}

// ... and V's weighted sums by BF16 dot products too: each row's probabilities rounded to bf16 (as PyTorch's
// FlashAttention on a CPU rounds them for its P.V product in bf16), two slots a dot product, so a slot and row take 2
// instructions for 64 columns where fp32 multiply-adds took 4 (the V pass was half of a row's time, bound by them).
// In place, p[0..n) becomes (n + 1) / 2 words of two bf16: ranks 2j (low half) and 2j + 1 (high; 0 past n - 1)
inline void probs_to_bf16_pairs(float* p, int64_t n) {
  p[n] = 0.0f;  // an odd count's last slot is paired with a weight of 0 (scores have room for n + 3)
  uint32_t* w = (uint32_t*)p;
  for (int64_t i = 0; i <= n; i += 32) {  // words [i/2, i/2 + 16) land on floats already read
    const int64_t left = std::min<int64_t>(32, n + 1 - i);
    const __mmask16 m0 = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
    const __mmask16 m1 = left >= 32 ? (__mmask16)0xffff : left > 16 ? (__mmask16)((1u << (left - 16)) - 1) : 0;
    const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(m1, p + i + 16), _mm512_maskz_loadu_ps(m0, p + i));
    const int64_t words = (left + 1) / 2;
    _mm512_mask_storeu_epi32(w + i / 2, words >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << words) - 1), (__m512i)b);
  }
}

// 64 columns from d0 (FULL, else 32) of R rows' weighted sums: for each pair of ranks, their two V rows interleaved
// (a 32-bit lane holds one column's two bf16) and one dot product a 16 columns and row; one chain a chunk and row
// (R x 4 of them). The lanes come out as columns 0-3, 8-11, 16-19, 24-27 (unpacklo) and 4-7, 12-15, ... (unpackhi)
// of each 32, put back in order at the end.
template <int R, bool FULL>
void v_pass512bf16(const uint16_t* v, int64_t D, uint32_t* const* pw, const int64_t* slots, int64_t n,
                   const float* inv, int64_t d0, float* const* out) {
  alignas(64) static const uint16_t zeros[64] = {};  // the partner of an odd count's last slot
  constexpr int C = FULL ? 4 : 2;  // 16-column chunks
  __m512 acc[R][C];
#pragma GCC unroll 4
  for (int r = 0; r < R; r++)
#pragma GCC unroll 4
    for (int j = 0; j < C; j++) acc[r][j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 2) {
    const uint16_t* a = v + slots[i] * D + d0;
    const uint16_t* b = i + 1 < n ? v + slots[i + 1] * D + d0 : zeros;
    __m512i x[C];
#pragma GCC unroll 2
    for (int h = 0; h < C / 2; h++) {
      const __m512i ra = _mm512_loadu_si512(a + 32 * h), rb = _mm512_loadu_si512(b + 32 * h);
      x[2 * h] = _mm512_unpacklo_epi16(ra, rb), x[2 * h + 1] = _mm512_unpackhi_epi16(ra, rb);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32((int)pw[r][i / 2]);
#pragma GCC unroll 4
      for (int j = 0; j < C; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], p, (__m512bh)x[j]);
    }
  }
  const __m512i lo = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i hi = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
#pragma GCC unroll 4
  for (int r = 0; r < R; r++)
#pragma GCC unroll 2
    for (int h = 0; h < C / 2; h++) {
      const __m512 s = _mm512_set1_ps(inv[r]);
      const __m512 ev = _mm512_mul_ps(acc[r][2 * h], s), od = _mm512_mul_ps(acc[r][2 * h + 1], s);
      _mm512_storeu_ps(out[r] + d0 + 32 * h, _mm512_permutex2var_ps(ev, lo, od));
      _mm512_storeu_ps(out[r] + d0 + 32 * h + 16, _mm512_permutex2var_ps(ev, hi, od));
    }
}

template <int R>
void softmax_v512bf16(const uint16_t* v, int64_t D, float* const* scores, const int64_t* slots, int64_t n,
                      float* const* out) {
  float inv[R];
  uint32_t* pw[R];
  for (int r = 0; r < R; r++) {
    inv[r] = n ? 1.0f / softmax_numerators512(scores[r], n) : 0.0f;  // the sum of the unrounded numerators
    probs_to_bf16_pairs(scores[r], n);
    pw[r] = (uint32_t*)scores[r];
  }
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    if (D - d0 >= 64) v_pass512bf16<R, true>(v, D, pw, slots, n, inv, d0, out);
    else v_pass512bf16<R, false>(v, D, pw, slots, n, inv, d0, out);
  }
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
// R query rows (heads of one KV head, qstride apart in q; D apart in out) against the cache slots their one mask row holds,
// in slot order: scores, softmax in fp32, weighted sum of V. Every step goes by a slot's rank among the visible
// ones, never by its index, so a tree row that sees slots 0..L-1, L+2 and L+5 computes exactly what the decode step
// computes once those two moved to L and L+1; and each row the same whatever R is. Tries: docs/performance.md.
template <typename E, int R>
void attend_rows512(const float* q, const uint16_t* qb, int64_t qstride, const E* k, const E* v, const bool* mask,
                    int64_t S, int64_t D, float scale, float* scores, int64_t* slots, float* out) {
  const int64_t n = visible_slots(mask, S, slots);
  float* sc[R];
  float* o[R];
  for (int r = 0; r < R; r++) {
    sc[r] = scores + r * (S + 4), o[r] = out + r * D;
    if (!qb) scores512<E>(q + r * qstride, k, D, scale, slots, n, sc[r]);
  }
  if (qb) scores512bf16<R>(qb, qstride, (const uint16_t*)k, D, scale, slots, n, sc);
  if (qb && D % 32 == 0) softmax_v512bf16<R>((const uint16_t*)v, D, sc, slots, n, o);
  else softmax_v512<E, R>(v, D, sc, slots, n, o);
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
template <typename E>
inline __m256 vload256(const E* p) {
  if (sizeof(E) == 4) return _mm256_loadu_ps((const float*)p);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

// as scores512, 8 columns a vector, for R query rows (qstride apart; scores sstride apart) at once: each piece of K
// is loaded and widened once for them (widening bf16 K three times was most of a row's time), and each row's
// scores are the multiply-adds and the sum scores512's order gives one row alone
template <typename E, int R>
void scores256(const float* q, int64_t qstride, const E* k, int64_t D, float scale, const int64_t* slots, int64_t n,
               float* scores, int64_t sstride) {
  for (int64_t i = 0; i < n; i += 4) {
    const E* kj[4] = {k + slots[i] * D, k + slots[std::min(i + 1, n - 1)] * D, k + slots[std::min(i + 2, n - 1)] * D,
                      k + slots[std::min(i + 3, n - 1)] * D};
    __m256 acc[R][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
      for (int j = 0; j < 4; j++) acc[r][j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
#pragma GCC unroll 4
      for (int j = 0; j < 4; j++) {
        const __m256 kv = vload256(kj[j] + d);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) acc[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * qstride + d), kv, acc[r][j]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
      _mm_storeu_ps(scores + r * sstride + i, _mm_mul_ps(reduce4_256(acc[r][0], acc[r][1], acc[r][2], acc[r][3]), _mm_set1_ps(scale)));
  }
}

// as attend_rows512, 8 columns a vector; 16 registers, so R rows take 64 / R columns of V at a time (8 / R
// accumulators each, the V rows' pieces shared): a column's sum is the same whatever the pass
template <typename E, int R>
void attend_rows256(const float* q, int64_t qstride, const E* k, const E* v, const bool* mask, int64_t S, int64_t D,
                    float scale, float* scores, int64_t* slots, float* out) {
  constexpr int C = R == 1 ? 8 : R == 2 ? 4 : 2;  // 8-column chunks a pass
  const int64_t n = visible_slots(mask, S, slots);
  float inv[R];
  scores256<E, R>(q, qstride, k, D, scale, slots, n, scores, S + 4);
  for (int r = 0; r < R; r++) inv[r] = n ? 1.0f / softmax_numerators256(scores + r * (S + 4), n) : 0.0f;
  for (int64_t d0 = 0; d0 < D; d0 += 8 * C) {
    const int64_t chunks = std::min<int64_t>(C, (D - d0) / 8);
    __m256 acc[R][C];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
      for (int j = 0; j < C; j++) acc[r][j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i++) {
      const E* vr = v + slots[i] * D + d0;
#pragma GCC unroll 8
      for (int j = 0; j < C; j++)
        if (j < chunks) {
          const __m256 x = vload256(vr + 8 * j);
#pragma GCC unroll 4
          for (int r = 0; r < R; r++)
            acc[r][j] = _mm256_fmadd_ps(_mm256_set1_ps(scores[r * (S + 4) + i]), x, acc[r][j]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
      for (int j = 0; j < chunks; j++)
        _mm256_storeu_ps(out + r * D + d0 + 8 * j, _mm256_mul_ps(acc[r][j], _mm256_set1_ps(inv[r])));
  }
}
#pragma GCC pop_options

// an output row from fp32 to bf16, rounded as torch's .to() rounds (to_bf16x4, four at a time)
void store_bf16(const float* x, uint16_t* y, int64_t D) {
  for (int64_t d = 0; d < D; d += 4) _mm_storel_epi64((__m128i*)(y + d), to_bf16x4(_mm_loadu_ps(x + d)));
}

// Work items are query rows, or where there are enough of them to keep every thread busy, the R = 2 or 3 query
// heads of one KV head at one position together (their mask row and slots are one; V is read once for them).
// q is read where it lies (any strides, D contiguous) and each output row written in q's dtype where out puts it:
// a copy of q, a conversion of the output and their dispatch cost more than the kernel at T = 5 (~30 us a layer).
template <typename E>
void attention_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                    at::Tensor& out, int level, bool dot) {  // dot: bf16 scores by BF16 dot products
  const int64_t B = out.size(0), H = out.size(1), T = out.size(2), D = out.size(3), n_kv = k.size(1), S = k.size(2);
  const int64_t group = H / n_kv, mask_batch = mask.size(0);
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2);
  const int64_t os0 = out.stride(0), os1 = out.stride(1), os2 = out.stride(2);
  const float scale = 1.0f / std::sqrt((float)D);
  const E* qp = (const E*)q.data_ptr();
  const E* kp = (const E*)k.data_ptr();
  const E* vp = (const E*)v.data_ptr();
  const bool* mp = mask.data_ptr<bool>();
  E* op = (E*)out.data_ptr();
  int64_t R = 1;
  // 3 or 2 heads an item as soon as there is one item a thread: a one-token step then reads V once for a KV head's
  // heads (10.5 -> 8.6 us a layer on 2 threads)
  if (B * n_kv * T >= at::get_num_threads()) R = group % 3 == 0 ? 3 : group % 2 == 0 ? 2 : 1;
  at::parallel_for(0, B * H * T / R, 1, [&](int64_t i0, int64_t i1) {
    // this thread's buffers, kept between calls (allocated and zero-filled each call, they cost the op at T = 1
    // 2-10%: the AVX2 and AVX-512-BF16 builds forced on a Xeon)
    static thread_local std::vector<float> fbuf;
    static thread_local std::vector<int64_t> slot_buf;
    int64_t* const slots = scratch(slot_buf, S);  // a row's visible slots
    float* const scores = scratch(fbuf, R * (S + 4) + 2 * R * D);  // R rows of S + 4: scores are written four at a time
    float* const qbuf = scores + R * (S + 4);  // q rows in fp32 (bf16 q without dot products)
    float* const obuf = qbuf + R * D;  // outputs
    for (int64_t i = i0; i < i1; i++) {  // i = ((b * n_kv + kv) * (group / R) + pass) * T + t
      const int64_t t = i % T, h = (i / T) % (H / R) * R, b = i / (T * (H / R));  // heads h..h+R-1 at position t
      const E* qr = qp + b * qs0 + h * qs1 + t * qs2;
      const int64_t kv = (b * n_kv + h / group) * S * D;
      const bool* row_mask = mp + ((mask_batch > 1 ? b : 0) * T + t) * S;
      const float* qf = (const float*)qr;
      int64_t qstride = qs1;
      if (sizeof(E) == 2 && !dot) {  // bf16 to fp32 is exact: the rows' scores as from a converted copy
        for (int64_t r = 0; r < R; r++)
          for (int64_t d = 0; d < D; d++) {
            const uint32_t bits = (uint32_t)((const uint16_t*)qr)[r * qs1 + d] << 16;
            std::memcpy(&qbuf[r * D + d], &bits, 4);
          }
        qf = qbuf, qstride = D;
      }
      if (level >= AVX512) {
        auto run = R == 3 ? attend_rows512<E, 3> : R == 2 ? attend_rows512<E, 2> : attend_rows512<E, 1>;
        run(dot ? nullptr : qf, dot ? (const uint16_t*)qr : nullptr, qstride, kp + kv, vp + kv, row_mask, S, D, scale,
            scores, slots, obuf);
      } else {
        auto run = R == 3 ? attend_rows256<E, 3> : R == 2 ? attend_rows256<E, 2> : attend_rows256<E, 1>;
        run(qf, qstride, kp + kv, vp + kv, row_mask, S, D, scale, scores, slots, obuf);
      }
      for (int64_t r = 0; r < R; r++) {
        E* dst = op + b * os0 + (h + r) * os1 + t * os2;
        if (sizeof(E) == 4) std::memcpy(dst, &obuf[r * D], D * 4);
        else store_bf16(&obuf[r * D], (uint16_t*)dst, D);
      }
    }
  });
}

#if EAGLE_AMX
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16,amx-int8")
// bf16 attention on AMX: the scores of up to 16 query rows at once by tiles, C = K . Q^T: 16 cache slots' K rows as A
// straight from the cache (32 columns a tile), the rows' column pairs as B; C holds a slot's 16 scores in one row of
// 64 bytes (cs: (slots, 16) fp32, unscaled). Each score is summed over its own K row and q row only, so it is the
// same whatever the other rows and slots are (tests: rows alone = rows together, a tree row = its decode row over
// the compacted cache). Slots [0, n16), n16 a multiple of 16; a last block past the cache's S rows is read from a
// zero-padded copy.
void scores_amx(const uint16_t* k, int64_t S, int64_t D, const uint16_t* const* q, int rows, int64_t n16, float* cs) {
  alignas(64) uint32_t bt[6][16][16];  // D <= 192: the rows' pairs, (D / 32, 16 pairs, 16 rows), zeros past `rows`
  alignas(64) uint16_t pad[16 * 192];
  const int64_t DB = D / 32;
  std::memset(bt, 0, DB * 1024);
  for (int r = 0; r < rows; r++)
    for (int64_t i = 0; i < 16 * DB; i++) bt[i / 16][i % 16][r] = ((const uint32_t*)q[r])[i];
  TileConfig c;
  for (int t = 0; t <= 7; t++) c.rows[t] = 16, c.colsb[t] = 64;
  load_tile_config(c);
  if (DB == 2) {  // head_dim 64: q's two B tiles stay loaded (1, 3), two blocks of slots in flight (A 0/4 and 6/7, C 2/5)
    _tile_loadd(1, bt[0], 64);
    _tile_loadd(3, bt[1], 64);
  }
  for (int64_t s0 = 0; s0 < n16; s0 += 32) {
    const uint16_t* a = k + s0 * D;
    const bool two = s0 + 16 < n16;
    if (s0 + (two ? 32 : 16) > S) {  // the last block(s) run past the cache: a zero-padded copy
      std::memset(pad, 0, sizeof(pad));
      if (S > s0 + (two ? 16 : 0)) std::memcpy(pad, k + (two ? s0 + 16 : s0) * D, (S - s0 - (two ? 16 : 0)) * D * 2);
    }
    const uint16_t* a0 = two || s0 + 16 <= S ? a : pad;
    const uint16_t* a1 = s0 + 32 <= S ? a + 16 * D : pad;
    if (DB == 2) {  // every load before the products: the tile instructions wait on each other in order
      _tile_loadd(0, a0, 128);
      _tile_loadd(4, a0 + 32, 128);
      if (two) {
        _tile_loadd(6, a1, 128);
        _tile_loadd(7, a1 + 32, 128);
      }
      _tile_zero(2);
      _tile_dpbf16ps(2, 0, 1);
      if (two) {
        _tile_zero(5);
        _tile_dpbf16ps(5, 6, 1);
      }
      _tile_dpbf16ps(2, 4, 3);
      if (two) _tile_dpbf16ps(5, 7, 3);
      _tile_stored(2, cs + s0 * 16, 64);
      if (two) _tile_stored(5, cs + (s0 + 16) * 16, 64);
      continue;
    }
    for (int blk = 0; blk < (two ? 2 : 1); blk++) {
      const uint16_t* ab = blk ? a1 : a0;
      _tile_zero(2);
      for (int64_t cb = 0; cb < DB; cb++) {
        _tile_loadd(0, ab + 32 * cb, D * 2);
        _tile_loadd(1, bt[cb], 64);
        _tile_dpbf16ps(2, 0, 1);
      }
      _tile_stored(2, cs + (s0 + 16 * blk) * 16, 64);
    }
  }
  _tile_release();
}

// visible_slots 64 mask bytes a step: 8 visible slots in a row are one store of 8 indices, a mixed 8 bytes one
// compressed store (the 8-byte loop took ~550 TSC ticks a 1,032-slot row: at T = 5, a tenth of the op's time)
inline int64_t visible_slots512(const bool* mask, int64_t S, int64_t* slots) {
  int64_t n = 0, s = 0;
  const __m512i lane = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7);
  for (; s + 64 <= S; s += 64) {
    const __mmask64 m = _mm512_test_epi8_mask(_mm512_loadu_si512(mask + s), _mm512_set1_epi8(1));
    if (!m) continue;
    for (int j = 0; j < 8; j++) {
      const __mmask8 b = (__mmask8)(m >> (8 * j));
      const __m512i idx = _mm512_add_epi64(_mm512_set1_epi64(s + 8 * j), lane);
      if (b == 0xff) _mm512_storeu_si512(slots + n, idx), n += 8;
      else if (b) _mm512_mask_compressstoreu_epi64(slots + n, b, idx), n += __builtin_popcount(b);
    }
  }
  for (; s < S; s++)
    if (mask[s]) slots[n++] = s;
  return n;
}

// 16 slots' scores from scores_amx (c: 16 slots x 16 query rows) as the query rows' columns, times scale:
// dst[r * stride + i] = c[16 i + r] * scale for r < rows and the slots i that keep holds. A 16 x 16 transpose by
// shuffles; every value is the one product it was. (Each row reading its scores one by one from the tiles' layout
// was the largest part of the op at T = 5: with this, softmax and all 33k -> 21k TSC ticks a call on one thread.)
inline void scores_to_rows(const float* c, float scale, int rows, float* dst, int64_t stride, __mmask16 keep) {
  __m512 t[16], u[16], x[16];
  for (int i = 0; i < 16; i += 2) {  // t[i], lane L: slots i, i + 1 at columns 4L, 4L + 1; t[i + 1]: 4L + 2, 4L + 3
    const __m512 a = _mm512_loadu_ps(c + 16 * i), b = _mm512_loadu_ps(c + 16 * i + 16);
    t[i] = _mm512_unpacklo_ps(a, b), t[i + 1] = _mm512_unpackhi_ps(a, b);
  }
  for (int g = 0; g < 16; g += 4) {  // u[g + e], lane L: slots g..g+3 at column 4L + e
    u[g] = _mm512_shuffle_ps(t[g], t[g + 2], 0x44), u[g + 1] = _mm512_shuffle_ps(t[g], t[g + 2], 0xEE);
    u[g + 2] = _mm512_shuffle_ps(t[g + 1], t[g + 3], 0x44), u[g + 3] = _mm512_shuffle_ps(t[g + 1], t[g + 3], 0xEE);
  }
  for (int e = 0; e < 4; e++) {  // the lanes of columns e, 4 + e, 8 + e, 12 + e gathered in slot order
    const __m512 v0 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0x88), v1 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0xDD);
    const __m512 w0 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0x88), w1 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0xDD);
    x[e] = _mm512_shuffle_f32x4(v0, w0, 0x88), x[8 + e] = _mm512_shuffle_f32x4(v0, w0, 0xDD);
    x[4 + e] = _mm512_shuffle_f32x4(v1, w1, 0x88), x[12 + e] = _mm512_shuffle_f32x4(v1, w1, 0xDD);
  }
  for (int r = 0; r < rows; r++) _mm512_mask_storeu_ps(dst + r * stride, keep, _mm512_mul_ps(x[r], _mm512_set1_ps(scale)));
}

// Where a row's V sum goes by tiles: ranks [0, pv_tiles(n)), whole blocks of 32 at least 32 ranks short of its n. A
// verification row sees the causal prefix, then at most MAX_M = 32 tree slots, so those ranks are prefix slots (rank
// = slot) for every row of a step, and the decode row that sees the same n once the tree is compacted takes the same
// ranks by tiles: the same sums in the same order.
inline int64_t pv_tiles(int64_t n) { return n >= 64 ? (n - 32) / 32 * 32 : 0; }

// P . V over the ranks [0, region[id]) of the rows ids[0..rows) (< 16), which all see the slots `slots` at those
// ranks: A = the rows' softmax numerators rounded to bf16, 32 ranks a tile (zeros past a row's region), B = the V
// rows of 32 of those slots as pairs, 16 columns a tile; acc (16, D) fp32, row id for id in ids. Each output sums
// its own row of P in block order, whatever the other rows are.
void pv_amx(const uint16_t* v, int64_t D, const int64_t* slots, const float* probs, int64_t pstride, const int* ids,
            int rows, const int64_t* region, int64_t rmax, float* acc) {
  static thread_local std::vector<uint16_t> a_buf;
  static thread_local std::vector<float> c_buf;
  uint16_t* const a = scratch(a_buf, rows * rmax);
  float* const c_rows = scratch(c_buf, rows * D);
  for (int r = 0; r < rows; r++) {
    const float* p = probs + ids[r] * pstride;
    const int64_t reg = region[ids[r]];  // a multiple of 32
    for (int64_t j = 0; j < reg; j += 16)
      _mm256_storeu_si256((__m256i*)(a + r * rmax + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + j)));
    std::memset(a + r * rmax + reg, 0, (rmax - reg) * 2);
  }
  alignas(64) uint32_t bt[2][4][16][16];  // 32 V rows as pairs, 16 columns a tile (D % 32 == 0: pairs of tiles)
  TileConfig c;
  c.rows[0] = rows, c.colsb[0] = 64;  // A: P
  for (int t = 1; t <= 2; t++) c.rows[t] = 16, c.colsb[t] = 64;  // B: V
  for (int t = 4; t <= 7; t++) c.rows[t] = rows, c.colsb[t] = 64;  // C: 16 columns each
  load_tile_config(c);
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    const int nb = (int)std::min<int64_t>(4, (D - d0) / 16);
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    // rows 2j and 2j + 1 of the 32 from s0 interleaved, 32 columns at a time: two tiles' rows. Built one block ahead
    // of the products: a tile load of what the vector stores just wrote waited for them
    auto build = [&](int64_t s0, uint32_t (*b4)[16][16]) {
      for (int j = 0; j < 16; j++) {
        const uint16_t* va = v + slots[s0 + 2 * j] * D + d0;
        const uint16_t* vb = v + slots[s0 + 2 * j + 1] * D + d0;
        for (int b = 0; b < nb; b += 2) {
          const __m512i x0 = _mm512_loadu_si512(va + 16 * b), x1 = _mm512_loadu_si512(vb + 16 * b);
          _mm512_store_si512(b4[b][j], _mm512_unpacklo_epi16(x0, x1));
          _mm512_store_si512(b4[b + 1][j], _mm512_unpackhi_epi16(x0, x1));
        }
      }
    };
    build(0, bt[0]);
    for (int64_t s0 = 0, cur = 0; s0 < rmax; s0 += 32, cur ^= 1) {
      if (s0 + 32 < rmax) build(s0 + 32, bt[cur ^ 1]);
      _tile_loadd(0, a + s0, rmax * 2);
      _tile_loadd(1, bt[cur][0], 64);
      _tile_dpbf16ps(4, 0, 1);
      if (nb > 1) {
        _tile_loadd(2, bt[cur][1], 64);
        _tile_dpbf16ps(5, 0, 2);
      }
      if (nb > 2) {
        _tile_loadd(1, bt[cur][2], 64);
        _tile_dpbf16ps(6, 0, 1);
      }
      if (nb > 3) {
        _tile_loadd(2, bt[cur][3], 64);
        _tile_dpbf16ps(7, 0, 2);
      }
    }
    _tile_stored(4, c_rows + d0, D * 4);
    if (nb > 1) _tile_stored(5, c_rows + d0 + 16, D * 4);
    if (nb > 2) _tile_stored(6, c_rows + d0 + 32, D * 4);
    if (nb > 3) _tile_stored(7, c_rows + d0 + 48, D * 4);
  }
  _tile_release();
  // unpacklo / unpackhi pair columns 0-3, 8-11, 16-19, 24-27 of each 32 in the first tile and the rest in the second:
  // the columns back in order
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int r = 0; r < rows; r++)
    for (int64_t d = 0; d < D; d += 32) {
      const __m512 lo = _mm512_loadu_ps(c_rows + r * D + d), hi = _mm512_loadu_ps(c_rows + r * D + d + 16);
      _mm512_storeu_ps(acc + ids[r] * D + d, _mm512_permutex2var_ps(lo, first, hi));
      _mm512_storeu_ps(acc + ids[r] * D + d + 16, _mm512_permutex2var_ps(lo, second, hi));
    }
}

// The rest of R rows' V sums (the R heads of one position: the same slots), ranks [from, n), on the vectors as
// softmax_v512 sums them, added to the tiles' part `base` (zeros where from = 0), times 1 / the numerators' sum;
// C chunks of 16 columns from d0
template <int R, int C>
inline void pv_rest_cols(const uint16_t* v, int64_t D, int64_t d0, float* const* p, const int64_t* slots, int64_t from,
                         int64_t n, float* const* base, const float* inv, float* const* out) {
  __m512 acc[R][2][C];
#pragma GCC unroll 4
  for (int r = 0; r < R; r++)
#pragma GCC unroll 4
    for (int j = 0; j < C; j++) acc[r][0][j] = acc[r][1][j] = _mm512_setzero_ps();
  // bf16 widened here: vload512, built for plain AVX-512, is not inlined into this AMX-built function
  auto widen = [](const uint16_t* x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)x)), 16));
  };
  int64_t i = from;
  for (; i + 1 < n; i += 2) {
    const uint16_t* v0 = v + slots[i] * D + d0;
    const uint16_t* v1 = v + slots[i + 1] * D + d0;
#pragma GCC unroll 4
    for (int j = 0; j < C; j++) {
      const __m512 x0 = widen(v0 + 16 * j), x1 = widen(v1 + 16 * j);
#pragma GCC unroll 4
      for (int r = 0; r < R; r++) {
        acc[r][0][j] = _mm512_fmadd_ps(_mm512_set1_ps(p[r][i]), x0, acc[r][0][j]);
        acc[r][1][j] = _mm512_fmadd_ps(_mm512_set1_ps(p[r][i + 1]), x1, acc[r][1][j]);
      }
    }
  }
  if (i < n) {  // an odd rank count: the last one to the even accumulators
    const uint16_t* v0 = v + slots[i] * D + d0;
#pragma GCC unroll 4
    for (int j = 0; j < C; j++) {
      const __m512 x0 = widen(v0 + 16 * j);
#pragma GCC unroll 4
      for (int r = 0; r < R; r++) acc[r][0][j] = _mm512_fmadd_ps(_mm512_set1_ps(p[r][i]), x0, acc[r][0][j]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; r++)
#pragma GCC unroll 4
    for (int j = 0; j < C; j++) {
      const __m512 sum = _mm512_add_ps(_mm512_loadu_ps(base[r] + d0 + 16 * j), _mm512_add_ps(acc[r][0][j], acc[r][1][j]));
      _mm512_storeu_ps(out[r] + d0 + 16 * j, _mm512_mul_ps(sum, _mm512_set1_ps(inv[r])));
    }
}

// 16-column chunks a pass: R x 2 x C accumulators, all in registers (R = 3 with 4 chunks, 24 of them and the V
// pieces, spilled); each column's sum the same whatever the pass
template <int R>
void pv_rest512(const uint16_t* v, int64_t D, float* const* p, const int64_t* slots, int64_t from, int64_t n,
                float* const* base, const float* inv, float* const* out) {
  constexpr int C = R == 3 ? 2 : 4;
  for (int64_t d0 = 0; d0 < D; d0 += 16 * C) {
    switch (std::min<int64_t>(C, (D - d0) / 16)) {
      case 1: pv_rest_cols<R, 1>(v, D, d0, p, slots, from, n, base, inv, out); break;
      case 2: pv_rest_cols<R, 2>(v, D, d0, p, slots, from, n, base, inv, out); break;
      case 3: pv_rest_cols<R, 3>(v, D, d0, p, slots, from, n, base, inv, out); break;
      default: pv_rest_cols<R, 4>(v, D, d0, p, slots, from, n, base, inv, out); break;
    }
  }
}

// Work items are a KV head's query heads at up to 16 / group positions: their scores in one pass of the tiles over
// the slots any of them sees, then each row's visible slots' scores in rank order and softmax, the V sums of most
// ranks by the tiles (pv_amx) and the rest on the vectors (pv_rest512, R heads of a position together). T = 1: one
// item a KV head, as the vector path has. A row's result does not depend on which item it is in.
void attention_amx(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                   at::Tensor& out) {
  const int64_t B = out.size(0), H = out.size(1), T = out.size(2), D = out.size(3), n_kv = k.size(1), S = k.size(2);
  const int64_t group = H / n_kv, mask_batch = mask.size(0);
  const int64_t R = group % 3 == 0 ? 3 : group % 2 == 0 ? 2 : 1;
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2);
  const int64_t os0 = out.stride(0), os1 = out.stride(1), os2 = out.stride(2);
  const float scale = 1.0f / std::sqrt((float)D);
  const uint16_t* qp = (const uint16_t*)q.data_ptr();
  const uint16_t* kp = (const uint16_t*)k.data_ptr();
  const uint16_t* vp = (const uint16_t*)v.data_ptr();
  const bool* mp = mask.data_ptr<bool>();
  uint16_t* op = (uint16_t*)out.data_ptr();
  // the (batch row, KV head, position) units in one even share a thread, each share cut into items of at most
  // 16 / group positions of one KV head, split evenly: at T = 5, 3 KV heads, 2 threads, the shares are 8 and 7
  // units, two items each (5 + 3 positions, 2 + 5), where chunks of positions a KV head had made three items a
  // thread (3 + 2 positions a head), each paying an item's fixed cost (the tile configuration, a pass over the slots)
  const int64_t most = 16 / group, units = B * n_kv * T, shares = std::min<int64_t>(at::get_num_threads(), units);
  struct Item { int64_t head, t0, t1; };  // head: b * n_kv + kvh; positions t0..t1-1
  static thread_local std::vector<Item> items;  // the calling thread's, kept between calls (no allocation a call)
  static thread_local std::vector<int64_t> first;
  items.clear(), first.resize(shares + 1);
  for (int64_t sh = 0; sh < shares; sh++) {
    first[sh] = (int64_t)items.size();
    // the larger shares first: the calling thread starts at once, a worker only once woken
    for (int64_t u = (sh * units + shares - 1) / shares, u1 = ((sh + 1) * units + shares - 1) / shares; u < u1;) {
      const int64_t head = u / T, n = std::min(u1, (head + 1) * T) - u, pieces = (n + most - 1) / most;
      for (int64_t p = 0; p < pieces; p++) items.push_back({head, u % T + p * n / pieces, u % T + (p + 1) * n / pieces});
      u += n;
    }
  }
  first[shares] = (int64_t)items.size();
  const Item* const item = items.data();  // a worker naming `items` would get its own thread's (empty) vector
  const int64_t* const from = first.data();
  at::parallel_for(0, shares, 1, [&](int64_t sh0, int64_t sh1) {
    // this thread's buffers, kept between calls and never zero-filled (~180 KB at 1,032 slots: filled, they cost a
    // one-token step ~1 us a layer; allocated and freed each call, the op 4-11% at T = 1, 1-5% at T = 5..17)
    static thread_local std::vector<int64_t> ibuf;
    static thread_local std::vector<float> fbuf;
    const int64_t cs_n = (S + 31) / 32 * 32 * 16, probs_n = 16 * S + 16;
    int64_t* const slots = scratch(ibuf, most * S + most);  // (most, S): each position's visible slots
    int64_t* const seen = slots + most * S;  // their counts
    float* const cs = scratch(fbuf, cs_n + probs_n + 16 * D + R * D);  // the tiles' scores
    float* const probs = cs + cs_n;  // (16, S): rows' scores, then numerators
    float* const acc = probs + probs_n;  // (16, D): the tiles' part of P . V
    float* const obuf = acc + 16 * D;  // (R, D): outputs
    const uint16_t* qrows[16];
    float inv[16];
    int64_t region[16];
    for (int64_t i = from[sh0]; i < from[sh1]; i++) {
      const int64_t kvh = item[i].head % n_kv, b = item[i].head / n_kv, t0 = item[i].t0, t1 = item[i].t1;
      const int64_t kv = (b * n_kv + kvh) * S * D;
      int64_t last = 0;
      for (int64_t t = t0; t < t1; t++) {
        int64_t* sl = slots + (t - t0) * S;
        seen[t - t0] = visible_slots512(mp + ((mask_batch > 1 ? b : 0) * T + t) * S, S, sl);
        if (seen[t - t0]) last = std::max(last, sl[seen[t - t0] - 1] + 1);
        for (int64_t hh = 0; hh < group; hh++) qrows[(t - t0) * group + hh] = qp + b * qs0 + (kvh * group + hh) * qs1 + t * qs2;
      }
      const int rows = (int)((t1 - t0) * group);
      scores_amx(kp + kv, S, D, qrows, rows, (last + 15) / 16 * 16, cs);
      for (int64_t s0 = 0; s0 < last; s0 += 16)
        scores_to_rows(cs + s0 * 16, scale, rows, probs + s0, S,
                       last - s0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (last - s0)) - 1));
      // each row's scores in rank order, their softmax numerators and sums
      for (int row = 0; row < rows; row++) {
        const int64_t* sl = slots + (row / group) * S;
        const int64_t n = seen[row / group];
        float* pr = probs + row * S;
        // ranks in place: rank j's slot is j up to the first slot the row does not see (a causal prefix; sl[j] == j
        // holds for a leading run of j only: bisection), past it sl[j] > j, each read before it is written
        int64_t lo = 0, hi = n;
        while (lo < hi) {
          const int64_t mid = (lo + hi) / 2;
          if (sl[mid] == mid) lo = mid + 1;
          else hi = mid;
        }
        for (int64_t j = lo; j < n; j++) pr[j] = pr[sl[j]];
        inv[row] = n ? 1.0f / softmax_numerators512(pr, n) : 0.0f;
        region[row] = pv_tiles(n);
      }
      // the V sums by tiles where pv_tiles says, for positions whose slots agree at the ranks the tiles take, the
      // first pending position's slots for them all (a tree's or a chain's rows share the prefix: one group; a
      // batch row's left padding is not visible, so there the ranks start past it)
      std::memset(acc, 0, rows * D * sizeof(float));
      unsigned done = 0;
      for (int64_t p0 = 0; p0 < t1 - t0; p0++) {
        if (done >> p0 & 1) continue;
        const int64_t* lead = slots + p0 * S;
        int ids[16], nr = 0;
        int64_t rmax = 0;
        for (int64_t p = p0; p < t1 - t0; p++) {
          const int64_t reg = pv_tiles(seen[p]);
          if ((done >> p & 1) || reg > seen[p0] ||
              (p != p0 && std::memcmp(slots + p * S, lead, reg * sizeof(int64_t))))
            continue;
          done |= 1u << p;
          for (int64_t hh = 0; hh < group; hh++) ids[nr++] = (int)(p * group + hh);
          rmax = std::max(rmax, reg);
        }
        if (rmax) pv_amx(vp + kv, D, lead, probs, S, ids, nr, region, rmax, acc);
      }
      for (int64_t t = t0; t < t1; t++) {
        const int64_t* sl = slots + (t - t0) * S;
        const int64_t n = seen[t - t0];
        for (int64_t h0 = 0; h0 < group; h0 += R) {
          const int64_t row = (t - t0) * group + h0;
          float* pr[3];
          float* base[3];
          float* o[3];
          for (int64_t r = 0; r < R; r++)
            pr[r] = probs + (row + r) * S, base[r] = acc + (row + r) * D, o[r] = obuf + r * D;
          if (R == 3) pv_rest512<3>(vp + kv, D, pr, sl, region[row], n, base, inv + row, o);
          else if (R == 2) pv_rest512<2>(vp + kv, D, pr, sl, region[row], n, base, inv + row, o);
          else pv_rest512<1>(vp + kv, D, pr, sl, region[row], n, base, inv + row, o);
          for (int64_t r = 0; r < R; r++)
            store_bf16(o[r], op + b * os0 + (kvh * group + h0 + r) * os1 + t * os2, D);
        }
      }
    }
  });
}
#pragma GCC pop_options
#else
void attention_amx(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&) {}
#endif

// q (B, H, T, D), k and v (B, n_kv, S, D), mask (1 or B, T, S): every query row attends to the slots its mask row
// holds, in slot order, softmax in fp32; a row that sees no slot gets zeros. The output is (B, H, T, D) laid out
// as (B, T, H, D), so that the model's transpose back to (B, T, H * D) is a view.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && mask.dim() == 3, "eagle_fast::attention: bad ranks");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "eagle_fast::attention: dtypes differ");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "eagle_fast::attention: fp32 or bf16");
  TORCH_CHECK(mask.scalar_type() == at::kBool && (mask.size(0) == 1 || mask.size(0) == q.size(0)) &&
              mask.size(1) == q.size(2) && mask.size(2) == k.size(2), "eagle_fast::attention: mask must be bool (1 or B, T, S)");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(1) % k.size(1) == 0 && q.size(3) == k.size(3) && v.sizes() == k.sizes() &&
              q.size(3) % 16 == 0, "eagle_fast::attention: shapes do not match");
  const int level = isa();
  TORCH_CHECK(level >= AVX2, "eagle_fast::attention: this CPU has no AVX2");
  at::Tensor qc = q.stride(3) == 1 ? q : q.contiguous();
  at::Tensor kc = k.contiguous(), vc = v.contiguous(), mc = mask.contiguous();
  const int64_t H = q.size(1), T = q.size(2), D = q.size(3);
  at::Tensor out = at::detail::empty_strided_cpu(q.sizes(), {T * H * D, D, H * D, 1}, q.scalar_type());  // (B, T, H, D) in memory
  const bool dot = q.scalar_type() == at::kBFloat16 && level >= AVX512BF16 && q.size(3) % 32 == 0;
  if (dot && level == AMX && D <= 192 && H / k.size(1) <= 16) attention_amx(qc, kc, vc, mc, out);  // never at EAGLE_AMX 0: level < AMX
  else if (q.scalar_type() == at::kFloat) attention_impl<float>(qc, kc, vc, mc, out, level, dot);
  else attention_impl<uint16_t>(qc, kc, vc, mc, out, level, dot);
  return out;
}

// Rows idx of int8 or bf16 weights in tall blocks (_vnni_tiles, or _vnni_lines' uint8 q + 128, read back as int8),
// (*idx.shape, K): the tied embedding's lookup. They lay a block out in 64-byte lines of 16 rows x 4 bytes (int8: 4
// columns, bf16: 2), a row's 4 bytes at 4 (row % 16) of each line. An op of its own: Inductor's code for the same
// gather as tensor indexing (packed_rows) read some wrong rows inside EAGLE's compiled cycle (greedy EAGLE parted from
// plain decoding on 3 of 20 prompts), where it was right on its own
at::Tensor tile_rows(const at::Tensor& w, const at::Tensor& idx) {
  const bool offset = w.dim() == 4 && w.scalar_type() == at::kByte && w.size(3) == 64;  // _vnni_lines: q + 128
  TORCH_CHECK(w.dim() == 4 && w.size(2) == 16 && w.size(3) == (offset ? 64 : 32) && w.is_contiguous() &&
              ((w.scalar_type() == at::kChar && w.size(1) % 2 == 0) || w.scalar_type() == at::kBFloat16 || offset),
              "eagle_fast::tile_rows: an int8 or bf16 weight in tall blocks");
  const int64_t N = 16 * w.size(0), K = w.size(3) * w.size(1);
  const int64_t lines = K * w.element_size() / 4;  // a row's 4-byte pieces
  const at::Tensor ic = idx.to(at::kLong).contiguous();
  std::vector<int64_t> shape(idx.sizes().begin(), idx.sizes().end());
  shape.push_back(K);
  at::Tensor out = at::detail::empty_cpu(shape, offset ? at::kChar : w.scalar_type());
  const char* wp = (const char*)w.data_ptr();
  const int64_t* ip = ic.data_ptr<int64_t>();
  char* op = (char*)out.data_ptr();
  for (int64_t i = 0; i < ic.numel(); i++) {
    const int64_t row = ip[i] < 0 ? ip[i] + N : ip[i];
    TORCH_CHECK(row >= 0 && row < N, "eagle_fast::tile_rows: index ", ip[i], " out of range for ", N, " rows");
    const char* src = wp + (row / 16) * lines * 64 + (row % 16) * 4;  // (block, line, row, 4 bytes)
    for (int64_t l = 0; l < lines; l++) std::memcpy(op + (i * lines + l) * 4, src + 64 * l, 4);
  }
  if (offset)  // q + 128 -> q: the top bit flipped
    for (int64_t i = 0; i < ic.numel() * K; i++) op[i] ^= (char)0x80;
  return out;
}

}  // namespace

int64_t cpu_isa() { return isa(); }

// The ops as C functions, which a compiled graph's C++ launcher calls directly (c_shims() below): through the
// dispatcher each call looked the op up by name and boxed its arguments (a one-token forward of the default model
// 1.5-2.1% faster without, a 5-token one 1.4-2.9%). Inductor names a custom op's C function
// aoti_torch_<device>_<op name>; tests check that libtorch exports none of these names.
using torch::aot_inductor::tensor_handle_to_tensor_pointer;
using torch::aot_inductor::new_tensor_handle;
static c10::optional<at::Tensor> optional_tensor(AtenTensorHandle* h) {  // a Tensor? argument: null for None
  return h ? c10::optional<at::Tensor>(*tensor_handle_to_tensor_pointer(*h)) : c10::nullopt;
}
extern "C" __attribute__((visibility("default"))) AOTITorchError aoti_torch_cpu_linear(
    AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle* scales, AtenTensorHandle* offsets, AtenTensorHandle* bias,
    AtenTensorHandle* residual, int64_t act_bits, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = new_tensor_handle(linear(*tensor_handle_to_tensor_pointer(x), *tensor_handle_to_tensor_pointer(w),
                                     optional_tensor(scales), optional_tensor(offsets), optional_tensor(bias),
                                     optional_tensor(residual), act_bits));
  });
}
extern "C" __attribute__((visibility("default"))) AOTITorchError aoti_torch_cpu_attention(
    AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v, AtenTensorHandle mask, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = new_tensor_handle(attention(*tensor_handle_to_tensor_pointer(q), *tensor_handle_to_tensor_pointer(k),
                                        *tensor_handle_to_tensor_pointer(v), *tensor_handle_to_tensor_pointer(mask)));
  });
}
extern "C" __attribute__((visibility("default"))) AOTITorchError aoti_torch_cpu_tile_rows(
    AtenTensorHandle w, AtenTensorHandle idx, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = new_tensor_handle(tile_rows(*tensor_handle_to_tensor_pointer(w), *tensor_handle_to_tensor_pointer(idx)));
  });
}

TORCH_LIBRARY(eagle_fast, m) {
  m.def("linear(Tensor x, Tensor w, Tensor? scales, Tensor? offsets, Tensor? bias, Tensor? residual=None, "
        "int act_bits=16) -> Tensor");
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor mask) -> Tensor");
  m.def("tile_rows(Tensor w, Tensor idx) -> Tensor");
}

TORCH_LIBRARY_IMPL(eagle_fast, CPU, m) {
  m.impl("linear", &linear);
  m.impl("attention", &attention);
  m.impl("tile_rows", &tile_rows);
}
"""

ISA_NAMES = {1: "avx2", 2: "avx2_vnni", 3: "avx512", 4: "avx512_bf16", 5: "amx"}
# builds whose int8 linears in 4-row blocks multiply x rounded to 16-bit integers a row (KernelI8, KernelI8x512; the
# AVX-512-BF16 build's 16-row int8 lines likewise, KernelI8v16)
INT16_ROW_BUILDS = ("avx2", "avx2_vnni", "avx512_bf16")
_state = {"loaded": None, "why": None, "isa": 0, "shims": False}


def load() -> bool:
    """Build (first use on a machine) and load the C++ ops; True when they are usable. Never raises: a machine
    without a compiler, without AVX2, or with EAGLE_KERNELS=off runs the fallback."""
    if _state["loaded"] is not None:
        return _state["loaded"]
    _state["loaded"] = False
    forced = os.environ.get("EAGLE_KERNELS", "")
    if forced == "off":
        _state["why"] = "EAGLE_KERNELS=off"
        return False
    if forced not in ("", "avx2", "avx2_vnni", "avx512", "avx512_bf16", "amx"):  # (the C++ would run its best)
        print(f"kernels.py: EAGLE_KERNELS={forced!r} is none of off, avx2, avx2_vnni, avx512, avx512_bf16, amx: "
              "ignored, the best build for this CPU runs", file=sys.stderr)
    try:
        from torch.utils.cpp_extension import load_inline
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = load_inline("eagle_fast_kernels", CPP, functions=["cpu_isa"],
                                 extra_cflags=["-O3", "-std=c++17", "-fopenmp", "-ffp-contract=off"],
                                 extra_ldflags=["-fopenmp"], verbose=False)
        _state["isa"] = int(module.cpu_isa())
    except Exception as e:  # no compiler, no headers, a failed build: run the fallback, say why once
        _state["why"] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[-1][:200]}"
        print(f"kernels.py: the C++ kernels did not build ({_state['why']}); using the slower PyTorch fallback",
              file=sys.stderr)
        return False
    if _state["isa"] < 1:
        _state["why"] = "this CPU has no AVX2"
        print("kernels.py: this CPU has no AVX2 (and FMA); using the slower PyTorch fallback", file=sys.stderr)
        return False
    # the ops' C functions (c_shims) in the global scope, where a compiled launcher finds them when it is loaded
    try:
        import ctypes
        ctypes.CDLL(module.__file__, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
        _state["shims"] = True
    except (AttributeError, OSError):  # no dlopen flags here: graphs call the ops through the dispatcher
        pass

    @torch.library.register_fake("eagle_fast::linear")
    def _(x, w, scales, offsets, bias, residual=None, act_bits=16):
        return x.new_empty(x.shape[0], w.shape[2] * w.shape[0])  # blocks of 4 rows, or 16 (block_rows)

    @torch.library.register_fake("eagle_fast::tile_rows")
    def _(w, idx):  # _vnni_lines (uint8, 64 columns a block row) come back as int8
        offset = w.dtype == torch.uint8
        return w.new_empty(*idx.shape, w.shape[3] * w.shape[1], dtype=torch.int8 if offset else w.dtype)

    @torch.library.register_fake("eagle_fast::attention")
    def _(q, k, v, mask):  # (B, H, T, D) laid out as (B, T, H, D), like the kernel's output
        return q.new_empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3]).transpose(1, 2)

    _state["loaded"] = True
    return True


C_SHIMS = {  # op -> its C function (the C++ above), as Inductor's aot_inductor.custom_ops_to_c_shims declares them
    "linear": "AOTITorchError aoti_torch_cpu_linear(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle* scales, "
              "AtenTensorHandle* offsets, AtenTensorHandle* bias, AtenTensorHandle* residual, int64_t act_bits, "
              "AtenTensorHandle* ret0)",
    "attention": "AOTITorchError aoti_torch_cpu_attention(AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v, "
                 "AtenTensorHandle mask, AtenTensorHandle* ret0)",
    "tile_rows": "AOTITorchError aoti_torch_cpu_tile_rows(AtenTensorHandle w, AtenTensorHandle idx, AtenTensorHandle* ret0)",
}


def c_shims() -> dict:
    """For torch._inductor.config.aot_inductor.custom_ops_to_c_shims: a graph compiled with the C++ launcher then
    calls the ops' C functions directly, not through the dispatcher. Empty where the ops did not load."""
    if not load() or not _state["shims"]:
        return {}
    return {getattr(torch.ops.eagle_fast, name).default: [decl] for name, decl in C_SHIMS.items()}


def isa() -> str:
    """Which build runs here: 'amx', 'avx512_bf16', 'avx512', 'avx2_vnni' (AVX2 and AVX-VNNI, no AVX-512: the
    int8 kernel's multiply-adds by vpdpwssd), 'avx2', or 'fallback'."""
    return ISA_NAMES.get(_state["isa"], "fallback") if load() else "fallback"


# ---------------------------------------------------------------- the packed weight layout

def can_pack(weight: Tensor) -> bool:
    """Whether the kernel takes this weight (N, K) (int4: uint8 nibbles (N, K/2)): on the CPU, N % 4 == 0, K % 32 == 0
    (int4: K % 64 == 0),
    float32, bfloat16, int8 or uint8, and the kernels built."""
    K, cols = (2 * weight.shape[1], 64) if weight.dtype == torch.uint8 else (weight.shape[1], 32)
    return (weight.dim() == 2 and weight.device.type == "cpu" and weight.shape[0] % 4 == 0 and K % cols == 0
            and weight.dtype in (torch.float32, torch.bfloat16, torch.int8, torch.uint8) and load())


def pack(weight: Tensor, act_bits: int = 16) -> Tensor:
    """(N, K) -> (N/4, K/32, 4, 32): blocks of 4 rows x 32 columns, a block's rows one after another (int4 nibbles
    (N, K/2) -> (N/4, K/64, 4, 32): 64 columns a block); bf16, int8 and int4 on AMX (block_rows 16) as the tiles' B
    operand, (N/16, K/32, 16, 32) and (N/16, K/64, 16, 32) (_vnni_tiles, _int4_tiles); on AVX-512-BF16 CPUs
    without AMX int8 as uint8 (N/16, K/64, 16, 64) (_vnni_lines) and int4 as on AMX. The same numbers, re-laid so
    that the kernel reads each block sequentially (model.pack_weights then moves a model's packed weights onto 2 MB
    pages: on_huge_pages). act_bits 8 (a .a8 module's weights): on the AVX2 builds int8 and int4 in those AVX-512
    layouts too (block_rows)."""
    N, width = weight.shape
    C, R = 32, block_rows(weight, act_bits)
    if weight.dtype == torch.uint8 and R == 16:
        blocks = _int4_tiles(weight.detach())
    elif R == 16 and weight.dtype == torch.int8 and isa() != "amx":
        blocks = _vnni_lines(weight.detach())
    elif R == 16:
        blocks = _vnni_tiles(weight.detach())
    else:
        blocks = weight.detach().reshape(N // R, R, width // C, C).transpose(1, 2)
    return blocks.clone(memory_format=torch.contiguous_format)  # never a view of the weight


HUGE_PAGE = 2 << 20
ARENA_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.int16, torch.int32)
_arenas = []  # (first, last + 1) address of each mapping on_huge_pages made: what is on 2 MB pages already


def on_huge_pages(tensors: list[Tensor]) -> list[Tensor]:
    """Copies of CPU tensors side by side in one private anonymous mapping, from a 2 MB boundary, that Linux is asked
    to back with 2 MB pages (madvise MADV_HUGEPAGE before the first write; where transparent huge pages are
    "madvise", as on most distributions, only memory asked for gets them). Streaming the weights of a forward then
    walks one page table entry every 2 MB rather than every 4 KB. A model's packed weights as separate tensors
    (only its LM head, the one of 4 MB+, on 2 MB pages) against all of them on 2 MB pages (the linears of one forward,
    random weights, one process, alternated, a Zen 4; docs/performance.md): int4.g32.a8 at 1 / 5 / 9 / 17 rows
    -5.6 / -10.5 / -8.8 / -5.1%, int8 at 1 / 4 rows -1.0 / -6.6%. Each copy has its own storage (torch.frombuffer:
    the mapping lives as long as one of them does), 64-byte aligned. Tensors already on such pages, and all of them
    where the mapping is refused or there is no MADV_HUGEPAGE (not Linux), come back as they are."""
    move = [t.device.type == "cpu" and t.is_contiguous() and t.nbytes > 0 and t.dtype in ARENA_DTYPES
            and not any(lo <= t.data_ptr() < hi for lo, hi in _arenas) for t in tensors]
    sizes = [-(-t.nbytes // 64) * 64 if m else 0 for t, m in zip(tensors, move)]
    if not any(move) or not hasattr(mmap, "MADV_HUGEPAGE"):
        return list(tensors)
    try:
        arena = mmap.mmap(-1, sum(sizes) + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        arena.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return list(tensors)
    base = torch.frombuffer(arena, dtype=torch.uint8, count=1).data_ptr()
    at = -base % HUGE_PAGE
    _arenas.append((base, base + len(arena)))
    out = []
    for t, m, n in zip(tensors, move, sizes):
        if m:
            u = torch.frombuffer(arena, dtype=torch.uint8, count=t.nbytes, offset=at)
            t = u.view(t.dtype).view(t.shape).copy_(t)
            at += n
        out.append(t)
    return out


def trim_heap():
    """Hand what the C heap holds free back to the system (glibc's malloc_trim; nothing where there is no glibc): the
    ~100-200 MB of tensors a move onto 2 MB pages left behind on the default model, which glibc kept (RSS after
    loading it as int8.head8: +441-544 MB untrimmed, +343 trimmed)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass



def block_rows(weight: Tensor, act_bits: int = 16) -> int:
    """Rows of pack()'s blocks: 16 for bf16, int8 and int4 weights where the AMX build runs (N % 16 == 0, K % 64 ==
    0: a block is the tiles' B operand, _vnni_tiles / _int4_tiles), and for int8 and int4 ones where the AVX-512-BF16
    build runs (_vnni_lines, _int4_tiles: 16 output columns in a register), or the AVX2 builds with 8-bit
    activations (act_bits 8: the .a8 kernels' layouts, half a line a register); else 4."""
    N, width = weight.shape
    K = 2 * width if weight.dtype == torch.uint8 else width
    tall = (weight.dtype in (torch.bfloat16, torch.int8, torch.uint8) and weight.device.type == "cpu" and N % 16 == 0
            and K <= 65536 and K % 64 == 0)
    vnni = weight.dtype in (torch.int8, torch.uint8) and (
        isa() == "avx512_bf16" or (act_bits == 8 and isa() in ("avx2", "avx2_vnni")))
    return 16 if tall and load() and (isa() == "amx" or vnni) else 4


def _int4_tiles(nibbles: Tensor) -> Tensor:
    """int4 nibbles (N, K/2) -> (N/16, K/64, 16, 32) bytes: for each 16 rows and 64 columns, 512 bytes laid out as
    (8 quads, 16 rows, 4 columns), the low nibble of byte (r, n, j) column 4r + j of row n, the high nibble column
    32 + 4r + j: masked, the first 32 columns as an int8 B tile (VNNI order), shifted, the next 32."""
    N = nibbles.shape[0]
    q = torch.stack([nibbles & 15, nibbles >> 4], dim=-1).reshape(N // 16, 16, -1, 2, 8, 4)  # (blk, n, kp, half, r, j)
    q = q.permute(0, 2, 3, 4, 1, 5)  # (blk, kp, half, r, n, j)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(N // 16, -1, 16, 32)


def _vnni_tiles(weight: Tensor) -> Tensor:
    """int8 or bf16 (N, K) -> (N/16, K/32, 16, 32): the tiles' B operand (VNNI order), 1 KB a tile laid out as (16
    groups, 16 rows, e columns), e = 4 bytes of columns (int8: 4, bf16: 2), element (r, n, j) column e r + j of row
    n: 64 columns of 16 rows a tile for int8, 32 for bf16."""
    N, K = weight.shape
    e = 4 // weight.element_size()
    q = weight.reshape(N // 16, 16, K // (16 * e), 16, e).permute(0, 2, 3, 1, 4)  # (blk, tile, r, n, j)
    return q.reshape(N // 16, K // 32, 16, 32)


def _vnni_lines(weight: Tensor) -> Tensor:
    """int8 (N, K) -> uint8 (N/16, K/64, 16, 64): _vnni_tiles' bytes, each q + 128, a block row one 64-byte line of
    4 columns x 16 rows: what one vpdpbusd multiplies (unsigned) by 4 bytes of an activation row (KernelI8v16)."""
    N, K = weight.shape
    return (_vnni_tiles(weight).view(torch.uint8) ^ 128).reshape(N // 16, K // 64, 16, 64)


def a8_takes(packed: Tensor, scales: Tensor) -> bool:
    """Whether linear(..., act_bits=8) runs these packed weights: int4 groups of 32 in tall blocks (pack on an AMX,
    AVX-512-BF16 or, with act_bits 8, AVX2 CPU; KernelI4a8), or int8 lines (pack on an AVX-512-BF16 CPU without AMX,
    or on an AVX2 one with act_bits 8; KernelI8a8). AVX2 multiplies |x| by q with x's sign, so there q = -128 (byte
    0, which quantize_int8 never writes) is refused."""
    if not (load() and packed.dtype == torch.uint8 and packed.dim() == 4 and scales is not None):
        return False
    avx2 = isa() in ("avx2", "avx2_vnni")
    if tuple(packed.shape[2:]) == (16, 64):
        return isa() == "avx512_bf16" or (avx2 and not bool((packed == 0).any()))
    return (tuple(packed.shape[2:]) == (16, 32) and scales.dim() >= 2 and 64 * packed.shape[1] == 32 * scales.shape[1]
            and (isa() in ("amx", "avx512_bf16") or avx2))


def int4i_takes(weight: Tensor) -> bool:
    """Whether pack_int4i takes these int4i nibbles (N, K/2): the int8 tiles of an AMX CPU, N % 16 == 0, K % 64 ==
    0. Elsewhere int4i weights run as the int8 weights they stand for (quantize.Int4iLinear)."""
    N, K = weight.shape[0], 2 * weight.shape[1]
    return (weight.dim() == 2 and weight.dtype == torch.uint8 and weight.device.type == "cpu" and N % 16 == 0
            and K % 64 == 0 and K <= 65536 and load() and isa() == "amx")


def int4i_values(nibbles: Tensor, steps: Tensor, bases: Tensor) -> Tensor:
    """The int8 weights (N, K) that int4i nibbles (N, K/2; column 2j in the low nibble), steps q and bases z (N, K/32)
    stand for: q * nibble + z."""
    N, G = steps.shape
    q = torch.stack([nibbles & 15, nibbles >> 4], dim=-1).reshape(N, G, -1).to(torch.int16)
    return (q * steps.to(torch.int16)[..., None] + bases.to(torch.int16)[..., None]).reshape(N, -1).to(torch.int8)


def pack_int4i(nibbles: Tensor, steps: Tensor, bases: Tensor) -> Tensor:
    """int4i (quantize.quantize_int4i: int8 weights q * nibble + z, 32-column groups) -> (N/16, K/64, 16, 36) uint8:
    for each 16 rows and 64 columns, the nibbles as _int4_tiles lays them out (512 bytes), then the two groups'
    q's and z's, 16 bytes each (group, q or z, row): 576 bytes, read as the int8 tiles' B operand (run_amx_i8_tall)."""
    N, K = nibbles.shape[0], 2 * nibbles.shape[1]
    tiles = _int4_tiles(nibbles.detach()).reshape(N // 16, K // 64, 512)
    per_group = [t.detach().view(torch.uint8).reshape(N // 16, 16, K // 64, 2).permute(0, 2, 3, 1) for t in (steps, bases)]
    qz = torch.stack(per_group, dim=3).reshape(N // 16, K // 64, 64)  # (blk, kp, group, q or z, row)
    return torch.cat([tiles, qz], dim=-1).view(N // 16, K // 64, 16, 36)


def tile_groups(scales: Tensor, offsets: Tensor, packed: Tensor) -> tuple:
    """int4 fp32 scales and offsets (N, G) in the layout the tall blocks read, (N / 16, G, 16): a block's 16 values
    for a group side by side, one vector load (gathered from 16 rows, they cost 11% of the int4 linears at one row);
    as they are for other weights. The op takes either; the tiled form saves a transpose a call. Tiled, they are
    fp16 where every scale and offset is exact in it (a checkpoint from Q4_1 blocks, whose d and m are fp16, and
    quantize_int4's): the same values in half the bytes, which a one-row step streams beside the nibbles (with
    groups of 32, 2 bytes a group instead of 4 each: the linears 0.90x the time at 1 and 5 rows on a Zen 4)."""
    if packed.dtype != torch.uint8 or packed.shape[2] != 16:
        return scales.float().contiguous(), offsets.float().contiguous()
    tiled = [t.float().reshape(t.shape[0] // 16, 16, -1).transpose(1, 2).contiguous() for t in (scales, offsets)]
    if all(torch.equal(t.half().float(), t) for t in tiled):
        tiled = [t.half() for t in tiled]
    return tuple(tiled)


def plain_groups(t: Tensor) -> Tensor:
    """The inverse of tile_groups: (N, G)."""
    return t if t.dim() == 2 else t.transpose(1, 2).reshape(-1, t.shape[1])


def unpack(packed: Tensor) -> Tensor:
    """The inverse of pack(); of pack_int4i, the int8 weights (N, K) its nibbles stand for."""
    B, KB, R, C = packed.shape
    if C == 64:  # _vnni_lines: _vnni_tiles' bytes + 128
        return unpack((packed ^ 128).view(torch.int8).reshape(B, 2 * KB, 16, 32))
    if C == 36:  # pack_int4i
        raw = packed.reshape(B, KB, 576)
        nibbles = unpack(raw[..., :512].reshape(B, KB, 16, 32).contiguous())  # (N, K/2)
        qz = raw[..., 512:].reshape(B, KB, 2, 2, 16).permute(0, 4, 1, 2, 3).reshape(16 * B, 2 * KB, 2)
        return int4i_values(nibbles, qz[..., 0], qz[..., 1].view(torch.int8))
    if packed.dtype == torch.uint8 and R == 16:  # _int4_tiles
        v = packed.reshape(B, KB, 1, 8, 16, 4)
        q = torch.cat([v & 15, v >> 4], dim=2).permute(0, 4, 1, 2, 3, 5).reshape(16 * B, 64 * KB)  # (blk, n, kp, half, r, j)
        return q[:, 0::2] | (q[:, 1::2] << 4)
    if R == 16:  # _vnni_tiles
        e = 4 // packed.element_size()
        return packed.reshape(B, 32 * KB // (16 * e), 16, 16, e).permute(0, 3, 1, 2, 4).reshape(16 * B, 32 * KB)
    return packed.transpose(1, 2).reshape(R * B, KB * C)


def packed_rows(packed: Tensor, idx: Tensor) -> Tensor:
    """Rows idx of a packed weight, (*idx.shape, K): an embedding lookup in a tied, packed table."""
    B, KB, R, C = packed.shape
    if R == 16 and packed.dtype == torch.uint8 and C == 32:  # _int4_tiles: (..., K/64, 8 quads, 4) bytes, 2 nibbles
        v = packed.view(B, KB, 8, 16, 4)[idx // 16, :, :, idx % 16, :].flatten(-2)  # (..., K/64, 32)
        q = torch.cat([v & 15, v >> 4], dim=-1).flatten(-2)  # (..., K) values in column order
        return q[..., 0::2] | (q[..., 1::2] << 4)
    if R == 16:  # _vnni_tiles and _vnni_lines: by an op (see tile_rows in the C++)
        return torch.ops.eagle_fast.tile_rows(packed, idx)
    return packed[idx // R, :, idx % R].flatten(-2)


# ---------------------------------------------------------------- what the model calls

def linear(x: Tensor, packed: Tensor, bias: Tensor = None, scales: Tensor = None, offsets: Tensor = None,
           residual: Tensor = None, act_bits: int = 16) -> Tensor:
    """x (..., K) @ W.T (+ bias) for a packed weight: float in x's dtype, int8 with fp32 scales (N,), or int4 nibbles
    with fp32 scales and offsets (N, K/G; or tile_groups', fp32 or fp16), w = q * scale + offset. Any number of rows;
    each row is computed the same way whatever the number. residual (..., N): residual + that, as eager rounds it
    (the output in x's dtype, then the sum), written by the op itself: a block's residual stream then exists once,
    where a compiled graph had each norm re-add the stream's last 3-4 terms. act_bits 8: int4 groups of 32 in tall blocks with x rounded to 8
    bits in groups of 32 (round_groups8; a8_takes says where)."""
    x2 = x.reshape(-1, x.shape[-1])
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, packed, bias, residual)):
        y = _FrozenPackedLinear.apply(x2, packed, bias, scales, offsets, act_bits)
        y = y.view(*x.shape[:-1], y.shape[-1])
        return y if residual is None else residual + y
    if residual is not None:
        residual = residual.reshape(x2.shape[0], -1).contiguous()
    y = torch.ops.eagle_fast.linear(x2, packed, scales, offsets, bias, residual, act_bits)  # no Python on the way
    return y.view(*x.shape[:-1], y.shape[-1])


class _FrozenPackedLinear(torch.autograd.Function):
    """The input's gradient through a frozen packed weight (a head's loss through the target's packed LM head).
    Only calls that need a gradient come here. An autograd formula registered on the op itself would be a Python
    kernel that every inference call passes through, no_grad or not: a few Python frames a call, and where the stack
    then ended at a 16 KB chunk boundary CPython 3.11 mapped and unmapped a chunk for each of the 151 linears of a
    decode step, which made that step 40-60% slower (docs/performance.md)."""

    @staticmethod
    def forward(ctx, x, packed, bias, scales, offsets, act_bits):
        ctx.packed, ctx.scales, ctx.offsets = packed, scales, offsets
        ctx.needs_weight_grad = packed.requires_grad or (bias is not None and bias.requires_grad)
        return torch.ops.eagle_fast.linear(x, packed, scales, offsets, bias, None, act_bits)

    @staticmethod
    def backward(ctx, grad):
        if ctx.needs_weight_grad:
            raise RuntimeError("eagle_fast::linear: packed weights are frozen (pack_weights is for inference)")
        w = dequantize(unpack(ctx.packed), ctx.scales, ctx.offsets).to(grad.dtype)
        return grad @ w, None, None, None, None, None


def attention_takes(q: Tensor, k: Tensor) -> bool:
    """Whether the attention kernel takes these: CPU, at most MAX_M queries, head_dim % 16 == 0, fp32 or bf16."""
    return (q.device.type == "cpu" and q.shape[2] <= MAX_M and q.shape[-1] % 16 == 0
            and q.dtype in (torch.float32, torch.bfloat16) and k.dtype == q.dtype and load())


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """q (B, H, T, D), k and v (B, n_kv, S, D), mask (1 or B, T, S) bool -> (B, H, T, D): each query row over the
    slots it sees, in slot order, softmax in fp32."""
    return torch.ops.eagle_fast.attention(q, k, v, mask)


# ---------------------------------------------------------------- the pure-PyTorch reference

def dequantize(weight: Tensor, scales: Tensor = None, offsets: Tensor = None) -> Tensor:
    """Plain (N, K) fp32 weights from the kernel's forms (unpacked): float, int8 + scales, int4 nibbles + scales,
    offsets (column 2j in the low nibble, 2j + 1 in the high one; scales and offsets (N, G) or tile_groups')."""
    if offsets is not None:
        scales, offsets = plain_groups(scales), plain_groups(offsets)
        q = torch.stack([weight & 15, weight >> 4], dim=-1).reshape(weight.shape[0], -1).float()
        G = q.shape[1] // scales.shape[1]
        return (q.view(q.shape[0], -1, G) * scales.float()[..., None] + offsets.float()[..., None]).view_as(q)
    if scales is not None:
        return weight.float() * scales.float()[:, None]
    return weight.float()


def round_groups8(x: Tensor) -> tuple[Tensor, Tensor]:
    """x (M, K) as KernelI4a8 takes it: each row's groups of 32 columns as signed bytes q (fp32, |q| <= 127) and
    their scales s = max |x| / 127 (M, K/32): q = x times 127 / max |x| (a true division), rounded to nearest even;
    a group of zeros has s = 0, one with an inf or a NaN s = NaN."""
    M, K = x.shape
    x = x.float().view(M, K // 32, 32)
    amax = x.abs().amax(-1, keepdim=True)
    s = torch.where(amax.isfinite(), amax / 127, float("nan"))
    q = torch.where(amax > 0, torch.round(x * (torch.full_like(amax, 127.0) / amax)), 0.0)
    q = torch.where(amax.isfinite(), q, 0.0)
    return q.view(M, K), s.view(M, K // 32)


def round_rows16(x: Tensor, qmax: int = 32767) -> Tensor:
    """x (M, K) as the AVX2 and AMX builds give it to int8 weights: each row rounded to 16-bit integers times its
    scale max |x| / qmax (a row of zeros stays zeros; one with an inf or a NaN becomes NaN). AMX's int4 tiles and
    the AVX-512-BF16 build's int8 lines take qmax = 32639, which splits into two signed bytes."""
    q, scale = rows16(x, qmax)
    return q * scale


def rows16(x: Tensor, qmax: int = 32767) -> tuple[Tensor, Tensor]:
    """The 16-bit integers (as fp32) and the (M, 1) scales of round_rows16, computed as the kernel does: x times
    qmax / max |x| in fp32 (a true division: `qmax / t` is a reciprocal times qmax in torch, one rounding
    more), rounded to nearest even."""
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)
    scale = torch.where(amax.isfinite(), amax / qmax, float("nan"))
    q = torch.where(amax > 0, torch.round(x * (torch.full_like(amax, float(qmax)) / amax)).clamp(-qmax, qmax), 0.0)
    return q, scale


def linear_reference(x: Tensor, packed: Tensor, bias: Tensor = None, scales: Tensor = None,
                     offsets: Tensor = None, residual: Tensor = None, act_bits: int = 16) -> Tensor:
    """What eagle_fast::linear computes, in plain PyTorch with fp32 sums (tests compare the two); int8 weights on the
    AVX2 and AVX-512-BF16 builds, and int8 and int4 ones in tall blocks (AMX), see x rounded to 16 bits a row
    (round_rows16); act_bits 8 (int4 tall blocks, int8 lines), x rounded to 8 bits in groups of 32 (round_groups8)."""
    int16_rows = scales is not None and (offsets is None and isa() in INT16_ROW_BUILDS or packed.shape[2] == 16)
    qmax = 32639 if offsets is not None or packed.shape[3] == 64 else 32767  # int4 tiles, _vnni_lines: two signed bytes
    if act_bits == 8:
        q, s = round_groups8(x)
        xr = s.repeat_interleave(32, -1) * q  # a group with an inf or a NaN: NaN x 0
    else:
        xr = round_rows16(x, qmax) if int16_rows else x.float()
    y = F.linear(xr, dequantize(unpack(packed), scales, offsets))
    y = (y if bias is None else y + bias.float()).to(x.dtype)
    return y if residual is None else residual + y


def attention_reference(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """What eagle_fast::attention computes, in plain PyTorch: q (B, H, T, D), k, v (B, n_kv, S, D), mask (1|B, T, S).
    Up to rounding: the kernel sums in its own order, and in bf16 where the CPU has BF16 dot products or AMX it
    rounds the probabilities to bf16 for the V sums (as PyTorch's CPU FlashAttention does in bf16)."""
    H, n_kv = q.shape[1], k.shape[1]
    k, v = (t.float().repeat_interleave(H // n_kv, dim=1) for t in (k, v))
    scores = (q.float() @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    probs = scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1).nan_to_num(0.0)  # a row seeing no slot: 0
    return (probs @ v).to(q.dtype)
