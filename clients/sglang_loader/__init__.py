"""refitd as SGLang's custom weight loader (`--custom-weight-loader
clients.sglang_loader.load_refitd_version`); docs/engines/sglang.md has the calls.

    engine.update_weights_from_tensor(init_request(controller, "policy"), load_format=LOADER)
    engine.update_weights_from_tensor(version_request(v), load_format=LOADER)
"""

from clients.sglang_loader.loader import (
    INIT,
    LOADER,
    VERSION,
    SglangInit,
    detach,
    init_request,
    load_refitd_version,
    register_model_runner,
    served_version,
    version_request,
)

__all__ = [
    "INIT",
    "LOADER",
    "VERSION",
    "SglangInit",
    "detach",
    "init_request",
    "load_refitd_version",
    "register_model_runner",
    "served_version",
    "version_request",
]
