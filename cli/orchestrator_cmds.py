"""``tpagent orchestrator`` (the service) and the commands that ask it: ``taint``, ``untaint``,
``cluster`` and ``events``.  :mod:`cli.main` registers them."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Annotated, Any

import grpc
import typer
from google.protobuf.json_format import MessageToDict

from cli.common import (
    EXIT_FAILED,
    EXIT_USAGE,
    JsonOpt,
    SecretOpt,
    ServiceSecretOpt,
    ServiceTlsDirOpt,
    TlsDirOpt,
    credentials,
    die,
    given_path,
    utf8,
)
from host.api import UsageError
from transfer.api import DEFAULT_TLS_DIR

OrchestratorOpt = Annotated[
    str,
    typer.Option("--orchestrator", envvar="TPAGENT_ORCHESTRATOR", help="HOST:PORT of `tpagent orchestrator`."),
]
GpuOpt = Annotated[
    str, typer.Option("--gpu", envvar="TPAGENT_GPU", callback=utf8, help="Only this GPU of the node (its UUID).")
]


def orchestrator(
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            envvar="TPAGENT_ORCHESTRATOR_CONFIG",
            parser=given_path,
            help="TOML file (default /etc/tpagent/orchestrator.toml).",
        ),
    ] = None,
    listen: Annotated[str | None, typer.Option("--listen", help="ADDR:PORT of its gRPC API.")] = None,
    state: Annotated[Path | None, typer.Option("--state", parser=given_path, help="Its SQLite database.")] = None,
    secret_file: ServiceSecretOpt = None,
    tls_dir: ServiceTlsDirOpt = None,
) -> None:
    """Run the orchestrator (as its systemd unit does) until SIGTERM: it moves the ranks of jobs
    off tainted nodes and GPUs to spares, and back once they are untainted."""
    from tpagent.daemon.serve import structured_logs
    from tpagent.orchestrator import config as config_mod
    from tpagent.orchestrator.serve import serve

    structured_logs()
    try:
        serve(config_mod.load(config, listen=listen, state=state, secret_file=secret_file, tls_dir=tls_dir))
    except UsageError as e:
        die(str(e), EXIT_USAGE)


def _stub(address: str, secret_file: Path | None, tls_dir: Path) -> Any:
    from tpagent.daemon.rpc import channel, pb_grpc

    try:
        return pb_grpc.OrchestratorStub(channel(address, credentials(secret_file, tls_dir)))
    except UsageError as e:
        die(str(e), EXIT_USAGE)


def _call(address: str, call: Any, as_json: bool | None = None) -> Any:
    try:
        return call()
    except grpc.RpcError as e:
        if e.code() is grpc.StatusCode.UNAVAILABLE:
            from tpagent.daemon.client import unreachable_reason

            why = unreachable_reason(e)
            die(
                f"the orchestrator at {address} cannot be reached ({why}); is `tpagent orchestrator` running?",
                EXIT_USAGE,
                as_json,
            )
        if e.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
            die(f"the orchestrator at {address} did not answer in time.", EXIT_FAILED, as_json)
        # (a refusal is the request's: EXIT_USAGE; only the orchestrator's own failure is EXIT_FAILED)
        code = EXIT_FAILED if e.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN) else EXIT_USAGE
        die(f"the orchestrator at {address}: {e.details()}", code, as_json)


def taint(
    node: Annotated[
        str, typer.Argument(callback=utf8, help="The node to move every rank off (its agent's node name).")
    ],
    reason: Annotated[
        str, typer.Option("--reason", envvar="TPAGENT_REASON", callback=utf8, help="Why, for the record.")
    ] = "",
    gpu: GpuOpt = "",
    address: OrchestratorOpt = "127.0.0.1:7410",
    secret_file: SecretOpt = None,
    tls_dir: TlsDirOpt = DEFAULT_TLS_DIR,
) -> None:
    """Taint a node (or one GPU of it): its ranks move to spares at their next step boundary."""
    from tpagent.daemon.rpc import pb

    if not reason.strip():
        die("say why with --reason (e.g. --reason maintenance).", EXIT_USAGE)
    stub = _stub(address, secret_file, tls_dir)
    reply = _call(address, lambda: stub.Taint(pb.TaintRequest(node=node, gpu=gpu, reason=reason), timeout=30))
    typer.echo(reply.message)


def untaint(
    node: Annotated[str, typer.Argument(callback=utf8, help="The node to untaint.")],
    gpu: GpuOpt = "",
    address: OrchestratorOpt = "127.0.0.1:7410",
    secret_file: SecretOpt = None,
    tls_dir: TlsDirOpt = DEFAULT_TLS_DIR,
) -> None:
    """Remove a node's (or GPU's) taints: ranks moved off it come back if their job returns home."""
    from tpagent.daemon.rpc import pb

    stub = _stub(address, secret_file, tls_dir)
    reply = _call(address, lambda: stub.Untaint(pb.TaintRequest(node=node, gpu=gpu), timeout=30))
    typer.echo(reply.message)


def _when(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts).strftime("%H:%M:%S") if ts else "-"


def cluster(
    address: OrchestratorOpt = "127.0.0.1:7410",
    secret_file: SecretOpt = None,
    tls_dir: TlsDirOpt = DEFAULT_TLS_DIR,
    as_json: JsonOpt = False,
) -> None:
    """Nodes and their GPUs' health, taints (and why nothing moved), spares, where each rank runs, moves."""
    from tpagent.daemon.rpc import pb

    stub = _stub(address, secret_file, tls_dir)
    v = _call(address, lambda: stub.Cluster(pb.Empty(), timeout=30), as_json)
    if as_json:
        typer.echo(
            json.dumps(
                MessageToDict(v, preserving_proto_field_name=True, always_print_fields_with_no_presence=True), indent=2
            )
        )
        return
    typer.echo(f"nodes ({v.spares_free} spare(s) free):")
    for n in v.nodes:
        state = "reachable" if n.reachable else "UNREACHABLE"
        health = "; ".join(f"{f.gpu} {f.reading}" for f in n.findings) or "healthy"
        others = sum(g.others > 0 for g in n.gpus)
        gpus = f"{len(n.gpus)} GPU(s)" + (f" ({others} used by other workloads)" if others else "")
        typer.echo(f"  {n.name:<20} {n.agent:<22} {state:<12} {gpus}, {health}  {n.role}")
    typer.echo("taints:" if v.taints else "taints: none")
    for t in v.taints:
        what = f"{t.node} GPU {t.gpu}" if t.gpu else t.node
        typer.echo(f"  {t.id:>4} {what:<20} {t.kind:<11} since {_when(t.since)} ({t.source}): {t.reason}")
        if t.waiting:
            typer.echo(f"       nothing moved: {t.waiting}")
    typer.echo("ranks:")
    # (jobs of one name, their identities told apart: another user's, or another run)
    identities: dict[str, set[str]] = {}
    for r in v.ranks:
        identities.setdefault(r.job, set()).add(r.identity)
    shared = {job for job, ids in identities.items() if len(ids) > 1}
    for r in v.ranks:
        home = f" (home: {r.home})" if r.home else ""
        job = f"{r.job} [{r.identity[:8] or 'unknown'}]" if r.job in shared else r.job
        typer.echo(f"  job {job} rank {r.rank:<4} on {r.node}{home}, step {r.step}, generation {r.gen}")
    typer.echo("moves:" if v.moves else "moves: none")
    for m in v.moves:
        ranks = ",".join(map(str, m.ranks))
        took = f"{m.seconds:.1f} s" if m.seconds else "-"
        typer.echo(f"  {m.id:>4} job {m.job} rank(s) {ranks} {m.source} -> {m.target} ({m.kind}, try {m.attempt}) "
                   f"{m.state} at {_when(m.started)} in {took}{': ' + m.message if m.message else ''}")  # fmt: skip


def events(
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Then wait for new ones (until Ctrl-C).")] = False,
    after: Annotated[
        int, typer.Option("--after", help="Only the events after this sequence number.", min=0, max=(1 << 63) - 1)
    ] = 0,
    address: OrchestratorOpt = "127.0.0.1:7410",
    secret_file: SecretOpt = None,
    tls_dir: TlsDirOpt = DEFAULT_TLS_DIR,
    as_json: JsonOpt = False,
) -> None:
    """The orchestrator's events: taints, plans, moves and their outcomes (one per line)."""
    from tpagent.daemon.rpc import pb

    stub = _stub(address, secret_file, tls_dir)

    def show() -> None:
        for e in stub.Events(pb.EventsRequest(after=after, follow=follow), timeout=None if follow else 30):
            if as_json:
                typer.echo(json.dumps(MessageToDict(e, preserving_proto_field_name=True)))
            else:
                typer.echo(f"{e.seq:>6} {_when(e.ts)} {e.kind:<11} {e.text}")

    try:
        _call(address, show, as_json)
    except KeyboardInterrupt:
        raise typer.Exit(0) from None
