"""``tpagent --help`` and every command's ``--help`` read as typer lays them out: a paragraph of help
is one logical line that typer wraps to the terminal, never broken mid-sentence by a newline that
the source's line wrapping left in it.

Rendered 1000 columns wide, wider than any paragraph of help, typer wraps nothing: any line break
left inside a sentence is one the help text carries itself, a line that does not end a sentence
followed by one that goes on in lower case.
"""

from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

from cli.main import app

WIDTH = 1000
WIDE = {"COLUMNS": str(WIDTH), "NO_COLOR": "1"}
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # (styles, where the environment forces a terminal: FORCE_COLOR, CI)
BORDERS = "│╭╮╰╯─"
SENTENCE_ENDS = ".!?"


def _help(*args: str) -> str:
    result = CliRunner().invoke(app, [*args, "--help"], env=WIDE)
    assert result.exit_code == 0, result.output
    return ANSI.sub("", result.output)


def _lines(rendered: str) -> list[str]:
    """The rendered help's lines of text, panel borders taken off; a panel's top and bottom edges
    (its title among them) count as empty lines."""
    return ["" if "╭" in line or "╰" in line else line.strip(BORDERS + " ") for line in rendered.splitlines()]


def _broken(rendered: str) -> list[tuple[str, str]]:
    """Each pair of lines where a sentence runs on from one to the next."""
    lines = _lines(rendered)
    return [
        (line, after)
        for line, after in zip(lines, lines[1:], strict=False)
        if line and after and line[-1] not in SENTENCE_ENDS and after[0].islower()
    ]


def _commands() -> list[str]:
    """The app's commands, in the order they were registered (and are listed)."""
    group = typer.main.get_command(app)
    assert isinstance(group, typer.core.TyperGroup)
    return list(group.commands)


def test_the_check_sees_a_sentence_broken_mid_way() -> None:
    rendered = "│ migrate  Move a running process: restored there, and only          │\n│          then ended here. │"
    assert _broken(rendered) == [("migrate  Move a running process: restored there, and only", "then ended here.")]
    assert _broken("│ dump  Freeze PID.            │\n│ restore  Verify a snapshot. │") == []


def test_the_help_is_rendered_wide() -> None:
    lines = _help().splitlines()
    assert max(map(len, lines)) == WIDTH  # (typer's panels span the terminal: nothing is wrapped short of it)


def test_the_apps_help_breaks_no_sentence() -> None:
    assert _broken(_help()) == []


@pytest.mark.parametrize("name", _commands())
def test_a_commands_help_breaks_no_sentence(name: str) -> None:
    assert _broken(_help(name)) == []


def test_each_command_is_listed_on_one_line() -> None:
    """The app's list of commands holds one line per command: no summary runs on to a second line."""
    rendered = _help().splitlines()
    top = next(i for i, line in enumerate(rendered) if line.startswith("╭─ Commands"))
    bottom = next(i for i, line in enumerate(rendered) if i > top and line.startswith("╰"))
    rows = [line.strip(BORDERS + " ").split()[0] for line in rendered[top + 1 : bottom]]
    assert rows == _commands()
