"""``tpagent``: checkpoint, restore and inspect running processes.

Each command parses its flags (every one also read from a ``TPAGENT_*`` variable), calls one
typed function and maps the layer's errors to one sentence on stderr and a named exit code.
This module holds the app and the snapshot and transfer commands; the agent's commands are in
:mod:`cli.agent_cmds` (registered below), and what both share (exit codes, option types,
:func:`~cli.common.die`) in :mod:`cli.common`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from cli import agent_cmds, orchestrator_cmds, stages
from cli.common import (
    EXIT_FAILED,
    EXIT_USAGE,
    CompressOpt,
    CriuOpt,
    JsonOpt,
    PlaintextOpt,
    SecretOpt,
    TlsDirOpt,
    TransportName,
    TransportOpt,
    command,
    die,
    given_path,
    gpu_map_of,
    guarded,
    pid_number,
)
from host.api import MOST_SECONDS
from host.gpus import inventory
from host.signals import deferred_sigint, terminate_as_interrupt
from snapshot.api import DEFAULT_GHOST_LIMIT, DumpMode, SnapshotConfig, SnapshotError, Timeouts
from snapshot.dump import checkpoint
from snapshot.manifest import Manifest, load
from snapshot.restore import restore as restore_snapshot
from tpagent.daemon import doctor as doctor_mod
from tpagent.orchestrator.api import printable
from tpagent.workload.launch import launch as launch_workload
from tpagent.workload.launch import register as register_launched
from transfer import pipeline
from transfer.api import (
    DEFAULT_TLS_DIR,
    Compress,
    TlsFiles,
    TransferConfig,
    TransferError,
    Transport,
    parse_address,
    read_secret,
)
from transfer.receiver import Receiver, checked_request
from transfer.sender import Sender
from transfer.transports import make_transport

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


def _emit(as_json: bool, data: dict[str, Any], text: str) -> None:
    typer.echo(json.dumps(data, indent=2) if as_json else text)


def _print_version(asked: bool) -> None:
    if asked:
        import tpagent

        typer.echo(f"tpagent {tpagent.__version__}")
        raise typer.Exit()


@app.callback()
def main(
    verbose: Annotated[bool, typer.Option("-v", "--verbose", envvar="TPAGENT_VERBOSE")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Checkpoint and restore running (GPU) processes with CRIU and the CUDA driver."""
    logging.basicConfig(  # (what a command's parts warn of, said plainly; with -v, when and where)
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s" if verbose else "%(levelname)s: %(message)s",
    )


def _transport(name: TransportName, io_timeout: float, tls_dir: Path, plaintext: bool) -> Transport:
    """UCX (authenticated, not encrypted: it takes no TLS files), or TCP in mutual TLS with this
    node's certificates (only authenticated with --plaintext)."""
    return make_transport(name.value, io_timeout, None if plaintext else TlsFiles.in_dir(tls_dir))


@command(app)
def dump(
    pid: Annotated[
        int, typer.Argument(parser=pid_number, help="Process (or `tpagent launch` namespace) to checkpoint.")
    ],
    out: Annotated[
        Path, typer.Option("--out", "-o", envvar="TPAGENT_OUT", parser=given_path, help="New or empty directory.")
    ],
    leave_running: Annotated[bool, typer.Option("--leave-running", envvar="TPAGENT_LEAVE_RUNNING")] = False,
    send_to: Annotated[
        str | None,
        typer.Option(
            "--send-to", envvar="TPAGENT_SEND_TO", help="HOST:PORT of a `tpagent receive`: stream the snapshot there."
        ),
    ] = None,
    overlap: Annotated[
        bool,
        typer.Option(
            "--overlap/--no-overlap",
            envvar="TPAGENT_OVERLAP",
            help="With --send-to: send while the images are written.",
        ),
    ] = True,
    carry: Annotated[
        list[Path] | None,
        typer.Option(
            "--carry",
            envvar="TPAGENT_CARRY",
            parser=given_path,
            help="A node-local file the process has open, to take along (repeat).",
        ),
    ] = None,
    lock_timeout: Annotated[
        float,
        typer.Option(
            "--lock-timeout",
            envvar="TPAGENT_LOCK_TIMEOUT",
            min=0.001,
            max=MOST_SECONDS,
            help="Seconds a GPU process may take to reach a lockable point.",
        ),
    ] = Timeouts().cuda_lock,
    ghost_limit_mib: Annotated[
        int,
        typer.Option(
            "--ghost-limit-mib",
            envvar="TPAGENT_GHOST_LIMIT_MIB",
            min=0,
            max=1 << 20,  # (as the agent's ghost_limit_mib)
            help="Largest deleted-but-open file to keep (MiB).",
        ),
    ] = DEFAULT_GHOST_LIMIT >> 20,
    transport: TransportOpt = TransportName.TCP,
    compress: CompressOpt = Compress.AUTO,
    secret_file: SecretOpt = None,
    tls_dir: TlsDirOpt = DEFAULT_TLS_DIR,
    plaintext: PlaintextOpt = False,
    criu: CriuOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Freeze PID (and its children), write a snapshot to --out (and stream it to --send-to),
    then kill it (or leave it running)."""
    mode = DumpMode.LEAVE_RUNNING if leave_running else DumpMode.KILL
    config = SnapshotConfig(criu=criu, timeouts=Timeouts(cuda_lock=lock_timeout), ghost_limit=ghost_limit_mib << 20)
    _carriable(carry or [], as_json)
    terminate_as_interrupt()  # (a SIGTERM, a closed terminal: the frozen tree is resumed, as on a Ctrl-C)
    try:
        if send_to is None:
            m = checkpoint(pid, out, mode, config, stages.progress(as_json), carry=carry or ())
            shipped = None
        else:
            cfg = TransferConfig(secret=read_secret(secret_file), compress=compress)
            sender = Sender(_transport(transport, cfg.io_timeout, tls_dir, plaintext), cfg)
            shipped = pipeline.dump_and_send(
                pid, out, send_to, sender, mode, config, stages.progress(as_json), overlap, carry or ()
            )
            m = shipped.manifest
    except (SnapshotError, TransferError) as e:
        stages.fail(e, as_json)
    _dumped(pid, out, mode, m, shipped, send_to, overlap, as_json)


def _carriable(paths: list[Path], as_json: bool) -> None:
    """--carry's files, checked before anything is frozen: each a regular file here that the
    dump's hook may take along (it skips one gone by then: CRIU keeps a file deleted while open)."""
    from host import files

    for path in paths:
        if not path.is_file():
            die(f"--carry {path}: there is no regular file there to take along; nothing was done.", EXIT_USAGE, as_json)
    if why := files.uncarriable([Path(os.path.abspath(p)) for p in paths]):
        die(f"--carry: {why[0]}; nothing was done.", EXIT_USAGE, as_json)


def _dumped(
    pid: int,
    out: Path,
    mode: DumpMode,
    m: Manifest,
    shipped: pipeline.Shipped | None,
    send_to: str | None,
    overlap: bool,
    as_json: bool,
) -> None:
    """What ``dump`` says once the snapshot is written (and sent)."""
    gib = m.total_bytes / 2**30
    doc: dict[str, object] = {
        "snapshot": str(out),
        "snapshot_id": m.snapshot_id,
        "mode": mode.value,
        "bytes": m.total_bytes,
        "timings": m.timings,
        "warnings": m.warnings,
    }
    for warning in m.warnings:  # (what a restore may not bring back as it was)
        typer.echo(f"warning: {printable(warning, None)}", err=True)
    ended = "left running" if mode is DumpMode.LEAVE_RUNNING else "ended"
    text = f"snapshot of PID {pid} written to {printable(str(out), None)} ({gib:.2f} GiB); process {ended}"
    if shipped is not None:
        doc |= {
            "sent_to": send_to,
            "overlap": overlap,
            "bytes_wire": shipped.transfer.bytes_wire,
            "dump_s": shipped.dump_s,
            "total_s": shipped.total_s,
        }
        text += f"; sent to {send_to} and verified there, {shipped.total_s:.2f} s in all"
    _emit(as_json, doc, text)


@command(app)
def restore(
    directory: Annotated[Path, typer.Argument(parser=given_path, help="Snapshot directory written by `tpagent dump`.")],
    gpu_map: Annotated[
        list[str] | None,
        typer.Option("--gpu-map", envvar="TPAGENT_GPU_MAP", help="OLD_UUID=NEW_UUID; repeat per GPU."),
    ] = None,
    pid_wait: Annotated[
        float,
        typer.Option(
            "--pid-wait",
            envvar="TPAGENT_PID_WAIT",
            min=0,
            max=MOST_SECONDS,
            help="Seconds to wait for the snapshot's PIDs to be free.",
        ),
    ] = Timeouts().pid_wait,
    criu: CriuOpt = None,
    clone: Annotated[
        bool,
        typer.Option(
            "--clone", envvar="TPAGENT_CLONE", help="Start it although a copy restored from it still runs here."
        ),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Verify a snapshot and bring its processes back to life on this node."""
    config = SnapshotConfig(criu=criu, timeouts=Timeouts(pid_wait=pid_wait))
    terminate_as_interrupt()  # (a SIGTERM, a closed terminal: its undo runs, no stopped copy is left behind)
    try:
        result = restore_snapshot(directory, gpu_map_of(gpu_map or []), config, stages.progress(as_json), clone=clone)
    except SnapshotError as e:
        stages.fail(e, as_json)
    with deferred_sigint() as late:  # (the copy runs: it is registered, and said, whatever comes now)
        if result.manifest.namespace:
            register_launched(result.pid)  # still a launched workload, under its new PID
        doc = {"pid": result.pid, "pids": list(result.pids), "snapshot_id": result.manifest.snapshot_id}
        _emit(
            as_json,
            doc | {"timings": result.timings},
            f"restored {printable(str(directory), None)}: running as PID {result.pid}",
        )
        late.consume()


@command(app)
def inspect(
    directory: Annotated[Path, typer.Argument(parser=given_path, help="Snapshot directory.")],
    as_json: JsonOpt = False,
) -> None:
    """Show what a snapshot holds (without verifying checksums)."""
    try:
        m = load(directory)
    except SnapshotError as e:
        stages.fail(e, as_json)
    lines = [
        f"snapshot {m.snapshot_id}  created {m.created} on {m.host['hostname']} (tpagent {m.tpagent_version})",
        (
            f"root PID {m.root_pid}{'  (own PID namespace)' if m.namespace else ''};  CRIU {m.criu['version']};  "
            f"{len(m.files)} files, {m.total_bytes / 2**30:.3f} GiB"
        ),
    ]
    lines += [f"  pid {p.pid:>7}  {'cuda ' if p.uses_cuda else '     '}{' '.join(p.cmdline)[:90]}" for p in m.processes]
    lines += [f"  gpu {g['uuid']}  {g['name']}  {int(g['memory_used']) / 2**30:.1f} GiB used" for g in m.gpus]
    lines += [
        f"  forked child {f['pid']} ({f['name']}): no CUDA context; {len(f['mappings'])} mapping(s) and "
        f"{len(f['fds'])} descriptor(s) of the GPU driver left from its fork, removed before the freeze"
        for f in m.cuda.get("forked", [])
    ]
    lines += [f"  thread {b.tid} of pid {b.pid}: bound to CPUs {b.cpus}, bound again on restore" for b in m.bindings]
    lines += ["  timings: " + ", ".join(f"{k} {v:.2f}s" for k, v in m.timings.items())]
    lines += [f"  warning: {printable(w, None)}" for w in m.warnings]
    # (its user chose the command lines, and anyone may have written the directory: no escape
    # sequence of theirs reaches the operator's terminal)
    _emit(as_json, m.to_json(), "\n".join(printable(line, 4000) for line in lines))


@command(app)
def gpus(as_json: JsonOpt = False) -> None:
    """List this node's NVIDIA GPUs (empty without NVIDIA hardware)."""
    found = inventory()
    header = f"{'IDX':<4}{'UUID':<42}{'NAME':<24}{'USED/TOTAL GiB':<16}{'TEMP':<6}{'ECC':<5}PIDS"
    rows = [
        f"{g.index:<4}{g.uuid:<42}{g.name[:23]:<24}"
        f"{g.memory_used / 2**30:.1f}/{g.memory_total / 2**30:<10.1f}"
        f"{g.temperature_c if g.temperature_c is not None else '-'!s:<6}"
        f"{g.ecc_uncorrected if g.ecc_uncorrected is not None else '-'!s:<5}{','.join(map(str, g.pids)) or '-'}"
        for g in found
    ]
    _emit(
        as_json,
        {"gpus": [g.to_dict() for g in found]},
        "\n".join([header, *rows]) if rows else header + "\n(no NVIDIA GPUs found)",
    )


@command(app)
def doctor(
    criu: CriuOpt = None,
    as_json: JsonOpt = False,
    pid: Annotated[
        int | None,
        typer.Option(
            "--pid",
            parser=pid_number,
            help="Also check this process: CUDA features the driver cannot checkpoint, children forked after CUDA.",
        ),
    ] = None,
) -> None:
    """Check that this node can checkpoint and restore; one line per check."""
    checks = doctor_mod.run_checks(criu, pid)
    _emit(
        as_json,
        {"checks": [{"name": c.name, "verdict": c.verdict.value, "message": c.message} for c in checks]},
        "\n".join(f"{c.verdict.value:<5} {c.name:<14} {printable(c.message, None)}" for c in checks),
    )
    if any(c.verdict is doctor_mod.Verdict.FAIL for c in checks):
        raise typer.Exit(EXIT_FAILED)


@command(app, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def launch(
    ctx: typer.Context,
    stdout: Annotated[
        Path,
        typer.Option("--stdout", envvar="TPAGENT_STDOUT", parser=given_path, help="File for the workload's stdout."),
    ] = Path("/dev/null"),
    stderr: Annotated[
        Path | None,
        typer.Option(
            "--stderr", envvar="TPAGENT_STDERR", parser=given_path, help="File for stderr (default: as --stdout)."
        ),
    ] = None,
) -> None:
    """Start `-- CMD ...` in its own PID and mount namespace; print its PID for `tpagent dump`."""
    try:
        pid = launch_workload(list(ctx.args), stdout, stderr or stdout, umask=USER_UMASK)
    except SnapshotError as e:
        stages.fail(e)
    typer.echo(pid)


#: The umask tpagent was started with: what a launched workload gets (tpagent itself runs under 077).
USER_UMASK = 0o022


@command(app)
def send(
    directory: Annotated[Path, typer.Argument(parser=given_path, help="Snapshot directory to send.")],
    peer: Annotated[str, typer.Argument(help="HOST:PORT of a `tpagent receive`.")],
    streams: Annotated[int, typer.Option("--streams", envvar="TPAGENT_STREAMS", min=1, max=64)] = 4,
    compress: CompressOpt = Compress.AUTO,
    chunk_mib: Annotated[int, typer.Option("--chunk-mib", envvar="TPAGENT_CHUNK_MIB", min=1, max=64)] = 8,
    transport: TransportOpt = TransportName.TCP,
    secret_file: SecretOpt = None,
    tls_dir: TlsDirOpt = DEFAULT_TLS_DIR,
    plaintext: PlaintextOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Stream a snapshot to a receiving node, compressed where it pays, verified end to end."""
    t0 = time.monotonic()
    shown: list[bool] = []  # (whether the bar is on screen: a line of its own to end)

    def bar(done: int, wire_bytes: int, total: int) -> None:
        if as_json:
            return
        shown[:] = [True]
        rate = done / max(time.monotonic() - t0, 1e-6)
        eta = (total - done) / rate if rate else 0.0
        ratio = done / wire_bytes if wire_bytes else 1.0
        typer.echo(
            f"\r  {done / 2**20:9.1f} / {total / 2**20:.1f} MiB  {rate / 1e9:5.2f} GB/s"
            f"  ratio {ratio:4.2f}  ETA {eta:5.1f} s",
            err=True,
            nl=False,
        )

    try:
        cfg = TransferConfig(
            secret=read_secret(secret_file), streams=streams, compress=compress, chunk_size=chunk_mib << 20
        )
        stats = Sender(_transport(transport, cfg.io_timeout, tls_dir, plaintext), cfg, bar).send(directory, peer)
    except (SnapshotError, TransferError) as e:
        if shown:
            typer.echo("", err=True)
        stages.fail(e, as_json)
    if shown:
        typer.echo("", err=True)
    _emit(
        as_json,
        {
            "bytes_raw": stats.bytes_raw,
            "bytes_wire": stats.bytes_wire,
            "chunks": stats.chunks,
            "seconds": stats.seconds,
            "ratio": stats.ratio,
        },
        f"sent {printable(str(directory), None)} to {peer}: {stats.bytes_raw / 2**20:.1f} MiB in {stats.seconds:.2f} s "
        f"({stats.bytes_raw / max(stats.seconds, 1e-9) / 1e9:.2f} GB/s, ratio {stats.ratio:.2f}), "
        "verified by the receiver",
    )


@command(app)
def receive(
    listen: Annotated[
        str, typer.Option("--listen", envvar="TPAGENT_LISTEN", help="ADDR:PORT to listen on (port 0: any).")
    ],
    out: Annotated[
        Path, typer.Option("--out", envvar="TPAGENT_OUT", parser=given_path, help="New directory for the snapshot.")
    ],
    timeout: Annotated[float, typer.Option("--timeout", envvar="TPAGENT_RECEIVE_TIMEOUT")] = 3600.0,
    transport: TransportOpt = TransportName.TCP,
    secret_file: SecretOpt = None,
    tls_dir: TlsDirOpt = DEFAULT_TLS_DIR,
    plaintext: PlaintextOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Accept one authenticated snapshot stream and write it, verified, to --out."""
    try:
        cfg = TransferConfig(secret=read_secret(secret_file))
        parse_address(listen)  # (before --out's parents are made)
        checked_request(out, timeout)  # (before it listens: a bad request is said alone)
        receiver = Receiver(_transport(transport, cfg.io_timeout, tls_dir, plaintext), cfg, listen)
        typer.echo(f"listening on {receiver.address}", err=True)
        try:
            stats = receiver.receive(out, timeout)
        finally:
            receiver.close()
    except (SnapshotError, TransferError) as e:
        stages.fail(e, as_json)
    _emit(
        as_json,
        {"out": str(out), "bytes_raw": stats.bytes_raw, "bytes_wire": stats.bytes_wire, "seconds": stats.seconds},
        f"received a verified snapshot into {printable(str(out), None)} ({stats.bytes_raw / 2**20:.1f} MiB)",
    )


command(app)(agent_cmds.serve)
command(app)(agent_cmds.migrate)
command(app)(agent_cmds.status)
command(app)(agent_cmds.cancel)
command(app)(agent_cmds.resolve)
command(app)(agent_cmds.node)
command(app, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(agent_cmds.rank)
command(app)(orchestrator_cmds.orchestrator)
command(app)(orchestrator_cmds.taint)
command(app)(orchestrator_cmds.untaint)
command(app)(orchestrator_cmds.cluster)
command(app)(orchestrator_cmds.events)


def run() -> None:
    global USER_UMASK
    USER_UMASK = os.umask(0o077)  # snapshots, logs and keys it writes are its user's alone
    guarded(lambda: app(args=sys.argv[1:] or ["--help"], prog_name="tpagent", standalone_mode=False))


if __name__ == "__main__":
    run()
