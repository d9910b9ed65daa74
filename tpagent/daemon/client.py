"""The :class:`tpagent.migration.api.Peer` of another agent, over its gRPC API (mutual TLS, every
call signed: :mod:`tpagent.daemon.rpc`).  A status code becomes :class:`~tpagent.migration.api.Refused`
(the peer answered no) or :class:`~tpagent.migration.api.PeerUnreachable` (no answer)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import grpc

from tpagent.common.credentials import Credentials
from tpagent.daemon import rankwire
from tpagent.daemon.rpc import CODES, pb, stub
from tpagent.migration.api import Acceptance, Offer, Peer, PeerStatus, PeerUnreachable, Refused, Restored, Versions, Why
from tpagent_rank import protocol as P

R = TypeVar("R")
A = TypeVar("A", bound=P.Answer)
_WHY = {code: why for why, code in CODES.items()}
#: What a peer that cannot be reached at all looks like.
UNREACHABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


def broke(e: grpc.RpcError) -> bool:
    """Whether a call ended because its connection did (the agent died mid-call): UNAVAILABLE, or
    the UNKNOWN "Stream removed" some gRPC versions say for the same (grpc/grpc#34076)."""
    return e.code() is grpc.StatusCode.UNAVAILABLE or rpc_text(e).startswith("Stream removed")


def rpc_text(e: grpc.RpcError) -> str:
    details = e.details() if hasattr(e, "details") else ""
    return str(details or e.code().name.lower())


def unreachable_reason(e: grpc.RpcError) -> str:
    """Why an agent could not be reached, in a few words (gRPC's own text names its resolver,
    addresses and codes: "failed to connect to all addresses; last error: UNKNOWN: ipv4:...:
    Failed to connect to remote host: Connection refused" becomes "connection refused")."""
    if e.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
        return "no answer in time"
    text = rpc_text(e)
    if "CERTIFICATE_VERIFY_FAILED" in text:
        return "its TLS certificate is not one this cluster's CA signed (--tls-dir)"
    if "handshake failed" in text.lower():
        return "the TLS handshake failed: it does not trust this cluster's CA, or speaks no TLS"
    last = text.rsplit(": ", 1)[-1].strip().rstrip(".")
    return (last[:1].lower() + last[1:])[:120] or "unavailable"


class GrpcPeer(Peer):
    def __init__(self, address: str, creds: Credentials) -> None:
        self.address = address
        self._stub = stub(address, creds)

    @staticmethod
    def _call(call: Callable[[], R]) -> R:
        try:
            return call()
        except grpc.RpcError as e:
            if e.code() in UNREACHABLE:
                raise PeerUnreachable(f"unreachable, {unreachable_reason(e)}") from e
            # The peer's sentence becomes a clause of ours ("…: its words; the original was resumed"):
            # without its full stop.
            raise Refused(rpc_text(e).rstrip("."), _WHY.get(e.code(), Why.INTERNAL)) from e

    def receive(self, offer: Offer, timeout: float) -> Acceptance:
        request = pb.ReceiveRequest(
            migration_id=offer.migration_id,
            source_node=offer.source_node,
            source_agent=offer.source_agent,
            bytes_estimate=offer.bytes_estimate,
            gpu_uuids=list(offer.gpu_uuids),
            shared_files=list(offer.shared_files),
            dry_run=offer.dry_run,
            carried_files=list(offer.carried_files),
            tcp=[pb.TcpEndpoint(local=a, remote=b) for a, b in offer.tcp],
            hold=offer.hold,
            gpu_bus_ids=list(offer.gpu_bus_ids),
            abstract_sockets=list(offer.abstract_sockets),
            mounts=list(offer.mounts),
            target_gpus=list(offer.target_gpus),
        )
        r = self._call(lambda: self._stub.Receive(request, timeout=timeout))
        missing = tuple(m for m in r.missing_mounts if m in offer.mounts)  # (never one it was not asked of)
        return Acceptance(r.transfer_address, dict(r.gpu_map), tuple(r.problems), r.reserved, float(r.clock), missing)

    def restore(self, migration_id: str, timeout: float) -> Restored:
        r = self._call(lambda: self._stub.Restore(pb.RestoreRequest(migration_id=migration_id), timeout=timeout))
        return Restored(int(r.pid), dict(r.timings))

    def finish(self, migration_id: str, commit: bool, timeout: float, confirmed: bool = False) -> PeerStatus:
        request = pb.FinishRequest(migration_id=migration_id, commit=commit, confirmed=confirmed)
        return _status(self._call(lambda: self._stub.Finish(request, timeout=timeout)))

    def status(self, migration_id: str, timeout: float) -> PeerStatus:
        return _status(
            self._call(lambda: self._stub.Status(pb.MigrationRef(migration_id=migration_id), timeout=timeout))
        )

    def rank(self, job: str, rank: int, request: P.Request[A], timeout: float, key: str = "") -> A:
        try:
            message = rankwire.request_pb(job, rank, request, timeout, key)
        except ValueError as e:  # (a text protobuf cannot carry, a number past 64 bits: nothing was sent)
            raise Refused(f"the request cannot be sent ({e})", Why.INVALID) from e
        reply = self._call(lambda: self._stub.Rank(message, timeout=timeout + 10))
        return rankwire.answer_of(request, reply)

    def versions(self, timeout: float) -> Versions:
        info = self._call(lambda: self._stub.Info(pb.Empty(), timeout=timeout))
        return Versions(info.agent_version, info.criu_version)


def _status(s: pb.MigrationStatus) -> PeerStatus:
    return PeerStatus(s.migration_id, s.state, s.message, int(s.pid))
