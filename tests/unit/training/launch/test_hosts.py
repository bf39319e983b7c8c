"""One host's part in a multi-host job: its rendezvous arguments, its network; the batch share."""


import pytest

from training.config import Workers
from training.launch.host_role import (
    HostNetworkError,
    HostRole,
    interface_of,
    route_source,
)


def test_node_rank_decides_the_ranks_and_who_hosts_the_store() -> None:
    leader, follower = HostRole(2, 0, "10.0.0.1:29400"), HostRole(2, 1, "10.0.0.1:29400")
    assert leader.leads and not follower.leads
    args = follower.torchrun_args()
    # static rendezvous: node r runs ranks r·nproc…, and node 0 hosts the store
    assert {"--nnodes=2", "--node-rank=1", "--rdzv-backend=static", "--rdzv-endpoint=10.0.0.1:29400"} <= set(args)
    assert "--rdzv-conf=timeout=300" in args


@pytest.mark.parametrize(
    ("role", "message"),
    [
        (lambda: HostRole(2, 2, "h:1"), "--node-rank: must be in 0..1"),
        (lambda: HostRole(0, 0, "h:1"), "--nnodes: must be at least 1"),
        (lambda: HostRole(2, 0, "h"), "--rdzv-endpoint: expected HOST:PORT"),
        (lambda: HostRole(2, 0, "h:99999"), "--rdzv-endpoint: expected HOST:PORT"),
    ],
)
def test_impossible_roles_are_named(role, message: str) -> None:
    with pytest.raises(HostNetworkError, match=message):
        role()


def test_the_address_and_interface_are_those_that_reach_the_endpoint() -> None:
    assert route_source("127.0.0.1:29400") == "127.0.0.1"
    assert interface_of("127.0.0.1") == "lo"
    resolved = HostRole(2, 0, "127.0.0.1:29400").resolved()
    assert (resolved.local_addr, resolved.socket_ifname) == ("127.0.0.1", "lo")
    assert resolved.environment() == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    assert "--local-addr=127.0.0.1" in resolved.torchrun_args()
    given = HostRole(2, 1, "127.0.0.1:29400", "192.0.2.7", "eth9").resolved()
    assert (given.local_addr, given.socket_ifname) == ("192.0.2.7", "eth9"), "what the user sets is kept"


def test_an_address_no_interface_holds_is_a_clear_error() -> None:
    with pytest.raises(HostNetworkError, match="no network interface holds 192.0.2.123"):
        interface_of("192.0.2.123")


def test_the_batch_is_shared_by_every_process_of_every_host() -> None:
    assert Workers(2).per_rank_batch(256) == 128 and Workers(2, hosts=2).per_rank_batch(256) == 64
    with pytest.raises(ValueError, match=r"not a multiple of the world size 6 \(3 hosts × 2 processes\)"):
        Workers(2, hosts=3).per_rank_batch(256)
