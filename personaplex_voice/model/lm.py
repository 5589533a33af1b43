"""The PersonaPlex LM: temporal transformer over 17 token streams + depth transformer.

Per step, the temporal transformer reads the sum of the 17 stream embeddings (text, 8 agent
codebooks, 8 user codebooks) and gives a hidden state, from which `text_linear` predicts the
text token. The depth transformer ("depformer") then predicts the `dep_q` audio tokens one after
the other, each conditioned on the previous token (text first) through a fresh 16-step causal
attention (`depformer_weights_per_step`: one set of weights per step; `depformer_multi_linear`:
one input projection per step). Attribute names match the published checkpoint keys.

Token bookkeeping (delays, forcing) lives in `personaplex_voice.engine.tokens`, sampling in
`personaplex_voice.engine.sampling`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from personaplex_voice.model.config import LMConfig
from personaplex_voice.model.quant import linear, storage_key, weight_rows
from personaplex_voice.model.streaming import StepContext, StreamState, init_state, name_streaming_modules
from personaplex_voice.model.transformer import (
    ActivationGating,
    LayerScale,
    StreamingTransformer,
    apply_rope,
    make_norm,
)

# sample(logits [B, card] float32, codebook index) -> tokens [B] long
AudioSampler = Callable[[torch.Tensor, int], torch.Tensor]
# The published embeddings' `zero_idx`: this token id embeds to a zero vector (other negative
# ids embed as id 0).
ZERO_TOKEN_ID = -1


def embed(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Embedding lookup with the published `zero_idx` semantics (see ZERO_TOKEN_ID)."""
    return F.embedding(ids.clamp(min=0), weight).masked_fill_((ids == ZERO_TOKEN_ID)[..., None], 0.0)


class _DepformerAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, num_weights: int):
        super().__init__()
        self.num_heads = num_heads
        self.in_proj_weight = nn.Parameter(torch.empty(num_weights * 3 * dim, dim))
        self.out_proj = nn.Linear(dim, num_weights * dim, bias=False)
        nn.init.xavier_uniform_(self.in_proj_weight)


class _DepformerLayer(nn.Module):
    def __init__(self, cfg: LMConfig, num_weights: int, dim_feedforward: int | list[int]):
        super().__init__()
        dim = cfg.depformer_dim
        self.self_attn = _DepformerAttention(dim, cfg.depformer_num_heads, num_weights)
        self.norm1 = make_norm(cfg.norm, dim)
        self.norm2 = make_norm(cfg.norm, dim)
        gating: nn.Module
        if cfg.depformer_weights_per_step:
            dims = dim_feedforward if isinstance(dim_feedforward, list) else [dim_feedforward] * num_weights
            if len(dims) != num_weights:
                raise ValueError("depformer_dim_feedforward needs one width per depformer step")
            gating = nn.ModuleList([ActivationGating(dim, ff, cfg.depformer_gating) for ff in dims])
        else:
            if isinstance(dim_feedforward, list):
                raise ValueError("a list depformer_dim_feedforward needs depformer_weights_per_step")
            gating = ActivationGating(dim, dim_feedforward, cfg.depformer_gating)
        self.gating = gating
        ls = cfg.depformer_layer_scale
        self.layer_scale_1: nn.Module = nn.Identity() if ls is None else LayerScale(dim, ls)
        self.layer_scale_2: nn.Module = nn.Identity() if ls is None else LayerScale(dim, ls)


class Depformer(nn.Module):
    """The depth transformer: `dep_q` sequential steps, a fresh causal attention every tick."""

    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.cfg = cfg
        self.dim = cfg.depformer_dim
        self.num_heads = cfg.depformer_num_heads
        self.steps = cfg.dep_q
        self.per_step = bool(cfg.depformer_weights_per_step)
        num_weights = cfg.dep_q if self.per_step else 1
        ff = cfg.depformer_dim_feedforward
        if ff is None:
            ff = int(cfg.hidden_scale * cfg.depformer_dim)
        if cfg.depformer_pos_emb not in ("none", "rope"):
            raise ValueError(f"unsupported depformer_pos_emb {cfg.depformer_pos_emb!r}")
        self.rope_period = float(cfg.depformer_max_period) if cfg.depformer_pos_emb == "rope" else None
        self.layers = nn.ModuleList(
            [_DepformerLayer(cfg, num_weights, ff) for _ in range(cfg.depformer_num_layers)]
        )

    def _step_weights(self, device: torch.device) -> list[list[tuple]]:
        """Per step, per layer: the weights the step uses (views built once, not per tick)."""
        key = storage_key(self.layers[0].self_attn.in_proj_weight)
        if getattr(self, "_weights_key", None) != key:
            table = []
            for step in range(self.steps):
                w = step if self.per_step else 0
                rows = []
                for layer in self.layers:
                    attn = layer.self_attn
                    gating = layer.gating[w] if self.per_step else layer.gating
                    rows.append(
                        (
                            layer.norm1,
                            weight_rows(attn.in_proj_weight, w, 3 * self.dim),
                            weight_rows(attn.out_proj.weight, w, self.dim),
                            None if isinstance(layer.layer_scale_1, nn.Identity) else layer.layer_scale_1,
                            layer.norm2,
                            gating.linear_in.weight,
                            gating.linear_out.weight,
                            gating.activation,
                            None if isinstance(layer.layer_scale_2, nn.Identity) else layer.layer_scale_2,
                        )
                    )
                table.append(rows)
            self._weights = table
            # As in the published ring KV cache (capacity = steps), a full ring masks its oldest
            # entry: the last step does not attend to the first.
            index = torch.arange(self.steps, device=device)
            self._masks = [
                ((index >= max(0, s + 2 - self.steps)) & (index <= s)).view(1, self.steps)
                for s in range(self.steps)
            ]
            self._weights_key = key
        return self._weights

    def forward_step(
        self, x: torch.Tensor, step: int, keys: list[torch.Tensor], values: list[torch.Tensor]
    ) -> torch.Tensor:
        """One depformer step for every slot. x [B, dim]; keys/values: per-layer caches [B, H, steps, D]."""
        B = x.shape[0]
        H, D = self.num_heads, self.dim // self.num_heads
        weights = self._step_weights(x.device)[step]
        mask = self._masks[step]
        h = x[:, None]
        for li, (norm1, w_in, w_out, ls1, norm2, g_in, g_out, act, ls2) in enumerate(weights):
            y = norm1.forward(h)
            q, k, v = linear(y[:, 0], w_in).view(B, 3, H, 1, D).unbind(1)
            if self.rope_period is not None:
                pos = torch.full((B, 1), step, device=x.device, dtype=torch.long)
                q, k = apply_rope(q, k, pos, self.rope_period)
            keys[li][:, :, step : step + 1] = k
            values[li][:, :, step : step + 1] = v
            out = F.scaled_dot_product_attention(q, keys[li], values[li], mask)
            out = linear(out.reshape(B, self.dim), w_out)[:, None]
            h = h + (out if ls1 is None else ls1.forward(out))
            g = linear(norm2.forward(h), g_in)
            g = g.view(*g.shape[:-1], 2, -1)
            g = linear(act(g[..., 0, :]) * g[..., 1, :], g_out)
            h = h + (g if ls2 is None else ls2.forward(g))
        return h[:, 0]

    def new_caches(
        self, batch: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        shape = (batch, self.num_heads, self.steps, self.dim // self.num_heads)
        keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in self.layers]
        values = [torch.zeros(shape, device=device, dtype=dtype) for _ in self.layers]
        return keys, values


class LMModel(nn.Module):
    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.cfg = cfg
        dim = cfg.dim
        self.n_q = cfg.n_q
        self.dep_q = cfg.dep_q
        self.card = cfg.card
        self.text_card = cfg.text_card
        self.emb = nn.ModuleList([nn.Embedding(cfg.card + 1, dim) for _ in range(cfg.n_q)])
        self.text_emb = nn.Embedding(cfg.text_card + 1, dim)
        extra_text = 1 if cfg.existing_text_padding_id is None else 0
        self.text_linear = nn.Linear(dim, cfg.text_card + extra_text, bias=False)
        self.transformer = StreamingTransformer(
            d_model=dim,
            num_heads=cfg.num_heads,
            num_layers=cfg.num_layers,
            dim_feedforward=int(cfg.hidden_scale * dim),
            context=cfg.context,
            positional_embedding=cfg.positional_embedding,
            max_period=cfg.max_period,
            norm=cfg.norm,
            layer_scale=cfg.layer_scale,
            gating=cfg.gating,
            causal=cfg.causal,
        )
        self.out_norm = make_norm(cfg.norm, dim)
        n_in = cfg.dep_q if cfg.depformer_multi_linear else 1
        self.depformer_in = nn.ModuleList(
            [nn.Linear(dim, cfg.depformer_dim, bias=False) for _ in range(n_in)]
        )
        self.depformer_emb = nn.ModuleList(
            [nn.Embedding(cfg.card + 1, cfg.depformer_dim) for _ in range(cfg.dep_q - 1)]
        )
        self.depformer_text_emb = nn.Embedding(cfg.text_card + 1, cfg.depformer_dim)
        self.depformer = Depformer(cfg)
        self.linears = nn.ModuleList(
            [nn.Linear(cfg.depformer_dim, cfg.card, bias=False) for _ in range(cfg.dep_q)]
        )
        name_streaming_modules(self)

    @property
    def initial_token_id(self) -> int:
        return self.card

    @property
    def text_initial_token_id(self) -> int:
        return self.text_card

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (the embeddings' dtype: embeddings are never quantized)."""
        return self.text_emb.weight.dtype

    def set_kv_dtype(self, dtype: torch.dtype | None) -> None:
        """Keep the temporal transformer's KV cache in `dtype` (None = the compute dtype)."""
        for layer in self.transformer.layers:
            layer.self_attn.kv_dtype = dtype

    def init_state(self, batch: int, device: torch.device | str | None = None) -> StreamState:
        weight = self.text_emb.weight
        return init_state(self, batch, device or weight.device, weight.dtype)

    def reset_slot(self, state: StreamState, slot: int) -> None:
        """Fresh state for one slot: empty KV rings, position 0, nothing pinned."""
        for key, value in state.items():
            if key.endswith(":kpos"):
                value[slot] = -1
            else:
                value[slot] = 0

    def embed_codes(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, 17, T] -> summed input embeddings [B, T, dim] (published summation order)."""
        x = embed(tokens[:, 1], self.emb[0].weight)
        for i in range(1, self.n_q):
            x = x + embed(tokens[:, i + 1], self.emb[i].weight)
        return x + embed(tokens[:, 0], self.text_emb.weight)

    def forward_embeddings(self, x: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, dim] -> (normed hidden [B, T, dim], text logits [B, T, text_card])."""
        out = self.out_norm(self.transformer(x, ctx))
        return out, linear(out, self.text_linear.weight)

    def depformer_tokens(
        self,
        hidden: torch.Tensor,
        text_token: torch.Tensor,
        forced: torch.Tensor,
        forced_mask: torch.Tensor,
        sample: AudioSampler,
        logits_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Sample the `dep_q` audio tokens of one step.

        hidden [B, dim] (temporal transformer output), text_token [B] (the step's text token),
        forced / forced_mask [B, dep_q]: where a token is forced, the next step is fed the forced
        token instead of the sampled one. Returns the *sampled* tokens [B, dep_q]; writes the
        float32 logits into `logits_out` [B, dep_q, card] when given.
        """
        B = hidden.shape[0]
        keys, values = self.depformer.new_caches(B, hidden.device, hidden.dtype)
        prev = text_token
        sampled = []
        multi = len(self.depformer_in) > 1
        for cb in range(self.dep_q):
            x = linear(hidden, self.depformer_in[cb if multi else 0].weight)
            emb = self.depformer_text_emb if cb == 0 else self.depformer_emb[cb - 1]
            x = x + embed(prev, emb.weight)
            out = self.depformer.forward_step(x, cb, keys, values)
            logits = linear(out, self.linears[cb].weight).float()
            if logits_out is not None:
                logits_out[:, cb] = logits
            token = sample(logits, cb)
            sampled.append(token)
            prev = torch.where(forced_mask[:, cb], forced[:, cb], token)
        return torch.stack(sampled, dim=1)
