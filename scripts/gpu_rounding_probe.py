"""Does a CUDA matmul round a row the same whatever the number of rows? (What bf16 EAGLE's exactness on a GPU rests
on: a one-token step and a T-token verification must compute each query row alike.)

    python scripts/gpu_rounding_probe.py      # one CUDA GPU, a few seconds

For each shape: whether row 0 is the same when the other rows change (at a fixed row count), and for which row
counts M row 0 equals its value at the largest M. The linears' bf16 GEMMs of a Llama-2-7B layer, then the two
batched products of the attention (fp32 scores Q.K^T, bf16 P.V) at 7B's and SmolLM2's head shapes. The first run
(an H200, torch 2.11, docs/gpu.md): the GEMMs and P.V gave the same row for every M; the fp32 scores rounded M = 1-5
differently from M >= 6 (7B's shape) and M = 1 from M >= 2 (SmolLM2's), which model.padded_query_rows answers.
"""
import sys

import torch
import torch.nn.functional as F


def main():
    if not torch.cuda.is_available():
        sys.exit("error: no CUDA GPU here")
    torch.manual_seed(0)
    dev = "cuda"
    for N, K in [(4096, 4096), (11008, 4096), (4096, 11008), (32000, 4096)]:
        W = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * K ** -0.5
        x = torch.randn(16, K, device=dev, dtype=torch.bfloat16)
        full = F.linear(x, W)
        x2 = x.clone()
        x2[1:] = torch.randn_like(x2[1:])
        same = [M for M in range(1, 17) if torch.equal(F.linear(x[:M], W)[0], full[0])]
        print(f"linear bf16 {N} x {K}: row 0 independent of the others: {torch.equal(F.linear(x2, W)[0], full[0])}; "
              f"M with row 0 as at M=16: {same}")
    for name, dt, a_shape, b_shape in [("scores fp32, 7B", torch.float32, (32, 32, 128), (32, 128, 600)),
                                       ("P.V bf16, 7B", torch.bfloat16, (32, 32, 600), (32, 600, 128)),
                                       ("scores fp32, SmolLM2 (3 heads a KV head)", torch.float32, (3, 96, 64), (3, 64, 600)),
                                       ("P.V bf16, SmolLM2", torch.bfloat16, (3, 96, 600), (3, 600, 64))]:
        a = torch.randn(*a_shape, device=dev, dtype=dt)
        b = torch.randn(*b_shape, device=dev, dtype=dt)
        full = a @ b
        a2 = a.clone()
        a2[:, 1:] = torch.randn_like(a2[:, 1:])
        same = [M for M in range(1, a_shape[1] + 1) if torch.equal((a[:, :M] @ b)[:, 0], full[:, 0])]
        print(f"{name}: row 0 independent of the others: {torch.equal((a2 @ b)[:, 0], full[:, 0])}; "
              f"M with row 0 as at M={a_shape[1]}: {same}")


if __name__ == "__main__":
    main()
