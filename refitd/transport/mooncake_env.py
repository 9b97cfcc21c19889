"""Whether this host can take the rdma path: Mooncake Transfer Engine importable (naming the
package to install when not) and the RDMA devices the kernel exposes. No torch here: the
node agent asks before it offers the path.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from refitd.transport.errors import TransportError

PROTOCOLS = ("tcp", "rdma")
RDMA_SYSFS = Path("/sys/class/infiniband")
# Debian packages that provide the shared libraries the engine links.
ADMISSION_WAIT_MS = 600_000  # the engine's largest admission wait
PENDING_ADMISSIONS = 65_535  # the engine's largest number of requests waiting for admission
DEBIAN = {"libibverbs.so.1": "libibverbs1", "libnuma.so.1": "libnuma1", "libcurl.so.4": "libcurl4"}


def mooncake_unavailable_reason() -> str | None:
    """Why Mooncake Transfer Engine cannot be imported here, naming what to install; None
    when it can."""
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # read once, when the engine loads
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as e:
        lib = re.search(r"(lib[\w+-]+\.so[.\d]*): cannot open shared object", str(e))
        if lib:
            pkg = DEBIAN.get(lib.group(1), "the package that provides it")
            return f"{lib.group(1)} is missing (Debian: apt-get install {pkg})"
        return (
            f"Mooncake Transfer Engine is not installed ({e}): pip install 'refitd[rdma]' "
            "(mooncake-transfer-engine-non-cuda; GPU hosts: mooncake-transfer-engine)"
        )
    return None


def rdma_devices_present() -> list[str]:
    """RDMA devices the kernel exposes (mlx5_0, ...), empty where there is no fabric."""
    return sorted(p.name for p in RDMA_SYSFS.iterdir()) if RDMA_SYSFS.is_dir() else []


def check_fabric(protocol: str, devices: tuple[str, ...], lanes: int) -> None:
    """Refuse, with what is missing, a protocol or device this host cannot serve."""
    if protocol not in PROTOCOLS:
        raise TransportError(f"rdma_protocol must be tcp or rdma, got {protocol!r}")
    _configure_environment(protocol, lanes)
    reason = mooncake_unavailable_reason()
    if reason:
        raise TransportError(f"the rdma path is unavailable: {reason}")
    if protocol == "rdma":
        present = rdma_devices_present()
        if not present:
            raise TransportError(
                f"rdma_protocol=rdma but this host has no RDMA device ({RDMA_SYSFS} is empty "
                "or absent: no fabric, or its driver is not loaded); use rdma_protocol=tcp"
            )
        missing = sorted(set(devices) - set(present))
        if missing:
            raise TransportError(
                f"rdma_devices {', '.join(missing)} not found on this host; "
                f"present: {', '.join(present)}"
            )


def _configure_environment(protocol: str, lanes: int) -> None:
    """The engine's tunables are environment variables read when it starts; an operator's
    own MC_TCP_* values win over the options."""
    env = os.environ
    if protocol == "tcp":
        env["MC_FORCE_TCP"] = "1"
    else:
        env.pop("MC_FORCE_TCP", None)
    env.setdefault("MC_TCP_ENABLE_CONNECTION_POOL", "1")
    env.setdefault("MC_TCP_LANES_PER_PEER", str(lanes))
    # requests beyond the engine's per-peer queue wait for admission and fail after this
    # long (1 s by default): behind a slow link they wait longer than that without anything
    # being wrong, and refitd bounds every write by its own timeout
    env.setdefault("MC_TCP_ADMISSION_TIMEOUT_MS", str(ADMISSION_WAIT_MS))
    env.setdefault("MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER", str(PENDING_ADMISSIONS))
