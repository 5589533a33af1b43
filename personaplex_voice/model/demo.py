"""The `demo` model: a tiny PersonaPlex with random weights, built with no network and no GPU.

It has the real architecture at toy size (like ../shared/golden), so every transport, the session
manager and the CLI run against it exactly as against the 7B model. It babbles: the weights are
random (seeded, so two runs babble the same), it only exists so a new user can wire up Twilio,
Pipecat or the browser before fetching 16 GB. Its codec hears and answers nonetheless: the model
layer tunes any Mimi built without weights (`model/random_init.py`, run by `load_mimi`).
`loaders.load_models` builds it (weights drawn on the CPU under `WEIGHTS_SEED`).

Its files are made at first use and cached under `$PERSONAPLEX_CACHE/demo` (default
`~/.cache/personaplex-voice/demo`): a SentencePiece tokenizer trained on the short text below,
following the published tokenizer's conventions (ids 0..3 = unk/EPAD, BOS, EOS, PAD; `<system>`
one piece), and a voices directory that the engine fills with the demo's voices
(`personaplex_voice.engine.demo_voices`: they need the model to be made).
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

if TYPE_CHECKING:
    from personaplex_voice.model.config import ModelConfig


DEMO_NOTICE = (
    "the demo model has random weights: it babbles, it does not talk. It is there to wire things up; "
    "use --model nvidia/personaplex-7b-v1 (HF_TOKEN) for the real PersonaPlex."
)
# Bump when the assets or the weights change, so old caches (voice files) are not reused.
ASSETS_VERSION = "v2"
WEIGHTS_SEED = 20240611
VOCAB_SIZE = 256

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
    """Make (at first use) and return the demo's tokenizer and voices directory. Safe to call
    concurrently."""
    root = cache_root() / "demo" / ASSETS_VERSION
    voices = root / "voices"
    voices.mkdir(parents=True, exist_ok=True)
    tokenizer = root / "tokenizer.model"
    if not tokenizer.is_file():
        write_atomic(tokenizer, train_tokenizer())
    return DemoAssets(root=root, tokenizer=tokenizer, voices_dir=voices, vocab_size=VOCAB_SIZE)


def demo_config(vocab_size: int = VOCAB_SIZE) -> ModelConfig:
    """The demo architecture: the published structure at the golden model's toy sizes."""
    from personaplex_voice.model.config import LMConfig, MimiConfig, ModelConfig

    mimi = MimiConfig.published_layout(
        dimension=32,
        n_filters=4,
        codebook_dimension=16,
        n_q=16,
        transformer_heads=2,
        transformer_layers=2,
        transformer_feedforward=64,
    )
    lm = LMConfig(
        dim=64,
        text_card=vocab_size,
        num_heads=4,
        num_layers=2,
        depformer_dim=32,
        depformer_dim_feedforward=132,
        depformer_num_heads=2,
        depformer_num_layers=2,
    )
    cfg = ModelConfig(mimi=mimi, lm=lm, lm_dtype_in_file="float32")
    cfg.validate()
    return cfg


def demo_config_dict() -> dict[str, Any]:
    """The demo architecture as a config.json dict (the format of ../shared/golden/config.json)."""
    return demo_config().to_dict()


@contextlib.contextmanager
def seeded_weights() -> Iterator[None]:
    """Run the model's random init on the CPU (weights, and the codec tuning `load_mimi` does)
    under a fixed seed, without disturbing the caller's RNG."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(WEIGHTS_SEED)
        yield


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


def write_atomic(path: Path, data: bytes) -> None:
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
