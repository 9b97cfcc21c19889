"""Network interfaces and addresses: by name, by address, host of HOST:PORT (no torch, no gRPC)."""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

SIOCGIFADDR = 0x8915


class InterfaceError(RuntimeError):
    """An interface has no IPv4 address (or does not exist)."""


def interface_address(name: str) -> str:
    """IPv4 address of interface `name` (SIOCGIFADDR), or InterfaceError naming it."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError as e:
            known = ", ".join(n for _, n in socket.if_nameindex())
            raise InterfaceError(
                f"data-plane interface {name!r} has no IPv4 address ({e.strerror}); "
                f"interfaces here: {known}"
            ) from e
    return socket.inet_ntoa(packed[20:24])


def interface_of(address: str) -> str:
    """Name of the interface holding IPv4 `address`, or '' when none does."""
    for _, name in socket.if_nameindex():
        try:
            if interface_address(name) == address:
                return name
        except InterfaceError:
            continue
    return ""


def host_of(address: str) -> str:
    """The host part of `HOST:PORT` (brackets of an IPv6 host removed); `address` itself
    when it has no port."""
    host, sep, _ = address.rpartition(":")
    return (host if sep and not address.endswith("]") else address).strip("[]")


def is_loopback(host: str) -> bool:
    """Whether `host` (an address, or the name localhost) is this machine's loopback."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"
