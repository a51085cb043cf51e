"""The chunked loss against the plain one on the loss alone, on one device:
``python -m benchmarks.chunked_loss [--device cuda] [--tokens 16384] [--dim 4096] [--vocab 128256]
[--chunks 0,1024,2048,4096]``.

The 8B row of issue 41 by default (Llama 3.1 8B's head, 2 × 8192 tokens of one FSDP rank,
bf16): final-normed hidden states ``(tokens, dim)`` and a bf16 head ``(vocab, dim)``; per chunk
size (0: the plain loss, ``ray_titan.trainer.build.cross_entropy_loss``; else
``ray_titan.trainer.chunked_loss.ChunkedCrossEntropy``) it prints the forward-and-backward's
peak of allocated bytes above what was allocated before (``torch.cuda.max_memory_allocated``;
on CPU nothing), its median time over 5 runs after one warm-up, and how far the loss and the
gradients are from the plain loss's (relative norm of the difference).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from ray_titan.trainer.build import cross_entropy_loss
from ray_titan.trainer.chunked_loss import ChunkedCrossEntropy


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.chunked_loss", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--chunks", default="0,1024,2048,4096")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    args = ap.parse_args(argv)
    dev, dtype = torch.device(args.device), torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    head = nn.Linear(args.dim, args.vocab, bias=False, device=dev, dtype=dtype)
    nn.init.normal_(head.weight, std=0.02)
    hidden = torch.randn(2, args.tokens // 2, args.dim, device=dev, dtype=dtype)
    labels = torch.randint(0, args.vocab, (2, args.tokens // 2), device=dev)
    cuda = dev.type == "cuda"
    ref: tuple[torch.Tensor, ...] | None = None
    print(f"{args.tokens} tokens, dim {args.dim}, vocab {args.vocab}, {args.dtype}, {args.device}"
          + (f" ({torch.cuda.get_device_name(dev)})" if cuda else ""))
    for chunk in [int(c) for c in args.chunks.split(",")]:
        loss_fn = ChunkedCrossEntropy(head, chunk) if chunk else (lambda h, y: cross_entropy_loss(head(h), y))
        times, peak = [], 0
        for i in range(6):
            h = hidden.detach().requires_grad_(True)
            head.weight.grad = None
            if cuda:
                torch.cuda.synchronize(dev)
                torch.cuda.reset_peak_memory_stats(dev)
                before = torch.cuda.memory_allocated(dev)
            t = time.perf_counter()
            loss = loss_fn(h, labels)
            loss.backward()
            if cuda:
                torch.cuda.synchronize(dev)
                peak = max(peak, torch.cuda.max_memory_allocated(dev) - before)
            if i:
                times.append(time.perf_counter() - t)
        got = (loss.detach().float(), h.grad.float(), head.weight.grad.float())
        if ref is None:
            ref = got
        err = max(float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(got, ref))
        ms = statistics.median(times) * 1e3
        print(f"chunk {chunk or 'plain':>6}: peak {peak / 2**30:6.2f} GiB  median {ms:8.1f} ms"
              f"  loss {got[0].item():.5f}  max relative error vs plain {err:.2e}")
        del loss, h, got
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
