"""Offline bundles for the deploy tests, built once per test session (downloads from the package
index and Debian's archive take a minute each), and a simulated GPU host image.

`shared_bundle` builds a bundle under the session's shared temporary root, behind a file lock:
pytest-xdist's workers (each with its own session fixtures) wait for the one building it and
reuse it, instead of each downloading the same wheels.

`gpu_image_site` stands for the CUDA torch image bench/gpu_check.sh meets on the GPU host: a
`site-packages` folder of links to this machine's torch and the packages such an image has
(`GPU_IMAGE`, the gpu profile's `host_provides`), with their own dependencies, and nothing of the
serving stack (fastapi, uvicorn, pydantic, websockets, soxr, opuslib, soundfile...) even where a
package here depends on it.
"""

from __future__ import annotations

import fcntl
import importlib.metadata as metadata
import re
from pathlib import Path

from personaplex_voice.deploy.bundle import GPU_IMAGE_PROVIDES, build_bundle, canonical
from personaplex_voice.deploy.target import Target

GPU_IMAGE = ("torch", *GPU_IMAGE_PROVIDES)
# What the GPU host lacks (docs/deploy.md): never in the simulated image.
ABSENT_ON_THE_GPU_HOST = (
    "fastapi", "starlette", "uvicorn", "pydantic", "pydantic-core", "pydantic-settings", "websockets",
    "soundfile", "soxr", "opuslib", "pyloudnorm", "cryptography", "httptools",
)  # fmt: skip


def shared_bundle(tmp_path_factory, target: Target, profile: str, root: Path) -> Path:
    """The bundle of `profile` for `target`, built by the first test session worker asking."""
    shared = tmp_path_factory.getbasetemp().parent / "bundles"
    shared.mkdir(exist_ok=True)
    out = shared / f"{profile}-{target.python_version}-{target.platform}"
    with open(shared / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "manifest.json").is_file():
            build_bundle(out, target, root=root, profile=profile, log=lambda _: None)
    return out


def _closure(names: tuple[str, ...], absent: set[str]) -> set[str]:
    """`names` and every distribution they require (extras ignored), as installed here, except
    the `absent` ones (this machine's typer wants pydantic; the image's older one does not)."""
    seen: set[str] = set()
    todo = [canonical(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen or name in absent:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen.add(name)
        for requirement in dist.requires or []:
            if "extra ==" in requirement:
                continue
            todo.append(canonical(re.split(r"[\s\[<>=!~;(]", requirement, maxsplit=1)[0]))
    return seen


def gpu_image_site(dest: Path) -> Path:
    """A `site-packages` folder (links) holding what the simulated GPU image has."""
    site = dest / "site-packages"
    site.mkdir(parents=True)
    names = _closure(GPU_IMAGE, {canonical(n) for n in ABSENT_ON_THE_GPU_HOST})
    for name in sorted(names):
        dist = metadata.distribution(name)
        for top in {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            source = Path(str(dist.locate_file(top)))
            if source.exists() and not (site / top).exists():
                (site / top).symlink_to(source)
    return site
