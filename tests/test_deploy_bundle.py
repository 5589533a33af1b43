"""The offline install bundle (`personaplex-voice bundle`, docs/deploy.md): made here from the
package index and Debian's archive, then used with no network at all.

- For the default target (CPython 3.12, manylinux): the install resolves completely offline
  (`pip install --dry-run --no-index` on the bundle alone, for 3.12's tags and markers, a
  placeholder standing for the host's torch), it holds no torch or CUDA wheel, and its libopus
  (Debian's libopus0) loads through the project's loader.
- The gpu profile (what bench/gpu_check.sh needs on a CUDA torch image): it and the golden files
  fit the carry to a GPU host (under 48 MiB), it resolves offline with the image's packages
  standing in for the rest.
- The whole air-gapped flow, on this machine's Python: a clean copy of the checkout with a gpu
  profile bundle in `offline-bundle/`, a fresh venv holding only what the GPU image has (torch,
  numpy, safetensors...: none of fastapi, uvicorn, pydantic, websockets, soxr, opuslib, soundfile,
  libopus), `bench/gpu_check.sh --cpu-smoke` inside a network namespace with nothing but loopback
  (when the machine allows one): the bundle is installed, nothing is missing, every part of the
  check runs, serving included (opus through the project's loader).

The bundles are built once per test session (tests/support_bundle.py).
"""

from __future__ import annotations

import ctypes.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from support_bundle import ABSENT_ON_THE_GPU_HOST, GPU_IMAGE, gpu_image_site, shared_bundle

from personaplex_voice.audio import opus_library
from personaplex_voice.deploy.bundle import (
    GPU_IMAGE_PROVIDES,
    HOST_ONLY,
    PROFILES,
    build_bundle,
    canonical,
    check_no_host_packages,
    placeholder_torch,
    profile_requirements,
    read_manifest,
    runtime_requirements,
    verify_bundle,
    wheel_name,
)
from personaplex_voice.deploy.target import Target
from personaplex_voice.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT.parent / "shared" / "golden"
# What can travel to the GPU host beside the tracked tree (the device tool carries 64 MiB in
# all); the bundle, the golden files and anything else the check needs stay under this.
CARRY_BUDGET_MIB = 48


# ---------------------------------------------------------------------------------------------
# pure parts


def test_the_target_lists_every_older_manylinux_tag_and_its_markers():
    target = Target("3.12", "manylinux_2_28_x86_64")
    tags = target.platform_tags()
    assert tags[0] == "manylinux_2_28_x86_64" and tags[-3:] == [
        "manylinux2014_x86_64",
        "manylinux2010_x86_64",
        "manylinux1_x86_64",
    ]
    assert "manylinux_2_17_x86_64" in tags and "manylinux_2_29_x86_64" not in tags
    options = target.pip_options()
    assert options[:3] == ["--only-binary=:all:", "--python-version", "3.12"]
    assert {"cp312", "abi3", "none"} <= {options[i + 1] for i, o in enumerate(options) if o == "--abi"}
    assert target.markers()["python_version"] == "3.12" and target.debian_arch == "amd64"
    assert Target("3.11", "manylinux_2_17_aarch64").debian_arch == "arm64"
    for bad in (("3", "manylinux_2_28_x86_64"), ("3.12", "linux_x86_64"), ("3.12", "win_amd64")):
        with pytest.raises(UserError):
            Target(*bad)


def test_pip_runs_with_the_target_markers_not_its_own(tmp_path):
    """pip alone evaluates `; python_version >= "3.13"` for the interpreter running it (this one
    is older): through the target's runner, a requirement only 3.13 needs is looked for."""
    assert sys.version_info[:2] < (3, 13)
    requirement = 'no-such-package-here; python_version >= "3.13"'
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    args = [
        "install",
        "--dry-run",
        "--no-index",
        "--find-links",
        str(tmp_path),
        "--target",
        str(tmp_path / "t"),
    ]
    results = {}
    for version in ("3.12", "3.13"):
        cmd = [*Target(version).pip_command(), *args, requirement]
        results[version] = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert results["3.12"].returncode == 0 and "Ignoring no-such-package-here" in results["3.12"].stdout
    assert results["3.13"].returncode != 0 and "no-such-package-here" in results["3.13"].stderr


def test_runtime_requirements_leave_torch_out_and_follow_extras():
    core = runtime_requirements(ROOT)
    assert not any(r.split(">")[0].split("=")[0].strip() == "torch" for r in core)
    assert any(r.startswith("numpy") for r in core) and any(r.startswith("cryptography") for r in core)
    with_twilio = runtime_requirements(ROOT, ["twilio"])
    assert any(r.startswith("twilio") for r in with_twilio) and set(core) < set(with_twilio)
    dev = runtime_requirements(ROOT, ["dev"])  # an extra made of other extras
    assert any(r.startswith("ray") for r in dev) and any(r.startswith("twilio") for r in dev)
    with pytest.raises(UserError, match="no such extra"):
        runtime_requirements(ROOT, ["gpu"])


def test_a_torch_or_cuda_wheel_in_a_bundle_is_refused(tmp_path):
    for name in (
        "torch-2.11.0-cp312-cp312-manylinux_2_28_x86_64.whl",
        "nvidia_cublas_cu12-12.8-py3-none-any.whl",
    ):
        folder = tmp_path / name
        folder.mkdir()
        (folder / name).write_bytes(b"")
        with pytest.raises(UserError, match="never carries torch"):
            check_no_host_packages(folder)
    assert HOST_ONLY.match("triton") and not HOST_ONLY.match("torchmetrics-free-name")
    assert wheel_name("pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.whl") == (
        "pydantic-core",
        "2.50.5",
    )


def test_a_folder_that_is_not_a_bundle_is_never_overwritten(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="holds no bundle"):
        build_bundle(tmp_path, root=ROOT, verify=False, log=lambda _: None)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_the_placeholder_torch_is_an_installable_empty_wheel(tmp_path):
    wheel = placeholder_torch(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        assert "Name: torch" in z.read("torch-2.4.0.dist-info/METADATA").decode()


# ---------------------------------------------------------------------------------------------
# the opus loader's search order


def _fresh_opus(monkeypatch):
    monkeypatch.setattr(opus_library, "_module", None)
    for name in [m for m in sys.modules if m == "opuslib" or m.startswith("opuslib.")]:
        monkeypatch.delitem(sys.modules, name)


SYSTEM_LIBOPUS = Path("/usr/lib/x86_64-linux-gnu/libopus.so.0")


def test_the_loader_prefers_the_environment_s_project_dir_then_the_system(tmp_path, monkeypatch):
    monkeypatch.delenv(opus_library.LIBOPUS_ENV, raising=False)
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    assert opus_library.project_libopus() is None  # nothing placed: the system's is used
    placed = opus_library.project_lib_dir() / "libopus.so.0"
    assert placed == tmp_path / "lib" / "personaplex-voice" / "libopus.so.0"
    placed.parent.mkdir(parents=True)
    placed.write_bytes(b"")
    assert opus_library.project_libopus() == str(placed)
    monkeypatch.setenv(opus_library.LIBOPUS_ENV, str(tmp_path / "nowhere.so"))
    with pytest.raises(opus_library.OpusUnavailableError, match="no such file"):
        opus_library.project_libopus()


@pytest.mark.skipif(not SYSTEM_LIBOPUS.is_file(), reason="needs Debian's libopus0 to copy")
def test_a_library_in_the_project_dir_is_the_one_loaded(tmp_path):
    """A fresh interpreter whose system finds no libopus loads the copy in <prefix>/lib/personaplex-voice."""
    prefix = tmp_path / "prefix"
    (prefix / "lib" / "personaplex-voice").mkdir(parents=True)
    shutil.copy2(SYSTEM_LIBOPUS, prefix / "lib" / "personaplex-voice" / "libopus.so.0")
    code = (
        "import ctypes.util, sys\n"
        "ctypes.util.find_library = lambda name: None\n"
        f"sys.prefix = {str(prefix)!r}\n"
        "from personaplex_voice.audio.opus_library import libopus_version, project_libopus\n"
        "print(libopus_version(), project_libopus())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != opus_library.LIBOPUS_ENV}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-1] == str(prefix / "lib" / "personaplex-voice" / "libopus.so.0")


def test_a_library_that_does_not_load_is_named_in_the_error(tmp_path, monkeypatch):
    broken = tmp_path / "libopus.so.0"
    broken.write_bytes(b"not an ELF file")
    monkeypatch.setenv(opus_library.LIBOPUS_ENV, str(broken))
    _fresh_opus(monkeypatch)
    with pytest.raises(opus_library.OpusUnavailableError, match=f"libopus at {broken} does not load"):
        opus_library.require_opus()
    assert ctypes.util.find_library is not None and ctypes.util.find_library("c")  # restored


# ---------------------------------------------------------------------------------------------
# the bundle for the default target (downloads from the package index and Debian's archive)


@pytest.fixture(scope="session")
def bundle_312(tmp_path_factory) -> Path:
    return shared_bundle(tmp_path_factory, Target("3.12", "manylinux_2_28_x86_64"), "full", ROOT)


@pytest.fixture(scope="session")
def gpu_bundle_312(tmp_path_factory) -> Path:
    return shared_bundle(tmp_path_factory, Target("3.12", "manylinux_2_28_x86_64"), "gpu", ROOT)


def size_mib(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20


def test_the_gpu_profile_takes_the_project_s_specifiers_and_no_extras():
    requirements = profile_requirements(ROOT, PROFILES["gpu"])
    assert [r.split(">")[0].split("=")[0].split("<")[0] for r in requirements] == list(
        PROFILES["gpu"].packages
    )
    uvicorn = next(r for r in requirements if r.startswith("uvicorn"))
    assert "[" not in uvicorn and "<0.55" in uvicorn  # the pin kept, [standard] dropped
    with pytest.raises(UserError, match="fixed set"):
        profile_requirements(ROOT, PROFILES["gpu"], ["twilio"])
    with pytest.raises(UserError, match="no such profile"):
        build_bundle(ROOT / "nowhere", root=ROOT, profile="tiny", verify=False, log=lambda _: None)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_gpu_profile_and_the_golden_files_fit_the_carry(gpu_bundle_312, tmp_path):
    """What travels to the GPU host beside the tracked tree: the gpu profile bundle and the golden
    files, under 48 MiB (the full bundle alone is ~75 MiB); none of what the image has (numpy),
    all of the serving stack; and it resolves offline for 3.12 with the image's packages (here
    placeholders) standing in for the rest."""
    bundle_mib, golden_mib = size_mib(gpu_bundle_312), size_mib(GOLDEN)
    print(f"gpu bundle {bundle_mib:.1f} MiB + golden {golden_mib:.1f} MiB")
    assert bundle_mib + golden_mib < CARRY_BUDGET_MIB, (bundle_mib, golden_mib)
    names = {wheel_name(p.name)[0] for p in (gpu_bundle_312 / "wheels").glob("*.whl")}
    assert {"personaplex-voice", "fastapi", "uvicorn", "pydantic", "websockets", "soxr", "opuslib"} <= names
    assert not names & {canonical(n) for n in (*GPU_IMAGE_PROVIDES, "scipy", "soundfile", "cryptography")}
    assert not any(HOST_ONLY.match(n) for n in names)
    assert (gpu_bundle_312 / "lib" / "libopus.so.0").is_file()
    manifest = read_manifest(gpu_bundle_312)
    assert manifest["profile"] == "gpu" and manifest["host_provides"] == list(GPU_IMAGE_PROVIDES)
    resolved = verify_bundle(gpu_bundle_312, log=lambda _: None)
    assert f"personaplex-voice=={manifest['version']}" in resolved
    assert {r.split("==")[0] for r in resolved} >= names  # every wheel is used


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_3_12_bundle_resolves_offline_and_holds_no_torch(bundle_312, tmp_path):
    manifest = read_manifest(bundle_312)
    assert (manifest["python_version"], manifest["platform"]) == ("3.12", "manylinux_2_28_x86_64")
    wheels = sorted(p.name for p in (bundle_312 / "wheels").glob("*.whl"))
    names = {wheel_name(w)[0] for w in wheels}
    assert not any(HOST_ONLY.match(n) for n in names), wheels
    assert {"personaplex-voice", "numpy", "fastapi", "uvicorn", "opuslib", "cryptography"} <= names
    for wheel in wheels:  # each binary wheel is for CPython 3.12 (or the stable ABI), on Linux
        tags = wheel.removesuffix(".whl").split("-")[-3:]
        assert tags[1] in ("cp312", "abi3", "none"), wheel
        assert tags[2] == "any" or "manylinux" in tags[2], wheel
    for name, digest in manifest["files"].items():
        assert len(digest) == 64 and (bundle_312 / name).is_file()
    # The Must-show command itself: pip, no index, no configuration, the bundle and a placeholder
    # for the host's torch only, 3.12's tags (and markers, through the target's pip runner).
    target = Target("3.12")
    report = tmp_path / "report.json"
    placeholder_torch(tmp_path / "host-torch", "2.11.0")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    cmd = [*target.pip_command(), "install", "--dry-run", "--ignore-installed", "--no-index"]
    cmd += ["--find-links", str(bundle_312 / "wheels"), "--find-links", str(tmp_path / "host-torch")]
    cmd += [*target.pip_options(), "--report", str(report), manifest["requirement"]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resolved = {
        i["metadata"]["name"].lower(): i["download_info"]["url"]
        for i in json.loads(report.read_text())["install"]
    }
    assert "host-torch" in resolved.pop("torch")
    assert all("/wheels/" in url for url in resolved.values()), resolved
    assert len(resolved) == len(wheels)  # every wheel is needed, none is missing
    assert len(verify_bundle(bundle_312, log=lambda _: None)) == len(wheels) + 1


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_bundled_libopus_loads_through_the_project_loader(bundle_312):
    library = bundle_312 / "lib" / "libopus.so.0"
    assert library.is_file() and (bundle_312 / "lib" / "libopus.copyright").is_file()
    assert read_manifest(bundle_312)["libopus"].startswith("libopus0_")
    # A fresh interpreter in which the system has no libopus (find_library finds nothing):
    # the bundled library alone must load, through $PERSONAPLEX_LIBOPUS.
    code = (
        "import ctypes.util; ctypes.util.find_library = lambda name: None\n"
        "from personaplex_voice.audio.opus_library import libopus_version\n"
        "from personaplex_voice.audio.opus import OggOpusWriter\n"
        "import numpy as np\n"
        "pages = OggOpusWriter(24000).write(np.zeros(1920, np.float32))\n"
        "print(libopus_version(), len(pages) > 0)\n"
    )
    env = {**os.environ, opus_library.LIBOPUS_ENV: str(library)}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["libopus", "1.3.1", "True"]


# ---------------------------------------------------------------------------------------------
# the whole air-gapped flow, on this machine's Python


def clean_copy(dest: Path) -> Path:
    """The checkout as a clean clone has it: tracked and untracked-but-not-ignored files only."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout.split(b"\0")
    for raw in listed:
        if not raw:
            continue
        source = ROOT / raw.decode()
        if source.is_file():
            target = dest / raw.decode()
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return dest


def isolated_network() -> list[str]:
    """A command prefix running in a new network namespace with only loopback up, or [] where
    this machine does not allow one (not root, no unshare)."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return []
    probe = subprocess.run(
        ["unshare", "-n", "ip", "link", "set", "lo", "up"], capture_output=True, timeout=30
    )
    return (
        ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"] if probe.returncode == 0 else []
    )


def missing_entries(value, path: str = "") -> list[str]:
    """Every non-empty value under a key that says something is missing, anywhere in the JSON."""
    found = []
    if isinstance(value, dict):
        for key, item in value.items():
            if "missing" in key and item not in ("", None, [], {}, False):
                found.append(f"{path}{key}={item!r}")
            found += missing_entries(item, f"{path}{key}.")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found += missing_entries(item, f"{path}{i}.")
    return found


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_air_gapped_flow_gpu_bundle_then_gpu_check_cpu_smoke_on_a_bare_gpu_image(tmp_path, tmp_path_factory):
    clone = clean_copy(tmp_path / "clone")
    # On the connected machine: the gpu profile bundle, for this machine's Python, beside bench/.
    bundle = shared_bundle(tmp_path_factory, Target.local(), "gpu", ROOT)
    shutil.copytree(bundle, clone / "offline-bundle")
    # The "GPU host": a fresh venv seeing only what the CUDA torch image has.
    image = gpu_image_site(tmp_path / "image")
    host = tmp_path / "host"
    subprocess.run([sys.executable, "-m", "venv", str(host)], check=True, timeout=300)
    host_site = next((host / "lib").glob("python3*/site-packages"))
    (host_site / "gpu-image.pth").write_text(f"{image}\n")
    python = str(host / "bin" / "python")
    for name in GPU_IMAGE:  # the image's packages are there...
        probe = subprocess.run(
            [python, "-c", f"import importlib.metadata as m; m.version({name!r})"], timeout=120
        )
        assert probe.returncode == 0, name
    for module in ("fastapi", "uvicorn", "pydantic", "websockets", "soxr", "opuslib", "soundfile"):
        absent = subprocess.run([python, "-c", f"import {module}"], capture_output=True, timeout=120)
        assert absent.returncode != 0, module  # ...and nothing of the serving stack
    out = tmp_path / "out" / "gpu_check.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
    env.update(PYTHON=python, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [*isolated_network(), "bash", str(clone / "bench" / "gpu_check.sh"), str(out), "--cpu-smoke"],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout[-2000:]
    result = json.loads(lines[0])
    setup = result["setup"]
    assert setup["bundle"] == "offline-bundle" and "fastapi" in setup["from_bundle"], setup
    assert "libopus" in setup["from_bundle"]  # the host had none the loader could use
    assert setup["python"] == ".venv-gpu/bin/python"
    assert missing_entries(result) == [], missing_entries(result)
    assert result["complete"] and result["errors"] == [], result["errors"]
    assert result["serving"]["calls_completed"] == result["serving"]["callers"] > 0
    assert "[install.sh] done" in proc.stderr and "libopus 1.3.1" in proc.stderr
    assert "profile gpu" in proc.stderr
    # the host's torch and numpy are the ones used: .venv-gpu has none of its own
    venv_site = next((clone / ".venv-gpu" / "lib").glob("python3*/site-packages"))
    assert not (venv_site / "torch").exists() and not (venv_site / "numpy").exists()
    assert (venv_site / "fastapi").exists()
    assert not any((venv_site / name).exists() for name in ("soundfile", "cryptography", "scipy"))
    assert set(ABSENT_ON_THE_GPU_HOST) >= {"soundfile", "cryptography"}
