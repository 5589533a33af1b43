"""Loading weights in the model's own size, with the published loader's tolerance.

- a >= 1 GB checkpoint (the 7B's 4096-wide temporal layer, one of it) loads in a subprocess whose
  peak RSS stays within the model's own size + 400 MB, in float32 and in bfloat16;
- an unknown tensor is ignored with a warning naming it; a missing one is one error line naming
  it; Mimi checkpoints with the old codebook buffer names load; id -1 embeds to zeros;
- the chunked safetensors reader and writer agree with the reference library.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from personaplex_voice.errors import UserError
from personaplex_voice.model.config import ModelConfig
from personaplex_voice.model.lm import LMModel, embed
from personaplex_voice.model.loaders import MIMI_RENAMES, load_lm, load_mimi
from personaplex_voice.model.safetensors_io import (
    SafetensorsFile,
    TensorSpec,
    save_state_dict,
    write_safetensors,
)
from personaplex_voice.model.streaming import StepContext

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 1 << 20
HEADROOM_MB = 400


def big_config(golden_dir: Path) -> ModelConfig:
    """The golden model with a 7B-wide LM (dim 4096, 32 heads), one temporal layer: 527 M params."""
    raw = json.loads((golden_dir / "config.json").read_text())
    raw["lm"].update(
        dim=4096,
        num_heads=32,
        num_layers=1,
        text_card=8000,
        depformer_dim=512,
        depformer_num_heads=8,
        depformer_num_layers=1,
        depformer_dim_feedforward=2112,
    )
    return ModelConfig.from_dict(raw)


def pattern_block() -> torch.Tensor:
    return torch.randn(BLOCK, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)


def write_big_checkpoint(cfg: ModelConfig, path: Path) -> int:
    """The LM's tensors in bfloat16, each a tiling of one random block; returns the parameter count."""
    with torch.device("meta"):
        lm = LMModel(cfg.lm)
    block = pattern_block()
    specs = [TensorSpec(name, torch.bfloat16, tuple(t.shape)) for name, t in lm.state_dict().items()]

    def produce(spec: TensorSpec) -> torch.Tensor:
        n = int(np.prod(spec.shape))
        return block.repeat(-(-n // BLOCK))[:n].view(spec.shape)

    write_safetensors(path, specs, produce)
    return sum(int(np.prod(s.shape)) for s in specs)


LOAD_SCRIPT = """
import json, sys, torch
from personaplex_voice.model.config import ModelConfig
from personaplex_voice.model.loaders import host_peak_rss_mb, load_lm
torch.set_num_threads(1)
cfg = ModelConfig.from_json(sys.argv[1])
lm = load_lm(cfg, sys.argv[2], "cpu", getattr(torch, sys.argv[3]))
probe = lm.transformer.layers[0].gating.linear_in.weight[3, :8]
print(json.dumps({"peak_mb": host_peak_rss_mb(), "dtype": str(lm.dtype), "probe": probe.float().tolist(),
                  "numel": sum(t.numel() for t in lm.state_dict().values())}))
"""


def test_a_1gb_checkpoint_loads_in_its_own_size(golden_dir: Path, tmp_path: Path) -> None:
    cfg = big_config(golden_dir)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    path = tmp_path / "big.safetensors"
    try:
        numel = write_big_checkpoint(cfg, path)
        assert path.stat().st_size >= 1e9
        # where the probed tensor starts in the tiling: every tensor restarts the block
        expected_probe = pattern_block()[3 * 4096 : 3 * 4096 + 8].float().tolist()
        for dtype, element in (("float32", 4), ("bfloat16", 2)):
            proc = subprocess.run(
                [sys.executable, "-c", LOAD_SCRIPT, str(tmp_path / "config.json"), str(path), dtype],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=240,
            )
            assert proc.returncode == 0, proc.stderr[-2000:]
            report = json.loads(proc.stdout.strip().splitlines()[-1])
            assert report["numel"] == numel and report["dtype"] == f"torch.{dtype}"
            assert report["probe"] == expected_probe
            own_size_mb = numel * element / 2**20
            print(f"{dtype}: peak RSS {report['peak_mb']:.0f} MB for a {own_size_mb:.0f} MB model")
            assert report["peak_mb"] <= own_size_mb + HEADROOM_MB, (dtype, report["peak_mb"], own_size_mb)
    finally:
        path.unlink(missing_ok=True)  # 1 GB: not left in pytest's kept temp dirs


def golden_cfg(golden_dir: Path) -> ModelConfig:
    return ModelConfig.from_json(golden_dir / "config.json")


def test_an_unknown_tensor_is_ignored_with_a_warning_naming_it(golden_dir, tmp_path, caplog) -> None:
    weights = load_file(str(golden_dir / "model.safetensors"))
    save_file({**weights, "depformer.mystery_gain": torch.ones(3)}, str(tmp_path / "extra.safetensors"))
    with caplog.at_level(logging.WARNING, logger="personaplex_voice.model.loaders"):
        lm = load_lm(golden_cfg(golden_dir), tmp_path / "extra.safetensors")
    assert any("depformer.mystery_gain" in r.getMessage() for r in caplog.records)
    reference = load_lm(golden_cfg(golden_dir), golden_dir / "model.safetensors")
    for name, value in reference.state_dict().items():
        assert torch.equal(lm.state_dict()[name], value), name


def test_a_missing_tensor_is_one_line_naming_it(golden_dir, tmp_path) -> None:
    weights = load_file(str(golden_dir / "model.safetensors"))
    gone = "depformer.layers.1.gating.3.linear_out.weight"
    save_file({k: v for k, v in weights.items() if k != gone}, str(tmp_path / "short.safetensors"))
    with pytest.raises(UserError) as info:
        load_lm(golden_cfg(golden_dir), tmp_path / "short.safetensors")
    message = str(info.value)
    assert "\n" not in message and gone in message and "short.safetensors" in message


def test_old_mimi_buffer_names_load(golden_dir, tmp_path) -> None:
    cfg = golden_cfg(golden_dir)
    old = {v: k for k, v in MIMI_RENAMES.items() if k != "embed_sum"}  # new name -> old name
    renamed = {}
    for key, value in load_file(str(golden_dir / "mimi.safetensors")).items():
        prefix, _, leaf = key.rpartition(".")
        renamed[f"{prefix}.{old.get(leaf, leaf)}"] = value
    assert any(k.endswith(".embed_avg") for k in renamed) and not any(
        k.endswith(".embedding_sum") for k in renamed
    )
    save_file(renamed, str(tmp_path / "old.safetensors"))
    mimi = load_mimi(cfg, tmp_path / "old.safetensors")
    reference = load_mimi(cfg, golden_dir / "mimi.safetensors")
    for name, value in reference.state_dict().items():
        assert torch.equal(mimi.state_dict()[name], value), name
    pcm = torch.from_numpy(np.random.default_rng(0).standard_normal(4 * 1920).astype(np.float32) * 0.1)
    codes = [m.encode(pcm.view(1, 1, -1), StepContext(m.init_state(1))) for m in (mimi, reference)]
    assert torch.equal(codes[0], codes[1])


def test_token_minus_one_embeds_to_zeros_as_published() -> None:
    weight = torch.randn(5, 3)
    out = embed(torch.tensor([[-1, 0, 4, -2]]), weight)
    assert torch.equal(out[0, 0], torch.zeros(3))
    assert torch.equal(out[0, 1], weight[0]) and torch.equal(out[0, 2], weight[4])
    assert torch.equal(out[0, 3], weight[0])  # other negative ids clamp to 0, as published


def test_chunked_reader_and_writer_agree_with_the_reference_library(tmp_path, monkeypatch) -> None:
    import personaplex_voice.model.safetensors_io as io

    monkeypatch.setattr(io, "CHUNK_BYTES", 64)  # many chunks per tensor
    tensors = {
        "a": torch.randn(7, 33).to(torch.bfloat16),
        "b": torch.arange(10, dtype=torch.int64),
        "c": torch.tensor([True, False, True]),
        "d": torch.randn(2, 3, 4),
        "empty": torch.zeros(0, 4),
    }
    save_state_dict(tmp_path / "ours.safetensors", tensors)
    theirs = load_file(str(tmp_path / "ours.safetensors"))
    save_file(tensors, str(tmp_path / "theirs.safetensors"))
    with SafetensorsFile(tmp_path / "theirs.safetensors") as file:
        for name, value in tensors.items():
            assert torch.equal(theirs[name], value)
            assert torch.equal(file.read(name), value)
            if value.is_floating_point():  # converted on the way in, chunk by chunk
                assert torch.equal(file.read(name, torch.float32), value.float())
    data = (tmp_path / "theirs.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) - 40])
    with pytest.raises(UserError, match=r"cut.safetensors.*(truncated|outside)"):
        SafetensorsFile(tmp_path / "cut.safetensors")
