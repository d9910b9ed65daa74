"""The snapshot layer's contract: stages, modes, configuration and its error family.

A *snapshot* is a directory::

    SNAPSHOT_DIR ::= manifest.json images/ { CRIU_IMAGE_FILE }

``manifest.json`` is described in :mod:`snapshot.manifest`; ``images/`` holds what
``criu dump`` wrote (plus its ``dump.log``).  Everything a restore needs is in the
directory, so it can be moved to another node as a unit.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from host import forked
from host.api import MOST_SECONDS, HostError

#: Base of the snapshot layer's errors: the host floor's family (:mod:`host.api`), so that a
#: refusal of a host check (:class:`~host.api.UsageError`) is one of this layer's errors too.
SnapshotError = HostError


class Interrupted(SnapshotError):
    """The user interrupted (Ctrl-C / SIGINT) a checkpoint or restore."""


class SnapshotInvalid(SnapshotError):
    """A snapshot directory is missing, damaged, truncated or of a format we do not read."""


class ToolError(SnapshotError):
    """An external tool (CRIU, the CUDA driver) refused; carries its own words.

    ``detail`` holds the tool's message (CRIU's error lines, the ``CUresult`` name) and
    ``code`` its exit status or error number, so nothing the tool said is lost.
    """

    tool = "tool"

    def __init__(self, message: str, *, detail: str = "", code: int | None = None) -> None:
        super().__init__(message)
        self.detail = detail
        self.code = code

    def __str__(self) -> str:
        base = super().__str__()
        return f"{base}: {self.detail}" if self.detail else base


class CriuError(ToolError):
    tool = "criu"


class CudaError(ToolError):
    tool = "cuda"


class DumpMode(str, enum.Enum):
    """What happens to the original process once its images are safely written."""

    KILL = "kill"
    LEAVE_RUNNING = "leave-running"
    LEAVE_STOPPED = "leave-stopped"


class Stage(str, enum.Enum):
    """The stages of a checkpoint and of a restore, in order.

    Checkpoint: FORKED_CHILDREN -> CUDA_LOCK -> CUDA_CHECKPOINT -> CRIU_DUMP -> CHECKSUM -> (finish by mode).
    Restore:    VERIFY -> CRIU_RESTORE -> CUDA_RESTORE -> CUDA_UNLOCK.
    A failure before the checkpoint has finished rolls back: CUDA_RESTORE/UNLOCK of what was
    frozen and SIGCONT of the stopped tree.
    """

    #: The GPU driver's leftovers removed from children forked after CUDA started (:mod:`host.forked`).
    FORKED_CHILDREN = "forked_children"
    CUDA_LOCK = "cuda_lock"
    CUDA_CHECKPOINT = "cuda_checkpoint"
    CRIU_DUMP = "criu_dump"
    CHECKSUM = "checksum"
    VERIFY = "verify"
    CRIU_RESTORE = "criu_restore"
    CUDA_RESTORE = "cuda_restore"
    CUDA_UNLOCK = "cuda_unlock"


@dataclass(frozen=True)
class Timeouts:
    """Phase timeouts in seconds; all blocking calls of the layer take them from here."""

    cuda_lock: float = 30.0
    dump: float = 1800.0
    restore: float = 1800.0
    pid_wait: float = 10.0
    #: A process of the tree waited for to stop under ptrace (the GPU driver's leftovers removed).
    stop: float = 10.0

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            low = 0.0 if name == "pid_wait" else 0.001
            if not low <= value <= MOST_SECONDS:  # (NaN too)
                raise ValueError(f"the {name} timeout {value} s is not a number of seconds this layer waits")


DEFAULT_GHOST_LIMIT = 1 << 30


#: Takes an image's name, the offset of a chunk in it and the chunk, valid during the call only
#: (an image that ended empty: one call with an empty chunk).
ImageSink = Callable[[str, int, memoryview], None]


@dataclass(frozen=True)
class SnapshotConfig:
    """How the layer runs.  ``criu`` None means: TPAGENT_CRIU, then the installed prefix, then PATH."""

    criu: Path | None = None
    timeouts: Timeouts = field(default_factory=Timeouts)
    #: Test hook: fail right after this stage, to exercise the rollback path with real tools.
    fail_after: Stage | None = None
    #: Seconds to hold the sealed, still frozen tree until :func:`snapshot.hook.decide` says
    #: commit or abort (a migration's original); None: finish at once.
    hold: float | None = None
    #: Largest deleted-but-open file a dump keeps (in the images; DataLoader workers' shared
    #: memory is such a file).  CRIU's own 1 MiB would refuse most training jobs.
    ghost_limit: int = DEFAULT_GHOST_LIMIT
    #: How many times a dump CRIU refused for a passing reason is tried again (see
    #: :data:`snapshot.dump.TRANSIENT`).
    dump_retries: int = 3
    #: The device files whose mappings and descriptors a forked child without a CUDA context
    #: gives up before the freeze (:mod:`host.forked`); tests name a stand-in file.
    gpu_devices: tuple[str, ...] = forked.DEVICES
    #: Where CRIU's images go instead of into files (:mod:`snapshot.streamer`): called with
    #: each image's name, a chunk's offset and the chunk (valid during the call), from
    #: threads of the dump.  Trees with a CUDA context are still dumped into files.
    stream: ImageSink | None = field(default=None, compare=False)
    #: Carry too, as the tree is frozen, every regular file it has open or maps shared then, but
    #: those under these paths (shared: every node sees them); None: only the files named.  A
    #: migration's: what the tree opened since it was checked (a checkpoint's temporary file,
    #: a tensor's /dev/shm segment) must travel as well.
    carry_opened: tuple[str, ...] | None = None
    #: The most bytes the carried files may hold once the tree is frozen (what a migration's
    #: target made room for); None: no bound.
    carry_most: int | None = None
    #: Mount points of a `tpagent launch` workload's namespace to leave out of the dump, and
    #: so of its restore (the restore's node lacks them; the tree holds nothing in them).
    skip_mounts: tuple[str, ...] = ()


#: Called as a stage starts (``msg`` empty) and ends (``msg`` says how it went).
ProgressFn = Callable[[Stage, str], None]


#: What :func:`producer_version` says when tpagent runs from a source tree that was never
#: installed (no distribution metadata to read).
UNKNOWN_VERSION = "0+unknown"


@functools.cache
def producer_version() -> str:
    """The installed tpagent's version (a manifest's ``tpagent_version``, an agent's
    ``agent_version``), read from its distribution metadata so that pyproject.toml's
    ``version`` is its only source; :data:`UNKNOWN_VERSION` where tpagent is not installed.
    Here, in the bottom layer, so that the snapshot layer need not import the ``tpagent``
    package above it."""
    # Imported here, not at the top: importlib.metadata costs some 20 ms, and CRIU's post-dump
    # hook imports this module while the workload is frozen.
    from importlib import metadata

    try:
        return metadata.version("tpagent")
    except metadata.PackageNotFoundError:
        return UNKNOWN_VERSION
