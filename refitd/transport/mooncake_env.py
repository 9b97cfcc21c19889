"""Whether this host can take the rdma path: Mooncake Transfer Engine importable (naming the
package to install when not) and the RDMA devices the kernel exposes. No torch here: the
node agent asks before it offers the path.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

RDMA_SYSFS = Path("/sys/class/infiniband")
# Debian packages that provide the shared libraries the engine links.
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
