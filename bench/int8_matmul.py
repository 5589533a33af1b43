"""The measurement behind `--quantize int8`'s kernel choice: ms per weight-only int8 matmul.

    .venv/bin/python bench/int8_matmul.py [--device cpu] [--threads 1]

For the 7B's typical shapes (temporal layer in-projection, depth-transformer gating) at a few
batch sizes and float32 / bfloat16 activations: the dense matmul, `torch._weight_int8pack_mm`,
dequantise-then-matmul, and torchao's int8 weight-only layout when torchao is installed (it is
not a dependency: `pip install torchao` to include it). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.nn import functional as F


def ms(fn, n: int, device: str) -> float:
    fn()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - t0) / n


def torchao_linear(weight: torch.Tensor):
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except Exception:
        return None
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device)
    layer = layer.to(weight.dtype)
    layer.weight.data = weight.clone()
    quantize_(layer, Int8WeightOnlyConfig())
    return layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {}
    with torch.no_grad():
        for m, n, k in [(1, 12288, 4096), (8, 12288, 4096), (1, 5632, 1024), (16, 5632, 1024)]:
            w = torch.randn(n, k, device=args.device) * 0.02
            s = w.abs().amax(1) / 127
            q = torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8)
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(m, k, device=args.device).to(dtype)
                wd, sd = w.to(dtype), s.to(dtype)
                row = {
                    "dense": ms(lambda x=x, wd=wd: F.linear(x, wd), args.runs, args.device),
                    "int8pack_mm": ms(
                        lambda x=x, sd=sd, q=q: torch._weight_int8pack_mm(x, q, sd), args.runs, args.device
                    ),
                    "dequant": ms(
                        lambda x=x, sd=sd, q=q: F.linear(x, q.to(x.dtype)) * sd, args.runs, args.device
                    ),
                }
                layer = torchao_linear(wd)
                if layer is not None:
                    row["torchao"] = ms(lambda x=x, layer=layer: layer(x), args.runs, args.device)
                name = f"{m}x{k}->{n} {str(dtype).removeprefix('torch.')}"
                results[name] = {key: round(value, 3) for key, value in row.items()}
                print(name, results[name], flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
