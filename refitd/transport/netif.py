"""Network interfaces by name and address (Linux ioctls; no torch, no gRPC)."""

from __future__ import annotations

import fcntl
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
