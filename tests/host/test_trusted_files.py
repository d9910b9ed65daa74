"""Files root reads to decide what it does, or runs, are ones only root can change: a
configuration (it says what root checkpoints and where it writes), the CRIU binary (root runs
it on other users' processes), the cluster CA (whom a node trusts).  One another user can
change, a FIFO, or one behind another user's symlink is refused in one sentence before it is
used: nothing planted is run, obeyed or trusted, and no command waits on a FIFO."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import needs_criu
from host.api import UsageError
from support.certs import node_certs
from support.helpers import ROOT, assert_one_sentence_error, tpagent
from support.users import NOBODY, user_dir
from tpagent.common.credentials import Credentials
from transfer.api import TlsFiles
from transfer.tls import server_context

pytestmark = needs_criu


def test_a_criu_another_user_can_change_is_never_run(tmp_path: Path) -> None:
    with user_dir(NOBODY) as home:
        ran = home / "ran"
        fake = home / "criu"
        fake.write_text(f"#!/bin/sh\ntouch {ran}\necho 'Version: 4.2.1'\n")
        fake.chmod(0o755)
        os.chown(fake, *NOBODY)
        # (its directory is theirs: said of the directory)
        said = f"{home} can be changed by other users (owner UID {NOBODY[0]}, mode 700), so {fake} under it"
        assert f"FAIL  criu           {said}" in tpagent("doctor", "--criu", str(fake)).stdout
        with subprocess.Popen(["sleep", "60"], start_new_session=True) as p:
            try:
                dumped = tpagent("dump", str(p.pid), "--out", str(tmp_path / "snap"), "--criu", str(fake))
                assert_one_sentence_error(dumped, said)
                assert p.poll() is None and Path(f"/proc/{p.pid}/stat").read_text().split()[2] in "SR"
            finally:
                p.kill()
        assert not ran.exists(), "root ran another user's CRIU"
    ours = tmp_path / "criu"  # (root's, in root's directory, but anyone may write it)
    ours.write_text(f"#!/bin/sh\ntouch {tmp_path / 'ran'}\necho 'Version: 4.2.1'\n")
    ours.chmod(0o757)
    said = f"CRIU {ours} can be changed by other users (owner UID 0, mode 757); give a file only root can change."
    assert f"FAIL  criu           {said}" in tpagent("doctor", "--criu", str(ours)).stdout
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("planted", ["theirs", "group-writable", "their-symlink"])
def test_a_configuration_another_user_can_change_is_not_obeyed(tmp_path: Path, planted: str) -> None:
    """Its allow_executables would have had root checkpoint what they chose; its work_dir, write there."""
    with user_dir(NOBODY) as home:
        work = home / "work"
        text = f'work_dir = "{work}"\nallow_executables = ["/bin/sh"]\nsecret_file = "/nonexistent"\n'
        ours = tmp_path / "agent.toml"
        ours.write_text(text)
        given = home / "agent.toml"
        if planted == "theirs":
            given.write_text(text)
            os.chown(given, *NOBODY)
        elif planted == "group-writable":
            given = ours
            given.chmod(0o664)
        else:
            given.symlink_to(ours)
            os.lchown(given, *NOBODY)
        served = tpagent("serve", "--config", str(given), "--listen", "127.0.0.1:0", timeout=60)
        why = "is a symlink owned by UID" if planted == "their-symlink" else "can be changed by other users"
        assert_one_sentence_error(served, why)
        assert not work.exists()


def test_a_cluster_ca_another_user_can_change_or_a_fifo_is_not_trusted(tmp_path: Path) -> None:
    """Whoever can write ca.crt chooses whom the node trusts; a FIFO there left every command
    (serve ignoring SIGTERM) waiting in its open for ever."""
    tls = node_certs(tmp_path, "n1")
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    assert Credentials.load(secret, tls).ca == (tls / "ca.crt").read_bytes()
    os.chown(tls / "ca.crt", *NOBODY)
    for load in (lambda: Credentials.load(secret, tls), lambda: server_context(TlsFiles.in_dir(tls))):
        with pytest.raises(UsageError, match=f"the cluster CA {tls / 'ca.crt'} can be changed by other users"):
            load()
    os.chown(tls / "ca.crt", 0, 0)
    (tls / "tls.crt").chmod(0o666)
    with pytest.raises(UsageError, match="this node's certificate .* can be changed by other users"):
        server_context(TlsFiles.in_dir(tls))
    (tls / "ca.crt").unlink()
    os.mkfifo(tls / "ca.crt")
    code = "import sys; from tpagent.common.credentials import Credentials; from pathlib import Path; "
    code += "Credentials.load(Path(sys.argv[1]), Path(sys.argv[2]))"
    waited = subprocess.run(
        [sys.executable, "-c", code, str(secret), str(tls)], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert "is not a regular file" in waited.stderr and waited.returncode != 0


@pytest.mark.parametrize("broken", ["empty-key", "empty-cert", "not-pem-ca", "another-nodes-key"])
def test_tls_files_grpc_cannot_take_are_refused_in_one_sentence(tmp_path: Path, broken: str) -> None:
    """An empty tls.key or tls.crt aborted the process inside gRPC (SIGABRT, a native stack's
    banner); a CA or key that is no PEM, or a key of another certificate, printed gRPC's log
    lines and then blamed the agent ("cannot be reached").  Now each is one sentence, before
    any channel is made or any file of the agent's written."""
    tls = node_certs(tmp_path, "a")
    other = node_certs(tmp_path, "b")
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    file, text = {
        "empty-key": ("tls.key", b""),
        "empty-cert": ("tls.crt", b""),
        "not-pem-ca": ("ca.crt", b"not a certificate\n"),
        "another-nodes-key": ("tls.key", (other / "tls.key").read_bytes()),
    }[broken]
    (tls / file).write_bytes(text)
    said = "cannot load the cluster CA" if file == "ca.crt" else "cannot load this node's certificate"
    with pytest.raises(UsageError, match=said):
        Credentials.load(secret, tls)
    for args in (("node",), ("status", "--json", "0" * 32)):
        out = tpagent(*args, "--secret-file", str(secret), "--tls-dir", str(tls), "--agent", "127.0.0.1:9")
        assert_one_sentence_error(out, said)
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_a_file_the_kernel_makes_up_is_no_secret_key_or_configuration(tmp_path: Path) -> None:
    """/proc/kmsg passed the checks of a secret (root's, mode 400): the kernel's log was read as
    the cluster secret, and once read empty (its reads do not wait), it ended in an internal
    error.  Files of /proc and /sys are refused, as any file that is not a regular one is."""
    for path in ("/proc/kmsg", "/proc/self/environ"):
        out = tpagent("node", "--secret-file", path, "--agent", "127.0.0.1:9")
        assert_one_sentence_error(out, f"the cluster secret in {path} must be a regular file")
    config = tpagent("orchestrator", "--config", "/proc/cpuinfo")
    assert_one_sentence_error(config, "/proc/cpuinfo is not a regular file")


def test_a_bare_sys_directory_makes_no_file_of_its_filesystem_the_kernels(tmp_path: Path) -> None:
    """Where /sys is not mounted (a container's bare directory of the root filesystem), its
    filesystem is not the kernel's: files beside it are read as they are."""
    (tmp_path / "bare").mkdir()
    config = tmp_path / "agent.toml"
    config.write_text('node = "n"\n')
    code = "import sys; from pathlib import Path; from host.trusted import read_trusted; "
    code += "print(read_trusted(Path(sys.argv[1]), 'the configuration', 100).decode().strip())"
    bare = f'mount --bind "{tmp_path / "bare"}" /sys && exec "$0" "$@"'
    read = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", bare, sys.executable, "-c", code, str(config)],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert (read.returncode, read.stdout.strip()) == (0, 'node = "n"'), read.stderr
