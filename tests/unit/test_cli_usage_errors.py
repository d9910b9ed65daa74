"""What typer itself refuses (a missing argument, an unknown option or command, a value out of its
range) is said as every other refusal is: one ``tpagent:`` line, exit 2, and under ``--json`` the
JSON error on stdout.  (It was typer's box of several lines, with no JSON.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from support.helpers import assert_one_sentence_error, tpagent

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("dump",), "missing argument 'pid'. See 'tpagent dump --help'."),
        (("dump", "1", "--bogus"), "no such option: --bogus"),
        (("bogus",), "no such command 'bogus'"),
        # seconds past what a wait takes (inf was taken: CUDA's lock then overflowed its 32 bits)
        (("dump", "1", "--lock-timeout", "inf"), "invalid value for '--lock-timeout'"),
        (("dump", "1", "--lock-timeout", "5000000"), "less than or equal to 2000000"),
        (("restore", "/nowhere", "--pid-wait", "inf"), "invalid value for '--pid-wait'"),
        (("dump", "1", "--ghost-limit-mib", str(1 << 40)), "invalid value for '--ghost-limit-mib'"),
        # (int() reads "1_000" as 1000 and " 5" as 5: another process than the one meant)
        (("dump", "1_000", "--out", "/nowhere"), "'1_000' is not a PID (digits, as ps writes it)"),
        (("dump", " 5", "--out", "/nowhere"), "' 5' is not a PID"),
        (("migrate", str(1 << 23), "--to", "a:1"), f"{1 << 23} is not a PID (Linux gives none above {1 << 22})"),
        (("doctor", "--pid", "+7"), "'+7' is not a PID"),
    ],
    ids=[
        "missing-argument",
        "unknown-option",
        "unknown-command",
        "lock-inf",
        "lock-past-bound",
        "pid-wait",
        "ghost-limit",
        "pid-underscore",
        "pid-space",
        "pid-past-bound",
        "pid-sign",
    ],
)
def test_a_usage_error_is_one_sentence_and_json_under_json(args: tuple[str, ...], says: str) -> None:
    said = tpagent(*args, "--json")
    assert_one_sentence_error(said, says)
    assert said.returncode == 2
    doc = json.loads(said.stdout)
    assert doc["exit_code"] == 2 and says in doc["error"]


@pytest.mark.parametrize("command", ["cluster", "events"])
def test_a_refusal_before_the_orchestrator_is_called_is_json_under_json(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(cluster and events said "no cluster secret" with no JSON: they refused before --json reached them.)"""
    monkeypatch.delenv("TPAGENT_SECRET_FILE", raising=False)
    said = tpagent(command, "--orchestrator", "127.0.0.1:9", "--json")
    assert_one_sentence_error(said, "no cluster secret")
    assert json.loads(said.stdout)["exit_code"] == said.returncode == 2


def test_no_arguments_show_the_help() -> None:
    said = tpagent()
    assert said.returncode == 0 and "Usage: tpagent" in said.stdout and "dump" in said.stdout


def test_a_launched_commands_own_json_flag_is_not_tpagents(tmp_path: Path) -> None:
    """``tpagent launch ... python train.py --json`` (no ``--``): a refusal is one line, with no
    JSON error on stdout, where a caller reads the workload's PID."""
    said = tpagent("launch", "--stdout", str(tmp_path), sys.executable, "train.py", "--json")
    assert_one_sentence_error(said)
    assert said.stdout == ""


@pytest.mark.parametrize(
    "args",
    [
        ("dump", "1", "--out", ""),
        ("dump", "1", "--out", "x", "--carry", ""),
        ("inspect", ""),
        ("serve", "--work-dir", ""),
        ("serve", "--config", ""),
        ("orchestrator", "--state", ""),
        ("receive", "--listen", "127.0.0.1:0", "--out", ""),
        ("launch", "--stdout", "", "--", "true"),
        ("doctor", "--criu", ""),
    ],
    ids=lambda a: "-".join(x for x in a if x.startswith("--") or x in ("inspect", "dump"))[:40],
)
def test_an_empty_path_is_refused_not_taken_for_the_working_directory(args: tuple[str, ...]) -> None:
    """`--work-dir ""` (an unset variable in a unit file) was ".": the agent made its journals in
    the directory it was started from."""
    said = tpagent(*args)
    assert_one_sentence_error(said, "an empty path names nothing; give a path")
    assert said.returncode == 2


def test_an_empty_path_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TPAGENT_WORK_DIR", "")
    said = tpagent("serve", "--listen", "127.0.0.1:7399", "--secret-file", "/nonexistent")
    assert_one_sentence_error(said, "the setting work_dir = '' is not valid (give a path)")


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"RANK": "9" * 25}, f"RANK={'9' * 25} is not a rank tpagent can move: give 0 to 1048575."),
        (
            {"RANK": "0", "TORCHELASTIC_RUN_ID": "a\x1bb"},
            "the job id 'a\\x1bb' (TPAGENT_JOB or TORCHELASTIC_RUN_ID or SLURM_JOB_ID) is not one tpagent can move",
        ),
    ],
    ids=["rank-past-bound", "job-unprintable"],
)
def test_a_rank_no_agent_could_know_is_not_started(
    env: dict[str, str], says: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank whose number or job id no agent takes ran unmovable, exit 0, its job's escape
    sequence written to the terminal and into its log's name; now refused before it starts."""
    for name in ("TPAGENT_JOB", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    ran = tmp_path / "ran"
    said = tpagent("rank", "--stdout", str(tmp_path / "out"), "--", "touch", str(ran))
    assert_one_sentence_error(said, says)
    assert said.returncode == 2 and not ran.exists() and "\x1b" not in said.stderr
