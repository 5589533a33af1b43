"""Split residual vector quantizer (Mimi): one semantic codebook + residual acoustic codebooks.

Both halves quantize the same input (each through its own 1x1 projection); only the first
`num_codebooks` of the `n_q` trained codebooks are used. Inference only: the codebook vectors are
`embedding_sum / cluster_usage`, computed once after loading (`refresh()`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


class EuclideanCodebook(nn.Module):
    def __init__(self, dim: int, bins: int, epsilon: float = 1e-5):
        super().__init__()
        self.epsilon = epsilon
        self.register_buffer("_initialized", torch.tensor([False], dtype=torch.float))
        self.register_buffer("cluster_usage", torch.ones(bins))
        self.register_buffer("embedding_sum", torch.zeros(bins, dim))
        self._embedding: torch.Tensor | None = None
        self._padded: torch.Tensor | None = None
        self._ones_cols: dict[tuple, torch.Tensor] = {}

    @property
    def embedding(self) -> torch.Tensor:
        if self._embedding is None or self._embedding.device != self.embedding_sum.device:
            self.refresh()
        assert self._embedding is not None
        return self._embedding

    def refresh(self) -> None:
        emb = self.embedding_sum / self.cluster_usage.clamp(min=self.epsilon)[:, None]
        self._embedding = emb
        # torch.cdist(p=2) on a codebook this size computes [x, 1, |x|^2]-style padded matmuls
        # (ATen's _euclidean_dist); the codebook half is constant, so it is built once here.
        emb_norm = emb.pow(2).sum(-1, keepdim=True)
        self._padded = torch.cat([emb, torch.ones_like(emb_norm), emb_norm], -1)

    @torch.no_grad()
    def set_centroids(self, centroids: torch.Tensor) -> None:
        """Make `centroids` [bins, dim] the codebook vectors (random init: no weights file)."""
        self.embedding_sum.copy_(centroids)
        self.cluster_usage.fill_(1.0)
        self.refresh()

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] -> codes [N] (nearest centroid), the same distances as torch.cdist."""
        if self._embedding is None or self._embedding.device != self.embedding_sum.device:
            self.refresh()
        if self._embedding.shape[0] <= 25 and x.shape[0] <= 25:  # cdist's direct (non-matmul) path
            return torch.cdist(x[None], self.embedding[None], p=2)[0].argmin(dim=-1)
        x_norm = x.pow(2).sum(-1, keepdim=True)
        padded = torch.cat([x.mul(-2), x_norm, self._ones(x_norm)], -1)
        dists = padded.matmul(self._padded.mT).clamp_min_(0).sqrt_()
        return dists.argmin(dim=-1)

    def _ones(self, like: torch.Tensor) -> torch.Tensor:
        """A column of ones like `like` [N, 1], made once per shape, never replaced (a captured
        CUDA graph keeps reading the one it was captured with)."""
        key = (tuple(like.shape), like.dtype, like.device)
        ones = self._ones_cols.get(key)
        if ones is None:
            ones = self._ones_cols[key] = torch.ones_like(like)
        return ones

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return F.embedding(codes, self.embedding)


class _VQLayer(nn.Module):
    def __init__(self, dim: int, bins: int):
        super().__init__()
        self._codebook = EuclideanCodebook(dim, bins)


class _RVQ(nn.Module):
    def __init__(self, dim: int, bins: int, n_q: int):
        super().__init__()
        self.layers = nn.ModuleList([_VQLayer(dim, bins) for _ in range(n_q)])


class ResidualVectorQuantizer(nn.Module):
    def __init__(self, dimension: int, input_dimension: int, output_dimension: int, n_q: int, bins: int):
        super().__init__()
        self.input_proj: nn.Module = (
            nn.Identity()
            if input_dimension == dimension
            else nn.Conv1d(input_dimension, dimension, 1, bias=False)
        )
        self.output_proj: nn.Module = (
            nn.Identity()
            if output_dimension == dimension
            else nn.Conv1d(dimension, output_dimension, 1, bias=False)
        )
        self.vq = _RVQ(dimension, bins, n_q)

    @property
    def codebooks(self) -> list[EuclideanCodebook]:
        """The codebooks in residual order (stored as `vq.layers.N._codebook`, the published keys)."""
        return [layer._codebook for layer in self.vq.layers]

    def encode(self, x: torch.Tensor, n_q: int) -> torch.Tensor:
        """x [B, C, T] -> codes [B, n_q, T]."""
        x = self.input_proj(x)
        B, D, T = x.shape
        residual = x.transpose(1, 2).reshape(B * T, D)
        codes = []
        for layer in self.vq.layers[:n_q]:
            cb = layer._codebook
            idx = cb.encode(residual)
            residual = residual - cb.decode(idx)
            codes.append(idx.view(B, T))
        return torch.stack(codes, dim=1)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, K, T] -> [B, C, T]."""
        quantized: torch.Tensor | float = 0.0
        for i in range(codes.shape[1]):
            quantized = quantized + self.vq.layers[i]._codebook.decode(codes[:, i])
        assert isinstance(quantized, torch.Tensor)
        return self.output_proj(quantized.transpose(1, 2))


class SplitResidualVectorQuantizer(nn.Module):
    def __init__(self, cfg: dict[str, Any], num_codebooks: int, n_q_semantic: int = 1):
        super().__init__()
        n_q = cfg["n_q"]
        kwargs = dict(
            dimension=cfg["dimension"],
            input_dimension=cfg.get("input_dimension") or cfg["dimension"],
            output_dimension=cfg.get("output_dimension") or cfg["dimension"],
            bins=cfg["bins"],
        )
        self.n_q_semantic = n_q_semantic
        self.num_codebooks = num_codebooks
        self.rvq_first = ResidualVectorQuantizer(n_q=n_q_semantic, **kwargs)
        self.rvq_rest = ResidualVectorQuantizer(n_q=n_q - n_q_semantic, **kwargs)

    @property
    def halves(self) -> tuple[ResidualVectorQuantizer, ResidualVectorQuantizer]:
        """The semantic and the acoustic quantizer: each projects and quantizes the same input."""
        return self.rvq_first, self.rvq_rest

    def refresh(self) -> None:
        for module in self.modules():
            if isinstance(module, EuclideanCodebook):
                module.refresh()

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        codes = self.rvq_first.encode(x, self.n_q_semantic)
        if self.num_codebooks > self.n_q_semantic:
            rest = self.rvq_rest.encode(x, self.num_codebooks - self.n_q_semantic)
            codes = torch.cat([codes, rest], dim=1)
        return codes

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        quantized = self.rvq_first.decode(codes[:, : self.n_q_semantic])
        if codes.shape[1] > self.n_q_semantic:
            quantized = quantized + self.rvq_rest.decode(codes[:, self.n_q_semantic :])
        return quantized
