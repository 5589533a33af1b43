"""`personaplex-voice voices list|make`: see a model's voices, and precompute new ones.

`voices make` turns a short recording of a speaker into the published `.pt` voice format
(`{"embeddings": float32 [N,1,1,dim], "cache": int64 [1,17,4]}`), the file the reference saves with
its save-embeddings option. A deployment makes its voices once; each call then replays the stored
embeddings instead of encoding the audio again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from personaplex_voice.cli_options import (
    DEFAULT_MODEL,
    DeviceOpt,
    DtypeOpt,
    MimiWeightOpt,
    ModelOpt,
    MoshiWeightOpt,
    ThreadsOpt,
    TokenizerOpt,
    VoiceDirOpt,
)
from personaplex_voice.engine.options import configure_threads, parse_dtype, source_overrides
from personaplex_voice.errors import UserError

app = typer.Typer(
    help="List a model's voices, or make a new voice (.pt) from a recording.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.command("list")
def list_voices(
    model: ModelOpt = DEFAULT_MODEL,
    voice_prompt_dir: VoiceDirOpt = None,
) -> None:
    """Print the voices a client may name: one per line, name, kind (embeddings/audio), source."""
    from personaplex_voice.engine.voices import VoiceLibrary
    from personaplex_voice.model.sources import DEMO, resolve_voice_dirs

    if model == DEMO and voice_prompt_dir is None:
        # The demo's voices are made with the demo model at its first build (a second or so).
        from personaplex_voice.engine.factory import build_engine

        demo = build_engine(DEMO)
        dirs, voices = tuple(demo.files.voice_dirs), list(demo.voices())
    else:
        dirs = resolve_voice_dirs(model, voice_prompt_dir=voice_prompt_dir)
        source = "voice-dir" if voice_prompt_dir is not None else "model"
        voices = VoiceLibrary(list(dirs), source=source).list()
    if not voices:
        typer.echo(f"no voices in {', '.join(str(d) for d in dirs)}", err=True)
        return
    width = max(len(v.name) for v in voices)
    for voice in voices:
        typer.echo(f"{voice.name:<{width}}  {voice.kind:<10}  {voice.source}")


@app.command("make")
def make_voice(
    audio: Annotated[Path, typer.Option("--audio", help="A recording of the speaker (any format and rate).")],
    out: Annotated[Path, typer.Option("--out", help="Where to write the voice, NAME.pt.")],
    model: ModelOpt = DEFAULT_MODEL,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    threads: ThreadsOpt = 0,
    moshi_weight: MoshiWeightOpt = None,
    mimi_weight: MimiWeightOpt = None,
    tokenizer: TokenizerOpt = None,
) -> None:
    """Encode a recording into a published-format voice file (.pt) for this model."""
    import torch

    from personaplex_voice.engine.factory import build_engine
    from personaplex_voice.engine.voices import load_voice_audio

    if out.suffix != ".pt":
        raise UserError(f"--out {out}: a voice file name must end in .pt")
    if not out.parent.is_dir():
        raise UserError(f"--out {out}: the directory {out.parent} does not exist")
    if not audio.is_file():
        raise UserError(f"--audio {audio}: no such audio file")
    # Read and normalise (24 kHz mono, -24 LUFS) exactly as a .wav voice is at call time.
    pcm = load_voice_audio(audio)
    engine = build_engine(
        model,
        num_slots=1,
        device=device,
        dtype=parse_dtype(dtype),
        **source_overrides(moshi_weight, mimi_weight, tokenizer),
    )
    configure_threads(threads, engine)
    voice = engine.make_voice(pcm, normalized=True)  # type: ignore[attr-defined]  # PersonaPlexEngine only
    try:
        torch.save(voice, out)
    except OSError as exc:
        raise UserError(f"--out {out}: cannot write ({exc})") from None
    frames = int(voice["embeddings"].shape[0])
    typer.echo(f"wrote {out} ({frames} prompt steps)", err=True)
