"""`refitd status [--controller HOST:PORT] [--json]`: the controller's status document."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from refitd.config import add_settings_arguments, settings_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(
        parser,
        [
            "controller",
            "rpc_timeout_s",
            "tls_ca",
            "tls_client_cert",
            "tls_client_key",
            "tls_server_name",
            "auth_token",
            "auth_token_file",
        ],
    )
    parser.add_argument("--model", default="", help="only this model")
    parser.add_argument("--json", action="store_true", help="print the JSON document")


def run(args: argparse.Namespace) -> int:
    import grpc

    from refitd._proto import refitd_pb2 as pb
    from refitd._proto import refitd_pb2_grpc as pbg
    from refitd.security import ClientSecurity

    settings = settings_from_args(args)
    with ClientSecurity.from_settings(settings).channel(settings.controller) as ch:
        try:
            resp = pbg.RefitStub(ch).GetStatus(
                pb.StatusRequest(model=args.model), timeout=settings.rpc_timeout_s
            )
        except grpc.RpcError as e:
            print(
                f"refitd status: {settings.controller}: {e.code().name}: {e.details()}",
                file=sys.stderr,
            )
            return 1
    doc = json.loads(resp.json)
    print(json.dumps(doc, indent=2) if args.json else render(doc))
    return 0


def render(doc: dict[str, Any]) -> str:
    """A short human-readable summary of the status document."""
    c = doc["controller"]
    lines = [f"controller {c['grpc']}  http {c['http']}  store {c['store'] or 'off'}"]
    for m in doc["models"]:
        run = m["running"]
        lines.append(
            f"model {m['name']}: committed v{m['committed_version']}, epoch {m['epoch']}"
            + (f", running v{run['version']} ({run['state']})" if run else "")
        )
        for p in m["pools"]:
            slots = ",".join(str(r["slot"]) for r in p["ranks"])
            lines.append(
                f"  pool {p['name']} ({p['role']}): {p['registered']}/{p['size']} ranks, "
                f"slots {slots}"
            )
    for a in doc["agents"]:
        state = "connected" if a["connected"] else "disconnected"
        plane = a.get("data_plane_address") or "?"
        lines.append(
            f"agent {a['agent_id']} on {a['host']} (data plane {plane}): {state}, "
            f"slots {a['slots']}"
        )
    for r in doc["refits"][:10]:
        lines.append(
            f"refit {r['refit_id']} {r['model']} v{r['version']}: {r['state']}, "
            f"{r['seconds']:.3f}s, {r['bytes']} B, {r['gbps']:.2f} GB/s"
            + (f" ({r['reason']})" if r["reason"] else "")
        )
    return "\n".join(lines)
