"""The node agent's data-plane address: where its transfer processes accept peer connections.

Chosen once when the agent starts, in this order:
1. `data_plane_interface` (flag `--data-plane-interface`): the IPv4 address of that interface;
2. `data_plane_address` (flag `--data-plane-address`): that address (a name is resolved once);
3. `GLOO_SOCKET_IFNAME` (first name of the list), the variable torch.distributed users know;
4. by default, the local address of the route this host uses to reach the controller (a UDP
   socket is connect()ed and asked for its own address: no packet is sent).
The host name is never resolved to guess it (Debian and Ubuntu map it to 127.0.1.1).
A loopback address while the controller is on another host would make every cross-host
refit fail with a refused connection, so the agent refuses to start instead. NCCL reads
NCCL_SOCKET_IFNAME itself; when it is unset, the transfer processes set it to the interface
holding the data-plane address.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from typing import Any

from refitd.transport.netif import InterfaceError, host_of, interface_address, is_loopback


class DataPlaneError(RuntimeError):
    """The data-plane address cannot be chosen, or would not be reachable by peers."""


@dataclass(frozen=True, slots=True)
class DataPlaneAddress:
    """Where this agent's transfer processes listen, and how that was decided."""

    address: str
    interface: str = ""  # set when chosen by interface name (Gloo binds that interface)
    source: str = "route"  # interface, address, GLOO_SOCKET_IFNAME, route

    def describe(self) -> str:
        how = {
            "interface": f"--data-plane-interface {self.interface}",
            "address": "--data-plane-address",
            "GLOO_SOCKET_IFNAME": f"GLOO_SOCKET_IFNAME={self.interface}",
            "route": "the route to the controller",
        }[self.source]
        return f"{self.address} (from {how})"


def resolve(host: str) -> str:
    """`host` as an IPv4 address (resolving a name once, as connect() would)."""
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError as e:
        raise DataPlaneError(f"cannot resolve {host!r}: {e}") from e
    return str(infos[0][4][0])


def route_address(target_host: str, target_port: int = 9) -> str:
    """Local address of the route to target_host (UDP connect + getsockname: nothing sent)."""
    target = resolve(target_host)
    if target == "0.0.0.0":
        target = "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((target, target_port or 9))
        except OSError as e:
            raise DataPlaneError(f"no route to the controller at {target}: {e}") from e
        return str(s.getsockname()[0])


def split_host_port(address: str) -> tuple[str, int]:
    _, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise DataPlaneError(f"controller address {address!r} is not HOST:PORT")
    return host_of(address), int(port)


def _pick(iface: str, addr: str, gloo_if: str, host: str, port: int) -> DataPlaneAddress:
    if iface:
        return DataPlaneAddress(interface_address(iface), iface, "interface")
    if addr:
        return DataPlaneAddress(resolve(addr), "", "address")
    if gloo_if:
        return DataPlaneAddress(interface_address(gloo_if), gloo_if, "GLOO_SOCKET_IFNAME")
    return DataPlaneAddress(route_address(host, port), "", "route")


def choose_data_plane(
    settings: Any,
    controller: str,
    env: dict[str, str] | None = None,
    reached_as: str = "",
) -> DataPlaneAddress:
    """The agent's data plane per the module docstring; refuses a loopback one when the
    controller (`controller`, HOST:PORT) is on another host (`reached_as` words that case
    for the error, e.g. for the embedded agent of an advertised controller)."""
    env = os.environ if env is None else env
    iface = getattr(settings, "data_plane_interface", "") or ""
    addr = getattr(settings, "data_plane_address", "") or ""
    gloo_if = (env.get("GLOO_SOCKET_IFNAME") or "").split(",")[0].strip()
    host, port = split_host_port(controller)
    try:
        plane = _pick(iface, addr, gloo_if, host, port)
    except InterfaceError as e:
        raise DataPlaneError(str(e)) from e
    controller_ip = resolve(host)
    if is_loopback(plane.address) and not (
        is_loopback(controller_ip) or controller_ip == "0.0.0.0"
    ):
        raise DataPlaneError(
            f"data-plane address {plane.describe()} is a loopback address but "
            f"{reached_as or f'the controller {controller} ({controller_ip}) is on another host'}"
            ": transfer processes on other hosts could not connect to this one. Set "
            "--data-plane-address "
            "(REFITD_DATA_PLANE_ADDRESS) to this host's address on the cluster network, or "
            "--data-plane-interface (REFITD_DATA_PLANE_INTERFACE, or GLOO_SOCKET_IFNAME) to "
            "its interface."
        )
    return plane
