"""`personaplex-voice bundle` (`make bundle`): an offline install bundle for a GPU host that has a
CUDA build of torch and no network (docs/deploy.md).

Made on a connected machine from a checkout; the bundle folder holds
```
offline-bundle/
  wheels/            every runtime dependency for the target Python and platform, and the
                     project's own wheel; never torch, triton or NVIDIA's CUDA wheels
  lib/libopus.so.0   Debian's libopus (from the libopus0 .deb) and its copyright file
  install.sh         installs all of it with no network (pip --no-index), libopus into
                     <prefix>/lib/personaplex-voice/ where the project's opus loader looks
  requirements.txt   the exact wheels, pinned
  manifest.json      target, project version, extras, each file's sha256
```
How: the project's wheel is built with `pip wheel --no-deps`; its dependencies minus torch are
downloaded as wheels for the target (`deploy/target.py`); a dependency published only as source
(opuslib) is built here into a wheel, which must come out pure Python (`py3-none-any`), else the
bundle stops and says so. `verify_bundle` then resolves the whole install offline for the target,
with a placeholder standing for the host's torch, and the bundle is refused if anything is
missing or a torch wheel slipped in.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from personaplex_voice.deploy.target import DEFAULT_PLATFORM, DEFAULT_PYTHON, Target
from personaplex_voice.errors import UserError

PROJECT = "personaplex-voice"
BUNDLE_DIR_NAME = "offline-bundle"
MANIFEST_FORMAT = "personaplex-voice offline bundle v1"
# Distributions a bundle never carries: the host has its own torch (a CUDA build matched to its
# driver), and a second one, or CUDA runtime wheels, would shadow or fight it.
HOST_ONLY = re.compile(r"^(torch|torchvision|torchaudio|triton|pytorch[-_]triton.*|nvidia[-_].*)$")
LIBOPUS_PACKAGE = "libopus0"
# Source-only dependencies built into wheels here, at most this many (a guard against a loop).
MAX_SOURCE_BUILDS = 8
PIP_TIMEOUT_S = 900
INSTALL_SCRIPT = Path(__file__).with_name("install.sh")

Log = Callable[[str], None]


@dataclass(frozen=True)
class Profile:
    """What a bundle carries. `packages`: the runtime requirements it is made from, by name
    (None: all of the project's, with the extras asked for); `host_provides`: distributions the
    host is expected to have already (never bundled; install.sh checks they import there)."""

    name: str
    description: str
    packages: tuple[str, ...] | None = None
    host_provides: tuple[str, ...] = ()


# A CUDA torch image (docs/deploy.md; the GPU host of bench/gpu_check.sh: Python 3.12, torch
# 2.11) has numpy and these already; what the check needs beyond them is the serving stack.
GPU_IMAGE_PROVIDES = (
    "numpy", "safetensors", "sentencepiece", "huggingface-hub", "typer", "tqdm", "prometheus-client",
)  # fmt: skip
GPU_CHECK_PACKAGES = (
    "fastapi", "pydantic", "pydantic-settings", "uvicorn", "httptools", "websockets", "soxr", "opuslib",
)  # fmt: skip
PROFILES = {
    "full": Profile("full", "every runtime dependency (and the extras asked for): serve anything"),
    "gpu": Profile(
        "gpu",
        "what bench/gpu_check.sh needs on a CUDA torch image that lacks the serving stack: "
        "fastapi, uvicorn (httptools), pydantic, websockets, soxr, opuslib, libopus",
        packages=GPU_CHECK_PACKAGES,
        host_provides=GPU_IMAGE_PROVIDES,
    ),
}


def _stderr(message: str) -> None:
    print(f"[bundle] {message}", file=sys.stderr, flush=True)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name(filename: str) -> tuple[str, str]:
    """(canonical distribution name, version) of a wheel file name."""
    parts = filename.removesuffix(".whl").split("-")
    return canonical(parts[0]), parts[1]


# ---------------------------------------------------------------------------------------------
# what the project needs


def project_root(start: Path | None = None) -> Path:
    """The checkout this module runs from (its pyproject.toml names the project)."""
    root = (start or Path(__file__)).resolve()
    for candidate in [root, *root.parents]:
        pyproject = candidate / "pyproject.toml"
        if pyproject.is_file() and f'name = "{PROJECT}"' in pyproject.read_text():
            return candidate
    raise UserError("bundle: run it from a checkout of personaplex-voice (or give --project DIR)")


def project_metadata(root: Path) -> dict[str, Any]:
    return tomllib.loads((root / "pyproject.toml").read_text())["project"]


def runtime_requirements(root: Path, extras: Sequence[str] = ()) -> list[str]:
    """The project's runtime requirements (and those of `extras`), torch and friends left out."""
    meta = project_metadata(root)
    optional = meta.get("optional-dependencies", {})
    wanted: list[str] = []
    pending = list(meta.get("dependencies", []))
    seen_extras: set[str] = set()
    todo = list(extras)
    while todo:
        extra = todo.pop()
        if extra in seen_extras:
            continue
        if extra not in optional:
            raise UserError(f"--extras {extra}: the project has no such extra ({', '.join(optional)})")
        seen_extras.add(extra)
        for requirement in optional[extra]:
            match = re.match(rf"^{PROJECT}\[([^\]]+)\]", requirement)
            if match:  # an extra made of other extras
                todo += [e.strip() for e in match.group(1).split(",")]
            else:
                pending.append(requirement)
    for requirement in pending:
        name = re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0]
        if not HOST_ONLY.match(canonical(name)) and requirement not in wanted:
            wanted.append(requirement)
    return wanted


def requirement_name(requirement: str) -> str:
    return canonical(re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0])


def profile_requirements(root: Path, profile: Profile, extras: Sequence[str] = ()) -> list[str]:
    """The requirements a bundle of `profile` is made from: the project's own version specifiers
    for the profile's packages (their extras dropped: `uvicorn[standard]` is `uvicorn`, the
    profile names what it needs of the rest), or all of them for a profile without a list."""
    if profile.packages is None:
        return runtime_requirements(root, extras)
    if extras:
        raise UserError(f"--extras: the {profile.name} profile carries a fixed set of packages")
    wanted = {canonical(name) for name in profile.packages}
    found: dict[str, str] = {}
    for requirement in runtime_requirements(root):
        name = requirement_name(requirement)
        if name in wanted:
            found[name] = re.sub(r"^([A-Za-z0-9_.-]+)\[[^\]]*\]", r"\1", requirement)
    return [found.get(canonical(name), name) for name in profile.packages]


# ---------------------------------------------------------------------------------------------
# running pip


def _run(cmd: Sequence[str], log: Log, what: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    log(what)
    try:
        return subprocess.run(
            list(cmd), cwd=cwd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        raise UserError(
            f"bundle: {what} took over {PIP_TIMEOUT_S} s (is the package index reachable?)"
        ) from None


def _tail(proc: subprocess.CompletedProcess, lines: int = 6) -> str:
    text = (proc.stderr or "") + (proc.stdout or "")
    kept = [line for line in text.strip().splitlines() if line.strip() and "━" not in line]
    return " | ".join(kept[-lines:])


@contextlib.contextmanager
def bundle_only_pip_env() -> Iterator[dict[str, str]]:
    """An environment in which pip reads no configuration and no index: the bundle alone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    yield env


def build_project_wheel(root: Path, wheels: Path, log: Log) -> Path:
    before = set(wheels.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(wheels), str(root)]
    proc = _run(cmd, log, f"building the {PROJECT} wheel from {root}")
    made = [w for w in set(wheels.glob("*.whl")) - before if wheel_name(w.name)[0] == PROJECT]
    if proc.returncode != 0 or len(made) != 1:
        raise UserError(f"bundle: could not build the project's wheel: {_tail(proc)}")
    if not made[0].name.endswith("-py3-none-any.whl"):
        raise UserError(f"bundle: the project's wheel {made[0].name} is not pure Python")
    return made[0]


def download_wheels(requirements: list[str], wheels: Path, target: Target, work: Path, log: Log) -> list[str]:
    """Wheels of `requirements` and everything they need, for `target`, into `wheels`. Returns the
    requirements that had to be built from source here (each a pure-Python wheel)."""
    reqs = work / "requirements.in"
    reqs.write_text("\n".join(requirements) + "\n")
    built_dir = work / "built"
    built_dir.mkdir(exist_ok=True)
    built: list[str] = []
    for _ in range(MAX_SOURCE_BUILDS + 1):
        cmd = [*target.pip_command(), "download", *target.pip_options(), "--dest", str(wheels)]
        cmd += ["--find-links", str(built_dir), "--requirement", str(reqs)]
        proc = _run(cmd, log, f"downloading wheels for {target.describe()}")
        if proc.returncode == 0:  # pip saved the source-built wheels it used into `wheels` too
            return built
        missing = re.search(r"No matching distribution found for (\S+)", proc.stderr or "")
        if missing is None or missing.group(1) in built:
            raise UserError(f"bundle: pip could not download the wheels: {_tail(proc)}")
        requirement = missing.group(1)
        built.append(requirement)
        name = re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0]
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-binary", name]
        cmd += ["--wheel-dir", str(built_dir), requirement]
        proc = _run(cmd, log, f"{requirement} has no wheel for the target: building one from its source")
        made = [w for w in built_dir.glob("*.whl") if wheel_name(w.name)[0] == canonical(name)]
        if proc.returncode != 0 or not made:
            raise UserError(f"bundle: could not build {requirement} from source: {_tail(proc)}")
        if not all(w.name.endswith("-none-any.whl") for w in made):
            raise UserError(
                f"bundle: {requirement} has no wheel for {target.describe()} and its source builds "
                f"compiled code ({made[0].name}): make the bundle on a machine like the target"
            )
    raise UserError(f"bundle: more than {MAX_SOURCE_BUILDS} dependencies had to be built from source")


def drop_host_provided(wheels: Path, profile: Profile, log: Log) -> list[str]:
    """Remove the wheels of distributions the profile's host already has; returns their names."""
    provided = {canonical(name) for name in profile.host_provides}
    dropped = []
    for wheel in sorted(wheels.glob("*.whl")):
        name = wheel_name(wheel.name)[0]
        if name in provided:
            wheel.unlink()
            dropped.append(name)
    if dropped:
        log(f"left out (the host has them): {', '.join(dropped)}")
    return dropped


def check_no_host_packages(wheels: Path) -> None:
    found = sorted(w.name for w in wheels.glob("*.whl") if HOST_ONLY.match(wheel_name(w.name)[0]))
    if found:
        raise UserError(
            f"bundle: a dependency pulled in {', '.join(found)}: the bundle never carries torch or "
            "CUDA wheels (the host's own torch is used)"
        )


# ---------------------------------------------------------------------------------------------
# libopus from Debian's package


def fetch_libopus(lib: Path, target: Target, work: Path, log: Log) -> str:
    """Debian's libopus shared library (package libopus0) into `lib`; returns the .deb's name.

    `apt-get download` needs no root (only the package lists); `dpkg -x` unpacks the .deb
    without installing it."""
    for tool in ("apt-get", "dpkg"):
        if shutil.which(tool) is None:
            raise UserError(
                f"bundle: {tool} not found: libopus is taken from Debian's {LIBOPUS_PACKAGE} package; "
                "make the bundle on Debian/Ubuntu, or give --libopus PATH (a libopus.so.0), or --libopus none"
            )
    debs = work / "debs"
    debs.mkdir(exist_ok=True)
    package = f"{LIBOPUS_PACKAGE}:{target.debian_arch}"
    cmd = ["apt-get", "download", package]
    proc = _run(cmd, log, f"downloading Debian's {package}", cwd=debs)
    if proc.returncode != 0 and os.geteuid() == 0 and "Unable to locate" in (proc.stderr or ""):
        _run(["apt-get", "update", "-q"], log, "apt-get update (no package lists yet)")
        proc = _run(cmd, log, f"downloading Debian's {package} again", cwd=debs)
    found = sorted(debs.glob(f"{LIBOPUS_PACKAGE}_*.deb"))
    if proc.returncode != 0 or not found:
        raise UserError(
            f"bundle: apt-get download {package} failed ({_tail(proc, 2)}); run `apt-get update` "
            "first, or give --libopus PATH"
        )
    unpacked = work / "libopus0"
    proc = _run(["dpkg", "-x", str(found[0]), str(unpacked)], log, f"unpacking {found[0].name}")
    libraries = sorted(unpacked.glob("usr/lib/*/libopus.so.0.*")) or sorted(
        unpacked.glob("usr/lib/libopus.so.0.*")
    )
    if proc.returncode != 0 or not libraries:
        raise UserError(f"bundle: {found[0].name} holds no libopus.so.0 ({_tail(proc, 2)})")
    place_libopus(libraries[0], lib)
    copyright_file = unpacked / "usr" / "share" / "doc" / LIBOPUS_PACKAGE / "copyright"
    if copyright_file.is_file():
        shutil.copy2(copyright_file, lib / "libopus.copyright")
    return found[0].name


def place_libopus(library: Path, lib: Path) -> None:
    """`library` as lib/libopus.so.0 (a real file: links do not survive every copy)."""
    lib.mkdir(parents=True, exist_ok=True)
    shutil.copy2(library.resolve(), lib / "libopus.so.0")


# ---------------------------------------------------------------------------------------------
# the bundle


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def default_out() -> Path:
    return project_root() / BUNDLE_DIR_NAME


def _prepare_out(out: Path) -> None:
    """An empty folder, or an older bundle (replaced); never a folder of something else."""
    if out.exists():
        if not out.is_dir():
            raise UserError(f"bundle: {out} is a file")
        if any(out.iterdir()) and not (out / "manifest.json").is_file():
            raise UserError(f"bundle: {out} is not empty and holds no bundle: give another --out")
        for name in ("wheels", "lib"):
            shutil.rmtree(out / name, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)


def build_bundle(
    out: Path,
    target: Target = Target(),
    *,
    extras: Sequence[str] = (),
    root: Path | None = None,
    libopus: str = "auto",
    verify: bool = True,
    log: Log = _stderr,
    profile: str = "full",
) -> dict[str, Any]:
    """Make the bundle in `out` (see the module docstring); returns its manifest.

    `libopus`: "auto" (Debian's package), a path to a libopus shared library, or "none";
    `profile`: "full" or "gpu" (`PROFILES`)."""
    if profile not in PROFILES:
        raise UserError(f"--profile {profile}: no such profile ({', '.join(PROFILES)})")
    chosen = PROFILES[profile]
    root = root or project_root()
    meta = project_metadata(root)
    out = out.resolve()
    _prepare_out(out)
    wheels, lib = out / "wheels", out / "lib"
    wheels.mkdir()
    with tempfile.TemporaryDirectory(prefix="personaplex-bundle-") as tmp:
        work = Path(tmp)
        project_wheel = build_project_wheel(root, wheels, log)
        requirements = profile_requirements(root, chosen, extras)
        built = download_wheels(requirements, wheels, target, work, log)
        drop_host_provided(wheels, chosen, log)
        check_no_host_packages(wheels)
        if libopus == "auto":
            libopus_source = fetch_libopus(lib, target, work, log)
        elif libopus == "none":
            libopus_source = None
        else:
            given = Path(libopus)
            if not given.is_file():
                raise UserError(f"--libopus {libopus}: no such file")
            place_libopus(given, lib)
            libopus_source = str(given)
    extra = f"[{','.join(extras)}]" if extras else ""
    requirement = f"{PROJECT}{extra}=={meta['version']}"
    project_wheel_name = project_wheel.name
    pinned = sorted(
        f"{wheel_name(w.name)[0]}=={wheel_name(w.name)[1]}"
        for w in wheels.glob("*.whl")
        if w != project_wheel
    )
    (out / "requirements.txt").write_text("\n".join(pinned) + "\n")
    shutil.copy2(INSTALL_SCRIPT, out / "install.sh")
    (out / "install.sh").chmod(0o755)
    files = sorted([*wheels.glob("*.whl"), *lib.glob("*")]) if lib.exists() else sorted(wheels.glob("*.whl"))
    manifest: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "project": PROJECT,
        "version": meta["version"],
        "requirement": requirement,
        "profile": chosen.name,
        # a profile with a fixed set: the project's wheel installs without its dependencies,
        # these requirements with theirs, the host's distributions standing in for the rest
        "profile_requirements": requirements if chosen.packages is not None else None,
        "host_provides": list(chosen.host_provides),
        "project_wheel": project_wheel_name,
        "extras": list(extras),
        "python_version": target.python_version,
        "platform": target.platform,
        "abi": target.abi,
        "built_from_source": built,
        "libopus": libopus_source,
        "files": {str(f.relative_to(out)): _sha256(f) for f in files},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    if verify:
        resolved = verify_bundle(out, log=log)
        manifest["verified"] = len(resolved)
    size = sum(f.stat().st_size for f in files) / 2**20
    count = len(list(wheels.glob("*.whl")))
    log(f"bundle ready: {out} ({count} wheels, {size:.1f} MiB, profile {chosen.name})")
    log(f"for {target.describe()}")
    return manifest


def read_manifest(bundle: Path) -> dict[str, Any]:
    path = bundle / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{bundle}: not an offline bundle ({path.name}: {exc})") from None
    if manifest.get("format") != MANIFEST_FORMAT:
        raise UserError(f"{bundle}: not an offline bundle of this version ({manifest.get('format')!r})")
    return manifest


def placeholder_torch(folder: Path, version: str = "2.4.0", name: str = "torch") -> Path:
    """An empty `torch` wheel standing for the host's own torch while resolving offline (it is
    never put in a bundle): the bundle must satisfy everything else. `name`: another
    distribution a profile expects on the host."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = name.replace("-", "_")
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: personaplex-voice\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        z.writestr(f"{info}/RECORD", "")
    return path


def verify_bundle(bundle: Path, *, log: Log = _stderr) -> list[str]:
    """Resolve the bundle's install for its target with no index and no configuration: every
    distribution must come from the bundle, except torch (the placeholder for the host's).
    Returns the resolved `name==version` list; `UserError` when anything is missing."""
    manifest = read_manifest(bundle)
    target = Target(manifest["python_version"], manifest["platform"])
    check_no_host_packages(bundle / "wheels")
    fixed = manifest.get("profile_requirements")
    with tempfile.TemporaryDirectory(prefix="personaplex-verify-") as tmp, bundle_only_pip_env() as env:
        work = Path(tmp)
        placeholder_torch(work / "host-torch")
        for name in manifest.get("host_provides", []):  # the host's own, at any version
            placeholder_torch(work / "host-torch", "9999", name)
        report = work / "report.json"
        cmd = [*target.pip_command(), "install", "--dry-run", "--ignore-installed", "--no-index"]
        cmd += ["--find-links", str(bundle / "wheels"), "--find-links", str(work / "host-torch")]
        cmd += [*target.pip_options(), "--report", str(report), "--quiet"]
        if fixed is not None:  # the project's wheel installs without its dependencies
            cmd += [*fixed, *manifest.get("host_provides", [])]
        else:
            cmd.append(manifest["requirement"])
        profile = manifest.get("profile", "full")
        log(f"resolving {manifest['requirement']} ({profile} profile) offline for {target.describe()}")
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, env=env, check=False
        )
        if proc.returncode != 0:
            raise UserError(f"bundle {bundle} does not resolve offline: {_tail(proc)}")
        installs = json.loads(report.read_text())["install"]
    resolved = []
    for item in installs:
        name, version = canonical(item["metadata"]["name"]), item["metadata"]["version"]
        url = item["download_info"]["url"]
        host = {"torch", *(canonical(n) for n in manifest.get("host_provides", []))}
        source = "host-torch" if name in host else "wheels"
        if f"/{source}/" not in url:
            raise UserError(f"bundle {bundle}: {name} {version} resolved from outside the bundle ({url})")
        resolved.append(f"{name}=={version}")
    if fixed is not None:  # and the project's own wheel is there
        project = manifest.get("project_wheel")
        if not project or not (bundle / "wheels" / project).is_file():
            raise UserError(f"bundle {bundle}: the project's wheel {project} is missing")
        resolved.append(f"{PROJECT}=={manifest['version']}")
    return resolved


# ---------------------------------------------------------------------------------------------
# the command


def bundle(
    out: Annotated[
        Path | None, typer.Option(help=f"Bundle folder (default: {BUNDLE_DIR_NAME}/ in the checkout)")
    ] = None,
    python_version: Annotated[
        str, typer.Option(help="The target host's Python, major.minor (`python3 --version` there)")
    ] = DEFAULT_PYTHON,
    platform: Annotated[
        str,
        typer.Option(
            help="The target's manylinux tag: its glibc (`ldd --version`), e.g. manylinux_2_35_x86_64"
        ),
    ] = DEFAULT_PLATFORM,
    extras: Annotated[
        str, typer.Option(help="Comma-separated extras to include too, e.g. twilio,cluster")
    ] = "",
    libopus: Annotated[
        str, typer.Option(help="auto (Debian's libopus0 package), a path to libopus.so.0, or none")
    ] = "auto",
    verify: Annotated[
        bool, typer.Option(help="Resolve the install offline for the target afterwards")
    ] = True,
    project: Annotated[Path | None, typer.Option(help="The checkout to bundle (default: this one)")] = None,
    profile: Annotated[
        str,
        typer.Option(
            help="full (every runtime dependency) or gpu (what bench/gpu_check.sh needs on a CUDA "
            "torch image: the serving stack and libopus, not numpy and what such an image has)"
        ),
    ] = "full",
) -> None:
    """Make an offline install bundle for a GPU host with torch and no network (docs/deploy.md)."""
    root = project_root(project) if project else project_root()
    chosen = [e.strip() for e in extras.split(",") if e.strip()]
    build_bundle(
        out or root / BUNDLE_DIR_NAME,
        Target(python_version, platform),
        extras=chosen,
        root=root,
        libopus=libopus,
        verify=verify,
        profile=profile,
    )


def main(argv: list[str] | None = None) -> None:
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(bundle)
    try:
        app(args=argv, prog_name="python -m personaplex_voice.deploy.bundle", standalone_mode=True)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
