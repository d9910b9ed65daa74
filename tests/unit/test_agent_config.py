"""tpagent.common.config.load: the TOML file, then TPAGENT_* variables, then flags; bad input is UsageError."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from host.api import UsageError
from tpagent.common import config


@pytest.fixture
def toml(tmp_path: Path) -> Path:
    path = tmp_path / "agent.toml"
    path.write_text('secret_file = "/etc/tpagent/secret"\nstreams = 2\nshared_paths = ["/shared", "/data"]\n')
    return path


def test_the_file_is_read_with_its_types(toml: Path) -> None:
    cfg = config.load(toml, env={})
    assert cfg.secret_file == Path("/etc/tpagent/secret")
    assert (cfg.streams, cfg.shared_paths) == (2, ("/shared", "/data"))
    assert cfg.listen == "0.0.0.0:7400"  # (the default, for a key the file leaves out)


def test_the_environment_overrides_the_file_and_flags_override_both(toml: Path) -> None:
    env = {"TPAGENT_STREAMS": "8", "TPAGENT_SHARED_PATHS": " /a, /b ,,", "TPAGENT_IO_TIMEOUT": "12.5"}
    cfg = config.load(toml, env=env)
    assert (cfg.streams, cfg.shared_paths, cfg.io_timeout) == (8, ("/a", "/b"), 12.5)
    assert config.load(toml, env=env, streams=16, io_timeout=None).streams == 16
    assert config.load(toml, env=env, io_timeout=None).io_timeout == 12.5  # (a flag not given changes nothing)


def test_tpagent_config_names_the_file(toml: Path) -> None:
    assert config.load(env={"TPAGENT_CONFIG": str(toml)}).streams == 2


def test_a_relative_work_dir_is_made_absolute(toml: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert config.load(toml, env={"TPAGENT_WORK_DIR": "state"}).work_dir == tmp_path / "state"


def test_an_unknown_setting_is_refused_by_name(toml: Path) -> None:
    toml.write_text(toml.read_text() + "stream = 4\nlisten_port = 1\n")
    with pytest.raises(UsageError, match=r"unknown setting\(s\) in the configuration: listen_port, stream\."):
        config.load(toml, env={})


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("TPAGENT_STREAMS", "many"),
        ("TPAGENT_TRANSFER_PORT", "7400/tcp"),
        ("TPAGENT_HOLD_TIMEOUT", "1h"),
        # (each was read as a number: 3, 80, 15, 1000, 7)
        ("TPAGENT_MEMORY_LIMIT", "٣"),
        ("TPAGENT_TRANSFER_PORT", "٨٠"),
        ("TPAGENT_IO_TIMEOUT", "١٥"),
        ("TPAGENT_ECC_RISE", "1_000"),
        ("TPAGENT_MAX_INCOMING", " 7 "),
        ("TPAGENT_STREAMS", "2.5"),
    ],
)
def test_a_bad_value_is_refused_in_one_sentence(toml: Path, name: str, value: str) -> None:
    key = name.removeprefix("TPAGENT_").lower()
    with pytest.raises(UsageError, match=f"the setting {key} = '{value}' is not valid"):
        config.load(toml, env={name: value})


@pytest.mark.parametrize("value", ["-1", "0"])
def test_a_timeout_that_is_no_positive_number_is_refused(toml: Path, value: str) -> None:
    with pytest.raises(UsageError, match="the timeouts do not fit together: io_timeout .* must be a positive number"):
        config.load(toml, env={"TPAGENT_IO_TIMEOUT": value})


def test_timeouts_that_contradict_each_other_are_refused(toml: Path) -> None:
    with pytest.raises(UsageError, match=r"io_timeout \(30 s\) must be shorter than hold_timeout \(10 s\)"):
        config.load(toml, env={"TPAGENT_HOLD_TIMEOUT": "10"})


def test_no_secret_file_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    with pytest.raises(
        UsageError, match="no cluster secret: set secret_file in the configuration or TPAGENT_SECRET_FILE"
    ):
        config.load(empty, env={})
    assert config.load(empty, env={"TPAGENT_SECRET_FILE": "/s"}).secret_file == Path("/s")


def test_an_unreadable_or_invalid_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="cannot read the configuration .*missing.toml"):
        config.load(tmp_path / "missing.toml", env={})
    bad = tmp_path / "bad.toml"
    bad.write_text("streams = = 4\n")
    with pytest.raises(UsageError, match="is not valid TOML"):
        config.load(bad, env={})
    bad.write_bytes(b"\xff\xfe = 1\n")
    with pytest.raises(UsageError, match="is not valid TOML"):
        config.load(bad, env={})
    bad.write_bytes(b"#" * (config.CONFIG_MAX + 1))
    with pytest.raises(UsageError, match="is larger than 1 MiB"):
        config.load(bad, env={})
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)  # (its open waited for a writer; /dev/zero, read for ever)
    with pytest.raises(UsageError, match="fifo.toml is not a regular file"):
        config.load(fifo, env={})


@pytest.mark.parametrize("orchestrator", ["localhost", "10.0.0.1:99999", ":7410"])
def test_an_orchestrator_that_is_no_host_port_is_refused(tmp_path: Path, orchestrator: str) -> None:
    """(Its reports would have gone to port 443, or 99999 wrapped.)"""
    with pytest.raises(UsageError, match=f"the setting orchestrator = '{orchestrator}' is not valid: give HOST:PORT"):
        config.load(None, env={"TPAGENT_SECRET_FILE": str(tmp_path / "s"), "TPAGENT_ORCHESTRATOR": orchestrator})


@pytest.mark.parametrize(
    "text",
    ['listen = "[::]:7400"', 'listen = "[fd00::1]:7400"', 'metrics_listen = ":9400"', 'advertise = "[fd00::17]"',
     'node = "gpu-node-17.example.org"', "streams = 64", "transfer_port = 0", "hold_timeout = 2e6"],
)  # fmt: skip
def test_a_setting_at_its_bounds_or_of_every_form_is_taken(toml: Path, text: str) -> None:
    """(Every interface of an HTTP listener is ":PORT", as it always was; IPv6 in brackets.)"""
    toml.write_text(toml.read_text().replace("streams = 2\n", "") + text + "\n")
    key, _, value = text.partition(" = ")
    assert str(getattr(config.load(toml, env={}), key)) == value.strip('"').replace("2e6", "2000000.0")


@pytest.mark.parametrize(
    ("text", "says"),
    [
        # numbers that are none, or past what any wait takes (each once started the agent, or was
        # "unexpected error")
        ("io_timeout = nan", "io_timeout = 'nan' is not valid (give a number of seconds up to 2e+06)"),
        ("rewire_timeout = inf", "rewire_timeout = 'inf' is not valid"),
        ("hold_timeout = 1e300", "hold_timeout = '1e+300' is not valid"),
        ("io_timeout = 3000000", "io_timeout = '3000000' is not valid"),  # (TLS's poll takes ms in a C int)
        ("streams = true", "streams = 'True' is not valid (give a number)"),
        ("streams = 2.5", "streams = '2.5' is not valid (give a whole number)"),
        ("memory_limit = 1" + "0" * 5000, "not valid TOML: a number in it has thousands of digits"),
        # counts and sizes out of their range
        ("streams = -3", "streams = -3 is not valid: give 1 to 64 connections"),
        ("streams = 100000", "streams = 100000 is not valid: give 1 to 64"),
        ("transfer_port = 70000", "transfer_port = 70000 is not valid: give 0 to 65535"),
        ("max_incoming = -2", "max_incoming = -2 is not valid: give 0 to 4096 migrations (0: no limit)"),
        ("memory_limit = -1", "memory_limit = -1 is not valid: give 0 to"),
        ("ghost_limit_mib = -1", "ghost_limit_mib = -1 is not valid"),
        ("stream_buffer_mib = -5", "stream_buffer_mib = -5 is not valid"),
        ("ecc_rise = 0", "ecc_rise = 0 is not valid: give 1 to"),
        ("temperature_c = 100000", "temperature_c = 100000 is not valid: give 0 to 150 degrees C"),
        ('compress = "bogus"', "compress = 'bogus' is not valid: choose one of auto, zstd, none"),
        # addresses gRPC cannot listen on or peers cannot reach, names no node has
        ('listen = "127.0.0.1:0"', "listen = '127.0.0.1:0' is not valid: give HOST:PORT, the port 1 to 65535"),
        ('listen = ":7400"', "listen = ':7400' is not valid"),
        ('listen = "127.0.0.1:' + "9" * 5000 + '"', "listen = '127.0.0.1:9999"),  # (was "unexpected error")
        ('health_listen = "x"', "health_listen = 'x' is not valid"),
        ('metrics_listen = "127.0.0.1:99999"', "metrics_listen = '127.0.0.1:99999' is not valid"),
        ('transfer_address = "10.0.0.1"', "transfer_address = '10.0.0.1' is not valid"),
        ('node = ""', "node = '' is not valid: give a host name"),
        # lists of what is no name or path (each was taken as it came: "{'a': 1}" a path)
        ('aliases = ["a b", ""]', "aliases = ['a b'] is not valid: give host names"),
        ("shared_paths = [1, {a=1}]", "shared_paths = \"[1, {'a': 1}]\" is not valid (give a list of text)"),
        ('shared_paths = ["data"]', "shared_paths = ['data'] is not valid: give absolute paths"),
        ('allow_executables = ["python3", ""]', "allow_executables = ['python3'] is not valid: give absolute"),
        ("x = " + "[" * 1000 + "]" * 1000, "is not one tpagent reads: its values nest too deep"),  # (was "unexpected")
        ('rank_socket = "a\\u0000b"', "rank_socket = 'a\\x00b' is not valid: at most 100 characters, no NUL"),
        ('node = "n\\u001b[2J"', "node = 'n\\x1b[2J' is not valid: give a host name"),
        ('advertise = "a b"', "advertise = 'a b' is not valid: give a host name"),
        ('advertise = "10.0.0.17:7400"', "advertise = '10.0.0.17:7400' is not valid: give a host name"),
        ('listen = "h:7400:9"', "listen = 'h:7400:9' is not valid"),
        ('allow_executables = ["/x\\u0000"]', "allow_executables = ['/x\\x00'] is not valid: give absolute paths"),
        # two servers on one port (the second gRPC server shared it: it took half the agent's calls)
        ('health_listen = "127.0.0.1:7400"', "the settings listen and health_listen both name port 7400: give each"),
        ('metrics_listen = ":7400"', "the settings listen and metrics_listen both name port 7400"),
        ("transfer_port = 7400", "the settings transfer_port and listen both name port 7400"),
    ],
)
def test_a_setting_out_of_its_range_is_refused_by_name(toml: Path, text: str, says: str) -> None:
    key = text.partition(" = ")[0]
    kept = [line for line in toml.read_text().splitlines() if line.partition(" = ")[0] not in (key, "streams")]
    toml.write_text("\n".join([*kept, text]) + "\n")
    with pytest.raises(UsageError, match=re.escape(says)):
        config.load(toml, env={})


@pytest.mark.parametrize(
    ("listen", "health", "overlap"),
    [
        ("127.0.0.1:7400", "[::0]:7400", True),  # (every interface, spelt another way: was taken as a host)
        ("[::1]:7400", "[0:0::1]:7400", True),  # (one address, two spellings)
        ("Node-A:7400", "node-a:7400", True),
        ("127.0.0.1:7400", "127.0.0.2:7400", False),
        ("127.0.0.1:7400", "[::0]:7401", False),
    ],
)
def test_two_servers_on_one_port_of_one_host_are_refused_however_the_host_is_spelt(
    toml: Path, listen: str, health: str, overlap: bool
) -> None:
    toml.write_text(toml.read_text() + f'listen = "{listen}"\nhealth_listen = "{health}"\n')
    if overlap:
        with pytest.raises(UsageError, match="the settings listen and health_listen both name port 7400"):
            config.load(toml, env={})
    else:
        assert config.load(toml, env={}).health_listen == health
