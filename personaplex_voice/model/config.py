"""Model architecture: Mimi codec + PersonaPlex LM hyper-parameters.

The dict format is the one of `../shared/golden/config.json`: `mimi.seanet`, `mimi.quantizer`,
`mimi.transformer` and `lm` use the keyword names of the published loaders (`n_q`, `dep_q`,
`card`, `delays`, `depformer_*` ...). Every module in `personaplex_voice.model` is built from
these values, never from sizes it happens to see in a weight file.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

CONFIG_FORMAT = "personaplex-voice golden tiny config v1"
log = logging.getLogger(__name__)

# Published LMModel keywords this implementation only supports at their default value.
_LM_FIXED: dict[str, Any] = {
    "norm_emb": False,
    "bias_proj": False,
    "depformer_weights_per_step_schedule": None,
    "same_initial": False,
}


@dataclass
class MimiConfig:
    """Mimi codec: SEANet encoder/decoder, split RVQ, encoder/decoder transformers.

    `seanet`, `quantizer` and `transformer` hold the published keyword arguments as-is.
    `num_codebooks` is how many of the quantizer's `n_q` codebooks are used (8 for PersonaPlex).
    """

    seanet: dict[str, Any]
    quantizer: dict[str, Any]
    transformer: dict[str, Any]
    num_codebooks: int = 8

    @property
    def hop_length(self) -> int:
        hop = 1
        for ratio in self.seanet["ratios"]:
            hop *= int(ratio)
        return hop

    @classmethod
    def published_layout(
        cls,
        *,
        dimension: int,
        n_filters: int,
        codebook_dimension: int,
        n_q: int,
        transformer_heads: int,
        transformer_layers: int,
        transformer_feedforward: int,
        num_codebooks: int = 8,
    ) -> MimiConfig:
        """The published Mimi at the given sizes: causal SEANet with strides 8, 6, 5, 4 (24 kHz ->
        25 Hz latents of `dimension`), split RVQ of `n_q` codebooks of 2048 bins in
        `codebook_dimension`, and rope transformers of `dimension` (the 7B's and the demo's Mimi)."""
        seanet = {
            "channels": 1,
            "dimension": dimension,
            "causal": True,
            "n_filters": n_filters,
            "n_residual_layers": 1,
            "activation": "ELU",
            "compress": 2,
            "dilation_base": 2,
            "disable_norm_outer_blocks": 0,
            "kernel_size": 7,
            "residual_kernel_size": 3,
            "last_kernel_size": 3,
            "norm": "none",
            "pad_mode": "constant",
            "ratios": [8, 6, 5, 4],
            "true_skip": True,
        }
        quantizer = {
            "dimension": codebook_dimension,
            "n_q": n_q,
            "bins": 2048,
            "input_dimension": dimension,
            "output_dimension": dimension,
        }
        transformer = {
            "d_model": dimension,
            "num_heads": transformer_heads,
            "num_layers": transformer_layers,
            "causal": True,
            "layer_scale": 0.01,
            "context": 250,
            "conv_layout": True,
            "max_period": 10000,
            "gating": "none",
            "norm": "layer_norm",
            "positional_embedding": "rope",
            "dim_feedforward": transformer_feedforward,
            "input_dimension": dimension,
            "output_dimensions": [dimension],
        }
        return cls(seanet=seanet, quantizer=quantizer, transformer=transformer, num_codebooks=num_codebooks)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MimiConfig:
        for key in ("seanet", "quantizer", "transformer"):
            if not isinstance(d.get(key), dict):
                raise ValueError(f"mimi.{key} must be an object")
        return cls(
            seanet=copy.deepcopy(d["seanet"]),
            quantizer=copy.deepcopy(d["quantizer"]),
            transformer=copy.deepcopy(d["transformer"]),
            num_codebooks=int(d.get("num_codebooks", 8)),
        )

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(asdict(self))


@dataclass
class LMConfig:
    """The PersonaPlex LM (temporal transformer + depth transformer), published keyword names."""

    dim: int = 4096
    text_card: int = 32000
    existing_text_padding_id: int | None = 3
    n_q: int = 16
    dep_q: int = 16
    card: int = 2048
    num_heads: int = 32
    num_layers: int = 32
    hidden_scale: float = 4.125
    causal: bool = True
    layer_scale: float | None = None
    context: int = 3000
    max_period: float = 10000
    gating: str = "silu"
    norm: str = "rms_norm_f32"
    positional_embedding: str = "rope"
    depformer_dim: int = 1024
    depformer_dim_feedforward: int | list[int] | None = 4224
    depformer_num_heads: int = 16
    depformer_num_layers: int = 6
    depformer_causal: bool = True
    depformer_layer_scale: float | None = None
    depformer_multi_linear: bool = True
    depformer_context: int | None = 8
    depformer_max_period: float = 10000
    depformer_gating: str = "silu"
    depformer_pos_emb: str = "none"
    depformer_weights_per_step: bool = True
    delays: list[int] = field(default_factory=lambda: [0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1])

    @property
    def num_streams(self) -> int:
        """Token streams per step: 1 text + n_q audio (agent codebooks then user codebooks)."""
        return self.n_q + 1

    @property
    def max_delay(self) -> int:
        return max(self.delays)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LMConfig:
        known = {f.name for f in fields(cls)}
        for key in sorted(set(d) - known):
            if key in _LM_FIXED:
                if d[key] != _LM_FIXED[key]:
                    raise ValueError(f"lm.{key} = {d[key]!r} is not supported (only {_LM_FIXED[key]!r})")
            else:
                log.warning("model config: ignoring unknown lm key %r", key)
        cfg = cls(**copy.deepcopy({k: v for k, v in d.items() if k in known}))
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if len(self.delays) != self.n_q + 1:
            raise ValueError(f"lm.delays has {len(self.delays)} entries, expected n_q + 1 = {self.n_q + 1}")
        if any(d < 0 for d in self.delays):
            raise ValueError("lm.delays must be >= 0")
        if self.dep_q > self.n_q:
            raise ValueError("lm.dep_q must be <= lm.n_q")
        if self.dim % self.num_heads or self.depformer_dim % self.depformer_num_heads:
            raise ValueError("model dims must be divisible by their head counts")
        if self.depformer_gating == "none":
            raise ValueError("the depth transformer needs a gated feed-forward (depformer_gating != 'none')")

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(asdict(self))


@dataclass
class ModelConfig:
    mimi: MimiConfig
    lm: LMConfig
    sample_rate: int = 24000
    frame_rate: float = 12.5
    lm_dtype_in_file: str = "bfloat16"
    text_tokenizer: str = "tokenizer.model"

    @property
    def frame_size(self) -> int:
        return int(self.sample_rate / self.frame_rate)

    @property
    def agent_codebooks(self) -> int:
        """Codebooks per audio side (agent / user) in the LM streams: the Mimi codebooks used."""
        return self.mimi.num_codebooks

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        if not isinstance(d, dict):
            raise ValueError("a model config must be a JSON object")
        for key in ("mimi", "lm"):
            if not isinstance(d.get(key), dict):
                raise ValueError(f"missing '{key}' section")
        cfg = cls(
            mimi=MimiConfig.from_dict(d["mimi"]),
            lm=LMConfig.from_dict(d["lm"]),
            sample_rate=int(d.get("sample_rate", 24000)),
            frame_rate=float(d.get("frame_rate", 12.5)),
            lm_dtype_in_file=str(d.get("lm_dtype_in_file", "bfloat16")),
            text_tokenizer=str(d.get("text_tokenizer", "tokenizer.model")),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        self.lm.validate()
        if self.frame_size * self.frame_rate != self.sample_rate:
            raise ValueError("sample_rate / frame_rate must be an integer frame size")
        if self.frame_size % self.mimi.hop_length:
            raise ValueError("the frame size must be a multiple of the SEANet hop length")
        if 2 * self.mimi.num_codebooks != self.lm.n_q:
            raise ValueError(
                f"lm.n_q ({self.lm.n_q}) must be twice mimi.num_codebooks ({self.mimi.num_codebooks})"
            )
        if self.mimi.num_codebooks > self.mimi.quantizer["n_q"]:
            raise ValueError("mimi.num_codebooks exceeds mimi.quantizer.n_q")
        if self.lm.card != self.mimi.quantizer["bins"]:
            raise ValueError("lm.card must equal mimi.quantizer.bins")

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": CONFIG_FORMAT,
            "sample_rate": self.sample_rate,
            "frame_rate": self.frame_rate,
            "mimi": self.mimi.to_dict(),
            "lm": self.lm.to_dict(),
            "lm_dtype_in_file": self.lm_dtype_in_file,
            "text_tokenizer": self.text_tokenizer,
        }

    @classmethod
    def personaplex_7b(cls) -> ModelConfig:
        """The published nvidia/personaplex-7b-v1 architecture (dep_q = 16, as its loader sets)."""
        mimi = MimiConfig.published_layout(
            dimension=512,
            n_filters=64,
            codebook_dimension=256,
            n_q=32,
            transformer_heads=8,
            transformer_layers=8,
            transformer_feedforward=2048,
        )
        return cls(mimi=mimi, lm=LMConfig(), text_tokenizer="tokenizer_spm_32k_3.model")
