"""What every ``tpagent`` command shares: the named exit codes, the option types (each also read
from its ``TPAGENT_*`` variable), how a command is registered (:func:`command`: its docstring,
flowed, is its help), the one way a command fails (:func:`die`) with the mapping of errors to
exit codes, and the node's credentials for calling agents.

The commands live in :mod:`cli.main` (snapshots and transfers) and :mod:`cli.agent_cmds` (the
agent and migrations); both import this module and nothing of each other, except that
``cli.main`` registers the agent commands on its app.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import grpc
import typer

from host.api import UsageError
from snapshot.api import Interrupted, SnapshotError, SnapshotInvalid
from tpagent.common.credentials import Credentials
from tpagent.orchestrator.api import printable
from transfer.api import BadAddress, Compress, SnapshotDamaged, TransferError

EXIT_OK = 0
EXIT_FAILED = 1  # CRIU, the CUDA driver or the disk failed; the process was resumed
EXIT_USAGE = 2  # the request cannot be carried out as given
EXIT_INVALID = 3  # the snapshot is missing, damaged or foreign
EXIT_INTERRUPTED = 130  # Ctrl-C; a frozen process was resumed

#: gRPC statuses that mean the request was wrong or cannot reach its agent (EXIT_USAGE);
#: every other status is a failure of the operation itself (EXIT_FAILED).
USAGE_STATUSES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.UNAVAILABLE,
    }
)

#: Added to the message of an error after which the process was resumed where it stood.
ROLLED_BACK_NOTE = " (nothing was lost: the process was resumed where it stood)"


class TransportName(str, Enum):
    """The ``--transport`` choices: the names of :data:`transfer.transports.NAMES` (typer needs
    an Enum to offer and check them)."""

    TCP = "tcp"
    UCX = "ucx"


JsonOpt = Annotated[bool, typer.Option("--json", envvar="TPAGENT_JSON", help="Print a JSON result.")]


def given_path(value: str) -> Path:
    """A path option's value: an empty one (an unset variable in a unit file) is refused, not
    taken for "." (the working directory, where the agent would have written its journals)."""
    if not value:
        raise typer.BadParameter("an empty path names nothing; give a path")
    return Path(value)


#: A service's own (serve, orchestrator: their configuration and environment give the defaults).
ServiceSecretOpt = Annotated[
    Path | None, typer.Option("--secret-file", parser=given_path, help="File holding the cluster secret.")
]
ServiceTlsDirOpt = Annotated[
    Path | None, typer.Option("--tls-dir", parser=given_path, help="ca.crt, tls.crt, tls.key (mutual TLS).")
]
CriuOpt = Annotated[
    Path | None,
    typer.Option("--criu", envvar="TPAGENT_CRIU", parser=given_path, help="The criu binary to use (>= 4.2)."),
]
SecretOpt = Annotated[
    Path | None,
    typer.Option(
        "--secret-file", envvar="TPAGENT_SECRET_FILE", parser=given_path, help="File holding the cluster secret."
    ),
]
TlsDirOpt = Annotated[
    Path,
    typer.Option(
        "--tls-dir",
        envvar="TPAGENT_TLS_DIR",
        parser=given_path,
        help="ca.crt, tls.crt, tls.key of this node (mutual TLS).",
    ),
]
PlaintextOpt = Annotated[
    bool,
    typer.Option(
        "--plaintext",
        envvar="TPAGENT_PLAINTEXT",
        help="TCP without TLS: authenticated by the secret, but readable on the wire.",
    ),
]
TransportOpt = Annotated[
    TransportName,
    typer.Option("--transport", envvar="TPAGENT_TRANSPORT", help="tcp, or ucx (RDMA where present)."),
]
CompressOpt = Annotated[
    Compress, typer.Option("--compress", envvar="TPAGENT_COMPRESS", help="auto: zstd where it pays.")
]
AgentOpt = Annotated[str, typer.Option("--agent", envvar="TPAGENT_AGENT", help="HOST:PORT of the agent to ask.")]


def utf8(value: str | None) -> str | None:
    """(A typer callback.)  A name or text that travels in a call (protobuf's strings are UTF-8):
    bytes of no encoding, which a shell can pass, are refused in one sentence, exit 2."""
    if value is not None:
        try:
            value.encode()
        except UnicodeEncodeError:
            raise typer.BadParameter("it is not UTF-8 text.") from None
    return value


def pid_number(value: str | int) -> int:
    """(A typer parser.)  A PID as ``ps`` writes it: digits only (``int`` also takes "1_000" and
    " 5", which would name another process than the one meant).  One past :data:`host.proc.PID_MAX` is
    no process's (said so where it is looked for, :func:`sent_pid` where it travels)."""
    text = str(value)
    if not (text.isascii() and text.isdigit()):
        raise typer.BadParameter(f"{ascii(text[:40])} is not a PID (digits, as ps writes it).")
    return int(text)


def sent_pid(value: str | int) -> int:
    """(A typer parser.)  :func:`pid_number`, at most :data:`host.proc.PID_MAX`: a PID a call carries."""
    from host.proc import PID_MAX

    pid = pid_number(value)
    if pid > PID_MAX:
        raise typer.BadParameter(f"{pid} is not a PID (Linux gives none above {PID_MAX}).")
    return pid


def gpu_uuids(value: list[str] | None) -> list[str] | None:
    """(A typer callback.)  GPUs' UUIDs (GPU-..., as nvidia-smi -L lists them): anything
    else is refused in one sentence, exit 2."""
    from tpagent.migration.api import Refused
    from tpagent.migration.api import gpu_uuids as checked

    try:
        return list(checked(value or []))
    except Refused as e:
        raise typer.BadParameter(f"{e}.") from None


def migration_id(value: str) -> str:
    """(A typer callback.)  A migration's id: 32 hex digits, as ``tpagent migrate --json`` prints."""
    from tpagent.migration.journal import valid_id

    if not valid_id(value):
        raise typer.BadParameter("a migration's id is 32 hex digits, as `tpagent migrate --json` prints it.")
    return value


MigrationIdArg = Annotated[
    str, typer.Argument(callback=migration_id, help="The migration's id (tpagent migrate prints it with --json).")
]

CommandFunction = TypeVar("CommandFunction", bound=Callable[..., Any])


def flowed(text: str) -> str:
    """``text`` (a docstring) with each paragraph on one line, paragraphs a blank line apart: how a
    docstring wrapped to fit the source is to read in ``--help``.  typer's rich markup keeps a single
    newline as a line break (its list of commands, and every paragraph after the first), so a help
    text wrapped in the source would show wrapped twice, sentences broken mid-way."""
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(" ".join(line.strip() for line in p.splitlines()) for p in paragraphs)


def command(app: typer.Typer, **settings: Any) -> Callable[[CommandFunction], CommandFunction]:
    """``app.command(**settings)``, the command's help its docstring :func:`flowed`; as it runs,
    whether it was asked for JSON is noted for :func:`json_asked` (none: a command with no --json)."""

    def register(fn: CommandFunction) -> CommandFunction:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            global _command_json
            _command_json = bool(kwargs.get("as_json", False))
            return fn(*args, **kwargs)

        app.command(help=flowed(fn.__doc__ or ""), **settings)(run)
        return fn

    return register


#: Whether the running command was asked for JSON; None before any command runs.
_command_json: bool | None = None


#: Whether a command's error was said (:func:`_say`), or its exit status is another's
#: (:func:`passed_on`): an exit 130 then needs no word of tpagent's own.
_said = False


def passed_on(code: int) -> int:
    """``code``, another process's exit status that a command ends with (a rank's, 130 on its own
    Ctrl-C): said by nothing of tpagent's."""
    global _said
    _said = True
    return code


def die(msg: str, code: int, as_json: bool | None = None, rolled_back: bool = False) -> NoReturn:
    """Every command's error: one sentence on stderr (and, with --json, a JSON error on stdout;
    ``as_json`` None: whether the command line asked for it, :func:`json_asked`)."""
    _say(msg, code, json_asked() if as_json is None else as_json, rolled_back)
    raise typer.Exit(code)


def _say(msg: str, code: int, as_json: bool, rolled_back: bool = False) -> None:
    """An error's sentence on stderr, each character that does not print (an escape sequence in
    another user's process name or path) as "?"; with ``as_json``, the JSON error on stdout."""
    global _said
    _said = True
    typer.echo(f"tpagent: {printable(msg, None)}", err=True)
    if as_json:
        typer.echo(json.dumps({"error": msg, "exit_code": code, "rolled_back": rolled_back}, indent=2))


def exit_code(e: SnapshotError | TransferError) -> int:
    """The exit code for an error of the snapshot or transfer layer."""
    if isinstance(e, UsageError | BadAddress):
        return EXIT_USAGE
    if isinstance(e, SnapshotInvalid | SnapshotDamaged):
        return EXIT_INVALID
    if isinstance(e, Interrupted):
        return EXIT_INTERRUPTED
    return EXIT_FAILED


def die_of(e: SnapshotError | TransferError, as_json: bool | None = None) -> NoReturn:
    """:func:`die` with the error's own sentence and exit code (and whether it rolled back)."""
    rolled_back = isinstance(e, SnapshotError) and e.rolled_back
    die(str(e) + (ROLLED_BACK_NOTE if rolled_back else ""), exit_code(e), as_json, rolled_back)


def rpc_exit_code(status: grpc.StatusCode) -> int:
    """The exit code for an agent's refusal or failure (see :data:`USAGE_STATUSES`)."""
    return EXIT_USAGE if status in USAGE_STATUSES else EXIT_FAILED


def credentials(secret_file: Path | None, tls_dir: Path) -> Credentials:
    """This node's credentials for calling agents (the secret and the TLS files, checked)."""
    return Credentials.load(secret_file, tls_dir)


def guarded(command: Callable[[], object]) -> None:
    """Run ``command`` (the app, not standalone: its exit code returned, typer's errors raised),
    saying what no check of a command foresaw in one line, never as a traceback: arguments typer
    refused (exit 2), a check below the command's own (an address, a path: exit 2), a path the
    system refuses (too long: exit 2), anything else (exit 1; ``TPAGENT_DEBUG=1``: the traceback)."""
    try:
        code = command()
    except typer.TyperException as e:  # (its usage box was several lines, and no JSON under --json)
        msg = e.format_message()
        msg = msg[:1].lower() + msg[1:]
        ctx = getattr(e, "ctx", None)
        if ctx is not None:
            see = f"'{ctx.command_path} --help'"
            msg += f" See {see}." if msg.endswith((".", "?")) else f"; see {see}."
        _last_word(msg, e.exit_code)
    except typer.Abort:
        _last_word("aborted.", EXIT_FAILED)
    except UsageError as e:
        _last_word(str(e), EXIT_USAGE)
    except OSError as e:
        _last_word(f"{e.strerror}: {e.filename}" if e.filename and e.strerror else str(e), EXIT_USAGE)
    except Exception as e:
        if os.environ.get("TPAGENT_DEBUG"):
            raise
        _last_word(f"unexpected error ({type(e).__name__}: {e}); TPAGENT_DEBUG=1 shows where.", EXIT_FAILED)
    if code == EXIT_INTERRUPTED and not _said:  # (a Ctrl-C no step of the command took: typer's exit 130)
        _last_word("interrupted.", EXIT_INTERRUPTED)
    if isinstance(code, int):  # (--help, an interrupt: typer's typer.Exit)
        sys.exit(code)


def json_asked() -> bool:
    """Whether the running command was asked for JSON; before one runs (its arguments refused),
    whether the command line (or TPAGENT_JSON) asks for it."""
    if _command_json is not None:
        return _command_json
    args = sys.argv[1:]
    ours = args[: args.index("--")] if "--" in args else args  # (a launched command's own --json is not ours)
    return "--json" in ours or os.environ.get("TPAGENT_JSON", "").lower() in ("1", "true", "yes", "on")


def _last_word(msg: str, code: int) -> NoReturn:
    """:func:`die` where no command's context is left (nor its --json flag, read from the
    arguments and TPAGENT_JSON)."""
    _say(msg[:400], code, json_asked())
    sys.exit(code)


def gpu_map_of(pairs: list[str]) -> dict[str, str]:
    """``--gpu-map OLD_UUID=NEW_UUID`` options as a map."""
    out = {}
    for pair in pairs:
        old, sep, new = pair.partition("=")
        if not sep or not old or not new:
            raise UsageError(f"--gpu-map takes OLD_UUID=NEW_UUID, not {pair!r}.")
        out[old] = new
    return out
