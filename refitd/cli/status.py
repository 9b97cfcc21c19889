"""`refitd status [--controller HOST:PORT] [--json]`: the controller's status document."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from refitd.config import add_settings_arguments, settings_from_args

CLIENT_FIELDS = [
    "controller",
    "rpc_timeout_s",
    "tls_ca",
    "tls_client_cert",
    "tls_client_key",
    "tls_server_name",
    "auth_token",
    "auth_token_file",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser, CLIENT_FIELDS)
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


def _size(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def render(doc: dict[str, Any]) -> str:
    """The operator's summary (the status page's, in text): per model and pool the
    committed version, ranks per served version, dead and lagging ranks; agents and slots
    aggregated; the bottleneck link of the current plan; the last refits by phase."""
    c = doc["controller"]
    lines = [f"controller {c['grpc']}  http {c['http']}  store {c['store'] or 'off'}"]
    for m in doc["models"]:
        run = m["running"]
        lines.append(
            f"model {m['name']}: committed v{m['committed_version']}, epoch {m['epoch']}"
            + (f", running v{run['version']} ({run['state']})" if run else "")
        )
        for p in m["pools"]:
            s = p["summary"]
            served = ", ".join(f"v{v}: {n}" for v, n in s["versions"].items())
            cadence = f", every {p['every']} versions" if p.get("every", 1) > 1 else ""
            lines.append(
                f"  pool {p['name']} ({p['role']}, {p['mode']}{cadence}): {s['live']}/{s['size']} "
                f"ranks live on {s['hosts']} hosts / {s['slots']} slots, "
                f"{_size(s['bytes'])}" + (f"; serving {served}" if served else "")
            )
            if s["dead_count"]:
                lines.append(f"    dead or missing ranks ({s['dead_count']}): {s['dead']}")
            if s["lagging_count"]:
                lines.append(f"    lagging ranks ({s['lagging_count']}): {s['lagging']}")
        plan = m.get("plan")
        if plan:
            b = plan["bottleneck"]
            lines.append(
                f"  plan {plan['digest'][:12]}: {_size(plan['total_bytes'])} "
                f"({_size(plan['remote_bytes'])} remote), {plan['messages']} messages, "
                f"{plan['rounds']} rounds; busiest sender slot {b['send_slot']} "
                f"{_size(b['send_bytes'])}, receiver slot {b['recv_slot']} "
                f"{_size(b['recv_bytes'])}, send imbalance {plan['send_imbalance']:.2f}"
            )
            if plan.get("links"):
                lines.append("    " + _links(plan["links"]))
    sm = doc.get("summary")
    if sm:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(sm["slot_kinds"].items()))
        lines.append(
            f"agents {sm['agents_connected']}/{sm['agents']} connected on {sm['hosts']} hosts; "
            f"slots {sm['slots_connected']}/{sm['slots']} connected ({kinds or 'none'})"
        )
        if sm["agents_disconnected"]:
            lines.append(f"  disconnected agents: {', '.join(sm['agents_disconnected'][:20])}")
    agents = doc.get("agents", [])
    for a in agents[:20]:
        state = "connected" if a["connected"] else "disconnected"
        plane = a.get("data_plane_address") or "?"
        lines.append(
            f"  agent {a['agent_id']} on {a['host']} (data plane {plane}): {state}, "
            f"{len(a['slots'])} slots"
        )
    if len(agents) > 20:
        lines.append(f"  {len(agents) - 20} more agents")
    for r in doc["refits"][:10]:
        ph = r.get("phases") or {}
        phases = " ".join(f"{k} {v:.3f}s" for k, v in ph.items() if v)
        lines.append(
            f"refit {r['refit_id']} {r['model']} v{r['version']}: {r['state']}, "
            f"{r['seconds']:.3f}s, {_size(r['bytes'])}, {r['gbps']:.2f} GB/s"
            + (f" [{phases}]" if phases else "")
            + (f" ({r['reason']})" if r["reason"] else "")
        )
    return "\n".join(lines)


def _links(links: dict) -> str:
    """'links auto: mapped 8 messages 112.0 MiB, local 118 copies 56.0 MiB' (and fallbacks)."""
    parts = []
    for path, v in links.items():
        if isinstance(v, dict) and "messages" in v and path != "fallback":
            parts.append(f"{path} {v['messages']} messages {_size(v['bytes'])}")
        elif isinstance(v, dict) and "copies" in v:
            parts.append(f"{path} {v['copies']} copies {_size(v['bytes'])}")
    out = f"links {links.get('policy')}: " + ", ".join(parts)
    fb = links.get("fallback")
    if fb:
        why = "; ".join(f"{n} {reason}" for reason, n in fb["messages"].items())
        out += f" (forced {fb['from']} fell back to {fb['to']}: {why})"
    return out
