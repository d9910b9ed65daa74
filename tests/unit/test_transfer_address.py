"""A transfer's HOST:PORT (`tpagent send`, `receive --listen`, an agent's transfer address), as
:func:`transfer.api.parse_address` reads it before anything is asked of the network."""

from __future__ import annotations

import pytest

from transfer.api import BadAddress, parse_address

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("address", "parsed"),
    [
        ("[::1]:7411", ("::1", 7411)),
        ("gpu-node-17.example.org:7411", ("gpu-node-17.example.org", 7411)),
        ("10.0.0.17:1", ("10.0.0.17", 1)),
        (":0", ("0.0.0.0", 0)),
    ],
)
def test_an_address_is_its_host_and_port(address: str, parsed: tuple[str, int]) -> None:
    assert parse_address(address) == parsed


@pytest.mark.parametrize(
    "address", ["bad host:7411", "h\nx:7411", "[::1:7411", "h]:7411", "\udcff:7411", "\tnode:7411"]
)
def test_a_host_the_resolver_cannot_hold_is_refused_before_it_is_asked(address: str) -> None:
    """Each was asked of the resolver, failed as "Name or service not known", and was asked again
    as a network failure would be, six times over 5.7 s, before `send` gave up."""
    with pytest.raises(BadAddress, match="names no host: a host name is text DNS can hold"):
        parse_address(address)


@pytest.mark.parametrize(
    ("host", "written"),
    [("fd00::17", "[fd00::17]:7411"), ("[fd00::17]", "[fd00::17]:7411"), ("node-17", "node-17:7411")],
)
def test_an_address_a_node_gives_out_brackets_an_ipv6_host_once(host: str, written: str) -> None:
    """A target's transfer address was its advertised host, bracketed as the settings write an IPv6
    one, bracketed again: "[[fd00::17]]:PORT", which no sender can dial (every move there failed)."""
    from host.sockets import endpoint

    assert endpoint(host, 7411) == written
    assert parse_address(endpoint(host, 7411)) == (host.strip("[]"), 7411)
