"""`personaplex-voice offline`: answer a recorded user side with the model, from one file to another.

The user's audio (any common format and rate, stereo mixed to mono) goes through one engine slot
exactly as a live call does (prepare → start → one `step` per 80 ms frame); the agent's audio is
written as a 24 kHz float wav of the input's duration, and the text as a JSON list of one piece
per frame, written like the reference's offline script ("PAD" / "EPAD" for the padding ids 3 / 0,
"▁" shown as a space).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import numpy as np
import typer

from personaplex_voice.audio.io import read_audio, write_wav
from personaplex_voice.cli_options import (
    DEFAULT_MODEL,
    CudaGraphsOpt,
    DeviceOpt,
    DtypeOpt,
    KvDtype,
    KvDtypeOpt,
    MimiWeightOpt,
    ModelOpt,
    MoshiWeightOpt,
    PrefillMode,
    PrefillOpt,
    QuantizeMode,
    QuantizeOpt,
    ThreadsOpt,
    TokenizerOpt,
    VoiceDirOpt,
)
from personaplex_voice.engine.base import FRAME_SIZE, SAMPLE_RATE, Engine, Persona, Sampling
from personaplex_voice.engine.options import configure_threads, engine_options, parse_dtype, source_overrides
from personaplex_voice.errors import UserError

DEFAULT_TEXT_PROMPT = (
    "You are a wise and friendly teacher. Answer questions or provide advice in a clear and engaging way."
)
# Inputs longer than this many frames (10 s) get a progress bar.
PROGRESS_MIN_FRAMES = 125
# The reference's names for the two padding ids, in its output JSON.
PADDING_PIECES = {0: "EPAD", 3: "PAD"}


def run_offline(
    engine: Engine,
    persona: Persona,
    user_pcm: np.ndarray,
    *,
    slot: int = 0,
    on_frame: Callable[[int], None] | None = None,
) -> tuple[np.ndarray, list[str]]:
    """Run `user_pcm` (float32 mono 24 kHz) through one slot; return (agent pcm, text pieces).

    The agent audio has exactly `len(user_pcm)` samples; the last frame is zero-padded going in
    and trimmed coming out. One piece per frame.
    """
    n_samples = int(user_pcm.shape[0])
    n_frames = math.ceil(n_samples / FRAME_SIZE)
    padded = np.zeros(n_frames * FRAME_SIZE, dtype=np.float32)
    padded[:n_samples] = user_pcm
    frames_in = np.zeros((engine.num_slots, FRAME_SIZE), dtype=np.float32)
    active = np.zeros(engine.num_slots, dtype=bool)
    active[slot] = True

    prepared = engine.prepare(persona)
    engine.start(slot, prepared)
    out_pcm = np.zeros(n_frames * FRAME_SIZE, dtype=np.float32)
    pieces: list[str] = []
    try:
        for i in range(n_frames):
            frames_in[slot] = padded[i * FRAME_SIZE : (i + 1) * FRAME_SIZE]
            out = engine.step(frames_in, active)
            out_pcm[i * FRAME_SIZE : (i + 1) * FRAME_SIZE] = out.pcm[slot]
            token = None if out.tokens is None else int(out.tokens[slot, 0])
            pieces.append(_piece_for_output(out.text[slot], token))
            if on_frame is not None:
                on_frame(i)
    finally:
        engine.release(slot)
    return out_pcm[:n_samples], pieces


def _piece_for_output(piece: str | None, token: int | None) -> str:
    if piece is not None:
        return piece
    return PADDING_PIECES.get(token if token is not None else 3, "PAD")


def read_input_audio(path: Path) -> np.ndarray:
    """The user audio as float32 mono at 24 kHz; `UserError` naming the file when unreadable."""
    if not path.is_file():
        raise UserError(f"{path}: no such audio file")
    pcm = read_audio(path, SAMPLE_RATE)
    if pcm.size == 0:
        raise UserError(f"{path}: the audio file holds no samples")
    return np.ascontiguousarray(pcm, dtype=np.float32)


def check_outputs(*paths: Path) -> None:
    """Fail before the run, not after it, when an output cannot be written where asked."""
    for path in paths:
        if not path.parent.is_dir():
            raise UserError(f"{path}: the output directory {path.parent} does not exist")
        if path.is_dir():
            raise UserError(f"{path}: is a directory, expected a file name")


def write_outputs(wav_path: Path, text_path: Path, pcm: np.ndarray, pieces: list[str]) -> None:
    try:
        write_wav(wav_path, pcm, SAMPLE_RATE, subtype="FLOAT")
        text_path.write_text(json.dumps(pieces, ensure_ascii=False), encoding="utf-8")
    except (OSError, RuntimeError) as exc:  # soundfile's errors are RuntimeErrors
        raise UserError(f"cannot write the output: {exc}") from None


def voice_option(voice: str | None, voice_prompt_dir: Path | None) -> tuple[str | None, Path | None]:
    """`--voice-prompt` is a voice name, or (offline only) a path to a voice file: then its
    directory becomes the voice directory and its file name the voice."""
    if voice is None or ("/" not in voice and "\\" not in voice):
        return voice, voice_prompt_dir
    path = Path(voice).expanduser()
    if not path.is_file():
        raise UserError(f"--voice-prompt {voice}: no such voice file")
    if voice_prompt_dir is not None and path.parent.resolve() != voice_prompt_dir.resolve():
        raise UserError(
            "--voice-prompt is a path outside --voice-prompt-dir: give a name or drop the directory"
        )
    return path.name, path.parent


InputOpt = Annotated[
    Path, typer.Option("--input-wav", help="The user's side of the call (wav, flac, ogg, mp3...; any rate).")
]
OutputWavOpt = Annotated[
    Path, typer.Option("--output-wav", help="Where to write the agent's audio (24 kHz float wav).")
]
OutputTextOpt = Annotated[
    Path, typer.Option("--output-text", help="Where to write the agent's text pieces (JSON list).")
]
VoiceOpt = Annotated[
    str | None,
    typer.Option(
        "--voice-prompt", help="Voice name in the model's voices (e.g. NATF2.pt), or a path to a voice file."
    ),
]
TextPromptOpt = Annotated[
    str, typer.Option("--text-prompt", help="The role; <system> tags are added when missing. '' for none.")
]


def offline(
    input_wav: InputOpt,
    output_wav: OutputWavOpt,
    output_text: OutputTextOpt,
    model: ModelOpt = DEFAULT_MODEL,
    voice_prompt: VoiceOpt = None,
    text_prompt: TextPromptOpt = DEFAULT_TEXT_PROMPT,
    seed: Annotated[int, typer.Option("--seed", help="Sampling seed; -1 picks one at random.")] = -1,
    greedy: Annotated[bool, typer.Option("--greedy", help="Argmax instead of sampling.")] = False,
    temp_audio: Annotated[float, typer.Option("--temp-audio", help="Audio sampling temperature.")] = 0.8,
    temp_text: Annotated[float, typer.Option("--temp-text", help="Text sampling temperature.")] = 0.7,
    topk_audio: Annotated[int, typer.Option("--topk-audio", help="Audio top-k.")] = 250,
    topk_text: Annotated[int, typer.Option("--topk-text", help="Text top-k.")] = 25,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    prefill: PrefillOpt = PrefillMode.parallel,
    quantize: QuantizeOpt = QuantizeMode.none,
    kv_dtype: KvDtypeOpt = KvDtype.auto,
    cuda_graphs: CudaGraphsOpt = True,
    threads: ThreadsOpt = 0,
    moshi_weight: MoshiWeightOpt = None,
    mimi_weight: MimiWeightOpt = None,
    tokenizer: TokenizerOpt = None,
    voice_prompt_dir: VoiceDirOpt = None,
) -> None:
    """Answer a recorded user with the model: audio file in, agent audio and text out."""
    from personaplex_voice.engine.factory import build_engine

    check_outputs(output_wav, output_text)
    user_pcm = read_input_audio(input_wav)
    voice, voice_dir = voice_option(voice_prompt, voice_prompt_dir)
    sampling = Sampling(
        text_temperature=temp_text,
        text_topk=topk_text,
        audio_temperature=temp_audio,
        audio_topk=topk_audio,
        greedy=greedy,
    )
    persona = Persona(
        text_prompt=text_prompt, voice=voice, sampling=sampling, seed=None if seed == -1 else seed
    )
    engine = build_engine(
        model,
        num_slots=1,
        device=device,
        dtype=parse_dtype(dtype),
        **engine_options(prefill, quantize, kv_dtype, cuda_graphs),
        **source_overrides(moshi_weight, mimi_weight, tokenizer, voice_dir),
    )
    configure_threads(threads, engine)
    n_frames = math.ceil(user_pcm.shape[0] / FRAME_SIZE)
    with _progress(n_frames) as advance:
        pcm, pieces = run_offline(engine, persona, user_pcm, on_frame=advance)
    write_outputs(output_wav, output_text, pcm, pieces)
    seconds = pcm.shape[0] / SAMPLE_RATE
    typer.echo(f"wrote {output_wav} ({seconds:.2f} s) and {output_text} ({len(pieces)} pieces)", err=True)


class _progress:
    """A tqdm bar over the frames for long inputs; a no-op for short ones."""

    def __init__(self, n_frames: int) -> None:
        self._bar = None
        if n_frames >= PROGRESS_MIN_FRAMES:
            from tqdm import tqdm

            self._bar = tqdm(total=n_frames, unit="frame", desc="offline", file=sys.stderr, mininterval=0.5)

    def __enter__(self) -> Callable[[int], None]:
        bar = self._bar
        return (lambda _i: bar.update(1)) if bar is not None else (lambda _i: None)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()
