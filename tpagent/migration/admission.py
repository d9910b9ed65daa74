"""What a target checks before it takes a migration (:class:`Admission`: CRIU, GPUs, files on
shared paths, the tree's sockets), and what it sets aside for each one it takes: room for the
snapshot in its work directory, memory for the copy, room for the carried files where they go, a
place among the migrations it receives at once.

A migration is admitted only if it fits beside those already in flight here: each keeps its
reservation until its copy is restored (or dropped).  Free space counts what the others have
already written (their reservation less that), so nothing is counted twice.  A work directory
on tmpfs holds its snapshots in memory: their bytes are then reserved as memory too.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import psutil

from host import gpus, mounts, sockets
from host.api import is_whole
from snapshot.api import SnapshotError
from snapshot.criu import Criu
from tpagent.common import clock
from tpagent.migration.api import HOLD_MAX, Acceptance, Offer, Refused, Why, gpu_uuids
from tpagent.migration.context import Context
from tpagent.migration.journal import valid_id

MiB = 1 << 20
#: Beyond the process's own bytes: CRIU's metadata, page alignment, the restore's own needs.
MARGIN = 0.10


@dataclass(frozen=True)
class Reservation:
    disk: int  # bytes of the snapshot in the work directory
    memory: int  # bytes of the restored copy (and of its snapshot, on tmpfs)
    #: Where its snapshot goes (and its partial ``.NAME.partial-*`` beside it): the bytes
    #: already written there are no longer free space, nor still to come.
    snapshot: Path | None = None
    #: The abstract unix names its copy will bind: no other copy received meanwhile may need one.
    abstract: frozenset[str] = frozenset()
    #: The GPUs its copy is placed on: a copy received meanwhile is placed on others where it can be.
    gpus: frozenset[str] = frozenset()


def sized(entries: Iterable[str]) -> list[tuple[str, int]]:
    """ "PATH:SIZE" entries (an offer's files); a malformed one is skipped (the size is then 0)."""
    out = []
    for entry in list(entries)[:10_000]:
        path, _, size = entry.rpartition(":")
        out.append((path, int(size) if is_whole(size) else 0))
    return out


def on_tmpfs(path: Path) -> bool:
    """Whether ``path`` lies on a tmpfs (its bytes are memory): the mount with the longest
    mount point that holds it, from /proc/self/mounts."""
    best = ""
    kind = ""
    target = str(path.resolve())
    try:
        lines = Path("/proc/self/mounts").read_text(errors="surrogateescape").splitlines()
    except OSError:
        return False
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best = point
            kind = fields[2]
    return kind == "tmpfs"


def existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (where a file to be created will go)."""
    for p in (path, *path.parents):
        if p.exists():
            return p
    return Path("/")


def written(snapshot: Path | None) -> int:
    """Bytes a snapshot being received (and its partial directories) takes on disk now."""
    if snapshot is None:
        return 0
    total = 0
    for d in (snapshot, *snapshot.parent.glob(f".{snapshot.name}.partial-*")):
        for root, _, files in os.walk(d):
            for name in files:
                try:
                    total += os.lstat(os.path.join(root, name)).st_blocks * 512
                except OSError:
                    continue
    return total


class Reservations:
    """The reservations of the migrations this node receives; ``live(mid)`` says whether one
    is still in flight (its copy not yet restored, nor dropped)."""

    def __init__(self, work_dir: Path, limit: int, live: Callable[[str], bool]) -> None:
        self.work_dir = work_dir
        self.limit = limit
        self.live = live
        self.lock = threading.Lock()  # an admission checks and reserves at once
        self._held: dict[str, Reservation] = {}

    def in_flight(self) -> dict[str, Reservation]:
        for mid in [m for m in self._held if not self.live(m)]:
            del self._held[mid]
        return dict(self._held)

    def reserve(self, mid: str, r: Reservation) -> None:
        self._held[mid] = r

    def check(self, node: str, memory: int, carried: list[tuple[str, int]]) -> tuple[list[str], Reservation, str]:
        """What keeps this node from taking a migration whose copy needs ``memory`` bytes and
        whose snapshot takes ``carried`` files along; the reservation it would hold; and that
        reservation in words (for a dry run).  Call with :attr:`lock` held, then :meth:`reserve`."""
        others = self.in_flight()
        carried_bytes = sum(size for _, size in carried)
        disk = int((memory + carried_bytes) * (1 + MARGIN))
        tmpfs = on_tmpfs(existing(self.work_dir))
        need_memory = int(memory * (1 + MARGIN)) + (disk if tmpfs else 0)
        still_coming = sum(r.disk - written(r.snapshot) for r in others.values())
        free = shutil.disk_usage(existing(self.work_dir)).free - max(0, still_coming)
        available = psutil.virtual_memory().available - sum(r.memory for r in others.values())
        problems = []
        if self.limit and len(others) >= self.limit:
            problems.append(f"{node} is already receiving {len(others)} migration(s), its limit (max_incoming)")
        if disk > free:
            problems.append(
                f"{node}'s work directory {self.work_dir} has {max(0, free) // MiB} MiB free beside the migrations "
                f"in flight there; this snapshot needs about {disk // MiB} MiB (No space left on device otherwise)"
            )
        if need_memory > available:
            problems.append(
                f"{node} has {max(0, available) / 2**30:.2f} GiB of memory free beside the migrations in flight "
                f"there; this process needs about {need_memory / 2**30:.2f} GiB"
                + (f" (its snapshot too: {self.work_dir} is on tmpfs)" if tmpfs else "")
            )
        by_fs: dict[int, tuple[Path, int]] = {}
        for path, size in carried:
            at = existing(Path(path).parent)
            try:
                dev = at.stat().st_dev
            except OSError:
                continue
            by_fs[dev] = (by_fs.get(dev, (at, 0))[0], by_fs.get(dev, (at, 0))[1] + size)
        for at, size in by_fs.values():
            room = shutil.disk_usage(at).free
            if size > room:
                problems.append(
                    f"the files the process takes along need {size // MiB} MiB under {at} on {node}, "
                    f"which has {room // MiB} MiB free"
                )
        words = (
            f"{node} reserves {disk // MiB} MiB in {self.work_dir} ({max(0, free) // MiB} MiB free) and "
            f"{need_memory // MiB} MiB of memory ({max(0, available) // MiB} MiB available), for a copy of "
            f"{memory // MiB} MiB with {len(carried)} carried file(s) of {carried_bytes // MiB} MiB; "
            f"{len(others)} other migration(s) in flight there"
        )
        return problems, Reservation(disk, need_memory), words


class Admission:
    """What this node checks of each migration offered to it, and the reservations of those it
    takes (``receiving(mid)``: whether migration ``mid`` still holds its reservation here;
    ``sending(mid)``: whether this node is its source)."""

    def __init__(self, ctx: Context, receiving: Callable[[str], bool], sending: Callable[[str], bool]) -> None:
        self.ctx = ctx
        self.sending = sending  # whether this node is the source of a migration
        self.reservations = Reservations(ctx.cfg.work_dir, ctx.cfg.max_incoming, receiving)

    def offer(self, offer: Offer, take: Callable[[dict[str, str]], tuple[str, Path]]) -> Acceptance:
        """Check ``offer``; if it fits beside the migrations in flight (and is no dry run), take it
        (``take(gpu_map)``: where the snapshot is streamed to, and where it goes) and reserve for it.
        Checked and reserved at once: two offers never share the room."""
        if not valid_id(offer.migration_id):
            raise Refused("bad migration id", Why.INVALID)
        if not 0 <= offer.hold <= HOLD_MAX:  # (NaN too)
            raise Refused(f"hold must be between 0 and {HOLD_MAX:.0f} s", Why.INVALID)
        offer = replace(offer, target_gpus=gpu_uuids(offer.target_gpus))
        node = self.ctx.cfg.node
        if offer.source_node == node or self.sending(offer.migration_id):
            raise Refused(f"{node} is the source of this migration; give another node as the target", Why.INVALID)
        with self.reservations.lock:
            ours = gpus.inventory()  # (read once: NVML is started and stopped at each read)
            problems = self.problems(offer, ours)
            more, reservation, reserved = self.reservations.check(
                node, offer.bytes_estimate, sized(offer.carried_files)
            )
            problems += more
            missing = tuple(mounts.absent(offer.mounts))  # (left out of the dump if the tree holds nothing there)
            if problems or offer.dry_run:
                return Acceptance(
                    problems=tuple(problems), reserved=reserved, clock=clock.now(), missing_mounts=missing
                )
            gpu_map = self.gpu_map(offer, ours)
            address, snapshot = take(gpu_map)
            abstract = frozenset(offer.abstract_sockets)
            held = replace(reservation, snapshot=snapshot, abstract=abstract, gpus=frozenset(gpu_map.values()))
            self.reservations.reserve(offer.migration_id, held)
        return Acceptance(address, dict(gpu_map), reserved=reserved, clock=clock.now(), missing_mounts=missing)

    def problems(self, offer: Offer, ours: list[gpus.GpuInfo]) -> list[str]:
        """What would keep this node from taking the migration (empty: nothing); ``ours``: this node's GPUs."""
        node = self.ctx.cfg.node
        problems = []
        need = offer.bytes_estimate
        limit = self.ctx.cfg.memory_limit
        if limit and need > limit:
            problems.append(
                f"{node} accepts at most {limit / 2**30:.2f} GiB per migration (memory_limit); "
                f"this one needs {need / 2**30:.2f} GiB"
            )
        try:
            Criu(self.ctx.snapshot_config.criu).check()
        except SnapshotError as e:
            problems.append(f"{node}: {e}")
        need = len(offer.gpu_uuids)
        if need > len(ours):
            problems.append(f"{node} has {len(ours)} GPU(s); the process uses {need}")
        elif absent := [u for u in offer.target_gpus if u not in {g.uuid for g in ours}]:
            listed = "nvidia-smi -L lists them" if ours else "NVML lists none there"
            problems.append(f"{absent[0]}, named for the copy, is not a GPU of {node} ({listed})")
        elif offer.target_gpus and len(left := self._usable(offer, ours)) < need:
            taken = len(offer.target_gpus) - len(left)
            problems.append(
                f"the move names {len(offer.target_gpus)} GPU(s) of {node}"
                + (f", {taken} of them taken by the copies it is receiving" if taken else "")
                + f"; the process uses {need}"
            )
        problems += self._shared_files(offer)
        problems += sockets.unusable_here(node, list(offer.tcp)[:10_000])
        problems += self._abstract_sockets(offer)
        return problems

    def _shared_files(self, offer: Offer) -> list[str]:
        node = self.ctx.cfg.node
        problems = []
        for entry in list(offer.shared_files)[:10_000]:
            path, _, size = entry.rpartition(":")
            try:
                have = Path(path).stat().st_size
            except (OSError, ValueError):
                problems.append(f"{path} (on a shared path) is missing on {node}")
                continue
            # (a file the process writes grows as it runs: its size at the check says nothing;
            # CRIU holds it against the size at the freeze when it restores)
            if size != "*" and str(have) != size:
                problems.append(f"{path} is {have} bytes on {node} but {size} on the source")
        return problems

    def _abstract_sockets(self, offer: Offer) -> list[str]:
        """The abstract names the copy would bind that are bound here, or that a copy this node
        receives will bind (called with the reservations' lock held)."""
        node = self.ctx.cfg.node
        # (a name is "@" and at most 107 bytes, escaped where not UTF-8; each NUL of it printed as "@")
        names = {n for n in offer.abstract_sockets if n.startswith("@") and len(n) <= 4 * 107 + 1}
        coming = {n for r in self.reservations.in_flight().values() for n in r.abstract}
        taken = set(sockets.abstract_taken(names))
        problems = []
        for name in sorted(taken | (names & coming)):
            why = ""
            if name.startswith("@cuda-uvmfd-"):
                why = (
                    " (the CUDA driver's, named after the process's PID namespace and PID: a CUDA process moved "
                    "there from another node may hold the same)"
                )
            held = f"is bound on {node} already" if name in taken else f"is to be bound on {node} by a copy it receives"
            problems.append(
                f"the abstract unix socket {ascii(name)[1:-1]} {held}{why}, so the copy could not bind it there: "
                "pick another node, or end what holds it there"
            )
        return problems

    def gpu_map(self, offer: Offer, ours: list[gpus.GpuInfo]) -> dict[str, str]:
        """Each source GPU onto one of ``ours`` the offer may use: the one at its PCI bus id if any, else
        the emptiest; one that a copy received meanwhile is placed on last (with the reservations' lock held)."""
        uuids = list(offer.gpu_uuids)
        old = list(zip(uuids, [*offer.gpu_bus_ids, *[""] * len(uuids)], strict=False))
        return gpus.pair(old, self._usable(offer, ours), self._coming())

    def _coming(self) -> set[str]:
        """The GPUs the copies this node receives are placed on (with the reservations' lock held)."""
        return {g for r in self.reservations.in_flight().values() for g in r.gpus}

    def _usable(self, offer: Offer, ours: list[gpus.GpuInfo]) -> list[gpus.GpuInfo]:
        """Those of ``ours`` the offer's copy may be placed on: those it names (:attr:`Offer.target_gpus`)
        that no copy received meanwhile is placed on; none named: all."""
        if not offer.target_gpus:
            return ours
        coming = self._coming()
        return [g for g in ours if g.uuid in offer.target_gpus and g.uuid not in coming]
