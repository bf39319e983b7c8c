"""One host's part in a multi-host training job: its node rank, the rendezvous, its network.

torchrun's static rendezvous is used: node `r` runs global ranks r·nproc … r·nproc + nproc − 1
(the same ranks, reading the same rows, as one host running every process), and node 0
hosts the rendezvous store at the endpoint. Collectives (gloo, NCCL) pick the address to
advertise from the host name unless told an interface; two hosts that share a name, or
whose name resolves to a loopback address, then cannot reach each other. So each host
advertises, by default, the address and interface that route to the rendezvous endpoint
(on node 0: the endpoint's own address).
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from dataclasses import dataclass

_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


class HostNetworkError(ValueError):
    """A multi-host setting that cannot work; says which and what to do."""


@dataclass(frozen=True)
class HostRole:
    """This host's place in a job of `nnodes` hosts meeting at `endpoint` (HOST:PORT)."""

    nnodes: int
    node_rank: int
    endpoint: str
    local_addr: str = ""  # empty: the address that routes to the endpoint
    socket_ifname: str = ""  # empty: the interface holding that address
    join_timeout_s: int = 300  # how long a host waits for the others at the rendezvous

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise HostNetworkError(f"--nnodes: must be at least 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise HostNetworkError(f"--node-rank: must be in 0..{self.nnodes - 1}, got {self.node_rank}")
        endpoint_host(self.endpoint)  # a clear error for a malformed endpoint

    @property
    def leads(self) -> bool:
        """Node 0: hosts the store, owns the run folder's shared outputs (summary, clean-up)."""
        return self.node_rank == 0

    def resolved(self) -> HostRole:
        """With the address and interface filled in from the route to the endpoint."""
        address = self.local_addr or route_source(self.endpoint)
        return HostRole(self.nnodes, self.node_rank, self.endpoint, address,
                        self.socket_ifname or interface_of(address), self.join_timeout_s)  # fmt: skip

    def torchrun_args(self) -> list[str]:
        return [
            f"--nnodes={self.nnodes}",
            f"--node-rank={self.node_rank}",
            "--rdzv-backend=static",
            f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-conf=timeout={self.join_timeout_s}",
            *([f"--local-addr={self.local_addr}"] if self.local_addr else []),
        ]

    def environment(self) -> dict[str, str]:
        """The interface gloo and NCCL bind to (each reads its own variable)."""
        if not self.socket_ifname:
            return {}
        return {"GLOO_SOCKET_IFNAME": self.socket_ifname, "NCCL_SOCKET_IFNAME": self.socket_ifname}


def endpoint_host(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise HostNetworkError(f"--rdzv-endpoint: expected HOST:PORT (e.g. 10.0.0.1:29400), got {endpoint!r}")
    return host.strip("[]"), int(port)


def route_source(endpoint: str) -> str:
    """The local IPv4 address this host reaches `endpoint` from (its own, if the endpoint is here)."""
    host, port = endpoint_host(endpoint)
    try:
        target = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
    except socket.gaierror as error:
        raise HostNetworkError(f"--rdzv-endpoint: cannot resolve {host!r} ({error.strerror}); "
                               "give node 0's address") from error  # fmt: skip
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((target, port))  # UDP: picks the route, sends nothing
        except OSError as error:
            raise HostNetworkError(f"--rdzv-endpoint: no route to {target} from this host ({error.strerror}); "
                                   "check the network, or set --local-addr") from error  # fmt: skip
        return probe.getsockname()[0]


def interface_of(address: str) -> str:
    """The network interface holding IPv4 `address`."""
    if ipaddress.ip_address(address).is_loopback:
        return "lo"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue  # no IPv4 address on this interface
            if socket.inet_ntoa(answer[20:24]) == address:
                return name
    raise HostNetworkError(f"no network interface holds {address}: set --socket-ifname to the interface "
                           "the hosts reach each other over")  # fmt: skip


def free_local_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the system's pick; another
    process may take it before it is used)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
