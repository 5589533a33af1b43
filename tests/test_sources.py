"""Model sources: local model directories, the Hugging Face hub (mocked at `hf_hub_download`, the
one function we cannot reach from CI) with its voices.tgz, and per-file overrides."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import httpx
import huggingface_hub
import pytest
from huggingface_hub import constants as hf_constants
from huggingface_hub import errors as hf_errors

from personaplex_voice.errors import UserError
from personaplex_voice.model import sources
from personaplex_voice.model.sources import resolve_model, resolve_voice_dirs

REPO = "nvidia/personaplex-7b-v1"
GOLDEN_FILES = ("config.json", "model.safetensors", "mimi.safetensors", "tokenizer.model", "voices")


def _safetensors_bytes() -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    return len(header).to_bytes(8, "little") + header + b"\0" * 8


def _tgz(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    return buf.getvalue()


def _file(name: str) -> tarfile.TarInfo:
    return tarfile.TarInfo(name)


def _dir(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    return info


GOOD_VOICES = [(_dir("voices"), None), (_file("voices/NATF0.pt"), b"pt"), (_file("voices/NATM1.pt"), b"pt")]


class FakeHub:
    """A gated repo served from tmp_path the way huggingface_hub lays out its cache."""

    def __init__(self, root: Path, voices: bytes) -> None:
        self.snapshot = root / "models--nvidia--personaplex-7b-v1" / "snapshots" / "0123abcd"
        self.snapshot.mkdir(parents=True)
        for name in (sources.HUB_LM_WEIGHTS, sources.HUB_MIMI_WEIGHTS):
            (self.snapshot / name).write_bytes(_safetensors_bytes())
        (self.snapshot / sources.HUB_TOKENIZER).write_bytes(b"spm")
        (self.snapshot / sources.HUB_VOICES_ARCHIVE).write_bytes(voices)
        self.calls: list[str] = []
        self.offline = False

    def hf_hub_download(self, repo_id: str, filename: str, **kwargs: object) -> str:
        self.calls.append(filename)
        url = f"https://huggingface.co/{repo_id}/resolve/main/{filename}"
        response = httpx.Response(401, request=httpx.Request("GET", url))
        if self.offline:
            raise hf_errors.LocalEntryNotFoundError("cannot reach the hub")
        if repo_id != REPO:
            raise hf_errors.RepositoryNotFoundError("not found", response=response)
        if not os.environ.get("HF_TOKEN"):
            raise hf_errors.GatedRepoError("Access to this model is restricted", response=response)
        if os.environ["HF_TOKEN"] != "hf_good":
            raise hf_errors.GatedRepoError("You are not in the authorized list", response=response)
        path = self.snapshot / filename
        if not path.exists():
            raise hf_errors.RemoteEntryNotFoundError("no such file", response=response)
        return str(path)


@pytest.fixture
def hub_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Isolate the hub's token lookup from this machine: no token file, no OIDC."""
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "no-token-file"))
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)

    def make(voices: bytes = _tgz(GOOD_VOICES)) -> FakeHub:
        hub = FakeHub(tmp_path / "hub", voices)
        monkeypatch.setattr(huggingface_hub, "hf_hub_download", hub.hf_hub_download)
        return hub

    return make


def test_hub_repo_resolves_published_files_and_unpacks_voices_once(hub_env, monkeypatch) -> None:
    from personaplex_voice.model.config import ModelConfig

    hub = hub_env()
    monkeypatch.setenv("HF_TOKEN", "hf_good")
    files = resolve_model(REPO)
    assert files.name == REPO
    assert files.lm_weights == hub.snapshot / "model.safetensors"
    assert files.mimi_weights == hub.snapshot / "tokenizer-e351c8d8-checkpoint125.safetensors"
    assert files.tokenizer == hub.snapshot / "tokenizer_spm_32k_3.model"
    assert files.lm_dtype_in_file == "bfloat16"
    assert files.config == ModelConfig.personaplex_7b()
    assert files.voice_dirs == (hub.snapshot / "voices",)
    assert sorted(p.name for p in files.voice_dirs[0].iterdir()) == ["NATF0.pt", "NATM1.pt"]

    # Unpacked once: a second resolve must not read the archive again.
    (hub.snapshot / "voices.tgz").write_bytes(b"not a tarball any more")
    assert resolve_model().voice_dirs == files.voice_dirs  # None = the default repo


def test_overridden_files_are_not_downloaded(hub_env, monkeypatch, tmp_path) -> None:
    hub = hub_env()
    monkeypatch.setenv("HF_TOKEN", "hf_good")
    lm = tmp_path / "my-lm.safetensors"
    lm.write_bytes(_safetensors_bytes())
    voices = tmp_path / "my-voices"
    voices.mkdir()
    files = resolve_model(REPO, moshi_weight=lm, voice_prompt_dir=voices)
    assert files.lm_weights == lm and files.voice_dirs == (voices,)
    assert sorted(hub.calls) == sorted([sources.HUB_MIMI_WEIGHTS, sources.HUB_TOKENIZER])


def test_gated_repo_without_token_says_to_set_hf_token(hub_env) -> None:
    hub_env()
    with pytest.raises(UserError, match=r"nvidia/personaplex-7b-v1 is a gated repository.*HF_TOKEN"):
        resolve_model(REPO)


def test_gated_repo_with_a_token_lacking_access(hub_env, monkeypatch) -> None:
    hub_env()
    monkeypatch.setenv("HF_TOKEN", "hf_no_access")
    with pytest.raises(UserError, match="has no access"):
        resolve_model(REPO)


def test_hub_errors_name_the_repo_or_file(hub_env, monkeypatch) -> None:
    hub = hub_env()
    monkeypatch.setenv("HF_TOKEN", "hf_good")
    with pytest.raises(UserError, match="someone/other: no such Hugging Face repository"):
        resolve_model("someone/other")
    (hub.snapshot / sources.HUB_TOKENIZER).unlink()
    with pytest.raises(UserError, match=r"tokenizer_spm_32k_3\.model: missing file in the repository"):
        resolve_model(REPO)
    hub.offline = True
    with pytest.raises(UserError, match="cannot reach the Hugging Face hub"):
        resolve_model(REPO)


def test_voices_list_fetches_only_the_voices(hub_env, monkeypatch) -> None:
    hub = hub_env()
    monkeypatch.setenv("HF_TOKEN", "hf_good")
    dirs = resolve_voice_dirs(REPO)
    assert dirs == (hub.snapshot / "voices",)
    assert hub.calls == [sources.HUB_VOICES_ARCHIVE]


def _special(name: str, kind: bytes, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    return info


MALICIOUS = {
    "absolute": (_file("/tmp/evil.pt"), b"x"),
    "dotdot": (_file("voices/../../evil.pt"), b"x"),
    "symlink": (_special("voices/link.pt", tarfile.SYMTYPE, "/etc/passwd"), None),
    "hardlink": (_special("voices/hard.pt", tarfile.LNKTYPE, "/etc/passwd"), None),
    "device": (_special("voices/dev", tarfile.CHRTYPE), None),
    "fifo": (_special("voices/fifo", tarfile.FIFOTYPE), None),
}


@pytest.mark.parametrize("kind", sorted(MALICIOUS))
def test_malicious_voices_archive_is_refused_and_nothing_written(hub_env, monkeypatch, kind) -> None:
    bad = MALICIOUS[kind]
    hub = hub_env(_tgz([*GOOD_VOICES, bad]))
    monkeypatch.setenv("HF_TOKEN", "hf_good")
    with pytest.raises(UserError, match=r"voices\.tgz: .*(unsafe path|not a plain file)"):
        resolve_model(REPO)
    # Checked before anything was written: no voices/, no temporary directory, nothing outside.
    assert sorted(p.name for p in hub.snapshot.iterdir()) == sorted(
        [sources.HUB_LM_WEIGHTS, sources.HUB_MIMI_WEIGHTS, sources.HUB_TOKENIZER, "voices.tgz"]
    )
    assert not (hub.snapshot.parent.parent / "evil.pt").exists()


def test_archive_without_voices_directory(hub_env, monkeypatch) -> None:
    hub = hub_env(_tgz([(_file("other/NATF0.pt"), b"pt")]))
    monkeypatch.setenv("HF_TOKEN", "hf_good")
    with pytest.raises(UserError, match="no 'voices/' directory"):
        resolve_model(REPO)
    assert not (hub.snapshot / "voices").exists()


def test_corrupt_or_unwritable_voices_archive(hub_env, monkeypatch) -> None:
    good = _tgz([*GOOD_VOICES, (_file("voices/BIG.pt"), bytes(range(256)) * 400)])
    hub = hub_env(good[: len(good) - 200])  # truncated download
    monkeypatch.setenv("HF_TOKEN", "hf_good")
    with pytest.raises(UserError, match=r"voices\.tgz: unreadable voices archive"):
        resolve_model(REPO)
    assert not (hub.snapshot / "voices").exists()
    (hub.snapshot / "voices.tgz").write_bytes(good)

    def read_only(*args: object, **kwargs: object) -> str:
        raise PermissionError(13, "Permission denied", str(hub.snapshot))

    monkeypatch.setattr(sources.tempfile, "mkdtemp", read_only)  # a read-only hub cache
    with pytest.raises(UserError, match=r"cannot unpack into .*Permission denied"):
        resolve_model(REPO)


# --------------------------------------------------------------------------------------------
# local model directories


def _model_dir(golden_dir: Path, dest: Path, without: str | None = None) -> Path:
    """A model directory that links the golden files, minus one."""
    dest.mkdir()
    for name in GOLDEN_FILES:
        if name != without:
            (dest / name).symlink_to(golden_dir / name)
    return dest


def test_local_directory_with_the_golden_layout(golden_dir: Path) -> None:
    from personaplex_voice.model.config import ModelConfig

    files = resolve_model(str(golden_dir))
    assert files.config == ModelConfig.from_json(golden_dir / "config.json")
    assert files.lm_weights == golden_dir / "model.safetensors"
    assert files.mimi_weights == golden_dir / "mimi.safetensors"
    assert files.tokenizer == golden_dir / "tokenizer.model"
    assert files.voice_dirs == (golden_dir / "voices",)
    assert files.lm_dtype_in_file == "bfloat16"


@pytest.mark.parametrize("missing", GOLDEN_FILES)
def test_local_directory_missing_a_file_names_it(golden_dir: Path, tmp_path: Path, missing: str) -> None:
    root = _model_dir(golden_dir, tmp_path / "model", without=missing)
    with pytest.raises(UserError, match=rf"{root / missing}: missing"):
        resolve_model(str(root))


def test_per_file_override_replaces_a_missing_file(golden_dir: Path, tmp_path: Path) -> None:
    root = _model_dir(golden_dir, tmp_path / "model", without="model.safetensors")
    files = resolve_model(str(root), moshi_weight=golden_dir / "model.safetensors")
    assert files.lm_weights == golden_dir / "model.safetensors"


def test_corrupt_weights_are_named(golden_dir: Path, tmp_path: Path) -> None:
    root = _model_dir(golden_dir, tmp_path / "model", without="mimi.safetensors")
    (root / "mimi.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(UserError, match=rf"{root / 'mimi.safetensors'}: not a safetensors file"):
        resolve_model(str(root))
    (root / "mimi.safetensors").write_bytes(b"abc")
    with pytest.raises(UserError, match="not a safetensors file"):
        resolve_model(str(root))


def test_bad_config_json_is_named(golden_dir: Path, tmp_path: Path) -> None:
    root = _model_dir(golden_dir, tmp_path / "model", without="config.json")
    (root / "config.json").write_text("{ nope")
    with pytest.raises(UserError, match=rf"{root / 'config.json'}: unreadable model config"):
        resolve_model(str(root))


def test_unknown_specs_and_missing_overrides(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no such model directory"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(UserError, match="no such model directory"):
        resolve_model("not a repo id")
    with pytest.raises(UserError, match=r"--moshi-weight .*: no such file"):
        resolve_model("demo", moshi_weight=tmp_path / "missing.safetensors")
    with pytest.raises(UserError, match=r"--voice-prompt-dir .*: no such directory"):
        resolve_model("demo", voice_prompt_dir=tmp_path / "missing")
