"""``tpagent serve`` and ``tpagent migrate``: the node agent and the command that drives it
(with ``status``, ``cancel`` and ``node``, which ask an agent).  :mod:`cli.main` registers them."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import grpc
import typer

from cli import following
from cli.common import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    USAGE_STATUSES,
    AgentOpt,
    JsonOpt,
    MigrationIdArg,
    SecretOpt,
    ServiceSecretOpt,
    ServiceTlsDirOpt,
    TlsDirOpt,
    credentials,
    die,
    given_path,
    gpu_uuids,
    passed_on,
    rpc_exit_code,
    sent_pid,
    utf8,
)
from host.api import UsageError
from tpagent.migration.api import SOURCE_FINAL, TARGET_FINAL
from tpagent.orchestrator.api import printable
from transfer.api import DEFAULT_TLS_DIR


def serve(
    # No envvar on these flags, unlike the shared options: tpagent.common.config.load reads each
    # TPAGENT_* setting itself, between the TOML file and the flags.
    config: Annotated[
        Path | None,
        typer.Option(
            "--config", envvar="TPAGENT_CONFIG", parser=given_path, help="TOML file (default /etc/tpagent/agent.toml)."
        ),
    ] = None,
    listen: Annotated[str | None, typer.Option("--listen", help="ADDR:PORT for the agent's gRPC API.")] = None,
    advertise: Annotated[str | None, typer.Option("--advertise", help="Address peers reach this node on.")] = None,
    node: Annotated[str | None, typer.Option("--node", help="Name of this node in logs and metrics.")] = None,
    work_dir: Annotated[
        Path | None, typer.Option("--work-dir", parser=given_path, help="Journals and snapshots in flight.")
    ] = None,
    metrics_listen: Annotated[
        str | None, typer.Option("--metrics-listen", help="ADDR:PORT for Prometheus; '' for none.")
    ] = None,
    secret_file: ServiceSecretOpt = None,
    tls_dir: ServiceTlsDirOpt = None,
    health_listen: Annotated[
        str | None, typer.Option("--health-listen", help="ADDR:PORT for plain-text health checks; '' for none.")
    ] = None,
) -> None:
    """Run the node agent (as the systemd service does) until SIGTERM."""
    from tpagent.common import config as config_mod
    from tpagent.daemon.serve import serve as run_server
    from tpagent.daemon.serve import structured_logs

    structured_logs()
    try:
        cfg = config_mod.load(
            config,
            listen=listen,
            advertise=advertise,
            node=node,
            work_dir=work_dir,
            metrics_listen=metrics_listen,
            secret_file=secret_file,
            tls_dir=tls_dir,
            health_listen=health_listen,
        )
        run_server(cfg)
    except UsageError as e:
        die(str(e), EXIT_USAGE)


def _check_migrate(pid: int, to: str, job: str, ranks: list[int], mode: str, as_json: bool) -> None:
    if not to:
        die("give the target node's agent with --to HOST:PORT.", EXIT_USAGE, as_json)
    if bool(job) != bool(ranks) or (job and pid):
        die("give either a PID, or --job with its --rank(s).", EXIT_USAGE, as_json)
    if not job and pid <= 0:
        die("give the PID to move (or --job and --rank).", EXIT_USAGE, as_json)
    if mode not in ("transparent", "aware", "auto"):
        die(f"--mode is transparent, aware or auto, not {mode!r}.", EXIT_USAGE, as_json)
    if mode == "aware" and not job:
        die("--mode aware moves ranks of a job: give --job and --rank.", EXIT_USAGE, as_json)


JOB_HELP = "A distributed job (its rdzv id) whose --rank to move."


def migrate(
    pid: Annotated[
        int, typer.Argument(parser=sent_pid, help="The process (a launch namespace, a rank) to move; 0 with --job.")
    ] = 0,
    to: Annotated[str, typer.Option("--to", envvar="TPAGENT_TO", help="HOST:PORT of the target node's agent.")] = "",
    source: Annotated[
        str, typer.Option("--from", envvar="TPAGENT_AGENT", help="HOST:PORT of the source node's agent.")
    ] = "127.0.0.1:7400",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only check both sides; freeze nothing.")] = False,
    job: Annotated[str, typer.Option("--job", envvar="TPAGENT_JOB", callback=utf8, help=JOB_HELP)] = "",
    rank: Annotated[
        list[int] | None, typer.Option("--rank", min=0, max=2**31 - 1, help="A rank of --job on --from (repeat it).")
    ] = None,
    mode: Annotated[
        str,
        typer.Option(
            "--mode",
            help="How ranks of --job move: transparent (the process image), aware (the training state the "
            "script registered, to a fresh process of its command), auto (aware where registered).",
        ),
    ] = "auto",
    to_gpu: Annotated[
        list[str] | None,
        typer.Option(
            "--to-gpu",
            callback=gpu_uuids,
            help="A GPU of --to (its UUID, as nvidia-smi -L lists it) the process may use there "
            "(repeat it; default: those at the same PCI bus ids where free, else the least used).",
        ),
    ] = None,
    secret_file: SecretOpt = None,
    tls_dir: TlsDirOpt = DEFAULT_TLS_DIR,
    as_json: JsonOpt = False,
) -> None:
    """Move a running process to another node: frozen, streamed, restored there, and only
    then ended here; on any failure it runs on here where it stood.  A rank of a distributed
    job (started with `tpagent rank`) moves with its job: every rank stops at one step, the
    communicators are rebuilt, and the job goes on at the next step.  A rank whose script
    registered its training state (tpagent_rank.register) moves only that state, by default."""
    from tpagent.daemon.rpc import pb, stub

    ranks = list(rank or [])
    _check_migrate(pid, to, job, ranks, mode, as_json)

    try:
        creds = credentials(secret_file, tls_dir)
    except UsageError as e:
        die(str(e), EXIT_USAGE, as_json)
    if source == to:
        die(f"--from and --to are the same agent ({to}); give another node as --to.", EXIT_USAGE, as_json)
    agent = stub(source, creds)
    asked = pb.MigrateRequest(
        pid=pid, target=to, dry_run=dry_run, job=job, ranks=ranks, mode=mode, target_gpus=list(to_gpu or [])
    )
    call = agent.Migrate(asked)
    last: Any = None
    first = ""  # the migration's id (a rewire's: its ranks' own migrations have ids of their own)
    shown = ""
    said: list[str] = []  # what the checks said on the way (a dry run: what the target would reserve)
    try:
        for event in call:
            last = event
            first = first or event.migration_id
            if event.message and event.message not in said:
                said.append(event.message)
            if not as_json:
                shown = _show(event, shown)
    except grpc.RpcError as e:
        last = _broken(e, agent, source, last, first, as_json)
    except KeyboardInterrupt:
        call.cancel()
        typer.echo("\ninterrupted: the agent rolls the migration back, unless its copy already runs...", err=True)
        last = following.wait_final(agent, pb, last, first)
        raise typer.Exit(EXIT_INTERRUPTED if _report(last, as_json, dry_run) else 0) from None  # (done: 0)
    if last is not None and last.state in ("failed", "checking"):  # it ended in its checks (a dry run's: "checking")
        _refuse_bad_target(to, source, creds, as_json)  # (was --to the cause?)
    code = _report(last, as_json, dry_run, [m for m in said if last is None or m != last.message])
    raise typer.Exit(code)


def _broken(e: grpc.RpcError, agent: Any, source: str, last: Any, first: str, as_json: bool) -> Any:
    """``tpagent migrate``'s call to the source agent at ``source`` ended in ``e`` after its event ``last``
    (None: none came; ``first``: the migration's id): the migration's last event, once it is settled;
    or one sentence and the exit."""
    from tpagent.daemon.client import broke
    from tpagent.daemon.rpc import pb

    if e.code() is grpc.StatusCode.CANCELLED and last is not None:
        return last
    if last is not None and broke(e):
        return following.source_lost(agent, pb, source, last, first, as_json)
    if e.code() is grpc.StatusCode.UNAVAILABLE:
        die(_unreachable(source, e), EXIT_USAGE, as_json)
    if e.code() is grpc.StatusCode.UNAUTHENTICATED:
        die(f"the agent at {source} {e.details()}", EXIT_USAGE, as_json)  # (which agent refused, and why)
    if e.code() in USAGE_STATUSES:
        die(str(e.details()), EXIT_USAGE, as_json)
    die(f"the migration failed: {e.details()}", EXIT_FAILED, as_json)


def rank(
    ctx: typer.Context,
    agent: Annotated[
        str, typer.Option("--agent", envvar="TPAGENT_AGENT", help="HOST:PORT of this node's agent.")
    ] = "127.0.0.1:7400",
    stdout: Annotated[
        Path | None,
        typer.Option("--stdout", envvar="TPAGENT_STDOUT", parser=given_path, help="File for the rank's stdout."),
    ] = None,
    stderr: Annotated[
        Path | None,
        typer.Option(
            "--stderr", envvar="TPAGENT_STDERR", parser=given_path, help="File for stderr (default: as --stdout)."
        ),
    ] = None,
    socket_name: Annotated[
        str, typer.Option("--rank-socket", envvar="TPAGENT_RANK_SOCKET", help="The agents' rank_socket setting.")
    ] = "tpagent-ranks",
    relay: Annotated[
        bool,
        typer.Option(
            "--relay/--no-relay",
            envvar="TPAGENT_RELAY",
            help="Also write the rank's output here (the launcher's log), wherever the rank runs.",
        ),
    ] = True,
    secret_file: SecretOpt = None,
    tls_dir: TlsDirOpt = DEFAULT_TLS_DIR,
) -> None:
    """Run `-- CMD ...` as one rank of a distributed job that tpagent can move (the launcher's
    command: `torchrun --no-python ... tpagent rank -- python train.py`); exits as the rank does."""
    import os

    from tpagent.daemon.client import GrpcPeer
    from tpagent.jobs.local import LocalAgent
    from tpagent.jobs.local import socket_name as local_name
    from tpagent.jobs.standin import RankAgent, StandIn, job_of, rank_of

    cmd = list(ctx.args)
    if not cmd:
        die("give the rank's command after `--`, e.g. tpagent rank -- python train.py.", EXIT_USAGE)
    try:
        env = dict(os.environ)
        named = f"{job_of(env)}-rank{rank_of(env)}.log"  # (first: a rank no agent would take never starts)
        out = stdout or Path(named).absolute()
        if os.geteuid() == 0:
            creds = credentials(secret_file, tls_dir)
            here: RankAgent = GrpcPeer(agent, creds)
            connect: Callable[[str], RankAgent] = lambda a: GrpcPeer(a, creds)  # noqa: E731
        else:  # (a user's stand-in: its node's agent starts the rank as this user, over the local channel)
            local = LocalAgent(local_name(socket_name))
            here = local
            connect = local.to
        stand_in = StandIn(
            cmd,
            here,
            connect,
            out,
            stderr or out,
            socket_name,
            umask=0o022,
            relay=relay,
        )
        code = stand_in.run()
    except UsageError as e:
        die(str(e), EXIT_USAGE)
    raise typer.Exit(passed_on(code))


def _unreachable(agent: str, e: grpc.RpcError) -> str:
    from tpagent.daemon.client import unreachable_reason

    return f"the agent at {agent} cannot be reached ({unreachable_reason(e)}); is `tpagent serve` running there?"


def _refuse_bad_target(agent: str, source: str, creds: Any, as_json: bool) -> None:
    """A migration that failed before anything was frozen, because its target cannot be
    reached, or is the source under another address, is bad input as an unreachable --from,
    or a --to written as --from is, is: the same sentence, the same exit code."""
    from tpagent.daemon.rpc import pb, stub

    try:
        node = stub(agent, creds).Info(pb.Empty(), timeout=10).node
    except grpc.RpcError as e:
        if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            if not as_json:
                typer.echo("", err=True)
            die(_unreachable(agent, e), EXIT_USAGE, as_json)
        return
    try:
        same = node == stub(source, creds).Info(pb.Empty(), timeout=10).node
    except grpc.RpcError:
        return  # (--from gone since: the migration's own word says what became of it)
    if same:
        if not as_json:
            typer.echo("", err=True)
        msg = f"--from and --to are the same agent ({agent} is node {node}, as {source} is); give another node as --to."
        die(msg, EXIT_USAGE, as_json)


def _show(event: Any, shown: str) -> str:
    if event.bytes_total:
        rate = event.bytes_done / max(event.seconds, 1e-6)
        eta = (event.bytes_total - event.bytes_done) / rate if rate else 0.0  # (still growing while CRIU writes)
        typer.echo(
            f"\r  {event.state:<12} {event.bytes_done / 2**20:9.1f} / {event.bytes_total / 2**20:.1f} MiB  "
            f"{rate / 1e9:5.2f} GB/s  ETA {eta:5.1f} s",
            err=True,
            nl=False,
        )
        return shown
    if event.message and event.message != shown:
        typer.echo(
            f"\n  {event.state:<12} {event.message}" if shown else f"  {event.state:<12} {event.message}", err=True
        )
        return str(event.message)
    return shown


def _report(last: Any, as_json: bool, dry_run: bool, said: list[str] | None = None) -> int:
    if last is None:
        die("the agent ended the migration without a word", EXIT_FAILED)
    ok = last.state == "done"
    doc = {
        "migration_id": last.migration_id,
        "state": last.state,
        "message": last.message,
        "new_pid": last.new_pid,
        "seconds": round(last.seconds, 3),
        "timings": dict(last.timings),
        "problems": list(last.problems),
    }
    if dry_run and said:
        doc["checked"] = said
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
    else:
        typer.echo("", err=True)
        if dry_run:
            for p in last.problems:
                typer.echo(f"  would fail: {p}")
        timings = dict(last.timings)
        for stage, seconds in sorted(timings.items(), key=lambda kv: kv[1], reverse=True):
            if not stage.endswith("_bytes"):
                typer.echo(f"  {stage:<24} {seconds:8.2f} s")
        for stage, size in sorted((k, v) for k, v in timings.items() if k.endswith("_bytes")):
            typer.echo(f"  {stage:<24} {size / 2**20:8.1f} MiB")
        typer.echo(("ok: " if ok else "FAILED: ") + (last.message or last.state))
    return EXIT_OK if ok else EXIT_FAILED


def _call(agent: str, secret_file: Path | None, tls_dir: Path, method: str, request: Any) -> Any:
    from tpagent.daemon.rpc import stub

    try:
        return getattr(stub(agent, credentials(secret_file, tls_dir)), method)(request, timeout=30)
    except UsageError as e:
        die(str(e), EXIT_USAGE)
    except grpc.RpcError as e:
        if e.code() is grpc.StatusCode.UNAVAILABLE:
            die(_unreachable(agent, e), EXIT_USAGE)
        die(f"the agent at {agent}: {e.details()}", rpc_exit_code(e.code()))


def status(
    migration_id: MigrationIdArg,
    agent: AgentOpt = "127.0.0.1:7400",
    secret_file: SecretOpt = None,
    tls_dir: TlsDirOpt = DEFAULT_TLS_DIR,
    as_json: JsonOpt = False,  # (JSON either way)
) -> None:
    """Where a migration stands, as the agent's journal says (JSON)."""
    from tpagent.daemon.rpc import pb

    _say_state(_call(agent, secret_file, tls_dir, "Status", pb.MigrationRef(migration_id=migration_id)), True)


def cancel(
    migration_id: MigrationIdArg,
    agent: AgentOpt = "127.0.0.1:7400",
    secret_file: SecretOpt = None,
    tls_dir: TlsDirOpt = DEFAULT_TLS_DIR,
    as_json: JsonOpt = False,
) -> None:
    """Cancel a migration on its source agent: the process runs on where it stood."""
    from tpagent.daemon.rpc import pb

    _say_state(_call(agent, secret_file, tls_dir, "Cancel", pb.MigrationRef(migration_id=migration_id)), as_json)


def _say_state(s: Any, as_json: bool) -> None:
    """Where a migration stands (a MigrationStatus): a line, or with ``as_json`` its JSON."""
    doc = {"migration_id": s.migration_id, "state": s.state, "message": s.message, "pid": s.pid}
    typer.echo(
        json.dumps(doc, indent=2)
        if as_json
        else printable(f"migration {s.migration_id}: {s.state} {s.message}".rstrip(), None)
    )


FINAL_STATES = frozenset({*(s.value for s in SOURCE_FINAL), *(t.value for t in TARGET_FINAL)})


def resolve(
    migration_id: MigrationIdArg,
    commit: Annotated[
        bool | None,
        typer.Option(
            "--commit/--discard",
            help="--commit: the copy on the target goes on and the original is ended; "
            "--discard: the original goes on (a copy the target still holds is dropped when it is back).",
        ),
    ] = None,
    agent: AgentOpt = "127.0.0.1:7400",
    secret_file: SecretOpt = None,
    tls_dir: TlsDirOpt = DEFAULT_TLS_DIR,
    as_json: JsonOpt = False,
) -> None:
    """Decide a migration whose peer gives no answer (its node lost, its agent down for good).
    Refused while the peer answers (the agents then decide it themselves), and dropped if it
    answers again before the decision is carried out (the state shown says how it ended).
    Only you know the peer is gone: --discard while its agent could still start the held copy
    (takeover_after) can run the job twice; --commit while it never ran can lose it."""
    from tpagent.daemon.rpc import pb

    if commit is None:
        die("say how it ends: --commit (the copy goes on) or --discard (the original goes on).", EXIT_USAGE)
    s = _call(agent, secret_file, tls_dir, "Resolve", pb.ResolveRequest(migration_id=migration_id, commit=commit))
    for _ in range(60):  # (the agent carries the decision out within seconds)
        if s.state in FINAL_STATES:
            break
        time.sleep(1)
        s = _call(agent, secret_file, tls_dir, "Status", pb.MigrationRef(migration_id=migration_id))
    if s.state in FINAL_STATES or not as_json:  # (under --json, one document: the state, or the error)
        _say_state(s, as_json)
    if s.state not in FINAL_STATES:
        die(f"the agent has not carried the decision out yet; `tpagent status {migration_id}` follows it", EXIT_FAILED)


def node(
    agent: AgentOpt = "127.0.0.1:7400",
    secret_file: SecretOpt = None,
    tls_dir: TlsDirOpt = DEFAULT_TLS_DIR,
    as_json: JsonOpt = False,  # (JSON either way)
) -> None:
    """An agent's node: versions, health, GPUs, free memory, its clock's offset from this
    machine's, and its migratable processes (JSON)."""
    from tpagent.common import clock
    from tpagent.daemon import rankwire
    from tpagent.daemon.rpc import pb
    from tpagent_rank import codec
    from tpagent_rank import protocol as P

    asked = clock.now()
    info = _call(agent, secret_file, tls_dir, "Info", pb.Empty())
    offset = info.clock - (asked + clock.now()) / 2 if info.clock else None
    if offset is not None and abs(offset) > clock.START_LIMIT:
        typer.echo(
            f"tpagent: warning: the clock of the agent at {agent} is {clock.apart(offset)} this machine's; "
            f"migrations start only between nodes within {clock.START_LIMIT:.0f} s (use NTP)",
            err=True,
        )
    procs = _call(agent, secret_file, tls_dir, "ListProcesses", pb.Empty())
    jobs = P.Jobs()
    ranks = rankwire.answer_of(jobs, _call(agent, secret_file, tls_dir, "Rank", rankwire.request_pb("", 0, jobs, 5)))
    doc = {
        "node": info.node,
        "hostname": info.hostname,
        "healthy": info.healthy,
        "problems": list(info.problems),
        "agent_version": info.agent_version,
        "criu_version": info.criu_version,
        "driver_version": info.driver_version,
        "memory_available": info.memory_available,
        "clock_offset_seconds": None if offset is None else round(offset, 3),  # its clock minus this machine's
        "gpus": [
            {"uuid": g.uuid, "name": g.name, "memory_used": g.memory_used, "memory_total": g.memory_total}
            for g in info.gpus
        ],
        "migratable": [
            {"pid": p.pid, "why": p.why, "uid": p.uid, "owner": p.owner, "rss": p.rss, "cmdline": list(p.cmdline)}
            for p in procs.processes
        ],
        # of distributed jobs (`tpagent rank`): job, rank, world, generation, step, collectives, where it moved,
        # whether it registered its training state and its replicas (model-aware mode)
        "ranks": [codec.fields_of(r) for r in ranks.ranks],
    }
    typer.echo(json.dumps(doc, indent=2))
