"""The orchestrator's configuration: the file, then TPAGENT_ORCHESTRATOR_* variables; bad values
are one sentence."""

from __future__ import annotations

import re
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
        ('metrics_listen = ":7410"\n', "the settings listen and metrics_listen both name port 7410"),
        ("report_period = 60.0\n", "shorter than unreachable_after"),
        ("lost_grace = -1\n", "lost_grace must be 0 (never) to 3600 seconds"),
        ("quiet_after = -2\n", "quiet_after must be 0 (never) to 3600 seconds"),
        ('listen = "nowhere"\n', "give HOST:PORT"),
        ("colour = 1\n", "unknown setting(s) in the configuration: colour"),
        ("[return_home_jobs]\njob1 = 2\n", "a table of job = true/false"),
        ("retries = [\n", "not valid TOML"),
        # numbers that are none, or past what any wait or count takes (each once started the orchestrator)
        ("move_timeout = nan\n", "move_timeout = 'nan' is not valid (give a number of seconds up to 2e+06)"),
        ("spare_hold_timeout = inf\n", "spare_hold_timeout = 'inf' is not valid"),
        ("unreachable_after = 1e300\n", "unreachable_after = '1e+300' is not valid"),
        ("retries = true\n", "retries = 'True' is not valid (give a number)"),
        ("max_parallel = 2.5\n", "max_parallel = '2.5' is not valid (give a whole number)"),
        ("retries = 1" + "0" * 5000 + "\n", "not valid TOML: a number in it has thousands of digits"),
        ("kubernetes_preempt_below = -1\n", "kubernetes_preempt_below must be 0 (never)"),
        ("slurm_preempt_below = 99999999999\n", "slurm_preempt_below must be 0 (never)"),
        # addresses gRPC cannot listen on, names no node has
        ('listen = "127.0.0.1:0"\n', "listen = '127.0.0.1:0' is not valid: give HOST:PORT, the port 1 to 65535"),
        ('listen = ":7410"\n', "listen = ':7410' is not valid"),
        ('metrics_listen = "127.0.0.1:99999"\n', "metrics_listen = '127.0.0.1:99999' is not valid"),
        ('health_listen = "7401"\n', "health_listen = '7401' is not valid"),
        ('node = ""\n', "node = '' is not valid: give a host name"),
        ('advertise = "a b"\n', "advertise = 'a b' is not valid: give a host name"),
        ('webhook_listen = "[::1]"\n', "webhook_listen = '[::1]' is not valid"),
        # (every alert was refused as naming no node)
        ("alert_node_labels = []\n", "alert_node_labels must name an alert's label"),
        # (taken silently: node "a" and GPU "b/c", node "" and GPU "", no GPU after the slash)
        ('dedicated_spares = ["a/b/c"]\n', "dedicated_spares: 'a/b/c' is not a node's name, nor NODE/GPU-UUID"),
        ('dedicated_spares = ["/"]\n', "dedicated_spares: '/' is not"),
        ('dedicated_spares = ["d/"]\n', "dedicated_spares: 'd/' is not"),
    ],
)
def test_bad_settings_are_one_sentence(tmp_path: Path, text: str, says: str) -> None:
    with pytest.raises(UsageError, match=re.escape(says)):
        load(write(tmp_path, text), env={})


def test_every_interface_of_an_http_listener_is_taken_as_it_always_was(tmp_path: Path) -> None:
    token = tmp_path / "token"
    cfg = load(
        write(tmp_path, f'metrics_listen = ":9410"\nwebhook_listen = ":7412"\nwebhook_token_file = "{token}"\n'), env={}
    )
    assert (cfg.metrics_listen, cfg.webhook_listen) == (":9410", ":7412")
