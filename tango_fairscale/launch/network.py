"""Several hosts: which network interface reaches the other hosts."""

import fcntl
import ipaddress
import socket
import struct
import sys
from typing import Dict, List, Mapping, Optional, Sequence

from tango.common.exceptions import ConfigurationError


def local_address_towards(host: str, port: int) -> str:
    """
    This host's address on the interface that routes to ``host``: the local end of a UDP socket
    connected to it (connecting a UDP socket only picks a route; nothing is sent).
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except socket.gaierror as error:
        raise ConfigurationError(f"Cannot resolve the master address {host!r}: {error}.") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return str(probe.getsockname()[0])


def interface_addresses() -> Dict[str, List[str]]:
    """Each network interface's addresses (Linux: IPv4 by ``SIOCGIFADDR``, IPv6 from ``/proc``)."""
    if not sys.platform.startswith("linux"):
        return {}
    table: Dict[str, List[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address
                continue
            table.setdefault(name, []).append(socket.inet_ntoa(packed[20:24]))
    try:
        with open("/proc/net/if_inet6") as handle:
            for line in handle:
                fields = line.split()
                if len(fields) == 6:
                    table.setdefault(fields[5], []).append(str(ipaddress.IPv6Address(int(fields[0], 16))))
    except OSError:
        pass
    return table


def interface_with_address(address: str, table: Mapping[str, Sequence[str]]) -> Optional[str]:
    """The interface that has ``address``, or ``None``."""
    wanted = ipaddress.ip_address(address.split("%")[0])
    for name, addresses in table.items():
        if any(ipaddress.ip_address(a.split("%")[0]) == wanted for a in addresses):
            return name
    return None


def socket_interface_environment(
    env: Mapping[str, str], local_address: str, table: Mapping[str, Sequence[str]]
) -> Dict[str, str]:
    """
    ``{"GLOO_SOCKET_IFNAME": interface}`` for the interface holding ``local_address`` (the one
    that reaches the master), unless the user set ``GLOO_SOCKET_IFNAME``. Without it gloo binds to
    the address its host name resolves to, which on a host with several interfaces (or in a
    network namespace) may be one the other hosts cannot reach. NCCL's ``NCCL_SOCKET_IFNAME`` is
    left to NCCL, whose own choice skips loopback and docker interfaces.
    """
    if env.get("GLOO_SOCKET_IFNAME"):
        return {}
    name = interface_with_address(local_address, table)
    return {"GLOO_SOCKET_IFNAME": name} if name else {}
