"""Layering: imports point down only, no module imports itself through others, and the public API
stays small.

Every import counts, including those under ``TYPE_CHECKING`` and inside functions: a cycle hidden
behind either is still a cycle a reader has to untangle.
"""

from __future__ import annotations

import ast
import pathlib
import sys

import kvcm

ROOT = pathlib.Path(kvcm.__file__).parent

# Lowest first. A module may import from its own layer or any layer below, never above. A module
# belongs to the longest prefix that names it; "kvcm" alone is the package root only.
LAYERS: list[tuple[str, ...]] = [
    # foundations: they import nothing of kvcm but each other
    ("kvcm.errors", "kvcm.proto", "kvcm.version", "kvcm.threads", "kvcm.lockfile", "kvcm.metrics", "kvcm.rpc",
     "kvcm.rpc.curve", "kvcm.config"),
    ("kvcm.backends", "kvcm.ha"),  # metadata stores, the leader lease; KV-block storages
    ("kvcm.control", "kvcm.policies"),  # the registry; eviction policies
    ("kvcm.cache",),  # the data plane
    ("kvcm.reclaimer", "kvcm.engines", "kvcm.publish"),  # eviction; the inbound engine tier; outbound events
    ("kvcm.rpc.dispatch", "kvcm.rpc.auth", "kvcm.api"),  # the method table and its handlers
    ("kvcm.rpc.server", "kvcm.client", "kvcm.client_methods", "kvcm.client_shards", "kvcm.aio", "kvcm.aio_methods", "kvcm.blocks", "kvcm.http", "kvcm.tair"),  # sockets, client SDK; Tair's HTTP surface
    ("kvcm.connector", "kvcm.aio_connector"),  # the connector helpers over the clients and block I/O
    # a follower node's serving stage (reads from the shared store); opening stores; start refusals
    ("kvcm.node.follower", "kvcm.node.stores", "kvcm.node.refusals", "kvcm.node.kernel"),
    ("kvcm.node", "kvcm.testing", "kvcm.optimizer", "kvcm.rpc.keygen", "kvcm.cli", "kvcm.__main__"),
]


def layer_of(module: str) -> int:
    best, best_len = -1, -1
    for level, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = level, len(prefix)
    return len(LAYERS) if module == "kvcm" else best


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        name = ".".join(rel.parts)
        found[name.removesuffix(".__init__")] = path
    return found


MODULES = modules()


def kvcm_imports(path: pathlib.Path, module: str) -> set[str]:
    """The kvcm modules ``module`` imports: ``from pkg import mod`` counts as ``pkg.mod`` only."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("kvcm"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the importing package
                package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("kvcm"):
                continue
            submodules = {f"{target}.{a.name}" for a in node.names} & MODULES.keys()
            out.update(submodules)
            if len(submodules) < len(node.names):
                out.add(target)  # names defined in the module itself
    out.discard(module)
    return out


def graph() -> dict[str, set[str]]:
    return {name: kvcm_imports(path, name) for name, path in MODULES.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_every_module_has_a_layer():
    missing = [name for name in MODULES if layer_of(name) < 0]
    assert not missing, f"modules missing from LAYERS: {sorted(missing)}"


def test_imports_point_down():
    upward = []
    for name, targets in graph().items():
        if name == "kvcm":
            continue  # the package root re-exports the public API
        for target in targets:
            if layer_of(target) > layer_of(name):
                upward.append(f"{name} (layer {layer_of(name)}) imports {target} (layer {layer_of(target)})")
    assert not upward, "upward imports:\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    found = cycles(graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_server_knows_only_frames():
    allowed = ("kvcm.proto.wire", "kvcm.errors", "kvcm.metrics")
    targets = kvcm_imports(ROOT / "rpc" / "server.py", "kvcm.rpc.server")
    bad = [t for t in targets if not t.startswith(allowed)]
    assert not bad, f"rpc/server.py must not import {bad}"
    text = (ROOT / "rpc" / "server.py").read_text()
    assert "import lmdb" not in text


def _third_party(path: pathlib.Path) -> set[str]:
    """Top-level names of the non-kvcm, non-stdlib modules ``path`` imports."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        out.update(n.split(".")[0] for n in names)
    return {n for n in out if n and n != "kvcm" and n not in sys.stdlib_module_names and n != "__future__"}


def proto_violations(edges: dict[str, set[str]], third_party: dict[str, set[str]]) -> list[str]:
    """``kvcm.proto`` imports only :mod:`kvcm.errors`, itself and the codecs: a client author
    reads it and nothing of the server."""
    bad = []
    for name, targets in edges.items():
        if name == "kvcm.proto" or name.startswith("kvcm.proto."):
            bad += [f"{name} imports {t}" for t in targets if t != "kvcm.errors" and not t.startswith("kvcm.proto")]
            bad += [f"{name} imports {t}" for t in third_party.get(name, ()) if t not in ("msgspec", "msgpack")]
    return sorted(bad)


def test_proto_imports_only_errors_and_codecs():
    third = {name: _third_party(path) for name, path in MODULES.items() if name.startswith("kvcm.proto")}
    assert not proto_violations(graph(), third)


def test_proto_rule_catches_a_server_import():
    assert proto_violations({"kvcm.proto.wire": {"kvcm.errors", "kvcm.cache.keys"}}, {}) == [
        "kvcm.proto.wire imports kvcm.cache.keys"]
    assert proto_violations({"kvcm.proto.wire": set()}, {"kvcm.proto.wire": {"zmq"}}) == ["kvcm.proto.wire imports zmq"]
    assert proto_violations({"kvcm.cache.keys": {"kvcm.backends.metastore"}}, {"kvcm.cache.keys": {"lmdb"}}) == []


SDK = ("kvcm.client", "kvcm.client_methods", "kvcm.client_shards", "kvcm.aio", "kvcm.aio_methods", "kvcm.blocks", "kvcm.connector",
       "kvcm.aio_connector")


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def sdk_violations(edges: dict[str, set[str]]) -> list[str]:
    """The SDK (the clients, block I/O, the connectors, and their packages' modules) imports only
    the protocol, the errors, the CURVE helper and itself: a client never loads the server."""
    allowed = ("kvcm.proto", "kvcm.errors", "kvcm.rpc.curve", *SDK)
    return sorted(f"{name} imports {t}" for name, targets in edges.items() if _within(name, SDK)
                  for t in targets if not _within(t, allowed))  # fmt: skip


def test_the_sdk_imports_only_the_protocol():
    assert not sdk_violations(graph())


def test_sdk_rule_catches_a_server_import():
    assert sdk_violations({"kvcm.blocks": {"kvcm.proto.uris", "kvcm.backends.storage.base"}}) == [
        "kvcm.blocks imports kvcm.backends.storage.base"]
    assert sdk_violations({"kvcm.blocks.io": {"kvcm.blocks.specs", "kvcm.cache.keys"}}) == [
        "kvcm.blocks.io imports kvcm.cache.keys"]


def test_optimizer_never_opens_lmdb():
    for path in (ROOT / "optimizer").rglob("*.py"):
        text = path.read_text()
        assert "import lmdb" not in text and "kvcm.backends.metastore" not in text, path


def test_public_api():
    assert set(kvcm.__all__) == {
        "AccessDenied", "AsyncConnector", "CapacityError", "Client", "Code", "Config", "ConfigError", "Conflict",
        "Connector", "InvalidArgument", "KvcmError", "NotFound", "ServerError", "Unavailable", "__version__",
    }
    for name in kvcm.__all__:
        assert hasattr(kvcm, name)
