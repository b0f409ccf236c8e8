"""The documentation is tested: links resolve, nothing points outside the repository, the
configuration table matches ``kvcm/config.py``, every documented request is valid for its
method, and every runnable command block is run against a real kvcm.

Markers (CONTRIBUTING.md, "Documentation"): an HTML comment on the line before a fenced block,

* ``<!-- test: run -->`` before a ``sh`` block: run with bash, in order, in one temp dir per
  page, against a real server (see :func:`_prepare`); before a ``console`` block: every ``$``
  command is run and its output must equal the block's (wall-clock times aside);
* ``<!-- test: file NAME -->`` before any block: its text is written to NAME in that temp dir;
* ``<!-- test: by tests/test_x.py::test_y -->`` before a ``sh`` block: that test runs it.

A ``sh``/``bash``/``shell``/``console`` block without a marker fails
:func:`test_every_shell_block_is_marked`; output and files use ``text``, ``toml``, ...
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import typing
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

import pytest

from kvcm import config as kvcm_config

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
SHELLS = ("sh", "bash", "shell", "console")
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)
MARKER = re.compile(r"<!--\s*test:\s*(.*?)\s*-->\s*$")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


@dataclasses.dataclass
class Block:
    page: Path
    info: str
    text: str
    marker: str  # "" when none
    line: int

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.search(before)
        found.append(Block(page, m.group(1).strip(), m.group(2), marker.group(1) if marker else "",
                           text.count("\n", 0, m.start()) + 1))
    return found


def prose(page: Path) -> str:
    """The page without its fenced blocks and inline code (links inside them are not links)."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", page.read_text()))


# --- links and paths ---------------------------------------------------------------------------


def _layout_screen(page: Path) -> str:
    """The ``text`` block that draws the ``kvcm/`` tree on ``page``."""
    return next(b.text for b in blocks(page) if b.info == "text" and b.text.startswith("kvcm/"))


def screen_problems(screen: str, package_root: Path) -> list[str]:
    """What a layout screen gets wrong: a package of ``package_root`` it does not show, or a
    module it names on a package's line that does not exist."""
    packages = sorted(p.parent.relative_to(package_root).as_posix() for p in package_root.rglob("__init__.py")
                      if "__pycache__" not in p.parts and p.parent != package_root)  # fmt: skip
    shown = set(re.findall(r"\b([a-z_]+)/", screen))
    problems = [f"package {name}/ is not shown" for name in packages if name.split("/")[-1] not in shown]
    for line in screen.splitlines():
        m = re.match(r"\s+([a-z_/]+)/\s+([^#(]*)", line)
        if m and (package_root / m.group(1)).is_dir():
            for word in re.findall(r"\b[a-z_]+\b(?!/)", m.group(2)):
                if not (package_root / m.group(1) / f"{word}.py").exists():
                    problems.append(f"{m.group(1)}/{word}.py does not exist")
    return problems


@pytest.mark.parametrize("page", ["README.md", "docs/architecture.md"])
def test_the_layout_screens_show_every_package(page):
    assert not screen_problems(_layout_screen(ROOT / page), ROOT / "kvcm")


def test_the_layout_check_finds_a_missing_package_and_a_stale_module(tmp_path):
    for name in ("proto", "rpc"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / "rpc" / "server.py").write_text("")
    assert screen_problems("kvcm/  cli\n  rpc/        server wire   # frames\n", tmp_path) == [
        "package proto/ is not shown", "rpc/wire.py does not exist"]


def test_links_resolve():
    broken = []
    for page in [*PAGES, ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md"]:
        for target in LINK.findall(prose(page)):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#", 1)[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces become hyphens."""
    text = FENCE.sub("", page.read_text())
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", text, re.M)}


def test_anchors_resolve():
    broken = []
    for page in [*PAGES, ROOT / "CONTRIBUTING.md"]:
        for target in LINK.findall(prose(page)):
            if re.match(r"[a-z]+:", target) or "#" not in target:
                continue
            file, anchor = target.split("#", 1)
            linked = (page.parent / file).resolve() if file else page
            if linked.suffix == ".md" and linked.exists() and anchor not in _anchors(linked):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_nothing_points_outside_the_repo():
    # Spelled in pieces so that this file does not match its own search.
    shared, section = "shared" + "/", "\u00a7"
    offenders = []
    files = [*PAGES, ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md"]
    for folder in ("kvcm", "tests", "scripts"):
        files += [p for p in (ROOT / folder).rglob("*") if p.is_file() and p.suffix in ("", ".py", ".md", ".toml")]
    for path in files:
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for needle in (shared, section, "DESIGN" + ".md", "reliability" + ".md"):
            if needle in text:
                offenders.append(f"{path.relative_to(ROOT)}: {needle}")
        if path.suffix == ".md":
            for target in LINK.findall(prose(path)):
                if re.match(r"[a-z]+:", target):
                    continue
                resolved = (path.parent / target.split("#", 1)[0]).resolve()
                if ROOT not in resolved.parents and resolved != ROOT:
                    offenders.append(f"{path.relative_to(ROOT)}: {target}")
    assert not offenders, offenders


def test_code_paths_named_in_the_docs_exist():
    """A module, script or test the docs name in backticks exists (the layout moves, docs follow)."""
    pattern = re.compile(r"`((?:kvcm|tests|scripts)/[\w./-]*\w)(?:::\w+)?`")
    missing = []
    for page in [*PAGES, ROOT / "CONTRIBUTING.md"]:
        for path in pattern.findall(page.read_text()):
            if "<" in path or "_*" in path or path.endswith("test_x.py"):
                continue
            if not (ROOT / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, missing


# --- configuration -----------------------------------------------------------------------------


def _config_defaults() -> dict[str, tuple[str, typing.Any]]:
    """``section.key`` -> (type name, default), from kvcm.config's frozen dataclasses."""
    names = {str: "string", int: "integer", float: "float", bool: "bool"}
    out: dict[str, tuple[str, typing.Any]] = {}
    sections = typing.get_type_hints(kvcm_config.Config)
    for section in dataclasses.fields(kvcm_config.Config):
        kind = sections[section.name]
        hints = typing.get_type_hints(kind)
        defaults = kind()
        for key in dataclasses.fields(kind):
            value = getattr(defaults, key.name)
            hint = hints[key.name]
            out[f"{section.name}.{key.name}"] = (names.get(hint, "list of strings"),
                                                 list(value) if isinstance(value, tuple) else value)
    return out


def _config_table() -> dict[str, tuple[str, typing.Any]]:
    rows = {}
    for line in (ROOT / "docs" / "configuration.md").read_text().splitlines():
        m = re.match(r"\| `([a-z_]+\.[a-z_]+)` \| ([a-z ]+) \| `([^`]*)`[^|]* \|", line)
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} is listed twice"
            rows[m.group(1)] = (m.group(2), tomllib.loads(f"v = {m.group(3)}")["v"])
    return rows


def test_configuration_table_matches_config():
    code, table = _config_defaults(), _config_table()
    assert sorted(set(code) - set(table)) == [], "keys missing from docs/configuration.md"
    assert sorted(set(table) - set(code)) == [], "keys in docs/configuration.md that do not exist"
    wrong = {k: (table[k], code[k]) for k in code
             if table[k][0] != code[k][0] or table[k][1] != code[k][1]
             or type(table[k][1]) is not type(code[k][1])}
    assert not wrong, f"wrong type or default (docs, code): {wrong}"


def test_defaults_quoted_elsewhere_match_config():
    """A ``| `section.key` | `default` |`` row on any page (the README's short table) is right too."""
    code = _config_defaults()
    wrong = []
    for page in PAGES:
        for key, raw in re.findall(r"^\| `([a-z_]+\.[a-z_]+)` \| `([^`]*)` \|", page.read_text(), re.M):
            if key in code and tomllib.loads(f"v = {raw}")["v"] != code[key][1]:
                wrong.append(f"{page.relative_to(ROOT)}: {key} = {raw}")
    assert not wrong, wrong


def test_configuration_table_is_the_only_one():
    tables = [p for p in PAGES if re.search(r"^\| key \| type \| default \|", p.read_text(), re.M)]
    assert tables == [ROOT / "docs" / "configuration.md"]


# --- documented requests -----------------------------------------------------------------------


def _documented_calls() -> list[tuple[str, str, str | None]]:
    calls = []
    for page in PAGES:
        for block in blocks(page):
            if block.marker == "run":
                continue  # run for real below
            for line in block.text.splitlines():
                if not line.startswith("kvcm call "):
                    continue
                argv = shlex.split(line.split(" > ")[0])
                # The params are the first argument after the method that is not an option.
                rest = [a for i, a in enumerate(argv[3:]) if not a.startswith("--")
                        and not (i > 0 and argv[3 + i - 1].startswith("--"))]
                params = rest[0] if rest and "$(" not in rest[0] else None
                calls.append((block.where, argv[2], params))
    return calls


def test_documented_requests_are_valid():
    import json

    from kvcm.testing import serve_in_thread

    calls = _documented_calls()
    assert len(calls) > 30
    with serve_in_thread() as server:
        dispatcher = server.app.dispatcher
        for where, method, params in calls:
            assert method in dispatcher.methods, f"{where}: no method {method}"
            if params is not None:
                dispatcher._validate(dispatcher.methods[method], json.loads(params))


# --- shell blocks ------------------------------------------------------------------------------


def test_every_shell_block_is_marked():
    unmarked = [b.where for p in PAGES for b in blocks(p) if b.info.split(" ")[0] in SHELLS and not b.marker]
    assert not unmarked, f"mark these blocks (CONTRIBUTING.md, Documentation): {unmarked}"
    for p in PAGES:
        for b in blocks(p):
            assert b.marker == "" or re.fullmatch(r"run|file [\w./-]+|by tests/\S+::\w+", b.marker), b.where
            if b.marker.startswith("by "):
                path, name = b.marker[3:].split("::")
                assert f"def {name}(" in (ROOT / path).read_text(), b.where


#: The README's two commands, exactly: each makes (or reuses) a virtual environment inside the
#: command, so it runs the same on a Python that refuses installs outside one (PEP 668).
SERVE_COMMAND = "python3 -m venv .venv && .venv/bin/pip install . && .venv/bin/kvcm serve --data-dir ./kvcm-data"
TEST_COMMAND = "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/python -m pytest -q"


def front_door() -> tuple[str, str]:
    """The README's first two ``sh`` blocks: the serve command and the test command."""
    first = [b for b in blocks(ROOT / "README.md") if b.info == "sh"][:2]
    return first[0].text.strip(), first[1].text.strip()


def test_the_front_door_commands_are_exact():
    assert front_door() == (SERVE_COMMAND, TEST_COMMAND)
    assert (ROOT / "README.md").read_text().count("\n") < 300


def test_every_install_goes_into_a_venv():
    """A reader on Debian or Ubuntu copies these: a bare ``pip install`` there is refused
    (externally managed), so every install command names the venv's own pip."""
    bare = []
    for page in [*PAGES, ROOT / "CONTRIBUTING.md"]:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for m in re.finditer(r"pip3? install", line):
                if not line[:m.start()].endswith(".venv/bin/"):
                    bare.append(f"{page.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not bare, bare


#: Kills what a block left running, even when a command fails under ``set -e`` (the EXIT trap).
PRELUDE = """set -euo pipefail
trap 'jobs -p | xargs -r kill -TERM 2>/dev/null; wait 2>/dev/null || true' EXIT
kvcm_wait_ready() {
  for _ in $(seq 300); do
    kvcm call check_health '{}' --timeout 0.5 >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "kvcm never became ready" >&2; cat serve.log >&2; return 1
}
"""

#: ``python3 -m venv .venv && .venv/bin/pip install ... &&``: the harness's ``.venv`` runs this
#: checkout already (see :func:`shim`), so the install is dropped.
_INSTALL = re.compile(r"^python3 -m venv \.venv && \.venv/bin/pip install [^&]*&& ")


def _prepare(block: Block) -> str:
    """The block as a bash script: the venv install dropped (the checkout is what runs), ``kvcm
    serve`` in the background until it answers (stopped at the end, must exit 0), and the
    whole test suite (``.venv/bin/python -m pytest -q``) collected, not run (it runs this test)."""
    out, serving = [PRELUDE], False
    for line in block.text.splitlines():
        line = _INSTALL.sub("", line)
        if line.strip() in (".venv/bin/python -m pytest -q", "python3 -m pytest -q"):
            line = f"(cd {shlex.quote(str(ROOT))} && python3 -m pytest -q --collect-only -p no:cacheprovider >/dev/null)"
        if re.match(r"(\.venv/bin/)?kvcm serve", line):
            serving = True
            command = line.split("#")[0].strip().rstrip("&").strip()
            line = f"{command} > serve.log 2>&1 &\nKVCM_PID=$!\nkvcm_wait_ready"
        out.append(line)
    if serving:
        out.append('if kill -0 "$KVCM_PID" 2>/dev/null; then kill -TERM "$KVCM_PID"; wait "$KVCM_PID"; fi')
    return "\n".join(out) + "\n"


def _console(block: Block) -> list[tuple[str, str]]:
    """(command, expected output) pairs of a ``console`` block."""
    pairs: list[tuple[str, list[str]]] = []
    lines = block.text.splitlines()
    i = 0
    while i < len(lines):
        assert lines[i].startswith("$ "), f"{block.where}: expected a '$ ' command line"
        command = lines[i][2:]
        while command.endswith("\\"):
            i += 1
            command = command[:-1] + lines[i].strip()
        i += 1
        output = []
        while i < len(lines) and not lines[i].startswith("$ "):
            output.append(lines[i])
            i += 1
        pairs.append((command, output))
    return [(c, "\n".join(o)) for c, o in pairs]


def _normal(text: str) -> str:
    return re.sub(r"\d+\.\d+ s wall", "X s wall", text).strip()


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    """A stand-in for the reader's ``.venv``: ``bin/kvcm`` runs this checkout (``kvcm call`` goes
    to the test's server), ``bin/python`` and ``bin/python3`` run the test's own interpreter, and
    ``bin/activate`` puts them first on the PATH. The interpreters are scripts that exec it by
    its own path: a symlink to a venv's Python in another directory would start the base
    interpreter, without the venv's packages."""
    venv = tmp_path_factory.mktemp("venv")
    bin_dir = venv / "bin"
    bin_dir.mkdir()
    script = bin_dir / "kvcm"
    script.write_text(f"""#!{sys.executable}
import os, sys
sys.path.insert(0, {str(ROOT)!r})
argv = sys.argv[1:]
endpoint = os.environ.get("KVCM_TEST_DOCS_ENDPOINT")
if endpoint and argv[:1] == ["call"] and "--endpoint" not in argv:
    argv[1:1] = ["--endpoint", endpoint]
from kvcm.cli import main
sys.exit(main(argv))
""")
    for name in ("python", "python3"):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    (bin_dir / "activate").write_text(f'PATH={shlex.quote(str(bin_dir))}:"$PATH"\nexport PATH\n')
    for path in bin_dir.iterdir():
        path.chmod(0o755)
    return bin_dir


def _left_running(work: Path) -> list[tuple[int, str]]:
    """Processes still running in ``work`` (their cwd): what a block started and did not stop."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cwd = os.readlink(entry / "cwd")
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if cwd == str(work) or cwd.startswith(f"{work}/"):
            found.append((int(entry.name), cmdline))
    return found


def _stop_leftovers(work: Path) -> list[str]:
    left = _left_running(work)
    for pid, _ in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return [cmdline for _, cmdline in left]


RUNNABLE = [p for p in PAGES if any(b.marker == "run" for b in blocks(p))]


def test_there_are_runnable_blocks():
    count = sum(1 for p in PAGES for b in blocks(p) if b.marker == "run")
    assert count >= 8, f"only {count} runnable blocks"
    assert ROOT / "README.md" in RUNNABLE


@pytest.mark.parametrize("page", RUNNABLE, ids=[str(p.relative_to(ROOT)) for p in RUNNABLE])
def test_runnable_commands(page, shim):
    from kvcm.testing import start_subprocess, stop_subprocess

    page_blocks = blocks(page)
    assert any(b.marker == "run" for b in page_blocks), "no runnable blocks"
    work = Path(tempfile.mkdtemp(prefix="kvcm-docs-", dir="/tmp"))
    (work / ".venv").symlink_to(shim.parent)
    server = None
    leftovers: list[str] = []
    try:
        endpoint = f"ipc://{work}/rpc.sock"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVCM_")}
        env.update(PATH=f"{shim}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=str(ROOT),
                   KVCM_SERVER_ENDPOINT=endpoint, KVCM_HTTP_PORT="0", KVCM_TEST_DOCS_ENDPOINT=endpoint)
        for block in page_blocks:
            if block.marker.startswith("file "):
                (work / block.marker[5:]).write_text(block.text)
        for block in page_blocks:
            if block.marker != "run":
                continue
            if block.info == "console":
                for command, expected in _console(block):
                    done = subprocess.run(["bash", "-c", command], cwd=work, env=env, capture_output=True,
                                          text=True, timeout=120)
                    assert done.returncode == 0, f"{block.where}: {command}\n{done.stderr}"
                    assert _normal(done.stdout) == _normal(expected), f"{block.where}: {command}"
                continue
            assert block.info == "sh", block.where
            needs_server = "kvcm call" in block.text and "kvcm serve" not in block.text
            if needs_server and server is None:
                server = start_subprocess(str(work / "server-data"), f"ipc://{work}/shared-rpc.sock")
                env["KVCM_TEST_DOCS_ENDPOINT"] = server.endpoint
            elif not needs_server:
                env["KVCM_TEST_DOCS_ENDPOINT"] = endpoint
            done = subprocess.run(["bash", "-c", _prepare(block)], cwd=work, env=env, capture_output=True,
                                  text=True, timeout=120)
            leftovers = _stop_leftovers(work)
            assert done.returncode == 0, f"{block.where}:\n{block.text}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
            assert not leftovers, f"{block.where} left processes running: {leftovers}"
    finally:
        if server is not None:
            stop_subprocess(server)
        leftovers = _stop_leftovers(work)
        shutil.rmtree(work, ignore_errors=True)
    assert not leftovers, f"{page.name} left processes running: {leftovers}"


def test_runner_drops_install_and_backgrounds_serve():
    block = Block(ROOT / "README.md", "sh", SERVE_COMMAND + "\n", "run", 1)
    script = _prepare(block)
    assert "pip install" not in script and "venv" not in script.split("kvcm_wait_ready()")[1].split("}")[1]
    assert ".venv/bin/kvcm serve --data-dir ./kvcm-data > serve.log 2>&1 &" in script
    assert "kill -TERM" in script


def test_a_failing_block_stops_what_it_started(shim, tmp_path):
    """``set -e`` ends the script at the failing command, before the block's own ``kill``: the
    EXIT trap still stops the server."""
    (tmp_path / ".venv").symlink_to(shim.parent)
    block = Block(ROOT / "README.md", "sh", "kvcm serve --data-dir ./d &\nfalse\nkill %1 && wait %1\n", "run", 1)
    endpoint = f"ipc://{tmp_path}/rpc.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCM_")}
    env.update(PATH=f"{shim}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=str(ROOT), KVCM_SERVER_ENDPOINT=endpoint,
               KVCM_HTTP_PORT="0", KVCM_TEST_DOCS_ENDPOINT=endpoint)
    done = subprocess.run(["bash", "-c", _prepare(block)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0
    left = _stop_leftovers(tmp_path)
    assert not left, left


def test_the_venv_interpreter_keeps_its_packages(shim, tmp_path):
    """``python3`` of the harness's ``.venv`` imports what the test's own interpreter imports
    (a symlink to a venv's Python elsewhere would lose the venv's site-packages)."""
    done = subprocess.run([str(shim / "python3"), "-c", "import sys, msgspec; print(sys.prefix)"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == sys.prefix


# --- names ---------------------------------------------------------------------------------------

#: ``kvcm.`` followed by these is a file or host name in the docs (``kvcm.toml``, ``kvcm.lock``,
#: a segment ``kvcm.sidecar.0``, the host ``kvcm.internal``), not a Python name.
NOT_NAMES = {"toml", "lock", "sock", "md", "internal", "sidecar", "shm_01"}
KVCM_NAME = re.compile(r"(?<![\w/.\-])kvcm((?:\.[A-Za-z_]\w*)+)")


def documented_names() -> dict[str, list[str]]:
    """Every ``kvcm.X[.Y...]`` the README and docs name, with where."""
    found: dict[str, list[str]] = {}
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for m in KVCM_NAME.finditer(line):
                parts = m.group(1).lstrip(".").split(".")
                if parts[0] not in NOT_NAMES:
                    found.setdefault("kvcm." + ".".join(parts), []).append(f"{page.relative_to(ROOT)}:{number}")
    return found


def resolve(name: str) -> object:
    """Import the longest module prefix of ``name``, then take the rest as attributes."""
    import importlib

    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            value = getattr(value, attr)
        return value
    raise ModuleNotFoundError(name)


def test_every_kvcm_name_the_docs_use_exists():
    names = documented_names()
    assert {"kvcm.Connector", "kvcm.AsyncConnector", "kvcm.Client", "kvcm.blocks"} <= names.keys()
    missing = []
    for name, where in sorted(names.items()):
        try:
            resolve(name)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{name} ({', '.join(where[:3])}): {exc}")
    assert not missing, missing
