"""``tpagent``: checkpoint, restore and inspect running processes.

Each command parses its flags (every one also read from a ``TPAGENT_*`` variable), calls one
typed function and maps the layer's errors to one sentence on stderr and a named exit code.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from snapshot import engine
from snapshot.api import (
    DumpMode,
    Interrupted,
    SnapshotConfig,
    SnapshotError,
    SnapshotInvalid,
    Stage,
    UsageError,
)
from snapshot.gpus import inventory
from snapshot.manifest import load
from tpagent import doctor as doctor_mod
from tpagent.launch import launch as launch_workload

EXIT_OK = 0
EXIT_FAILED = 1  # CRIU, the CUDA driver or the disk failed; the process was resumed
EXIT_USAGE = 2  # the request cannot be carried out as given
EXIT_INVALID = 3  # the snapshot is missing, damaged or foreign
EXIT_INTERRUPTED = 130  # Ctrl-C; a frozen process was resumed

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False)

JsonOpt = Annotated[bool, typer.Option("--json", envvar="TPAGENT_JSON", help="Print a JSON result.")]
CriuOpt = Annotated[
    Path | None, typer.Option("--criu", envvar="TPAGENT_CRIU", help="The criu binary to use (>= 4.2).")
]


_line_open = False  # a stage's name is on screen, waiting for its time


def _fail(e: SnapshotError) -> NoReturn:
    if _line_open:
        typer.echo("failed", err=True)
    codes = {UsageError: EXIT_USAGE, SnapshotInvalid: EXIT_INVALID, Interrupted: EXIT_INTERRUPTED}
    code = next((c for cls, c in codes.items() if isinstance(e, cls)), EXIT_FAILED)
    msg = str(e)
    if e.rolled_back:
        msg += " (nothing was lost: the process was resumed where it stood)"
    typer.echo(f"tpagent: {msg}", err=True)
    raise typer.Exit(code)


def _progress(quiet: bool) -> Callable[[Stage, str], None]:
    def show(stage: Stage, msg: str) -> None:
        # The stage's name appears as it starts; its time completes the line when it ends.
        global _line_open
        if not quiet:
            typer.echo(f"  {stage.value:<16} {msg}" if not msg else msg, err=True, nl=bool(msg))
            _line_open = not msg

    return show


def _emit(as_json: bool, data: dict[str, Any], text: str) -> None:
    typer.echo(json.dumps(data, indent=2) if as_json else text)


@app.callback()
def main(
    verbose: Annotated[bool, typer.Option("-v", "--verbose", envvar="TPAGENT_VERBOSE")] = False,
) -> None:
    """Checkpoint and restore running (GPU) processes with CRIU and the CUDA driver."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


@app.command()
def dump(
    pid: Annotated[int, typer.Argument(help="Process (or `tpagent launch` namespace) to checkpoint.")],
    out: Annotated[Path, typer.Option("--out", "-o", envvar="TPAGENT_OUT", help="New or empty directory.")],
    leave_running: Annotated[bool, typer.Option("--leave-running", envvar="TPAGENT_LEAVE_RUNNING")] = False,
    criu: CriuOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Freeze PID (and its children), write a snapshot to --out, then kill it (or leave it running)."""
    mode = DumpMode.LEAVE_RUNNING if leave_running else DumpMode.KILL
    try:
        m = engine.checkpoint(pid, out, mode, SnapshotConfig(criu=criu), _progress(as_json))
    except SnapshotError as e:
        _fail(e)
    gib = m.total_bytes / 2**30
    _emit(
        as_json,
        {"snapshot": str(out), "snapshot_id": m.snapshot_id, "mode": mode.value, "bytes": m.total_bytes, "timings": m.timings},
        f"snapshot of PID {pid} written to {out} ({gib:.2f} GiB); process {'left running' if leave_running else 'ended'}",
    )


def _parse_map(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        old, sep, new = pair.partition("=")
        if not sep or not old or not new:
            raise UsageError(f"--gpu-map takes OLD_UUID=NEW_UUID, not {pair!r}.")
        out[old] = new
    return out


@app.command()
def restore(
    directory: Annotated[Path, typer.Argument(help="Snapshot directory written by `tpagent dump`.")],
    gpu_map: Annotated[
        list[str] | None,
        typer.Option("--gpu-map", envvar="TPAGENT_GPU_MAP", help="OLD_UUID=NEW_UUID; repeat per GPU."),
    ] = None,
    criu: CriuOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Verify a snapshot and bring its processes back to life on this node."""
    try:
        result = engine.restore(directory, _parse_map(gpu_map or []), SnapshotConfig(criu=criu), _progress(as_json))
    except SnapshotError as e:
        _fail(e)
    _emit(
        as_json,
        {"pid": result.pid, "pids": list(result.pids), "snapshot_id": result.manifest.snapshot_id, "timings": result.timings},
        f"restored {directory}: running as PID {result.pid}",
    )


@app.command()
def inspect(
    directory: Annotated[Path, typer.Argument(help="Snapshot directory.")],
    as_json: JsonOpt = False,
) -> None:
    """Show what a snapshot holds (without verifying checksums)."""
    try:
        m = load(directory)
    except SnapshotError as e:
        _fail(e)
    lines = [
        f"snapshot {m.snapshot_id}  created {m.created} on {m.host['hostname']} (tpagent {m.tpagent_version})",
        f"root PID {m.root_pid}{'  (own PID namespace)' if m.namespace else ''};  CRIU {m.criu['version']};  "
        f"{len(m.files)} files, {m.total_bytes / 2**30:.3f} GiB",
    ]
    lines += [f"  pid {p.pid:>7}  {'cuda ' if p.uses_cuda else '     '}{' '.join(p.cmdline)[:90]}" for p in m.processes]
    lines += [f"  gpu {g['uuid']}  {g['name']}  {int(g['memory_used']) / 2**30:.1f} GiB used" for g in m.gpus]
    lines += ["  timings: " + ", ".join(f"{k} {v:.2f}s" for k, v in m.timings.items())]
    _emit(as_json, m.to_json(), "\n".join(lines))


@app.command()
def gpus(as_json: JsonOpt = False) -> None:
    """List this node's NVIDIA GPUs (empty without NVIDIA hardware)."""
    found = inventory()
    header = f"{'IDX':<4}{'UUID':<42}{'NAME':<24}{'USED/TOTAL GiB':<16}{'TEMP':<6}{'ECC':<5}PIDS"
    rows = [
        f"{g.index:<4}{g.uuid:<42}{g.name[:23]:<24}"
        f"{g.memory_used / 2**30:.1f}/{g.memory_total / 2**30:<10.1f}{g.temperature_c if g.temperature_c is not None else '-'!s:<6}"
        f"{g.ecc_uncorrected if g.ecc_uncorrected is not None else '-'!s:<5}{','.join(map(str, g.pids)) or '-'}"
        for g in found
    ]
    _emit(as_json, {"gpus": [g.to_dict() for g in found]}, "\n".join([header, *rows]) if rows else header + "\n(no NVIDIA GPUs found)")


@app.command()
def doctor(criu: CriuOpt = None, as_json: JsonOpt = False) -> None:
    """Check that this node can checkpoint and restore; one line per check."""
    checks = doctor_mod.run_checks(criu)
    _emit(
        as_json,
        {"checks": [{"name": c.name, "verdict": c.verdict.value, "message": c.message} for c in checks]},
        "\n".join(f"{c.verdict.value:<5} {c.name:<14} {c.message}" for c in checks),
    )
    if any(c.verdict is doctor_mod.Verdict.FAIL for c in checks):
        raise typer.Exit(EXIT_FAILED)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def launch(
    ctx: typer.Context,
    stdout: Annotated[Path, typer.Option("--stdout", envvar="TPAGENT_STDOUT", help="File for the workload's stdout.")] = Path("/dev/null"),
    stderr: Annotated[Path | None, typer.Option("--stderr", envvar="TPAGENT_STDERR", help="File for stderr (default: as --stdout).")] = None,
) -> None:
    """Start `-- CMD ...` in its own PID and mount namespace; print its PID for `tpagent dump`."""
    try:
        pid = launch_workload(list(ctx.args), stdout, stderr or stdout)
    except SnapshotError as e:
        _fail(e)
    typer.echo(pid)


def run() -> None:
    app(prog_name="tpagent")


if __name__ == "__main__":
    run()
