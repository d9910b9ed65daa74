"""A stand-in relays its rank's output in whole lines: the launcher's output is shared with the
node's other ranks, whose lines a piece of one would cut in two (tpagent.jobs.standin)."""

from __future__ import annotations

import io

from tpagent.jobs import standin


def test_only_whole_lines_are_written_and_the_rest_at_the_end() -> None:
    out = io.BytesIO()
    relay = standin._Relay(0, out)
    relay.write(b"rank 2 step 143 loss 1.0\nrank 2 st")
    assert out.getvalue() == b"rank 2 step 143 loss 1.0\n"
    other = b"rank 3 step 9 loss 2.0\n"  # (another rank's line, written meanwhile)
    out.write(other)
    relay.write(b"ep 144 loss 0.9\n")
    assert out.getvalue().splitlines()[-1] == b"rank 2 step 144 loss 0.9"
    relay.write(b"no end")
    assert not out.getvalue().endswith(b"no end")
    relay.write(b"", final=True)
    assert out.getvalue().endswith(b"\nno end") and relay.offset == 56


def test_output_that_is_not_lines_is_not_held_back_for_ever() -> None:
    out = io.BytesIO()
    relay = standin._Relay(0, out)
    relay.write(b"x" * (standin.LINE_HELD_MAX + 1))
    assert len(out.getvalue()) == standin.LINE_HELD_MAX + 1 and relay.held == b""
