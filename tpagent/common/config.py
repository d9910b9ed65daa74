"""The agent's configuration: a TOML file, then ``TPAGENT_*`` environment variables on top.

    # /etc/tpagent/agent.toml (every key optional but secret_file)
    node = "gpu-node-17"              # name in logs and metrics (default: the host name)
    listen = "0.0.0.0:7400"           # the agent's gRPC address
    advertise = "10.0.0.17"           # the address peers reach this node on (transfers)
    secret_file = "/etc/tpagent/secret" # root's, mode 600: the cluster secret (same on every node)
    tls_dir = "/etc/tpagent/tls"      # ca.crt, tls.crt, tls.key (mode 600): mutual TLS, cluster CA
    health_listen = "0.0.0.0:7401"    # plain-text gRPC health Check only (probes); "" turns it off
    work_dir = "/var/lib/tpagent"     # journals and snapshots in flight: root's, mode 700, created
                                      # by the agent (an existing one owned by anyone else is refused)
    metrics_listen = "127.0.0.1:9400" # Prometheus text format; "" turns it off
    shared_paths = ["/shared"]        # expected on every node (checked, not copied)
    allow_executables = ["/opt/venv/bin/python3"]  # also migratable: processes running one of these
                                      # programs (full paths, compared with /proc/PID/exe)
    memory_limit = 0                  # most bytes this node accepts in one migration (0: no limit)
    max_incoming = 4                  # migrations this node receives at once (0: no limit); each
                                      # reserves its snapshot's room in work_dir and its memory
    hold_timeout = 3600.0             # longest a frozen original waits for its copy to start
    takeover_after = 300.0            # a restored copy whose source agent stays unreachable this
                                      # long starts on its own (0: it waits for the source forever)
    io_timeout = 30.0                 # a transfer stream silent this long is broken (and retried)
    rpc_timeout = 30.0                # one ordinary call to another agent
    restore_timeout = 3600.0          # the target's restore of a copy (its snapshot's arrival included)
    abort_confirm_timeout = 60.0      # a rollback asks the target this long to say its copy is gone
                                      # (then the original stays frozen and the agent keeps asking)
    shutdown_grace = 30.0             # on SIGTERM, running migrations get this long (a 2nd signal: none)
    confirm_period = 3.0              # a migrated copy must run this long before the original is ended
                                      # (it dies sooner: the original runs on); 0: ended at once
    transfer_port = 0                 # where this node receives snapshots (0: any free port; a fixed
                                      # one receives one migration at a time)
    transfer_address = ""             # what peers connect to for it, if not advertise:port (NAT, proxy)
    aliases = []                      # other names or addresses callers reach this agent by (NAT,
                                      # proxy): calls signed for them are accepted; put them in tls.crt
    transport = "tcp"                 # or "ucx"
    streams = 4                       # parallel connections per transfer
    ghost_limit_mib = 1024            # largest deleted-but-open file a dump keeps (CRIU's --ghost-limit)
    stream_buffer_mib = 0             # > 0: a migration's images go from CRIU straight to the transfer,
                                      # never written on this node, at most this much of them held in
                                      # memory (trees with a CUDA context are always written first).
                                      # Off by default: slower than files on a 2-core VM (README)
    compress = "auto"
    rank_socket = "tpagent-ranks"     # abstract unix socket (one per network namespace) where the
                                      # ranks of `tpagent rank` jobs reach this agent; "" turns it off
    rewire_timeout = 120.0            # a rank's rewire step (reach the boundary, rebuild) at most this long
    orchestrator = ""                 # HOST:PORT of `tpagent orchestrator`: reported to every
                                      # report_period seconds ("": no orchestrator)
    report_period = 2.0
    temperature_c = 0                 # a GPU this hot is unhealthy (0: its slowdown temperature
    temperature_margin_c = 5          #   less temperature_margin_c)
    ecc_rise = 1                      # uncorrectable ECC errors since the agent started: unhealthy

The variable for a key is TPAGENT_ and the key in capitals (lists: comma-separated).  Every
value is checked at load, the agent not started on a bad one: the timeouts against each other
(:class:`Timeouts`), each number against its range (:data:`RANGES`; no seconds past
:data:`MOST_SECONDS`, no NaN), each address as HOST:PORT and each name as a host's.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import math
import os
import re
import socket
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from host import paths
from host.api import MOST_SECONDS, UsageError, is_whole, port_number, unbracketed
from host.trusted import read_trusted
from snapshot.api import DEFAULT_GHOST_LIMIT
from tpagent.common.credentials import Credentials
from transfer.api import DEFAULT_TLS_DIR, MAX_STREAMS, Compress
from transfer.transports import NAMES

#: The configuration key of each timeout (tpagent/common/config.py), for messages.
TIMEOUT_KEYS = {
    "rpc": "rpc_timeout",
    "restore": "restore_timeout",
    "hold": "hold_timeout",
    "takeover_after": "takeover_after",
    "io": "io_timeout",
    "abort_confirm": "abort_confirm_timeout",
    "shutdown_grace": "shutdown_grace",
    "confirm": "confirm_period",
}


@dataclass(frozen=True)
class Timeouts:
    """Every wait of the agent layer, in seconds, checked against each other at load."""

    rpc: float = 30.0  # one ordinary call to another agent
    restore: float = 3600.0  # the target restores a copy (waiting for its snapshot included)
    hold: float = 3600.0  # longest a frozen original waits for its copy to be pinned
    takeover_after: float = 300.0  # a held copy whose source is unreachable this long starts (0: never)
    io: float = 30.0  # a transfer stream silent this long is broken (and retried)
    abort_confirm: float = 60.0  # a rollback asks the target this long to say its copy is gone
    shutdown_grace: float = 30.0  # `serve` waits this long for running migrations on SIGTERM
    confirm: float = 3.0  # a started copy must run this long before the original is ended (0: at once)

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if (
                not isinstance(v, int | float)
                or not math.isfinite(v)
                or v < 0
                or (v == 0 and f.name not in ("takeover_after", "confirm"))
            ):
                raise ValueError(f"{TIMEOUT_KEYS[f.name]} = {v!r} must be a positive number of seconds.")
        k = TIMEOUT_KEYS
        rules = [
            # A restore is an ordinary call that may last: shorter would cut restores off.
            (
                self.rpc < self.restore,
                f"{k['rpc']} ({self.rpc:g} s) must be shorter than {k['restore']} ({self.restore:g} s)",
            ),
            # A stalled stream must be noticed (and retried) well inside the hold.
            (self.io < self.hold, f"{k['io']} ({self.io:g} s) must be shorter than {k['hold']} ({self.hold:g} s)"),
            # A rollback's question must fit at least one whole answer.
            (
                self.abort_confirm >= self.rpc,
                f"{k['abort_confirm']} ({self.abort_confirm:g} s) must be at least {k['rpc']} ({self.rpc:g} s)",
            ),
        ]
        broken = [why for ok, why in rules if not ok]
        if broken:
            raise ValueError("; ".join(broken) + ".")


DEFAULT_FILE = paths.CONFIG_FILE

#: Each whole-number setting's range (inclusive) and what it counts, said in a refusal.
RANGES = {
    "memory_limit": (0, 1 << 62, "bytes (0: no limit)"),
    "max_incoming": (0, 4096, "migrations (0: no limit)"),
    "transfer_port": (0, 65535, "(a port; 0: any free one)"),
    "streams": (1, MAX_STREAMS, "connections"),
    "ghost_limit_mib": (0, 1 << 20, "MiB"),
    "stream_buffer_mib": (0, 1 << 20, "MiB (0: off)"),
    "temperature_c": (0, 150, "degrees C (0: the GPU's slowdown temperature less the margin)"),
    "temperature_margin_c": (0, 100, "degrees C"),
    "ecc_rise": (1, 1 << 31, "errors"),
}


@dataclass(frozen=True)
class AgentConfig:
    secret_file: Path
    node: str = field(default_factory=socket.gethostname)
    listen: str = "0.0.0.0:7400"
    tls_dir: Path = DEFAULT_TLS_DIR
    health_listen: str = "0.0.0.0:7401"
    advertise: str = ""
    work_dir: Path = paths.WORK_DIR
    metrics_listen: str = "127.0.0.1:9400"
    shared_paths: tuple[str, ...] = ()
    allow_executables: tuple[str, ...] = ()
    memory_limit: int = 0
    max_incoming: int = 4
    hold_timeout: float = 3600.0
    takeover_after: float = 300.0
    io_timeout: float = 30.0
    rpc_timeout: float = 30.0
    restore_timeout: float = 3600.0
    abort_confirm_timeout: float = 60.0
    shutdown_grace: float = 30.0
    confirm_period: float = 3.0
    transfer_port: int = 0
    transfer_address: str = ""
    aliases: tuple[str, ...] = ()
    transport: str = "tcp"
    streams: int = 4
    ghost_limit_mib: int = DEFAULT_GHOST_LIMIT >> 20
    stream_buffer_mib: int = 0
    compress: str = "auto"
    rank_socket: str = "tpagent-ranks"
    rewire_timeout: float = 120.0
    orchestrator: str = ""
    report_period: float = 2.0
    temperature_c: int = 0
    temperature_margin_c: int = 5
    ecc_rise: int = 1

    @property
    def advertised_host(self) -> str:
        if self.advertise:
            return self.advertise
        host = self.listen.rpartition(":")[0]
        return host if host not in ("", "0.0.0.0", "[::]") else socket.gethostname()

    def __post_init__(self) -> None:
        object.__setattr__(self, "work_dir", Path(self.work_dir).absolute())  # (paths in journals are absolute)
        self.timeouts  # noqa: B018 (checked now, at load, not at the first migration)
        if not 0 < self.rewire_timeout < float("inf"):
            raise UsageError(f"the setting rewire_timeout = {self.rewire_timeout} is not valid: give seconds > 0.")
        if not 0.1 <= self.report_period <= 3600:
            raise UsageError(f"the setting report_period = {self.report_period} is not valid: give 0.1 to 3600 s.")
        for name, (lo, hi, what) in RANGES.items():
            if not lo <= getattr(self, name) <= hi:
                raise UsageError(f"the setting {name} = {getattr(self, name)} is not valid: give {lo} to {hi} {what}.")
        check_hosts(self, ("listen", "health_listen", "transfer_address", "orchestrator"), http=("metrics_listen",))
        check_ports(self, ("listen", "health_listen", "metrics_listen"), ports=("transfer_port",))
        if self.compress not in {c.value for c in Compress}:
            choices = ", ".join(c.value for c in Compress)
            raise UsageError(f"the setting compress = {self.compress!r} is not valid: choose one of {choices}.")
        if len(self.rank_socket) > 100 or "\0" in self.rank_socket:
            raise UsageError(
                f"the setting rank_socket = {self.rank_socket[:60]!r} is not valid: at most 100 characters, no NUL."
            )
        if not all(is_name(f"[{a.strip('[]')}]" if ":" in a else a) for a in self.aliases):
            raise UsageError(f"the setting aliases = {list(self.aliases)!r:.80} is not valid: give host names.")
        for key in ("shared_paths", "allow_executables"):  # (a relative one: relative to the agent's directory)
            if not all(os.path.isabs(p) and "\0" not in p for p in getattr(self, key)):
                raise UsageError(
                    f"the setting {key} = {list(getattr(self, key))!r:.80} is not valid: give absolute paths."
                )
        if self.transport not in NAMES:
            raise UsageError(
                f"the setting transport = {self.transport!r} is not valid: choose one of {', '.join(NAMES)}."
            )

    @functools.cached_property
    def timeouts(self) -> Timeouts:
        try:
            return Timeouts(
                rpc=self.rpc_timeout,
                restore=self.restore_timeout,
                hold=self.hold_timeout,
                takeover_after=self.takeover_after,
                io=self.io_timeout,
                abort_confirm=self.abort_confirm_timeout,
                shutdown_grace=self.shutdown_grace,
                confirm=self.confirm_period,
            )
        except ValueError as e:
            raise UsageError(f"the timeouts do not fit together: {e}") from e

    @property
    def agent_address(self) -> str:
        """Where peers reach this agent's gRPC service."""
        return f"{self.advertised_host}:{self.listen.rpartition(':')[2]}"

    def credentials(self) -> Credentials:
        return Credentials.load(self.secret_file, self.tls_dir)

    @property
    def audiences(self) -> set[str]:
        """The names callers may address this agent by (a call signed for another is refused)."""
        hosts = {
            self.node,
            self.advertised_host,
            unbracketed(self.listen.rpartition(":")[0]),
            socket.gethostname(),
            "localhost",
            "127.0.0.1",
            "::1",
            *self.aliases,
        }
        return {h.lower() for h in hosts if h and h not in ("0.0.0.0", "::")}


def port_of(address: str, at_least: int = 0, any_host: bool = False) -> int | None:
    """The port of HOST:PORT, if it is one (``at_least`` to 65535; gRPC takes a larger one
    wrapped); where ``at_least`` asks for a real port, HOST must be a host's name or address
    (or, with ``any_host``, empty: every interface)."""
    host, _, port = address.rpartition(":")
    if at_least and not is_name(host, empty=any_host):
        return None
    number = port_number(port)
    return number if number is not None and number >= at_least else None


def _interface(host: str) -> str:
    """``host`` as :func:`check_ports` compares it: an address in its one spelling, a name in
    lower case, and "" for every interface of the node (0.0.0.0, [::], [::0], *, none), which
    overlaps any other host."""
    bare = unbracketed(host).lower()
    try:
        ip = ipaddress.ip_address(bare)
    except ValueError:
        return "" if bare == "*" else bare
    return "" if ip.is_unspecified else str(ip)


def is_name(text: str, empty: bool = False) -> bool:
    """Whether ``text`` may name a host or node: printable, no space, at most 255 characters, a
    colon only inside brackets ([::1]: a port is never part of it)."""
    if ":" in text and not (text.startswith("[") and text.endswith("]")):
        return False
    return (empty or bool(text)) and len(text) <= 255 and text.isprintable() and not any(c.isspace() for c in text)


def check_hosts(
    settings: object,
    addresses: tuple[str, ...],
    http: tuple[str, ...] = (),
    names: tuple[str, ...] = ("node", "advertise"),
) -> None:
    """The settings ``addresses`` (gRPC's, which needs a host) and ``http`` (an empty host: every
    interface) are HOST:PORT with a real port, ``names`` host names; the first address and the
    first name must be given, the others may be "" (off, or the default)."""
    for name in (*addresses, *http):
        value = getattr(settings, name)
        if (value or name == addresses[0]) and not port_of(value, at_least=1, any_host=name in http):
            raise UsageError(f"the setting {name} = {value[:60]!r} is not valid: give HOST:PORT, the port 1 to 65535.")
    for name in names:
        value = getattr(settings, name)
        if not is_name(value, empty=name != names[0]):
            raise UsageError(f"the setting {name} = {value[:60]!r} is not valid: give a host name.")


def check_ports(settings: object, listens: tuple[str, ...], ports: tuple[str, ...] = ()) -> None:
    """No two of the settings ``listens`` (HOST:PORT, checked; "": off), nor the bare ports
    ``ports`` (any host; 0: any free one), on one port of one host: the second server would not
    start (or, with SO_REUSEPORT, share it)."""
    held: list[tuple[str, str, int]] = [(name, "", getattr(settings, name)) for name in ports]
    for name in listens:
        if value := getattr(settings, name):
            held.append((name, _interface(value.rpartition(":")[0]), port_of(value) or 0))
    for i, (name, host, port) in enumerate(held):
        for other, its_host, its_port in held[:i]:
            if port and port == its_port and (host == its_host or not host or not its_host):
                raise UsageError(f"the settings {other} and {name} both name port {port}: give each a port of its own.")


#: A number as a setting's text (a variable's) is written.
_NUMBER = re.compile(r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?")


def convert_setting(name: str, kind: Any, value: Any) -> Any:
    """``value`` (from TOML, or a variable's text) as the setting's ``kind``; a number must be
    one (not true or false), finite, whole where counted, and at most :data:`MOST_SECONDS` where
    in seconds (every setting with a fraction is)."""
    try:
        if kind is Path or kind == "Path":
            if not isinstance(value, str | os.PathLike) or value == "":  # ("" would be ".", the working directory)
                raise ValueError("give a path")
            return Path(value)
        if kind in (int, "int", float, "float") and isinstance(value, bool):
            raise ValueError("give a number")
        if kind in (int, "int", float, "float") and isinstance(value, str) and not _NUMBER.fullmatch(value):
            raise ValueError("give a number in ASCII digits")  # (int() and float() read "٣", " 7 " and "1_000")
        if kind in (int, "int") and isinstance(value, str) and not is_whole(value.lstrip("+-")):
            raise ValueError("give a whole number")
        if kind in (int, "int"):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError("give a whole number")
            return int(value)
        if kind in (float, "float"):
            if not -MOST_SECONDS <= float(value) <= MOST_SECONDS:  # (NaN too)
                raise ValueError(f"give a number of seconds up to {MOST_SECONDS:g}")
            return float(value)
        if "tuple" in str(kind):
            items = value.split(",") if isinstance(value, str) else list(value)
            if not all(isinstance(x, str) for x in items):
                raise ValueError("give a list of text")
            return tuple(str(x).strip() for x in items if str(x).strip())
        return str(value)
    except (TypeError, ValueError, OverflowError) as e:
        raise UsageError(f"the setting {name} = {str(value)[:40]!r} is not valid ({e}).") from e


#: The most of a configuration file read (far more than any holds).
CONFIG_MAX = 1 << 20


def read_toml(path: Path | None, default: Path) -> dict[str, Any]:
    """The settings in ``path`` (else in ``default``, if it exists; else none)."""
    if path is None and not default.exists():
        return {}
    file = path or default
    # (it says what root checkpoints, where it listens and writes: a file only root can change)
    text = read_trusted(file, "the configuration", CONFIG_MAX)
    try:
        return tomllib.loads(text.decode())
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"the configuration {file} is not valid TOML: {e}.") from e
    except (UnicodeDecodeError, ValueError) as e:  # (ValueError: an integer of thousands of digits)
        why = "its text is not UTF-8" if isinstance(e, UnicodeDecodeError) else "a number in it has thousands of digits"
        raise UsageError(f"the configuration {file} is not valid TOML: {why}.") from e
    except RecursionError as e:  # (the parser's: arrays in arrays a thousand deep)
        raise UsageError(f"the configuration {file} is not one tpagent reads: its values nest too deep.") from e


def load(path: Path | None = None, env: dict[str, str] | None = None, **overrides: Any) -> AgentConfig:
    """The file (``path``, else TPAGENT_CONFIG, else /etc/tpagent/agent.toml if present),
    then the environment, then ``overrides`` (command-line flags)."""
    env = dict(os.environ) if env is None else env
    values = read_toml(path or (Path(env["TPAGENT_CONFIG"]) if "TPAGENT_CONFIG" in env else None), DEFAULT_FILE)
    fields = {f.name: f.type for f in dataclasses.fields(AgentConfig)}
    unknown = set(values) - set(fields)
    if unknown:
        raise UsageError(f"unknown setting(s) in the configuration: {', '.join(sorted(unknown))}.")
    for name in fields:
        if f"TPAGENT_{name.upper()}" in env:
            values[name] = env[f"TPAGENT_{name.upper()}"]
    values.update({k: v for k, v in overrides.items() if v is not None})
    if "secret_file" not in values:
        raise UsageError("no cluster secret: set secret_file in the configuration or TPAGENT_SECRET_FILE.")
    return AgentConfig(**{k: convert_setting(k, fields[k], v) for k, v in values.items()})
