"""`refitd explain MODEL TENSOR [--pool P] [--rank R] [--json]`: which source ranks and
boxes feed the destination shards of a tensor in the model's current plan."""

from __future__ import annotations

import argparse
import json
import sys

from refitd.cli.status import CLIENT_FIELDS
from refitd.config import add_settings_arguments, settings_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser, CLIENT_FIELDS)
    parser.add_argument("model", help="the model")
    parser.add_argument("tensor", help="registration name, engine parameter or canonical name")
    parser.add_argument("--pool", default="", help="only this destination pool")
    parser.add_argument("--rank", type=int, default=None, help="only this rank")
    parser.add_argument("--json", action="store_true", help="print the JSON document")


def run(args: argparse.Namespace) -> int:
    import grpc

    from refitd._proto import refitd_pb2 as pb
    from refitd._proto import refitd_pb2_grpc as pbg
    from refitd.security import ClientSecurity

    settings = settings_from_args(args)
    req = pb.ExplainRequest(model=args.model, tensor=args.tensor, pool=args.pool)
    if args.rank is not None:
        req.rank = args.rank
    with ClientSecurity.from_settings(settings).channel(settings.controller) as ch:
        try:
            resp = pbg.RefitStub(ch).Explain(req, timeout=settings.rpc_timeout_s)
        except grpc.RpcError as e:
            print(
                f"refitd explain: {settings.controller}: {e.code().name}: {e.details()}",
                file=sys.stderr,
            )
            return 1
    print(json.dumps(json.loads(resp.json), indent=2) if args.json else resp.text)
    return 0
