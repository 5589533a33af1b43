"""Headless Chromium for the browser tests: Debian's binary (playwright cannot download one here)
and the flags a closed, GPU-less machine needs."""

from __future__ import annotations

import shutil

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# No sandbox (root in CI), no GPU, and none of the background connections this machine refuses.
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--autoplay-policy=no-user-gesture-required",
]
# A fake microphone (add --use-file-for-fake-audio-capture=FILE.wav) that needs no permission prompt.
FAKE_MICROPHONE = ["--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream"]
