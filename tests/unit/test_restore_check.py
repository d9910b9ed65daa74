"""What a restore says when CRIU's post-restore action (snapshot.hook.restored) killed the copy:
a file that is not the one checked by its name, or the check itself failing (said so, and not
blamed on a swapped file)."""

from __future__ import annotations

from host.api import UsageError
from snapshot.api import ToolError
from snapshot.restore import _unchecked


def test_a_stranger_is_named_and_a_failed_check_is_not_taken_for_one() -> None:
    stranger = _unchecked("PID 7 holds /tmp/x/roots")
    assert isinstance(stranger, UsageError)
    assert str(stranger).startswith("PID 7 holds /tmp/x/roots, which is not the file checked by that name")
    failed = _unchecked("the restored tree could not be checked (PermissionError: /proc/7/map_files)")
    assert isinstance(failed, ToolError) and "not the file checked" not in str(failed)
    assert str(failed).endswith("that copy was killed before it ran, and the snapshot is intact")
