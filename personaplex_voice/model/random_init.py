"""Random Mimi weights that still make a usable toy codec (`load_mimi(cfg, None)`, the demo model).

A freshly initialised Mimi is useless even as a toy: its codebooks start empty (all zero), so
every input encodes to code 0, and its decoder's output is a fixed pattern set by its biases,
whatever the codes. `init_random_mimi` turns it into a codec that hears its input and answers
with varied sound:
- each RVQ level's centroids are drawn from the (residual) latents of synthetic calibration
  audio, plus jitter, like a k-means start;
- the decoder sees only what differs between codes: the codebooks' common direction is projected
  out of each quantizer's output projection, which is scaled to unit variance, and the SEANet
  decoder's conv biases are zeroed;
- the last conv becomes a gentle low-pass at speech level (`target_rms`) with no DC offset.

torch is imported inside the functions: `synthetic_voice` (the calibration sound, also the demo's
voice prompts) is used by the demo's asset maker, which runs without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from personaplex_voice.model.mimi import Mimi
    from personaplex_voice.model.quantizer import ResidualVectorQuantizer

SAMPLE_RATE = 24_000
# The calibration voices: a high and a low one (the demo's two voices use the same pitches).
CALIBRATION_PITCHES_HZ = (210.0, 115.0)
_WARMUP_FRAMES = 10  # decoder output frames skipped when measuring its level (streaming start-up)


def init_random_mimi(mimi: Mimi, generator: torch.Generator | None = None, target_rms: float = 0.05) -> None:
    """Tune a randomly initialised `mimi` (float32, any device) in place into a toy codec.

    Random draws come from `generator` (a CPU generator, so a seed gives the same codec on every
    device); None = one seeded from the global RNG, so `torch.manual_seed` before building the
    model fixes its codec as it fixes its other random weights.
    """
    import torch

    from personaplex_voice.model.streaming import StepContext

    if generator is None:
        generator = torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,)).item()))
    param = next(mimi.parameters())
    pcm = torch.from_numpy(calibration_audio(mimi.frame_size)).to(param.device).view(1, 1, -1)
    with torch.no_grad():
        latents = mimi.encode_latents(pcm, StepContext(mimi.init_state(1)))
        for rvq in mimi.quantizer.halves:
            _seed_codebooks(rvq, rvq.input_proj(latents)[0].T.float(), generator)
        for rvq in mimi.quantizer.halves:
            _decode_differences_only(rvq, generator)
        for module in mimi.decoder.modules():
            if isinstance(module, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)) and module.bias is not None:
                module.bias.zero_()
        _shape_output(mimi, target_rms, generator)


def _seed_codebooks(rvq: ResidualVectorQuantizer, latents: torch.Tensor, generator: torch.Generator) -> None:
    """Each level's centroids: random residual latents [frames, dim] of the level, plus jitter."""
    import torch

    residual = latents
    for book in rvq.codebooks:
        bins = book.embedding_sum.shape[0]
        pick = torch.randint(0, residual.shape[0], (bins,), generator=generator).to(residual.device)
        noise = torch.randn((bins, residual.shape[1]), generator=generator).to(residual.device)
        jitter = 0.3 * residual.std(dim=0, keepdim=True) * noise
        book.set_centroids(residual[pick] + jitter)
        residual = residual - book.decode(book.encode(residual))


def _decode_differences_only(rvq: ResidualVectorQuantizer, generator: torch.Generator) -> None:
    """Project the codebooks' shared mean out of the output projection; scale to unit variance."""
    import torch

    proj = rvq.output_proj
    if not isinstance(proj, torch.nn.Conv1d):
        return  # an identity projection (quantizer dim = model dim): leave the codec as it is
    books = [book.embedding for book in rvq.codebooks]
    mean = torch.stack([b.mean(dim=0) for b in books]).sum(dim=0)
    u = mean / mean.norm().clamp(min=1e-12)
    weight = proj.weight[:, :, 0]  # [out, in]
    weight = weight - torch.outer(weight @ u, u)
    picks = [torch.randint(0, b.shape[0], (256,), generator=generator).to(b.device) for b in books]
    sample = torch.stack([b[pick] for b, pick in zip(books, picks, strict=True)]).sum(dim=0)
    spread = (sample @ weight.T).std().clamp(min=1e-12)
    proj.weight.copy_((weight / spread)[:, :, None])


def _shape_output(mimi: Mimi, target_rms: float, generator: torch.Generator) -> None:
    import torch

    from personaplex_voice.model.streaming import StepContext

    last = [m for m in mimi.decoder.modules() if isinstance(m, torch.nn.Conv1d)][-1]
    if last.weight.shape[-1] == 3:  # one gain per channel times [1, 2, 1] / 4: zero at Nyquist
        gain = last.weight.sum(dim=-1, keepdim=True)
        last.weight.copy_(gain * last.weight.new_tensor([0.25, 0.5, 0.25]))
    bins = mimi.cfg.mimi.quantizer["bins"]
    shape = (1, mimi.num_codebooks, _WARMUP_FRAMES + 15)
    codes = torch.randint(0, bins, shape, generator=generator).to(last.weight.device)

    def steady_output() -> torch.Tensor:
        out = mimi.decode(codes, StepContext(mimi.init_state(1)))
        return out[..., _WARMUP_FRAMES * mimi.frame_size :]

    out = steady_output()
    rms = float((out - out.mean()).pow(2).mean().sqrt())
    if rms > 0:
        last.weight.mul_(target_rms / rms)
    if last.bias is not None:
        last.bias.sub_(steady_output().mean())  # no DC offset: loudspeakers and resamplers dislike it


def calibration_audio(frame_size: int = 1920) -> np.ndarray:
    """Three seconds of varied synthetic sound, whole frames: two voices, a chirp, noise, silence."""
    rng = np.random.default_rng(7)
    t = np.arange(SAMPLE_RATE) / SAMPLE_RATE
    chirp = 0.2 * np.sin(2 * np.pi * (100 + 1500 * t) * t)
    noise = 0.05 * rng.standard_normal(SAMPLE_RATE // 2)
    silence = np.zeros(SAMPLE_RATE // 2)
    voices = [synthetic_voice(f0, seconds=1.0, seed=1) for f0 in CALIBRATION_PITCHES_HZ]
    sig = np.concatenate([*voices, chirp, noise, silence]).astype(np.float32)
    return sig[: len(sig) // frame_size * frame_size]


def synthetic_voice(f0: float, seconds: float = 2.0, seed: int = 0) -> np.ndarray:
    """A vowel-like buzz at 24 kHz: harmonics of a wandering pitch shaped by three formants, with
    syllable-rate loudness. Not speech, but it gives Mimi something voice-like to encode."""
    rng = np.random.default_rng(seed)
    n = int(seconds * SAMPLE_RATE)
    t = np.arange(n) / SAMPLE_RATE
    pitch = f0 * (1.0 + 0.08 * np.sin(2 * np.pi * 0.7 * t) + 0.02 * np.sin(2 * np.pi * 5.5 * t))
    phase = 2 * np.pi * np.cumsum(pitch) / SAMPLE_RATE
    formants = ((700.0, 130.0), (1200.0, 170.0), (2600.0, 250.0))
    signal = np.zeros(n)
    for k in range(1, int(4000 / f0)):
        freq = k * f0
        gain = sum(1.0 / (1.0 + ((freq - fc) / bw) ** 2) for fc, bw in formants) / k**0.5
        signal += gain * np.sin(k * phase)
    envelope = 0.55 + 0.45 * np.sin(2 * np.pi * 3.5 * t - np.pi / 2)
    signal = signal * envelope + 0.01 * rng.standard_normal(n)
    fade = np.minimum(1.0, np.minimum(t, seconds - t) / 0.05)
    signal *= fade
    return (0.3 * signal / np.max(np.abs(signal))).astype(np.float32)
