"""How a snapshot command shows its stages on stderr, and ends a stage line left open when it fails."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NoReturn

import typer

from cli.common import die_of
from snapshot.api import SnapshotError, Stage
from transfer.api import TransferError

_line_open = False  # a stage's name is on screen, waiting for its time


def fail(e: SnapshotError | TransferError, as_json: bool | None = None) -> NoReturn:
    """:func:`~cli.common.die_of`, after ending a stage line left open on screen."""
    global _line_open
    if _line_open:
        typer.echo("failed", err=True)
        _line_open = False
    die_of(e, as_json)


def progress(quiet: bool) -> Callable[[Stage, str], None]:
    """Stage lines on stderr.  On a terminal a stage's name shows as it starts and its time
    completes the line; elsewhere (logs, pipes) each stage is one whole line when it ends."""
    live = sys.stderr.isatty()

    def show(stage: Stage, msg: str) -> None:
        global _line_open
        if quiet or (not msg and not live):
            return
        if not msg:
            typer.echo(f"  {stage.value:<16} ", err=True, nl=False)
        elif _line_open:
            typer.echo(msg, err=True)
        else:
            typer.echo(f"  {stage.value:<16} {msg}", err=True)
        _line_open = not msg

    return show
