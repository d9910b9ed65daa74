"""What a rewire (:mod:`tpagent.jobs.rewire`) is made of: asking a job's ranks at once, each
moving rank's migration, and the checks of the ranks' answers that keep a rank from moving."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed

from tpagent.jobs.api import Ask, Moving, RewireFailed
from tpagent.migration.api import AgentError, Event, MigrationResult, Refused, Why
from tpagent_rank import protocol as P

log = logging.getLogger(__name__)

#: One rank's answer, or the AgentError its agent gave instead.
Reply = P.Answer | AgentError
NONE_ANSWERED = "no rank of the job answered (was it ended?)"


def each(request: P.Request[P.Answer]) -> Callable[[int], P.Request[P.Answer]]:
    """The same request of every rank."""
    return lambda _rank: request


class Asking:
    """The ranks of ``job``, asked through their agents (``ask``), all at once."""

    def __init__(self, job: str, ask: Ask, timeout: float, key: str = "", by: str = "") -> None:
        self.job = job
        self.ask = ask
        self.timeout = timeout
        self.key = key  # the job's identity (RewireRecord.key): every rank asked must have it
        self.by = by  # the move asking (its id), named in what stops a rank or lets it go on (P.MOVER_OPS)

    def all(
        self,
        agents: list[str],
        request: Callable[[int], P.Request[P.Answer]],
        timeout: float,
        only: list[int] | None = None,
        until_one_fails: bool = False,
    ) -> dict[int, Reply]:
        """Ask every rank (``agents[rank]`` is its agent; or ``only`` these) at once; rank -> its
        answer, or the AgentError it gave.  ``until_one_fails``: only until a rank fails (the
        others' answers then are not waited for)."""
        ranks = list(range(len(agents))) if only is None else only

        def one(r: int) -> Reply:
            try:
                asked = request(r)
                if asked.OP in P.MOVER_OPS:
                    asked = dataclasses.replace(asked, by=self.by)  # type: ignore[call-arg]
                return self.ask(agents[r], self.job, r, asked, timeout, self.key)
            except AgentError as e:
                return e
            except Exception as e:  # (a bug, or a value no wire carries: this rank failed, the others go on)
                log.exception("asking rank %d of job %s failed", r, self.job)
                return Refused(f"{type(e).__name__}: {e}", Why.INTERNAL)

        out: dict[int, Reply] = {}
        if not ranks:
            return out
        pool = ThreadPoolExecutor(max_workers=min(64, len(ranks)))
        asked = {pool.submit(one, r): r for r in ranks}
        try:
            for done in as_completed(asked):
                answer = done.result()
                out[asked[done]] = answer
                if until_one_fails and (isinstance(answer, AgentError) or not answer.ok):
                    break
        finally:
            pool.shutdown(wait=not until_one_fails, cancel_futures=True)
        return out

    def end(
        self,
        agents: list[str],
        why: str,
        timeout: float,
        ending: Callable[[int], P.Request[P.Answer]] | None = None,
        only: list[int] | None = None,
        then: float | None = None,
    ) -> dict[int, Reply]:
        """The job cannot go on: every rank that still answers (or ``only`` these) is told ``why``
        first, within ``timeout`` (one let go for a freeze is waited for as it reconnects), then
        each is ended with ``ending`` (default: End with ``why``) within ``then`` (default:
        ``timeout``), so that none ends (and takes the others down with its launcher, the store's
        node) before all have heard why.  The answers to the ending."""
        self.all(agents, each(P.End(why=why, hold=True)), timeout, only=only)
        return self.all(agents, ending or each(P.End(why=why)), timeout if then is None else then, only=only)

    def where(self, agents: list[str], why: str = "") -> dict[int, P.Standing]:
        """Where every rank stands; RewireFailed (with ``why`` after) if any cannot say."""
        answers = self.all(agents, each(P.Where()), self.timeout)
        bad = fails(answers, "say where it stands")
        if bad:
            raise RewireFailed("; ".join(bad) + why)
        return {r: a for r, a in answers.items() if isinstance(a, P.Standing)}


class Verdict:
    """Whether a moving rank's copy, held on its target, is kept (True) or dropped (False); None
    until decided.  Decided once: the first word stands."""

    def __init__(self) -> None:
        self.keep: bool | None = None

    def __call__(self) -> bool | None:
        return self.keep

    def decide(self, keep: bool) -> None:
        if self.keep is None:
            self.keep = keep


class Move:
    """One rank's migration, run in a thread of its own, its events passed on to ``events`` (the
    rewire's).  Once its copy runs on the target (held there for the rewire's word), ``verdict``
    keeps or drops it."""

    def __init__(self, m: Moving, verdict: Verdict, events: Callable[[Event], None]) -> None:
        self.m = m
        self.verdict = verdict
        self.on_event = events
        self.ran = threading.Thread(target=m.run, name=f"migrate-{m.pid}", daemon=True)
        self.passed = threading.Thread(target=self._pass_on, name=f"events-{m.pid}", daemon=True)
        self.ran.start()
        self.passed.start()

    def _pass_on(self) -> None:
        while (event := self.m.events.get()) is not None:
            self.on_event(event)

    def wait_running(self) -> bool:
        """Wait until the copy runs on the target (True), or the migration ended without (False)."""
        while not self.m.copy_runs.wait(0.1):
            if not self.ran.is_alive():
                return self.m.copy_runs.is_set()
        return True

    def decide(self, keep: bool) -> None:
        self.verdict.decide(keep)

    def result(self, timeout: float | None = None) -> MigrationResult | None:
        """How it ended (None: it has not, ``timeout`` seconds on)."""
        self.ran.join(timeout)
        if self.ran.is_alive():
            return None
        self.passed.join()
        assert self.m.result is not None
        return self.m.result


def fails(answers: Mapping[int, Reply], what: str) -> list[str]:
    """Each rank that could not do ``what``, and why, in a clause."""
    out = []
    for r, a in sorted(answers.items()):
        if isinstance(a, AgentError):
            out.append(f"rank {r} could not {what} ({str(a).rstrip('.')})")
        elif not a.ok:
            out.append(f"rank {r} could not {what} ({(a.error or 'no reason given').rstrip('.')})")
    return out


def then(answers: Mapping[int, Reply], others: str, none: str = NONE_ANSWERED) -> str:
    """What becomes of the job once some ranks failed: ``others``, or ``none`` where no rank answered
    (each an error of its agent's: a rank that said no, or did not reach a step in time, runs on)."""
    return none if answers and all(isinstance(a, AgentError) for a in answers.values()) else others


def cannot_move(ranks: list[int], where: Mapping[int, P.Standing], image: bool = True) -> list[str]:
    """Why the moving ``ranks`` cannot move, from where each stands (empty: nothing keeps them);
    ``image``: their process images move (not only their training state)."""
    out = [_hosts_store(r, where[r].hosts_store) for r in ranks if where[r].hosts_store]
    out += [
        f"rank {r} reaches the job's store at a loopback address ({where[r].store_loopback}), which "
        "another node would not reach: start the job with an address every node reaches"
        for r in ranks
        if where[r].store_loopback
    ]
    out += [
        f"rank {r} runs NCCL's RAS thread (NCCL_RAS_ENABLE is on in its environment), which listens "
        "on this node's address for the life of the process, past every communicator: it cannot move "
        "(start the job without NCCL_RAS_ENABLE: tpagent rank turns RAS off where it is not set)"
        for r in ranks
        if where[r].nccl_ras and image
    ]
    return out


def _hosts_store(rank: int, address: str) -> str:
    return (
        f"rank {rank} serves the job's store ({address}) itself, and its peers reach it at this node's "
        "address: it cannot move (its stand-in serves the store in its place where it can: MASTER_ADDR "
        "and MASTER_PORT in its environment, and a Python command; what it said as it started tells why "
        "not)"
    )


def nccl_strangers(seen: Mapping[int, Reply]) -> list[str]:
    """Ranks whose NCCL holds one host identity (read once per process: NVIDIA/nccl issue 2348)
    but that run on different hosts now: NCCL would take them for neighbours, and join them
    through shared memory or GPU peer access, which cannot reach across hosts."""
    hosts: dict[str, dict[str, list[int]]] = {}  # NCCL's identity -> the host now -> ranks
    for r, a in sorted(seen.items()):
        if isinstance(a, P.Standing) and a.nccl_host:
            hosts.setdefault(a.nccl_host, {}).setdefault(a.host, []).append(r)
    out = []
    for split in hosts.values():
        if len(split) > 1:
            where = "; ".join(f"rank(s) {', '.join(map(str, rs))} on host {h.split('|')[0]}" for h, rs in split.items())
            out.append(
                f"NCCL in {where} holds one host identity (read once per process: NVIDIA/nccl issue "
                "2348) and would take them for neighbours across hosts: move such ranks together"
            )
    return out
