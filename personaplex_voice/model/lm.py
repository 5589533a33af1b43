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
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from personaplex_voice.model import fused_ops
from personaplex_voice.model.config import LMConfig
from personaplex_voice.model.embedding_tables import PackedEmbeddings
from personaplex_voice.model.quant import Weight, linear, pack_rows, storage_key, weight_rows
from personaplex_voice.model.rope import rope_tables, rotate
from personaplex_voice.model.streaming import StepContext, StreamState, init_state, name_streaming_modules
from personaplex_voice.model.transformer import (
    ActivationGating,
    LayerScale,
    StreamingTransformer,
    add_then_norm,
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

    FUSED_FLAGS: ClassVar[dict[str, str]] = {"step_attention": "fused_attention"}

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
        self._kv_buffers: dict[tuple, list[torch.Tensor]] = {}
        # a step's key/value append and attention as one kernel (fused_ops.step_attention_op)
        self.fused_attention = False

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
                            gating,
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
        self, x: torch.Tensor, step: int, kv: list[torch.Tensor], x_added: torch.Tensor
    ) -> torch.Tensor:
        """One depformer step for every slot on the input x + x_added [B, dim] (summed inside
        the first norm). kv: per layer, this tick's keys and values [B, 2, H, steps, D]
        (entries past `step` hold an earlier tick's values, masked)."""
        B = x.shape[0]
        H, D = self.num_heads, self.dim // self.num_heads
        weights = self._step_weights(x.device)[step]
        mask = self._masks[step]
        first = max(0, step + 2 - self.steps)  # the entries this step attends: first..step
        h = x[:, None]
        pending = x_added[:, None]  # added inside the next norm (here: the input's second part)
        for li, (norm1, w_in, w_out, ls1, norm2, gating, ls2) in enumerate(weights):
            h, y = add_then_norm(norm1, h, pending)
            qkv = linear(y[:, 0], w_in).view(B, 3, H, D)
            if self.rope_period is None and self.fused_attention:
                out = fused_ops.step_attention_op(qkv, kv[li], step, first)
            else:
                if self.rope_period is not None:
                    positions = torch.full((B, 1), step, device=x.device, dtype=torch.long)
                    qk = rotate(qkv[:, None, :2], rope_tables(positions, D, self.rope_period))[:, 0]
                    kv[li][:, 0, :, step] = qk[:, 1]
                    kv[li][:, 1, :, step] = qkv[:, 2]
                    q = qk[:, 0, :, None]
                else:
                    kv[li][:, :, :, step] = qkv[:, 1:]  # k and v of this step in one copy
                    q = qkv[:, 0, :, None]  # [B, H, 1, D]
                out = F.scaled_dot_product_attention(q, kv[li][:, 0], kv[li][:, 1], mask)
            out = linear(out.reshape(B, self.dim), w_out)[:, None]
            h, y = add_then_norm(norm2, h, out if ls1 is None else ls1.forward(out))
            update = gating.forward(y)
            pending = update if ls2 is None else ls2.forward(update)
        assert pending is not None
        return (h + pending)[:, 0]

    def kv_buffers(self, batch: int, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
        """The per-layer key/value buffers of a tick [B, 2, H, steps, D], made once per batch
        size and reused (static addresses for a CUDA graph; no zeroing per tick: an entry is
        written before any step attends to it)."""
        key = (batch, device, dtype)
        buffers = self._kv_buffers.get(key)
        if buffers is None:
            shape = (batch, 2, self.num_heads, self.steps, self.dim // self.num_heads)
            buffers = [torch.zeros(shape, device=device, dtype=dtype) for _ in self.layers]
            self._kv_buffers[key] = buffers
        return buffers


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
        self._input_key: tuple | None = None
        # packed weights and tables (a dict: nn.Module would register an Int8Weight as a submodule)
        self._packed: dict[str, Weight | PackedEmbeddings] = {}
        self.linears = nn.ModuleList(
            [nn.Linear(cfg.depformer_dim, cfg.card, bias=False) for _ in range(cfg.dep_q)]
        )
        name_streaming_modules(self)

    def depformer_input_weight(self) -> Weight:
        """The depformer's input projections as one [steps * depformer_dim, dim] weight. The
        per-step weights (checkpoint names unchanged) are rebound as row views of it, so it costs
        no memory; rebuilt when the weights were replaced (a load, int8 quantization)."""
        weights = [m.weight for m in self.depformer_in]
        key = tuple(storage_key(w) for w in weights)
        if self._input_key != key:
            self._packed["depformer_in"] = pack_rows(self.depformer_in, "weight")
            self._input_key = tuple(storage_key(m.weight) for m in self.depformer_in)
        return self._packed["depformer_in"]

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

    def _tables(self, name: str, modules: list[nn.Embedding]) -> PackedEmbeddings:
        """`modules`' tables packed into one storage (model/embedding_tables.py), made at first
        use and again after their weights were replaced."""
        tables = self._packed.get(name)
        if not isinstance(tables, PackedEmbeddings) or tables.stale(modules):
            tables = PackedEmbeddings(modules)
            self._packed[name] = tables
        return tables

    def embed_codes(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, 17, T] -> summed input embeddings [B, T, dim] (published summation order:
        audio codebooks 1..n_q, then the text)."""
        e = self._tables("embeddings", [self.text_emb, *self.emb]).lookup_all(tokens)  # [B, 17, T, dim]
        x = e[:, 1]
        for i in range(2, self.n_q + 1):
            x = x + e[:, i]
        return x + e[:, 0]

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
        kv = self.depformer.kv_buffers(B, hidden.device, hidden.dtype)
        # Every step's input projection reads the same hidden state: one matmul for all of them.
        inputs = linear(hidden, self.depformer_input_weight()).view(B, -1, self.depformer.dim)
        multi = inputs.shape[1] > 1
        tables = self._tables("depformer_embeddings", [self.depformer_text_emb, *self.depformer_emb])
        prev = text_token
        sampled = []
        for cb in range(self.dep_q):
            # the step's input (projection + embedding of the previous token) is summed in the
            # first layer's norm: one kernel on a GPU
            out = self.depformer.forward_step(inputs[:, cb if multi else 0], cb, kv, tables.lookup(prev, cb))
            logits = linear(out, self.linears[cb].weight).float()
            if logits_out is not None:
                logits_out[:, cb] = logits
            token = sample(logits, cb)
            sampled.append(token)
            prev = torch.where(forced_mask[:, cb], forced[:, cb], token)
        return torch.stack(sampled, dim=1)
