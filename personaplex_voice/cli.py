"""`personaplex-voice` command line: one Typer app, each command implemented next to what it drives.

| command          | implemented in                                   |
| ---------------- | ------------------------------------------------ |
| `serve`          | `personaplex_voice.serve_command.serve`          |
| `offline`        | `personaplex_voice.offline.offline`              |
| `voices list/make` | `personaplex_voice.voices_cli.app`             |
| `eval`           | `personaplex_voice.eval.command.eval_command` (needs the `eval` extra to run) |
| `call`           | `personaplex_twilio.cli.call` (needs the `twilio` extra) |
| `bundle`         | `personaplex_voice.deploy.bundle.bundle` (offline install bundle) |
| `phone simulate/keypair` | `personaplex_phone.cli.app` (needs the `phone` extra) |

Errors meant for the user are raised as `personaplex_voice.errors.UserError` (or the engine's
`EngineError`s: unknown voice, bad prompt...) and printed as one line (no traceback unless
`--debug` / `PERSONAPLEX_DEBUG=1`), exit code 2.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import typer

from personaplex_voice.engine.base import EngineError
from personaplex_voice.errors import UserError

app = typer.Typer(
    name="personaplex-voice",
    help="Full-duplex PersonaPlex speech-to-speech on phone lines, Pipecat and the browser.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _load(target: str) -> Any:
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def _register_command(name: str, target: str) -> None:
    try:
        func: Callable[..., Any] = _load(target)
    except ImportError as exc:  # an optional extra is not installed
        missing = exc.name or str(exc)

        def unavailable() -> None:
            raise UserError(f"`{name}` needs an optional dependency that is not installed ({missing})")

        app.command(name, help=f"(unavailable: {missing} not installed)")(unavailable)
        return
    app.command(name)(func)


def _register_group(name: str, target: str, optional: bool = False) -> None:
    # Core command groups: an ImportError here is a bug, so it is not hidden. An optional
    # group (an extra's) is listed as unavailable instead, like an optional command.
    try:
        sub: typer.Typer = _load(target)
    except ImportError:
        if not optional:
            raise
        _register_command(name, target)
        return
    app.add_typer(sub, name=name)


_register_command("serve", "personaplex_voice.serve_command:serve")
_register_command("offline", "personaplex_voice.offline:offline")
_register_group("voices", "personaplex_voice.voices_cli:app")
_register_command("eval", "personaplex_voice.eval.command:eval_command")
_register_command("call", "personaplex_twilio.cli:call")
_register_command("bundle", "personaplex_voice.deploy.bundle:bundle")
_register_group("phone", "personaplex_phone.cli:app", optional=True)


def main(argv: list[str] | None = None) -> None:
    debug = os.environ.get("PERSONAPLEX_DEBUG", "") not in ("", "0")
    args = list(sys.argv[1:] if argv is None else argv)
    if "--debug" in args:
        args.remove("--debug")
        debug = True
    # Warnings (e.g. "the demo model babbles") reach the terminal as one plain line each.
    logging.basicConfig(level=logging.INFO if debug else logging.WARNING, format="%(levelname)s: %(message)s")
    try:
        # Standalone mode: the CLI library itself answers usage errors (unknown option, bad
        # value) with its short usage message and exit status 2, --help with exit 0.
        app(args=args, prog_name="personaplex-voice", standalone_mode=True)
    except SystemExit as exc:
        if exc.code not in (0, None):  # standalone mode exits even on success: return then
            raise
    except (UserError, EngineError) as exc:
        if debug:
            raise
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
