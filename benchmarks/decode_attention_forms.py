"""Decode attention on CPU, the shapes the dense decode rows give: SDPA against its matmul form.

One torch thread, the tiny model's heads (2 KV heads, 2 query heads each, head size 64), rows
that are views into a wider buffer as in ``DenseDecode``; microseconds a layer, beside the time
of only reading K and V once (sums over the same views).

    python benchmarks/decode_attention_forms.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

KV_HEADS, GROUP, HEAD_DIM = 2, 2, 64
CASES = [(1, 100, 128), (16, 160, 256), (64, 300, 512), (256, 300, 512)]  # rows, length, capacity


def _micros(fn, *args, repeat: int = 300) -> float:
    for _ in range(20):
        fn(*args)
    started = time.perf_counter()
    for _ in range(repeat):
        fn(*args)
    return (time.perf_counter() - started) / repeat * 1e6


def sdpa(q, k, v, mask, scale):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def matmuls(q, k, v, mask, scale):
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale).add_(mask)
    return torch.matmul(torch.softmax(scores, -1), v)


def read(q, k, v, mask, scale):  # only reading K and V once: the floor for any form
    return k.sum() + v.sum()


def main() -> None:
    torch.set_num_threads(1)
    scale = HEAD_DIM**-0.5
    for rows, length, capacity in CASES:
        dense = torch.randn(rows, 2 * KV_HEADS, capacity, HEAD_DIM)
        q = torch.randn(rows, KV_HEADS, GROUP, HEAD_DIM)
        k, v = dense[:, :KV_HEADS, :length], dense[:, KV_HEADS:, :length]
        mask = torch.zeros(rows, 1, 1, length)
        mask[::3, ..., length - 20 :] = float("-inf")
        args = (q, k, v, mask, scale)
        diff = (matmuls(*args) - sdpa(*args)).abs().max().item()
        kv_mib = 2 * k.numel() * k.element_size() / 2**20
        print(
            f"rows {rows:3d} length {length:3d}: sdpa {_micros(sdpa, *args):8.1f} us, "
            f"matmuls {_micros(matmuls, *args):8.1f} us, "
            f"reading K and V {_micros(read, *args):8.1f} us ({kv_mib:5.1f} MiB); "
            f"largest difference {diff:.1e}"
        )


if __name__ == "__main__":
    main()
