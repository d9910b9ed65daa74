"""``tpagent doctor``: can this node checkpoint and restore?  One line per check.  And what an
agent says of its node (:func:`node_info`)."""

from __future__ import annotations

import ctypes
import enum
import importlib.metadata
import os
import platform
import shutil
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from host import ends, forked, gpus, proc
from host.api import UsageError
from host.criu_limits import large_ghosts
from snapshot.api import DEFAULT_GHOST_LIMIT, SnapshotError
from snapshot.criu import Criu
from tpagent import __version__
from tpagent.common import clock
from tpagent.migration.api import GpuInfo, NodeInfo


class Verdict(str, enum.Enum):
    OK = "OK"
    WARN = "WARN"
    FAIL = "FAIL"


@dataclass(frozen=True)
class Check:
    name: str
    verdict: Verdict
    message: str


def _root() -> Check:
    if os.geteuid() == 0:
        return Check("root", Verdict.OK, "running as root")
    return Check("root", Verdict.FAIL, "not root: CRIU needs root; run tpagent as root")


def _criu(criu_path: Path | None) -> list[Check]:
    try:
        criu = Criu(criu_path)
    except SnapshotError as e:
        return [Check("criu", Verdict.FAIL, str(e))]
    found = Check("criu", Verdict.OK, f"CRIU {criu.version_str} at {criu.path}")
    try:
        verdict = criu.check()
    except SnapshotError as e:
        return [found, Check("criu check", Verdict.FAIL, str(e))]
    return [found, Check("criu check", Verdict.OK, verdict)]


def _kernel() -> list[Check]:
    out = [Check("kernel", Verdict.OK, f"Linux {platform.release()} ({platform.machine()})")]
    if shutil.which("unshare") is None:
        out.append(Check("unshare", Verdict.FAIL, "unshare (util-linux) missing: `tpagent launch` needs it"))
    else:
        out.append(Check("unshare", Verdict.OK, "PID/mount namespaces for `tpagent launch` available"))
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists():
        mode = thp.read_text().split("[")[1].split("]")[0]
        if mode == "always":
            out.append(Check("huge pages", Verdict.OK, "transparent huge pages: always"))
        else:
            out.append(
                Check(
                    "huge pages",
                    Verdict.WARN,
                    f"transparent huge pages: {mode}; 'always' makes the CUDA checkpoint ~1.8x faster "
                    "(echo always > /sys/kernel/mm/transparent_hugepage/enabled)",
                )
            )
    return out


def _gpu() -> list[Check]:
    driver = gpus.driver_version()
    if driver is None:
        return [Check("nvidia driver", Verdict.WARN, "no NVIDIA driver/NVML: only CPU processes can be checkpointed")]
    major = int(driver.split(".")[0])
    verdict = Verdict.OK if major >= 570 else Verdict.FAIL
    advice = "" if major >= 570 else " (the checkpoint API needs 570 or newer: upgrade the driver)"
    out = [Check("nvidia driver", verdict, f"driver {driver}, {len(gpus.inventory())} GPU(s){advice}")]
    try:
        version = importlib.metadata.version("cuda-bindings")
        out.append(Check("cuda-python", Verdict.OK, f"cuda-bindings {version}"))
    except importlib.metadata.PackageNotFoundError:
        out.append(Check("cuda-python", Verdict.FAIL, "cuda-python missing: pip install cuda-python"))
    out.append(_checkpoint_api())
    for m in gpus.modes():
        if m.persistence is False:
            out.append(
                Check(
                    "persistence",
                    Verdict.WARN,
                    f"GPU {m.uuid}: persistence mode is off: with no process "
                    "on it the driver tears the GPU down, and a restore pays to bring it up again "
                    "(nvidia-smi -pm 1)",
                )
            )
        elif m.persistence:
            out.append(Check("persistence", Verdict.OK, f"GPU {m.uuid}: persistence mode on"))
        if m.mig:
            out.append(
                Check(
                    "mig",
                    Verdict.WARN,
                    f"GPU {m.uuid}: MIG is on: a process is restored only onto a MIG "
                    "instance like its own (give its UUID to --gpu-map)",
                )
            )
    return out


def _checkpoint_api() -> Check:
    """The driver's checkpoint entry points (what `cuda-checkpoint` calls), as libcuda exports them."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return Check("checkpoint api", Verdict.FAIL, f"libcuda.so.1 cannot be loaded: {e}")
    missing = [f for f in CHECKPOINT_CALLS if not hasattr(libcuda, f)]
    if missing:
        return Check("checkpoint api", Verdict.FAIL, f"the driver lacks {', '.join(missing)}: upgrade to 570 or newer")
    return Check("checkpoint api", Verdict.OK, "the driver has the CUDA checkpoint API")


CHECKPOINT_CALLS = (
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
    "cuCheckpointProcessGetState",
)


def process_checks(pid: int) -> list[Check]:
    """For one process: the CUDA features the driver cannot checkpoint, where they can be seen
    from outside it (several GPUs, MPS); what cannot be seen is said too."""
    try:
        proc.validate_target(pid)  # (what a dump refuses before anything: doctor says it too)
    except UsageError as e:
        return [Check("process", Verdict.FAIL, str(e).rstrip("."))]
    try:
        tree = {pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))}
    except psutil.Error as e:
        return [Check("process", Verdict.FAIL, f"PID {pid} cannot be read: {e}")]
    found = gpus.inventory()
    on = [g.uuid for g in found if tree & set(g.pids)]
    out = [Check("process", Verdict.OK, f"PID {pid}: {len(tree)} process(es), on {len(on)} GPU(s)")]
    if len(on) > 1:
        out.append(
            Check(
                "several gpus",
                Verdict.WARN,
                f"PID {pid}'s tree uses {len(on)} GPUs ({', '.join(on)}): "
                "each must be mapped on restore (--gpu-map), onto as many GPUs",
            )
        )
    mps = [m.uuid for m in gpus.modes() if tree & set(m.mps_pids)]
    if mps:
        out.append(
            Check(
                "mps",
                Verdict.FAIL,
                f"PID {pid} is a client of an MPS server on {', '.join(mps)}: the driver cannot checkpoint MPS clients",
            )
        )
    out += _forked_checks(sorted(tree), sorted(pid for g in found for pid in g.pids if pid in tree))
    out += [
        Check("cannot dump", Verdict.FAIL, why.rstrip(".")) for why in ends.unmovable(sorted(tree), agent_let_go=True)
    ]
    out += [Check("shared file", Verdict.WARN, why.rstrip(".")) for why in ends.shared_offsets(sorted(tree))]
    out += [  # (a warning: the limit is the dump's or the agent's, the default here)
        Check("ghost files", Verdict.WARN, why.rstrip(".")) for why in large_ghosts(sorted(tree), DEFAULT_GHOST_LIMIT)
    ]
    unseen = (
        "CUDA IPC handles and managed (UVM) memory cannot be seen from outside a process: if it holds them "
        "the driver refuses the checkpoint and the process is resumed"
    )
    out.append(Check("not visible", Verdict.OK, unseen))
    return out


def _forked_checks(tree: list[int], cuda_pids: list[int]) -> list[Check]:
    """Each child forked after CUDA started (no context, the driver's mappings kept): what a
    checkpoint does with it, or why it refuses the tree (:mod:`host.forked`)."""
    leftovers = forked.find(tree, cuda_pids)
    refused = forked.refusals(leftovers, cuda_pids)
    out = [Check("forked child", Verdict.OK, left.describe()) for left in leftovers]
    out += [Check("forked child", Verdict.FAIL, why) for why in refused]
    return out


#: adjtimex(2)'s answer when the kernel's clock is not kept in sync (no NTP daemon disciplines it).
_TIME_ERROR = 5


def _clock() -> Check:
    """Whether something (chrony, ntpd, systemd-timesyncd) keeps the clock in sync: the agents
    of two nodes refuse to start a migration between clocks far apart (tpagent/common/clock.py)."""
    timex = ctypes.create_string_buffer(512)  # (struct timex, modes 0: only read)
    state = ctypes.CDLL(None, use_errno=True).adjtimex(timex)
    if state == _TIME_ERROR:
        why = (
            "the clock is not kept in sync (no NTP): migrations start only between nodes whose clocks are "
            f"within {clock.START_LIMIT:.0f} s; run chrony or systemd-timesyncd"
        )
        return Check("clock", Verdict.WARN, why)
    if state < 0:
        return Check("clock", Verdict.WARN, f"cannot read the clock's sync state: {os.strerror(ctypes.get_errno())}")
    return Check("clock", Verdict.OK, "the clock is kept in sync (NTP)")


def run_checks(criu_path: Path | None = None, pid: int | None = None) -> list[Check]:
    steps: list[Callable[[], list[Check]]] = [
        lambda: [_root()],
        lambda: [_clock()],
        lambda: _criu(criu_path),
        _kernel,
        _gpu,
    ]
    if pid is not None:
        steps.append(lambda: process_checks(pid))
    return [check for step in steps for check in step()]


def node_info(node: str, criu_path: Path | None) -> NodeInfo:
    """This node as its agent describes it: GPUs, free memory, versions, and what is wrong."""
    problems = []
    criu_version = ""
    try:
        criu_version = Criu(criu_path).version_str
    except SnapshotError as e:
        problems.append(str(e))
    gpu_list = tuple(
        GpuInfo(g.uuid, g.name, g.memory_total, g.memory_used, g.temperature_c or 0, g.ecc_uncorrected or 0)
        for g in gpus.inventory()
    )
    available = psutil.virtual_memory().available
    driver = gpus.driver_version() or ""
    host = socket.gethostname()
    return NodeInfo(node, host, gpu_list, available, __version__, criu_version, driver, tuple(problems), clock.now())
