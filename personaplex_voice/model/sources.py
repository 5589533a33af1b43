"""Where a model's files come from: the `demo` model, a local model directory, or the Hugging Face hub.

`resolve_model(spec)` turns what a user typed after `--model` into a `ModelFiles`: the
architecture and the paths of the weights, tokenizer and voice directories. It only finds and
checks files; loading them is `model/loaders.py`'s job.

- `demo`: a tiny random-weight model (see `personaplex_voice.model.demo`); no network, no GPU.
- a directory with the layout of the golden vectors: `config.json`, `model.safetensors`,
  `mimi.safetensors`, `tokenizer.model` (or `config.json`'s `text_tokenizer`), `voices/`.
- a Hugging Face repo id (default `nvidia/personaplex-7b-v1`, gated: needs `HF_TOKEN`), with the
  file names of the published checkpoint; `voices.tgz` is unpacked once, safely, next to itself in
  the hub cache.

Per-file overrides (`moshi_weight`, `mimi_weight`, `tokenizer`, `voice_prompt_dir`) replace single
files, as the reference server's flags do; an overridden file is never downloaded.
A source never silently falls back to another: real weights that cannot be found are an error.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import re
import shutil
import struct
import tarfile
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from personaplex_voice.errors import UserError

if TYPE_CHECKING:
    from personaplex_voice.model.config import ModelConfig

log = logging.getLogger(__name__)

DEFAULT_REPO = "nvidia/personaplex-7b-v1"
DEMO = "demo"

# File names inside the published hub repo.
HUB_LM_WEIGHTS = "model.safetensors"
HUB_MIMI_WEIGHTS = "tokenizer-e351c8d8-checkpoint125.safetensors"
HUB_TOKENIZER = "tokenizer_spm_32k_3.model"
HUB_VOICES_ARCHIVE = "voices.tgz"
HUB_LM_DTYPE = "bfloat16"

# File names inside a local model directory (the layout of ../shared/golden).
DIR_CONFIG = "config.json"
DIR_LM_WEIGHTS = "model.safetensors"
DIR_MIMI_WEIGHTS = "mimi.safetensors"
DIR_TOKENIZER = "tokenizer.model"
DIR_VOICES = "voices"

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
# A safetensors header is a little-endian u64 length then that many bytes of JSON.
_MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class ModelFiles:
    """Everything needed to build an engine, found and checked but not loaded.

    `lm_weights` / `mimi_weights` are None only for the `demo` model (random init).
    `lm_dtype_in_file` is the dtype the LM weights are stored in ("bfloat16" for the published
    checkpoint); the loader casts to the run dtype. `voice_source` is what the voice list says
    the voices are ("model", or "demo" for the demo model's own voices).
    """

    name: str
    config: ModelConfig
    lm_weights: Path | None
    mimi_weights: Path | None
    tokenizer: Path
    voice_dirs: tuple[Path, ...]
    lm_dtype_in_file: str
    voice_source: str = "model"

    @property
    def is_demo(self) -> bool:
        return self.name == DEMO


def resolve_model(
    spec: str | os.PathLike[str] | None = None,
    *,
    moshi_weight: str | os.PathLike[str] | None = None,
    mimi_weight: str | os.PathLike[str] | None = None,
    tokenizer: str | os.PathLike[str] | None = None,
    voice_prompt_dir: str | os.PathLike[str] | None = None,
    hf_repo: str | None = None,
) -> ModelFiles:
    """Find a model's files. `spec`: "demo", a model directory, or a hub repo id (None = default repo).

    `hf_repo` is the reference's `--hf-repo`: the repo to use when `spec` is not given.
    Raises `UserError` naming the file and the problem.
    """
    overrides = {
        "lm_weights": _override_file(moshi_weight, "--moshi-weight"),
        "mimi_weights": _override_file(mimi_weight, "--mimi-weight"),
        "tokenizer": _override_file(tokenizer, "--tokenizer"),
    }
    voice_dir = _override_dir(voice_prompt_dir, "--voice-prompt-dir")

    text = str(spec) if spec is not None else ""
    if not text:
        return _resolve_hub(hf_repo or DEFAULT_REPO, overrides, voice_dir)
    if hf_repo is not None and hf_repo != text:
        raise UserError(f"--model {text!r} and --hf-repo {hf_repo!r} disagree: give one of them")
    if text == DEMO:
        return _resolve_demo(overrides, voice_dir)
    path = Path(text).expanduser()
    if path.is_dir():
        return _resolve_dir(path, overrides, voice_dir)
    if path.exists():
        raise UserError(f"--model {text}: not a directory (expected a model directory, 'demo' or a repo id)")
    if _REPO_ID.match(text) and not text.startswith("."):
        return _resolve_hub(text, overrides, voice_dir)
    raise UserError(
        f"--model {text}: no such model directory (expected 'demo', a model directory "
        f"or a Hugging Face repo id such as {DEFAULT_REPO})"
    )


def resolve_voice_dirs(
    spec: str | os.PathLike[str] | None = None,
    *,
    voice_prompt_dir: str | os.PathLike[str] | None = None,
    hf_repo: str | None = None,
) -> tuple[Path, ...]:
    """Only the voice directories of a model (for `voices list`): no weights are fetched."""
    voice_dir = _override_dir(voice_prompt_dir, "--voice-prompt-dir")
    if voice_dir is not None:
        return (voice_dir,)
    text = str(spec) if spec is not None else ""
    if not text:
        text = hf_repo or DEFAULT_REPO
    if text != DEMO and not Path(text).expanduser().exists() and _REPO_ID.match(text):
        return (extract_voices(download(text, HUB_VOICES_ARCHIVE)),)
    return resolve_model(text).voice_dirs


# ---------------------------------------------------------------------------------------------
# demo


def _resolve_demo(overrides: dict[str, Path | None], voice_dir: Path | None) -> ModelFiles:
    flags = {"lm_weights": "--moshi-weight", "mimi_weights": "--mimi-weight", "tokenizer": "--tokenizer"}
    given = [flags[key] for key, path in overrides.items() if path is not None]
    if given:
        raise UserError(f"the demo model has built-in random weights and tokenizer; drop {', '.join(given)}")
    from personaplex_voice.model import demo

    assets = demo.demo_assets()
    return ModelFiles(
        name=DEMO,
        config=demo.demo_config(assets.vocab_size),
        lm_weights=None,
        mimi_weights=None,
        tokenizer=assets.tokenizer,
        voice_dirs=(voice_dir,) if voice_dir is not None else (assets.voices_dir,),
        lm_dtype_in_file="float32",
        voice_source="model" if voice_dir is not None else "demo",
    )


# ---------------------------------------------------------------------------------------------
# local model directory


def _resolve_dir(root: Path, overrides: dict[str, Path | None], voice_dir: Path | None) -> ModelFiles:
    from personaplex_voice.model.config import ModelConfig

    config_path = root / DIR_CONFIG
    raw = _read_config_json(config_path)
    try:
        config = ModelConfig.from_dict(raw)
    except UserError:
        raise
    except Exception as exc:  # a config.json in the wrong format: say which file and what is wrong
        raise UserError(f"{config_path}: not a valid model config ({type(exc).__name__}: {exc})") from None

    lm = overrides["lm_weights"] or _required_file(root / DIR_LM_WEIGHTS, "LM weights")
    mimi = overrides["mimi_weights"] or _required_file(root / DIR_MIMI_WEIGHTS, "Mimi weights")
    tok_name = raw.get("text_tokenizer") or DIR_TOKENIZER
    tok = overrides["tokenizer"] or _required_file(root / str(tok_name), "text tokenizer")
    if voice_dir is None:
        voices = root / DIR_VOICES
        if not voices.is_dir():
            raise UserError(f"{voices}: missing voices directory (or pass --voice-prompt-dir)")
        voice_dir = voices
    for path in (lm, mimi):
        check_safetensors(path)
    return ModelFiles(
        name=str(root),
        config=config,
        lm_weights=lm,
        mimi_weights=mimi,
        tokenizer=tok,
        voice_dirs=(voice_dir,),
        lm_dtype_in_file=str(raw.get("lm_dtype_in_file", "float32")),
    )


def _read_config_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise UserError(f"{path}: missing model config (a model directory needs {DIR_CONFIG})")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: unreadable model config ({exc})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: model config must be a JSON object")
    return raw


# ---------------------------------------------------------------------------------------------
# Hugging Face hub


def _resolve_hub(repo: str, overrides: dict[str, Path | None], voice_dir: Path | None) -> ModelFiles:
    from personaplex_voice.model.config import ModelConfig

    lm = overrides["lm_weights"] or download(repo, HUB_LM_WEIGHTS)
    mimi = overrides["mimi_weights"] or download(repo, HUB_MIMI_WEIGHTS)
    tok = overrides["tokenizer"] or download(repo, HUB_TOKENIZER)
    if voice_dir is None:
        voice_dir = extract_voices(download(repo, HUB_VOICES_ARCHIVE))
    for path in (lm, mimi):
        check_safetensors(path)
    return ModelFiles(
        name=repo,
        config=ModelConfig.personaplex_7b(),
        lm_weights=lm,
        mimi_weights=mimi,
        tokenizer=tok,
        voice_dirs=(voice_dir,),
        lm_dtype_in_file=HUB_LM_DTYPE,
    )


def download(repo: str, filename: str) -> Path:
    """One file from the hub (cached by huggingface_hub, which draws its own progress bar)."""
    import huggingface_hub
    from huggingface_hub import errors

    try:
        # Called through the module so tests can stand in for the hub at this one boundary.
        path = huggingface_hub.hf_hub_download(repo, filename)
    except errors.GatedRepoError:
        if huggingface_hub.get_token() is None:
            raise UserError(
                f"{repo} is a gated repository: accept its licence on https://huggingface.co/{repo} "
                f"and set HF_TOKEN to an access token (needed for {filename})"
            ) from None
        raise UserError(
            f"{repo}: your HF_TOKEN has no access to this gated repository; accept its licence on "
            f"https://huggingface.co/{repo} (needed for {filename})"
        ) from None
    except errors.RepositoryNotFoundError:
        raise UserError(
            f"{repo}: no such Hugging Face repository (or it is private and HF_TOKEN is missing)"
        ) from None
    except errors.RevisionNotFoundError as exc:
        raise UserError(f"{repo}: revision not found ({exc})") from None
    except errors.LocalEntryNotFoundError:
        raise UserError(
            f"{repo}/{filename}: cannot reach the Hugging Face hub and the file is not in the local cache"
        ) from None
    except errors.EntryNotFoundError:
        raise UserError(f"{repo}/{filename}: missing file in the repository") from None
    except errors.HfHubHTTPError as exc:
        raise UserError(f"{repo}/{filename}: download failed ({exc})") from None
    except OSError as exc:
        raise UserError(f"{repo}/{filename}: download failed ({exc})") from None
    return Path(path)


# ---------------------------------------------------------------------------------------------
# voices.tgz


def extract_voices(archive: Path) -> Path:
    """Unpack `voices.tgz` once into `voices/` beside it; return that directory.

    Every member is checked before anything is written: only plain files and directories under
    relative paths without `..` (no links, devices or absolute names). The archive is unpacked
    into a temporary directory and renamed into place, so a crash or a concurrent run never
    leaves a half-filled `voices/`.
    """
    target = archive.parent / DIR_VOICES
    if target.is_dir():
        return target
    try:
        with tarfile.open(archive, "r:*") as tar:
            members = tar.getmembers()
            for member in members:
                _check_member(archive, member)
            log.info("extracting %s to %s", archive, target)
            tmp = Path(tempfile.mkdtemp(prefix=".voices-", dir=archive.parent))
            try:
                for member in members:
                    _extract_member(tar, member, tmp)
                unpacked = tmp / DIR_VOICES
                if not unpacked.is_dir():
                    raise UserError(f"{archive}: archive has no '{DIR_VOICES}/' directory")
                try:
                    unpacked.rename(target)
                except OSError:
                    if not target.is_dir():  # lost a race only if the winner left a directory
                        raise
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise UserError(f"{archive}: unreadable voices archive ({exc})") from None
    except OSError as exc:  # a read-only cache, a full disk...
        raise UserError(f"{archive}: cannot unpack into {archive.parent} ({exc})") from None
    return target


def _check_member(archive: Path, member: tarfile.TarInfo) -> None:
    name = member.name
    parts = PurePosixPath(name).parts
    if name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name) or ".." in parts or "\\" in name:
        raise UserError(f"{archive}: unsafe path in voices archive: {name!r}")
    if not (member.isfile() or member.isdir()):
        raise UserError(f"{archive}: voices archive member {name!r} is not a plain file or directory")


def _extract_member(tar: tarfile.TarFile, member: tarfile.TarInfo, dest: Path) -> None:
    # Written by hand (not extractall) so modes, owners and times from the archive are ignored.
    path = dest.joinpath(*PurePosixPath(member.name).parts)
    if member.isdir():
        path.mkdir(parents=True, exist_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    source = tar.extractfile(member)
    if source is None:
        raise tarfile.TarError(f"cannot read member {member.name!r}")
    with source, open(path, "wb") as out:
        shutil.copyfileobj(source, out)


# ---------------------------------------------------------------------------------------------
# checks


def check_safetensors(path: Path) -> None:
    """Cheap check that `path` is a safetensors file (header only), so corrupt or wrong files fail
    here with their name rather than deep inside the loader."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise UserError(f"{path}: not a safetensors file (too short)")
            (length,) = struct.unpack("<Q", head)
            size = path.stat().st_size
            if length == 0 or length > _MAX_SAFETENSORS_HEADER or 8 + length > size:
                raise UserError(f"{path}: not a safetensors file (bad header length)")
            header = json.loads(f.read(length))
    except UserError:
        raise
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: not a safetensors file ({exc})") from None
    if not isinstance(header, dict):
        raise UserError(f"{path}: not a safetensors file (header is not a JSON object)")


def _required_file(path: Path, what: str) -> Path:
    if not path.is_file():
        raise UserError(f"{path}: missing {what}")
    return path


def _override_file(value: str | os.PathLike[str] | None, flag: str) -> Path | None:
    if value is None or str(value) == "":
        return None
    path = Path(value).expanduser()
    if not path.is_file():
        raise UserError(f"{flag} {path}: no such file")
    return path


def _override_dir(value: str | os.PathLike[str] | None, flag: str) -> Path | None:
    if value is None or str(value) == "":
        return None
    path = Path(value).expanduser()
    if not path.is_dir():
        raise UserError(f"{flag} {path}: no such directory")
    return path
