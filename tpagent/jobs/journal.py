"""The rewires' journal: one record per rewire, written before each phase takes effect, as the
migrations' journal is (:mod:`tpagent.migration.journal`, whose files it shares the format of).

::

    JOURNAL ::= WORK_DIR "/rewires/" { ID ".json" }          one file per rewire (ID: 32 hex)
    RECORD  ::= JSON object {
                  "format": 1,
                  "rewire_id": ID, "job": STR,
                  "here": HOST ":" PORT,                   the agent that runs it
                  "phase": PHASE,                          tpagent.jobs.api.Phase
                  "message": STR,
                  "agents": [HOST ":" PORT, ...],          rank -> its agent when it began
                  "gen": INT, "step": INT,                 the generation being built; the boundary
                  "unit": "step" | "collective",           what step counts
                  "moving": {RANK: [INIT_PID, TARGET]},    the ranks it moves, from here
                  "moves": {RANK: MIGRATION_ID},           each moving rank's migration, once begun
                  "gpus": [GPU_UUID, ...] }                the targets' GPUs the copies may use ([]: any)

A move is written only if the phases' table (:data:`tpagent.jobs.api.REWIRE_TRANSITIONS`) allows it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tpagent.jobs.api import REWIRE_FINAL, Phase, RewireRecord, phase_allowed
from tpagent.migration.api import BadTransition, JournalError
from tpagent.migration.journal import RecordFiles

log = logging.getLogger(__name__)


def _move(record: RewireRecord, to: Phase, message: str) -> tuple[Phase, str]:
    """Apply ``to`` to ``record`` (BadTransition if the table does not allow it); what it was."""
    if not phase_allowed(record.phase, to):
        raise BadTransition(f"rewire {record.rewire_id}: {record.phase.value} -> {to.value} is not allowed")
    before = (record.phase, record.message)
    record.phase = to
    record.message = message or record.message
    return before


def _over(data: dict[str, Any]) -> bool:
    try:
        return RewireRecord.from_json(data).phase in REWIRE_FINAL
    except (ValueError, KeyError, TypeError):
        return False


class RewireJournal:
    def __init__(self, directory: Path) -> None:
        self.files = RecordFiles(directory, "rewire", create=False)  # (made at the first rewire)

    def move(self, record: RewireRecord, to: Phase, message: str = "") -> None:
        before = _move(record, to, message)
        try:
            self.files.write(record.rewire_id, record.to_json())
        except JournalError:  # (the record in memory says what the journal says: nothing moved)
            record.phase, record.message = before
            raise
        if to in REWIRE_FINAL:
            self.files.prune(_over)

    def read(self, rewire_id: str) -> RewireRecord | None:
        """The record (None: there is none, or ``rewire_id`` is no rewire's id); JournalError if
        it cannot be read."""
        try:
            data = self.files.read(rewire_id)
        except ValueError:  # (not an id)
            return None
        if data is None:
            return None
        try:
            return RewireRecord.from_json(data)
        except (ValueError, KeyError, TypeError) as e:
            raise JournalError(f"the journal of rewire {rewire_id} is damaged: {e}") from e

    def unfinished(self) -> list[RewireRecord]:
        """Every record not yet final; those that cannot be read are logged and left for an operator."""
        out = []
        for rewire_id in self.files.ids():
            try:
                record = self.read(rewire_id)
            except JournalError as e:
                log.error("%s; left for an operator", e)
                continue
            if record is not None and record.phase not in REWIRE_FINAL:
                out.append(record)
        return out


class Unwritten:
    """A dry run's log: the table is checked, nothing is written."""

    def move(self, record: RewireRecord, to: Phase, message: str = "") -> None:
        _move(record, to, message)
