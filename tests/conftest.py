"""Settings every test process needs before anything imports gRPC."""

import os

# as the `refitd` command does: gRPC's fork handlers off, so controllers in this process
# may fork planning processes (refitd/server/plan_process.py)
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
