"""What a process announces is reachable from every node: loopback is recognised, refused in
a run that spans nodes (one line), and a replica on every interface names the node."""

from __future__ import annotations

import pytest

from pipeline.cli.main import build_parser
from pipeline.cli.stages import advertised_address
from workers.ports import (
    SPANS_NODES_ENV,
    LoopbackAddressError,
    check_reachable,
    is_loopback,
    routable_ip,
)


def test_loopback_addresses_are_recognised_in_hosts_and_urls() -> None:
    for address in ("127.0.0.1", "http://127.0.0.1:8000", "localhost", "http://[::1]:80",
                    "http://localhost:9", "127.0.1.1"):  # fmt: skip
        assert is_loopback(address), address
    for address in ("10.0.0.7", "http://10.0.0.7:8000", "node-3.cluster", "0.0.0.0x"):
        assert not is_loopback(address), address


def test_a_loopback_address_is_refused_only_when_the_run_spans_nodes(monkeypatch) -> None:
    monkeypatch.delenv(SPANS_NODES_ENV, raising=False)
    check_reachable("http://127.0.0.1:8000", "the replica's address")  # one node: fine
    monkeypatch.setenv(SPANS_NODES_ENV, "1")
    check_reachable("http://10.0.0.7:8000", "the replica's address")
    with pytest.raises(
        LoopbackAddressError, match=r"weights\.host 127\.0\.0\.1 is a loopback"
    ) as err:
        check_reachable("127.0.0.1", "weights.host")
    assert "\n" not in str(err.value)


def _serve(*argv: str):
    return build_parser().parse_args(["replica", "serve", "--model", "/m", *argv])


def test_a_replica_on_every_interface_announces_the_nodes_address(monkeypatch) -> None:
    monkeypatch.delenv(SPANS_NODES_ENV, raising=False)
    address = advertised_address(_serve("--host", "0.0.0.0", "--port", "8100", "--register"))
    assert address == f"http://{routable_ip()}:8100"
    monkeypatch.setenv(SPANS_NODES_ENV, "1")
    given = _serve("--advertise", "http://10.1.2.3:9", "--register")
    assert advertised_address(given) == "http://10.1.2.3:9"
    with pytest.raises(LoopbackAddressError, match="--advertise"):
        advertised_address(_serve("--advertise", "http://localhost:9", "--register"))
    with pytest.raises(LoopbackAddressError, match="the replica's address"):
        advertised_address(_serve("--port", "8100", "--register"))  # --host 127.0.0.1
    monkeypatch.delenv(SPANS_NODES_ENV)
    assert advertised_address(_serve("--port", "8100", "--register")) == "http://127.0.0.1:8100"
