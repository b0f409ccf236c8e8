"""Layering: imports point down only, and the public API stays small."""

from __future__ import annotations

import ast
import pathlib

import kvcm

ROOT = pathlib.Path(kvcm.__file__).parent

# Lowest first. A module may import from its own layer or any layer below, never above.
LAYERS: list[tuple[str, ...]] = [
    ("kvcm.errors", "kvcm.blockkeys", "kvcm.proto", "kvcm.metrics", "kvcm.threads", "kvcm.config", "kvcm.uricodec"),
    ("kvcm.backends",),
    ("kvcm.locks", "kvcm.model", "kvcm.policies"),
    ("kvcm.index", "kvcm.registry"),
    ("kvcm.manager", "kvcm.masks", "kvcm.sessions", "kvcm.deleter", "kvcm.selection", "kvcm.usage",
     "kvcm.records", "kvcm.locations", "kvcm.cache"),
    ("kvcm.reclaimer", "kvcm.engines"),
    ("kvcm.dispatch", "kvcm.auth", "kvcm.api"),
    ("kvcm.server", "kvcm.client", "kvcm.http"),
    ("kvcm.app", "kvcm.fake_engine", "kvcm.testing", "kvcm.pytest_plugin", "kvcm.optimizer", "kvcm.cli",
     "kvcm.__main__", "kvcm"),
]
DOMAIN_LAYER = 4  # where a module missing from the table is placed


def layer_of(module: str) -> int:
    best, best_len = DOMAIN_LAYER, -1
    for level, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = level, len(prefix)
    return best


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        name = ".".join(rel.parts)
        found[name.removesuffix(".__init__")] = path
    return found


def kvcm_imports(path: pathlib.Path, module: str) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("kvcm"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against the package
                base = module.split(".")[: -node.level] if path.name != "__init__.py" else module.split(".")[: len(module.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("kvcm"):
                out.add(target)
                out.update(f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules())
    return out


def test_imports_point_down():
    upward = []
    for name, path in modules().items():
        if name == "kvcm":
            continue  # the package root re-exports the public API
        for target in kvcm_imports(path, name):
            if layer_of(target) > layer_of(name):
                upward.append(f"{name} (layer {layer_of(name)}) imports {target} (layer {layer_of(target)})")
    assert not upward, "upward imports:\n" + "\n".join(sorted(upward))


def test_server_knows_only_frames():
    allowed = ("kvcm.proto", "kvcm.errors", "kvcm.metrics")
    targets = kvcm_imports(ROOT / "server.py", "kvcm.server")
    bad = [t for t in targets if not t.startswith(allowed)]
    assert not bad, f"server.py must not import {bad}"
    text = (ROOT / "server.py").read_text()
    assert "import lmdb" not in text


def test_optimizer_never_opens_lmdb():
    for path in (ROOT / "optimizer").rglob("*.py") if (ROOT / "optimizer").exists() else []:
        text = path.read_text()
        assert "import lmdb" not in text and "lmdb_store" not in text, path


def test_public_api():
    assert set(kvcm.__all__) == {
        "AccessDenied", "CapacityError", "Client", "Code", "Config", "ConfigError", "Conflict",
        "InvalidArgument", "KvcmError", "NotFound", "ServerError", "Unavailable", "__version__",
    }
    for name in kvcm.__all__:
        assert hasattr(kvcm, name)
