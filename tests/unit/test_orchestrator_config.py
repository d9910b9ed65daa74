"""The orchestrator's configuration: the file, then TPAGENT_ORCHESTRATOR_* variables; bad values
are one sentence."""

from __future__ import annotations

from pathlib import Path

import pytest

from host.api import UsageError
from tpagent.orchestrator.config import load


def write(tmp: Path, text: str) -> Path:
    f = tmp / "orchestrator.toml"
    f.write_text('secret_file = "/etc/tpagent/secret"\n' + text)
    return f


def test_the_file_then_the_environment(tmp_path: Path) -> None:
    f = write(tmp_path, 'dedicated_spares = ["d", "e/GPU-1"]\nretries = 3\n[return_home_jobs]\njob1 = false\n')
    cfg = load(f, env={"TPAGENT_ORCHESTRATOR_RETRIES": "1", "TPAGENT_ORCHESTRATOR_RETURN_HOME": "no"})
    assert cfg.retries == 1 and cfg.return_home is False
    assert cfg.dedicated() == {"d": frozenset(), "e": frozenset({"GPU-1"})}
    assert cfg.returns_home("job1") is False and cfg.returns_home("job2") is False
    assert load(f, env={}).returns_home("job2") is True


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("return_home = 3\n", "give true or false"),
        ('webhook_listen = "0.0.0.0:7412"\n', "needs webhook_token_file"),
        ("max_parallel = 0\n", "max_parallel must be 1 to 1000"),
        ("report_period = 60.0\n", "shorter than unreachable_after"),
        ("lost_grace = -1\n", "lost_grace must be 0 (never) to 3600 seconds"),
        ("quiet_after = -2\n", "quiet_after must be 0 (never) to 3600 seconds"),
        ('listen = "nowhere"\n', "give HOST:PORT"),
        ("colour = 1\n", "unknown setting(s) in the configuration: colour"),
        ("[return_home_jobs]\njob1 = 2\n", "a table of job = true/false"),
        ("retries = [\n", "not valid TOML"),
    ],
)
def test_bad_settings_are_one_sentence(tmp_path: Path, text: str, says: str) -> None:
    with pytest.raises(UsageError, match=says.replace("(", r"\(").replace(")", r"\)")):
        load(write(tmp_path, text), env={})
