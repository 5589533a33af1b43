"""Time the SDPA backends at the temporal transformer's shapes (prints one JSON line).

    python bench/sdpa_backends.py [--device cuda] [--slots 64] [--dtype bfloat16]

Decode: one query per slot and head against the whole ring, with the ring's mask (its oldest
entry masked), 64 slots x 32 heads x 1 query x 3000 keys x 128 by default. Prefill: one slot,
a chunk of 64 queries against the ring, causal. Each backend (cudnn, flash, efficient, math)
runs alone (`sdpa_kernel`); a backend torch refuses for the shape or the mask is listed with its
reason; each that runs is checked against the math backend. `winner` is what the engine pins at
warm-up (engine/gpu_tuning.py measures the same way, on its own KV cache). `bench/gpu_check.py`
runs this first.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from personaplex_voice.model.attention import time_backends

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def ring_mask(slots: int, queries: int, keys: int, device: torch.device) -> torch.Tensor:
    """[slots, 1, queries, keys]: causal over the ring, its oldest entry masked (a full ring)."""
    mask = torch.ones(slots, 1, queries, keys, dtype=torch.bool, device=device)
    mask = mask.tril(diagonal=keys - queries)
    mask[..., 0] = False
    return mask


@torch.no_grad()
def measure(
    device: str = "cuda",
    slots: int = 64,
    heads: int = 32,
    keys: int = 3000,
    head_dim: int = 128,
    chunk: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    reps: int = 10,
) -> dict[str, Any]:
    dev = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    out: dict[str, Any] = {"dtype": str(dtype).replace("torch.", "")}

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dev, dtype)

    k, v = rand(slots, heads, keys, head_dim), rand(slots, heads, keys, head_dim)
    decode = time_backends(rand(slots, heads, 1, head_dim), k, v, ring_mask(slots, 1, keys, dev), reps=reps)
    out["decode"] = decode.as_dict()
    prefill = time_backends(
        rand(1, heads, chunk, head_dim), k[:1], v[:1], ring_mask(1, chunk, keys, dev), reps=reps
    )
    out["prefill"] = prefill.as_dict()
    del k, v
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--keys", type=int, default=3000)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    args = parser.parse_args()
    print(json.dumps(measure(args.device, args.slots, keys=args.keys, dtype=DTYPES[args.dtype])))


if __name__ == "__main__":
    main()
