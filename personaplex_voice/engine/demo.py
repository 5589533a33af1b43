"""The `demo` model: a tiny PersonaPlex with random weights, built with no network and no GPU.

It has the real architecture at toy size (like ../shared/golden), so every transport, the session
manager and the CLI run against it exactly as against the 7B model. It babbles: the weights are
random (seeded, so two runs babble the same), it only exists so a new user can wire up Twilio,
Pipecat or the browser before fetching 16 GB.

Its assets are made at first use and cached under `$PERSONAPLEX_CACHE/demo` (default
`~/.cache/personaplex-voice/demo`): a SentencePiece tokenizer trained on the short text below,
following the published tokenizer's conventions (ids 0..3 = unk/EPAD, BOS, EOS, PAD; `<system>`
one piece), and two synthetic voice prompts as .wav files.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from personaplex_voice.model.config import ModelConfig


DEMO_NOTICE = (
    "the demo model has random weights: it babbles, it does not talk. It is there to wire things up; "
    "use --model nvidia/personaplex-7b-v1 (HF_TOKEN) for the real PersonaPlex."
)
# Bump when the assets below change, so old caches are not reused.
ASSETS_VERSION = "v1"
WEIGHTS_SEED = 20240611
VOCAB_SIZE = 256
SAMPLE_RATE = 24_000

# The tiny architecture, in the format of ../shared/golden/config.json (text_card is set from the
# trained tokenizer).
_CONFIG: dict[str, Any] = {
    "format": "personaplex-voice golden tiny config v1",
    "sample_rate": 24000,
    "frame_rate": 12.5,
    "mimi": {
        "seanet": {
            "channels": 1,
            "dimension": 32,
            "causal": True,
            "n_filters": 4,
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
        },
        "quantizer": {
            "dimension": 16,
            "n_q": 16,
            "bins": 2048,
            "input_dimension": 32,
            "output_dimension": 32,
        },
        "transformer": {
            "d_model": 32,
            "num_heads": 2,
            "num_layers": 2,
            "causal": True,
            "layer_scale": 0.01,
            "context": 250,
            "conv_layout": True,
            "max_period": 10000,
            "gating": "none",
            "norm": "layer_norm",
            "positional_embedding": "rope",
            "dim_feedforward": 64,
            "input_dimension": 32,
            "output_dimensions": [32],
        },
        "num_codebooks": 8,
    },
    "lm": {
        "dim": 64,
        "text_card": VOCAB_SIZE,
        "existing_text_padding_id": 3,
        "n_q": 16,
        "dep_q": 16,
        "card": 2048,
        "num_heads": 4,
        "num_layers": 2,
        "hidden_scale": 4.125,
        "causal": True,
        "layer_scale": None,
        "context": 3000,
        "max_period": 10000,
        "gating": "silu",
        "norm": "rms_norm_f32",
        "positional_embedding": "rope",
        "depformer_dim": 32,
        "depformer_dim_feedforward": 132,
        "depformer_num_heads": 2,
        "depformer_num_layers": 2,
        "depformer_causal": True,
        "depformer_layer_scale": None,
        "depformer_multi_linear": True,
        "depformer_context": 8,
        "depformer_max_period": 10000,
        "depformer_gating": "silu",
        "depformer_pos_emb": "none",
        "depformer_weights_per_step": True,
        "delays": [0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1],
    },
    "lm_dtype_in_file": "float32",
    "text_tokenizer": "tokenizer.model",
}

# What the demo tokenizer learns from: short phone-conversation English, the register the real
# model is prompted in.
_TRAINING_TEXT = """\
Hello, thank you for calling. How can I help you today?
Hi, I would like to check the status of my order, please.
Of course. Could you tell me your name and the order number?
My name is Maria Lopez and the order number is four five two one.
Thank you, Maria. I can see the order here. It will arrive on Tuesday morning.
That is great, thanks. Can I change the delivery address?
Yes, you can. What is the new address?
It is twenty three Oak Street, apartment nine.
All right, I have updated the address. Is there anything else I can do for you?
No, that is all. Have a nice day!
You too. Goodbye.
You enjoy having a good conversation. Have a deep conversation about technology.
You are a wise and friendly teacher. Answer questions or provide advice in a clear and engaging way.
You work for a restaurant and your name is Sam. Take the customer's pizza order.
What size would you like, small, medium or large?
Large, with mushrooms, onions and extra cheese.
Would you like something to drink with that?
Two bottles of water, please. How long will it take?
About thirty minutes. The total is twenty one dollars and fifty cents.
Can I pay by card when it arrives?
Yes, the driver will bring a card reader.
Good morning, this is the help desk. What seems to be the problem?
My computer will not start and the screen stays black.
Let us try something. Please hold the power button for ten seconds.
Okay, I did that. Now the light is blinking.
Good, that means it is restarting. Wait a moment and tell me what you see.
It works now! Thank you so much for your help.
I am glad I could help. Remember to save your work often.
Your appointment is on Monday at three in the afternoon.
Could we move it to Wednesday or Thursday instead?
Thursday at ten in the morning is free. Shall I book it?
Please do. And could you send me an email to confirm?
Sure, I will send the confirmation right away.
We collect the waste every other week on Friday.
The recycling bin is picked up on the first and third week of the month.
Your payment of forty dollars was received yesterday, so your account is up to date.
I understand. Let me check that for you. One moment, please.
Sorry to keep you waiting. I found the answer to your question.
Is there a phone number where we can reach you later?
Yes, my number is five five five, one two three, four five six seven.
What a lovely idea! I think you will really enjoy the trip.
Do you have any questions about the new plan or the premium service?
We are open every day from nine to six, except on holidays.
Please verify your password and your date of birth for security.
The weather will be sunny and warm this weekend, perfect for a walk in the park.
I hear you. That sounds difficult, but we will figure it out together.
"""


@dataclass(frozen=True)
class DemoAssets:
    """Files of the demo model, inside the cache."""

    root: Path
    tokenizer: Path
    voices_dir: Path
    vocab_size: int


def cache_root() -> Path:
    """`$PERSONAPLEX_CACHE` or `~/.cache/personaplex-voice`: where generated assets are kept."""
    env = os.environ.get("PERSONAPLEX_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "personaplex-voice"


def demo_assets() -> DemoAssets:
    """Make (at first use) and return the demo's tokenizer and voices. Safe to call concurrently."""
    root = cache_root() / "demo" / ASSETS_VERSION
    voices = root / "voices"
    voices.mkdir(parents=True, exist_ok=True)
    tokenizer = root / "tokenizer.model"
    if not tokenizer.is_file():
        _write_atomic(tokenizer, train_tokenizer())
    for name, f0 in DEMO_VOICES.items():
        path = voices / f"{name}.wav"
        if not path.is_file():
            _write_atomic(path, _wav_bytes(synthetic_voice(f0, seed=int(f0))))
    return DemoAssets(root=root, tokenizer=tokenizer, voices_dir=voices, vocab_size=VOCAB_SIZE)


def demo_config(vocab_size: int = VOCAB_SIZE) -> ModelConfig:
    from personaplex_voice.model.config import ModelConfig

    raw = {**_CONFIG, "lm": {**_CONFIG["lm"], "text_card": vocab_size}}
    return ModelConfig.from_dict(raw)


def demo_config_dict() -> dict[str, Any]:
    """The demo architecture as a config.json dict (a copy)."""
    import copy

    return copy.deepcopy(_CONFIG)


@contextlib.contextmanager
def seeded_weights(device: str = "cpu") -> Iterator[None]:
    """Run the model's random init under a fixed seed, without disturbing the caller's RNG."""
    import torch

    devices = [torch.device(device).index or 0] if str(device).startswith("cuda") else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(WEIGHTS_SEED)
        yield


def tune_codec(mimi: Any, target_rms: float = 0.05) -> None:
    """Make the random Mimi a usable toy codec: inputs map to varied codes, codes to varied sound.

    A randomly initialised Mimi is useless even as a toy: its codebooks start empty (all zero), so
    every input encodes to code 0; and its decoder's output is a fixed pattern set by its biases,
    whatever the codes. So, for the demo only:
    - each RVQ level's centroids are drawn from the (residual) latents of synthetic calibration
      audio, plus jitter, like a k-means start;
    - the decoder sees only what differs between codes: the latents' common direction is
      projected out of the quantizer's output projection, which is scaled to unit variance, and
      the decoder's conv biases are zeroed;
    - the last conv becomes a gentle low-pass at speech level (`target_rms`) with no DC offset.
    Call under `seeded_weights` for reproducible results.
    """
    import torch

    latents = _capture_latents(mimi)
    with torch.no_grad():
        for key, rvq in (("first", mimi.quantizer.rvq_first), ("rest", mimi.quantizer.rvq_rest)):
            _seed_codebooks(rvq, latents[key])
        mimi.refresh()
        for rvq in (mimi.quantizer.rvq_first, mimi.quantizer.rvq_rest):
            _decode_differences_only(rvq)
        for module in mimi.decoder.modules():
            if isinstance(module, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)) and module.bias is not None:
                module.bias.zero_()
        _shape_output(mimi, target_rms)


def _capture_latents(mimi: Any) -> dict[str, Any]:
    """Each RVQ's projected input latents [frames, dim] for the calibration audio."""
    import torch

    from personaplex_voice.model.streaming import StepContext

    param = next(mimi.parameters())
    pcm = torch.from_numpy(_calibration_audio()).to(param.device).view(1, 1, -1)
    captured: dict[str, torch.Tensor] = {}
    rvqs = {"first": mimi.quantizer.rvq_first, "rest": mimi.quantizer.rvq_rest}
    hooks = [
        rvq.input_proj.register_forward_hook(
            lambda _m, _i, out, key=key: captured.__setitem__(key, out[0].T.float())
        )
        for key, rvq in rvqs.items()
    ]
    try:
        mimi.encode(pcm, StepContext(mimi.init_state(1)))
    finally:
        for hook in hooks:
            hook.remove()
    return captured


def _seed_codebooks(rvq: Any, latents: Any) -> None:
    import torch

    residual = latents
    for layer in rvq.vq.layers:
        book = layer._codebook
        bins = book.embedding_sum.shape[0]
        pick = torch.randint(0, residual.shape[0], (bins,), device=residual.device)
        jitter = 0.3 * residual.std(dim=0, keepdim=True) * torch.randn_like(residual[pick])
        book.embedding_sum.copy_(residual[pick] + jitter)
        book.cluster_usage.fill_(1.0)
        book.refresh()
        residual = residual - book.decode(book.encode(residual))


def _decode_differences_only(rvq: Any) -> None:
    """Project the codebooks' shared mean out of the output projection; scale to unit variance."""
    import torch

    proj = rvq.output_proj
    if not isinstance(proj, torch.nn.Conv1d):
        return  # an identity projection (quantizer dim = model dim): leave the codec as it is
    books = [layer._codebook.embedding for layer in rvq.vq.layers]
    mean = torch.stack([b.mean(dim=0) for b in books]).sum(dim=0)
    u = mean / mean.norm().clamp(min=1e-12)
    weight = proj.weight[:, :, 0]  # [out, in]
    weight = weight - torch.outer(weight @ u, u)
    sample = torch.stack([b[torch.randint(0, b.shape[0], (256,))] for b in books]).sum(dim=0)
    spread = (sample @ weight.T).std().clamp(min=1e-12)
    proj.weight.copy_((weight / spread)[:, :, None])


def _shape_output(mimi: Any, target_rms: float) -> None:
    import torch

    from personaplex_voice.model.streaming import StepContext

    last = [m for m in mimi.decoder.modules() if isinstance(m, torch.nn.Conv1d)][-1]
    if last.weight.shape[-1] == 3:  # one gain per channel times [1, 2, 1] / 4: zero at Nyquist
        gain = last.weight.sum(dim=-1, keepdim=True)
        last.weight.copy_(gain * last.weight.new_tensor([0.25, 0.5, 0.25]))
    param = next(mimi.parameters())
    codes = torch.randint(0, 2048, (1, mimi.num_codebooks, 25), device=param.device)
    out = mimi.decode(codes, StepContext(mimi.init_state(1)))[..., 10 * 1920 :]
    rms = float((out - out.mean()).pow(2).mean().sqrt())
    if rms > 0:
        last.weight.mul_(target_rms / rms)
    if last.bias is not None:
        out = mimi.decode(codes, StepContext(mimi.init_state(1)))[..., 10 * 1920 :]
        last.bias.sub_(out.mean())  # no DC offset: loudspeakers and resamplers dislike it


def _calibration_audio() -> np.ndarray:
    """Three seconds of varied synthetic sound: both voices, a chirp, noise and silence."""
    rng = np.random.default_rng(7)
    t = np.arange(SAMPLE_RATE) / SAMPLE_RATE
    chirp = 0.2 * np.sin(2 * np.pi * (100 + 1500 * t) * t)
    noise = 0.05 * rng.standard_normal(SAMPLE_RATE // 2)
    silence = np.zeros(SAMPLE_RATE // 2)
    parts = [synthetic_voice(f0, seconds=1.0, seed=1) for f0 in DEMO_VOICES.values()]
    sig = np.concatenate([*parts, chirp, noise, silence]).astype(np.float32)
    frames = len(sig) // 1920
    return sig[: frames * 1920]


def train_tokenizer(vocab_size: int = VOCAB_SIZE) -> bytes:
    """Train the demo SentencePiece model; returns the serialized model."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_TRAINING_TEXT.splitlines()),
        model_writer=model,
        model_type="unigram",
        vocab_size=vocab_size,
        # The published tokenizer's id layout: 0 = <unk> (used as EPAD by the model), 1 BOS,
        # 2 EOS, 3 PAD, and `<system>` as one piece so prompt tags are single tokens.
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        user_defined_symbols=["<system>"],
        character_coverage=1.0,
        num_threads=1,  # one thread: the same text always gives the same model
        shuffle_input_sentence=False,
        input_sentence_size=0,
        hard_vocab_limit=True,
        minloglevel=2,
    )
    return model.getvalue()


# name -> fundamental frequency (Hz) of the synthetic voice
DEMO_VOICES = {"DEMOF0": 210.0, "DEMOM0": 115.0}


def synthetic_voice(f0: float, seconds: float = 2.0, seed: int = 0) -> np.ndarray:
    """A vowel-like buzz: harmonics of a wandering pitch shaped by two formants, with syllable-rate
    loudness. Not speech, but it gives Mimi something voice-like to encode."""
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


def _wav_bytes(pcm: np.ndarray) -> bytes:
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, pcm, SAMPLE_RATE, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def _write_atomic(path: Path, data: bytes) -> None:
    # Write beside the target then rename: parallel first uses never see a half-written file.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
