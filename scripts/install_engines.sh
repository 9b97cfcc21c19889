#!/usr/bin/env bash
# Install vLLM and SGLang for the engine tests (requirements/engines.txt) into the Python
# given as $1 (default: python3), without their dependency trees (they pin other torch
# releases) and without changing any package already installed: a dry run lists what pip
# would install, and an install that would change an installed version stops here.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python3}
REQ=requirements/engines.txt
report=$(mktemp)
trap 'rm -f "$report"' EXIT
"$PY" -m pip install -q --no-deps --dry-run --report "$report" -r "$REQ"
"$PY" - "$report" <<'PYEOF'
import importlib.metadata as md
import json
import sys

changed = []
for item in json.load(open(sys.argv[1]))["install"]:
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        continue
    if have != version:
        changed.append(f"{name} {have} -> {version}")
if changed:
    sys.exit("install_engines: would change installed packages: " + ", ".join(changed))
PYEOF
"$PY" -m pip install -q --no-deps -r "$REQ"
