"""Errors shown to a person at the command line or over a protocol, in one clear line."""

from __future__ import annotations


class UserError(Exception):
    """Something the user can fix: a missing file, a bad option, corrupt weights.

    The message names the file or option and the problem; the CLI prints it without a traceback.
    """
