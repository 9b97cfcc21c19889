"""The layering rules of docs/architecture.md, checked so they cannot break silently.

Each layer's modules are imported, every one of them, in a fresh interpreter whose first
import finder refuses the layer's forbidden modules (tests/architecture/_blocked_imports.py):
a violation fails with the chain of modules that led to the forbidden import. Imports made
inside functions only run when the function does, so every module's source is also read for
`import` statements anywhere in it (outside `if TYPE_CHECKING:` blocks); the few deliberate
ones are listed in ALLOWED_LAZY with the reason.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("_blocked_imports.py")
OPTIONAL = ["triton"]  # optional third-party packages (GPU kernels)
# the Triton kernel modules: left unchecked where triton is not installed
TRITON_MODULES = {
    "refitd.formats._triton_jit",
    "refitd.formats._triton_grouped",
    "refitd.formats._triton_nvfp4",
}
# they assemble the layers: no layer imports them (refitd.bench: only the CLI, by name)
ENTRY_POINTS = ("refitd.cli", "refitd.demo", "refitd.bench")
BENCH = "refitd.bench"
BENCH_IMPORTERS = ("refitd.cli", BENCH)  # the only packages whose modules name refitd.bench


@dataclass(frozen=True)
class Rule:
    """Modules of `layer` must not import `forbidden` (module prefixes); with `only_refitd`,
    no refitd module outside those packages either."""

    layer: str
    why: str
    forbidden: tuple[str, ...]
    only_refitd: tuple[str, ...] | None = None


# a node's processes and layers: the agent (no torch), its transfer processes, the executor
# they run, and the typed protocol between agent and transfer process
NODE = "refitd.node"
TRANSFER = "refitd.transfer"
EXECUTOR = "refitd.executor"
PROTOCOL = "refitd.slot_protocol"
SLOT_SIDE = (NODE, TRANSFER, EXECUTOR)
# the modules that move or map bytes (torch): the node agent only relays their errors and
# reaps shared memory by name
BYTE_MOVERS = (
    *(
        f"refitd.transport.{m}"
        for m in ("base", "doorbell", "gloo", "local", "mooncake", "nccl", "paths")
    ),
    *(f"refitd.memory.{m}" for m in ("arena", "mapping", "segments")),
)
CONTROL_PLANE = ("grpc", "google.protobuf", "refitd._proto", "refitd.rpc", "refitd.server")
# what only the processes speaking gRPC need: a GPU box's transfer processes run without it
SETTINGS_LIBS = ("pydantic", "pydantic_settings", "fastapi", "refitd.config")

RULES = [
    Rule(
        "refitd.plan",
        "the planner is pure Python + NumPy: no torch, no gRPC, no other refitd layer",
        ("torch", "grpc", "google.protobuf", "triton"),
        only_refitd=("refitd.plan",),
    ),
    Rule(
        "refitd.transport",
        "transports move bytes only: no gRPC, no worker memory, no other refitd layer",
        ("grpc", "google.protobuf", "triton"),
        only_refitd=("refitd.transport",),
    ),
    Rule(
        "refitd.memory",
        "worker memory is shared by the worker library and the transfer processes: torch and "
        "the dtype names only, no gRPC, no transport, no process's own code",
        ("grpc", "google.protobuf", "triton"),
        only_refitd=("refitd.memory", "refitd.torch_dtypes"),
    ),
    Rule(
        "refitd.formats",
        "codecs know tensors and wire layouts, not gRPC or the processes that call them",
        (
            *("grpc", "google.protobuf", "refitd._proto", "refitd.server", "refitd.client"),
            *(*SLOT_SIDE, PROTOCOL, "refitd.transport", *ENTRY_POINTS),
        ),
    ),
    Rule(
        "refitd.server",
        "the controller never touches tensor bytes: no torch, no data-plane layer",
        (
            *("torch", "triton", "refitd.transport", "refitd.formats"),
            *(*SLOT_SIDE, "refitd.client", *ENTRY_POINTS),
        ),
    ),
    Rule(
        "refitd.client",
        "the worker library does not carry the controller or the node's processes",
        ("refitd.server", *SLOT_SIDE, *ENTRY_POINTS),
    ),
    Rule(
        "refitd.rpc",
        "the shared RPC plumbing of workers and agents carries no process's own code",
        (
            *("torch", "triton", "refitd.server", "refitd.client", *SLOT_SIDE),
            *("refitd.transport", "refitd.formats", "refitd.plan", *ENTRY_POINTS),
        ),
    ),
    Rule(
        NODE,
        "the node agent relays commands: only its transfer processes touch tensors, so a host "
        "pays one torch import for all its slots (their fork server's), not one more; it "
        "talks to the controller over gRPC only, never through its code",
        (
            *("torch", "triton", EXECUTOR, TRANSFER, "refitd.formats", *BYTE_MOVERS),
            *("refitd.server", "refitd.client", *ENTRY_POINTS),
        ),
    ),
    Rule(
        PROTOCOL,
        "the typed commands and reports between a node agent and its transfer processes are "
        "plain data both sides import: no torch, no gRPC or settings, neither side's code",
        (
            *("torch", "triton", *CONTROL_PLANE, *SETTINGS_LIBS, *SLOT_SIDE),
            *("refitd.client", *ENTRY_POINTS),
        ),
    ),
    Rule(
        TRANSFER,
        "a transfer process takes typed commands from its node agent over a pipe: it never "
        "knows gRPC, the settings, the controller, the clients or the agent's code",
        (*CONTROL_PLANE, *SETTINGS_LIBS, NODE, "refitd.client", *ENTRY_POINTS),
    ),
    Rule(
        EXECUTOR,
        "the executor runs a slot program over resolved tensors: it never knows gRPC, the "
        "settings, the controller, the clients, or the processes that drive it",
        (*CONTROL_PLANE, *SETTINGS_LIBS, NODE, TRANSFER, "refitd.client", *ENTRY_POINTS),
    ),
    Rule(
        "refitd.torch_dtypes",
        "torch dtype names sit under every layer that holds tensors: torch, no other refitd module",
        ("grpc", "google.protobuf", "triton"),
        only_refitd=("refitd.torch_dtypes",),
    ),
    Rule(
        "refitd.refit_states",
        "the refit state names sit under the controller and the worker library: the proto "
        "enum only",
        ("torch", "grpc", "triton"),
        only_refitd=("refitd.refit_states", "refitd._proto"),
    ),
    Rule(
        "refitd.bench",
        "benchmarks and harnesses drive any layer; the CLI dispatches to them, never back",
        ("refitd.cli",),
    ),
    Rule(
        "refitd.demo",
        "the demo runs the product as a user would, without the benchmarks and harnesses",
        ("refitd.cli", BENCH),
    ),
]

# (module, imported module): why this function-level import is fine
ALLOWED_LAZY = {
    ("refitd.server.rendezvous", "torch.distributed"): (
        "runs only in the rendezvous store's own child process (python -m "
        "refitd.server.rendezvous), never in the controller"
    ),
    ("refitd.node.process_handle", "refitd.transfer.main"): (
        "the entry point of a transfer process: runs only in the child, forked from the fork "
        "server that preloaded it, never in the node agent"
    ),
}


def _modules(layer: str) -> list[str]:
    """Every module of the layer's package (or the layer itself, a module), found on disk
    (nothing is imported here)."""
    base = ROOT / layer.replace(".", "/")
    if base.with_suffix(".py").is_file():
        return [layer]
    out = []
    for path in sorted(base.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out.append(".".join(parts))
    return out


def _blocked(name: str, rule: Rule) -> bool:
    def under(prefix: str) -> bool:
        return name == prefix or name.startswith(prefix + ".")

    if any(under(p) for p in rule.forbidden):
        return True
    if rule.only_refitd is None or not name.startswith("refitd."):
        return False
    return not any(under(p) for p in rule.only_refitd)


def _imports(tree: ast.AST, module: str) -> list[tuple[int, str]]:
    """(line, imported module) of every import statement, TYPE_CHECKING blocks skipped."""
    out: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                package = module.rsplit(".", node.level)[0]
                base = f"{package}.{node.module}" if node.module else package
            else:
                base = node.module or ""
            out.append((node.lineno, base))
            out.extend((node.lineno, f"{base}.{a.name}") for a in node.names if base == "refitd")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def _source(module: str) -> Path:
    path = ROOT / (module.replace(".", "/") + ".py")
    return path if path.exists() else ROOT / module.replace(".", "/") / "__init__.py"


def _run_probe(rule: Rule) -> dict:
    args = {
        "root": str(ROOT),
        "modules": _modules(rule.layer),
        "forbidden": list(rule.forbidden),
        "only_refitd": None if rule.only_refitd is None else list(rule.only_refitd),
        "optional": OPTIONAL,
    }
    proc = subprocess.run(
        [sys.executable, str(PROBE), json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert proc.returncode == 0, f"import probe of {rule.layer} crashed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("rule", RULES, ids=[r.layer for r in RULES])
def test_layer_imports_nothing_forbidden(rule: Rule) -> None:
    """Import every module of the layer with its forbidden modules blocked."""
    out = _run_probe(rule)
    assert out["loaded_from"] == str(ROOT / "refitd" / "__init__.py"), out["loaded_from"]
    assert not out["preloaded"], f"already imported before the check: {out['preloaded']}"
    faults = []
    seen = set()
    for a in out["attempts"]:
        key = (a["blocked"], tuple(a["chain"]))
        if key not in seen:
            seen.add(key)
            faults.append(f"  {' -> '.join(a['chain'])} -> {a['blocked']}")
    if faults:
        pytest.fail(
            f"{rule.layer}: {rule.why}; forbidden imports (importer chain -> forbidden "
            "module):\n" + "\n".join(faults),
            pytrace=False,
        )
    assert not out["broken"], f"{rule.layer}: modules that fail to import: {out['broken']}"
    # only the Triton kernels may be left unchecked, where triton is not installed
    assert set(out["unavailable"]) <= TRITON_MODULES, out["unavailable"]


@pytest.mark.parametrize("rule", RULES, ids=[r.layer for r in RULES])
def test_layer_source_has_no_forbidden_lazy_import(rule: Rule) -> None:
    """Imports inside functions (run only when called) obey the same rule."""
    faults = []
    for module in _modules(rule.layer):
        path = _source(module)
        for line, imported in _imports(ast.parse(path.read_text()), module):
            if _blocked(imported, rule) and (module, imported) not in ALLOWED_LAZY:
                faults.append(f"  {path.relative_to(ROOT)}:{line}: import {imported}")
    if faults:
        pytest.fail(
            f"{rule.layer}: {rule.why}; forbidden imports:\n" + "\n".join(faults), pytrace=False
        )


def test_rules_cover_every_layer() -> None:
    """A new top-level package of refitd gets a rule (or is an entry point) on purpose."""
    packages = {p.name for p in (ROOT / "refitd").iterdir() if (p / "__init__.py").exists()}
    ruled = {r.layer.split(".")[1] for r in RULES}
    entry = {e.split(".")[1] for e in ENTRY_POINTS}
    assert packages - ruled - entry - {"_proto"} == set()


def _names_bench(node: ast.AST) -> bool:
    """A string that names a refitd.bench module (`python -m ...`, importlib)."""
    if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
        return False
    return any(w == BENCH or w.startswith(BENCH + ".") for w in node.value.split())


def test_only_the_cli_imports_bench() -> None:
    """No module of refitd outside the CLI and refitd.bench imports refitd.bench, at module
    level, inside a function (TYPE_CHECKING aside) or by name in a string."""
    faults = []
    for module in _modules("refitd"):
        if any(module == p or module.startswith(p + ".") for p in BENCH_IMPORTERS):
            continue
        path = _source(module)
        tree = ast.parse(path.read_text())
        for line, imported in _imports(tree, module):
            if imported == BENCH or imported.startswith(BENCH + "."):
                faults.append(f"  {path.relative_to(ROOT)}:{line}: import {imported}")
        # prose about a bench is fine; a string that launches or imports one is not
        docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
        for node in ast.walk(tree):
            if id(node) not in docstrings and _names_bench(node):
                faults.append(f"  {path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not faults, "refitd.bench is imported by the CLI only:\n" + "\n".join(faults)


def test_only_bench_imports_megatron_core() -> None:
    """Megatron-Core is a benchmark's reference (the bench-megatron extra): no module of
    refitd outside refitd.bench imports it, by statement or by a string naming it."""
    faults = []
    for module in _modules("refitd"):
        if module == BENCH or module.startswith(BENCH + "."):
            continue
        path = _source(module)
        tree = ast.parse(path.read_text())
        for line, imported in _imports(tree, module):
            if imported == "megatron" or imported.startswith("megatron."):
                faults.append(f"  {path.relative_to(ROOT)}:{line}: import {imported}")
        for node in ast.walk(tree):
            text = node.value if isinstance(node, ast.Constant) else None
            if isinstance(text, str) and text.startswith("megatron.core"):
                faults.append(f"  {path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not faults, "only refitd.bench imports Megatron-Core:\n" + "\n".join(faults)


def _loaded_modules(tree: ast.AST, modules: set[str], type_checking: bool) -> set[str]:
    """The refitd modules a module's imports load (at module level or inside functions;
    `from package import module` loads the module), those under `if TYPE_CHECKING:` only
    with `type_checking`."""

    def loaded(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in (node.body if type_checking else []) + node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update(loaded(a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.update(loaded(f"{node.module}.{a.name}") for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out - {""}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_no_import_cycle() -> None:
    """No circle among refitd's modules, counting imports inside functions; a name imported
    under `if TYPE_CHECKING:` (a type in an annotation) is not an import."""
    modules = set(_modules("refitd"))
    graph = {
        m: _loaded_modules(ast.parse(_source(m).read_text()), modules, False) - {m} for m in modules
    }
    cycles = _cycles(graph)
    assert not cycles, "modules importing each other:\n" + "\n".join(
        "  " + ", ".join(c) for c in cycles
    )


def test_server_front_ends_do_not_import_the_controller() -> None:
    """The gRPC services, ops HTTP, auth, status, explain and readiness depend on the
    protocols of refitd.server.frontend, which Controller implements; no module of the
    server imports controller.py, not even for a type."""
    modules = set(_modules("refitd"))
    importers = [
        m
        for m in _modules("refitd.server")
        if "refitd.server.controller"
        in _loaded_modules(ast.parse(_source(m).read_text()), modules, True)
    ]
    assert importers == [], f"import refitd.server.controller: {importers}"
