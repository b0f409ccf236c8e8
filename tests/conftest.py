from __future__ import annotations

import hashlib
import inspect
import os
import re
import subprocess
import sys
import tempfile
import uuid

import pytest

from kvcm.backends.metastore import LmdbStore, MemoryStore
from kvcm.testing import default_overrides
from kvcm.testing.redis_server import NoRedisServer, find_server
from kvcm.testing.redis_server import RedisServer as _RedisServer
from tests.helpers import TIME_FACTOR

# The host key that signs storage markers (kvcm.backends.storage.host) lives outside every data
# dir, by default under the user's home: the suite keeps its own (servers it starts inherit it),
# so a run leaves nothing in the home directory.
os.environ.setdefault("KVCM_STATE_DIR", tempfile.mkdtemp(prefix="kvcm-test-state-"))


def _redis_binary():
    """The Redis-compatible server the suite starts; a skip saying what to install when there is
    none (a failure under ``KVCM_TEST_REQUIRE_REDIS=1``, which CI sets: its Redis runs must run)."""
    try:
        return find_server()
    except NoRedisServer as exc:
        if os.environ.get("KVCM_TEST_REQUIRE_REDIS") == "1":
            pytest.fail(str(exc), pytrace=False)
        pytest.skip(str(exc))


class RedisServer(_RedisServer):
    def __init__(self, workdir, *extra: str, port: int | None = None) -> None:
        super().__init__(str(workdir), *extra, port=port, binary=_redis_binary(),
                         start_timeout=10 * TIME_FACTOR)


def _which_redis() -> str:
    try:
        return f"redis-compatible server: {find_server().describe()}"
    except NoRedisServer as exc:
        return f"redis-compatible server: none ({exc})"


def pytest_report_header(config):
    return _which_redis()


def pytest_terminal_summary(terminalreporter):
    """Also under ``-q`` (which hides the header): the CI log says which server the run used."""
    terminalreporter.write_line(_which_redis())


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One redis-server for the session (no persistence); each test uses its own key prefix."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def redis_factory(tmp_path):
    """Start more redis-servers for one test (replicas, passwords, persistence): ``factory(*args)``."""
    started: list[RedisServer] = []

    def start(*extra: str, name: str | None = None, port: int | None = None) -> RedisServer:
        server = RedisServer(tmp_path / (name or f"redis{len(started)}"), *extra, port=port)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop(kill=True)


@pytest.fixture(params=["lmdb", "memory", "redis"])
def store(request, tmp_path):
    """One store of each kind: the contract suite runs against all three."""
    if request.param == "redis":
        from kvcm.backends.metastore.redis import RedisStore

        server = request.getfixturevalue("redis_server")
        s = RedisStore(server.url, str(tmp_path / "data"), prefix=f"t{uuid.uuid4().hex[:12]}")
    elif request.param == "lmdb":
        s = LmdbStore(str(tmp_path / "data"), map_size=1 << 20)
    else:
        s = MemoryStore()
    yield s
    s.close()


# -- the data-plane suite on both stores ----------------------------------------------------------
#
# A module (``pytestmark``) or test marked ``both_stores`` runs once per metadata store: every
# kvcm server it starts (``serve_in_thread``, ``start_subprocess``, the ``kvcm_server`` fixtures)
# keeps its metadata in LMDB for ``[lmdb]`` and in the session's redis-server for ``[redis]``.
# ``lmdb_only("why")`` keeps one test of such a module on LMDB, saying why; ``store_independent``
# runs one once, unparametrized: it starts no server (it tests a formatter, a config check, a
# MemoryStore...), so a second run would test nothing new. Tests of the ``store`` fixture run on
# every store already and are left alone.

STORE_BACKENDS = ("lmdb", "redis")


def pytest_configure(config):
    config.addinivalue_line("markers", "both_stores: run the test once per metadata store, ids [lmdb] and [redis]")
    config.addinivalue_line("markers", "lmdb_only(reason): a both_stores test that only means something on LMDB")
    config.addinivalue_line("markers", "store_independent: a test of a both_stores module that starts no server")
    _compile_kvcm_once()


def _compile_kvcm_once() -> None:
    """Under ``PYTHONDONTWRITEBYTECODE`` every child Python of the suite (each ``kvcm serve``,
    each ``kvcm call`` of a docs test) compiles kvcm's modules from source again: about 0.5 s
    per child on a 2-core machine, and a run starts hundreds. Compiled once here, in place
    (``__pycache__`` is git-ignored), the children read the bytecode; with bytecode writing on,
    the first child writes it and nothing is needed."""
    if not sys.dont_write_bytecode:
        return
    import kvcm

    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", os.path.dirname(kvcm.__file__)],
                   check=False, stdout=subprocess.DEVNULL)


def pytest_generate_tests(metafunc):
    marked = metafunc.definition.get_closest_marker
    if marked("both_stores") is None or marked("store_independent") is not None or "store" in metafunc.fixturenames:
        return
    only = metafunc.definition.get_closest_marker("lmdb_only")
    if only is not None and not (only.args and isinstance(only.args[0], str) and only.args[0].strip()):
        pytest.fail(f"{metafunc.definition.nodeid}: lmdb_only needs its reason", pytrace=False)
    # Module scope: a module's servers are built once per store, not once per test.
    metafunc.parametrize("kvcm_store", ["lmdb"] if only else list(STORE_BACKENDS), indirect=True, scope="module")


class RedisLayer:
    """Servers on Redis, each under its own prefix named after its data dir: tests never share
    keys, while a restart on the same data dir finds its metadata again."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.nonce = uuid.uuid4().hex[:8]  # data dirs are temp dirs, but a freed name may come back

    def __call__(self, data_dir: str):
        digest = hashlib.sha1(os.path.realpath(data_dir).encode()).hexdigest()[:16]
        return {"store": {"backend": "redis", "redis_url": self.url, "redis_prefix": f"t{self.nonce}-{digest}"}}

    def drop_keys(self) -> int:
        """Delete every key the layer's servers wrote; how many there were."""
        import redis

        with redis.Redis.from_url(self.url) as conn:
            keys = list(conn.scan_iter(match=f"{{t{self.nonce}-*", count=1000))
            for i in range(0, len(keys), 500):
                conn.delete(*keys[i:i + 500])
        return len(keys)


@pytest.fixture(scope="module", autouse=True)
def kvcm_store(request):
    """The metadata store the servers of this module use: ``lmdb`` (kvcm's default) unless a
    ``both_stores`` parametrization says ``redis``. Module fixtures that start a server request
    it, so they are built again for each store."""
    backend = getattr(request, "param", "lmdb")
    if backend == "lmdb":
        yield backend
        return
    layer = RedisLayer(request.getfixturevalue("redis_server").url)
    with default_overrides(layer):
        yield backend
    # A [redis] run whose servers wrote nothing to Redis would pass without testing Redis.
    assert layer.drop_keys() > 0, f"{request.node.nodeid}: no server of the [redis] run wrote to Redis"


def pytest_collection_modifyitems(config, items):
    """Mark ``redis`` every test that starts a Redis-compatible server (or cluster): by its fixtures, or by
    its store parameter (those fixtures ask for the server at run time)."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if ({"redis_server", "redis_factory", "redis_cluster"} & set(getattr(item, "fixturenames", ()))
                or "redis" in params.values()):
            item.add_marker(pytest.mark.redis)
        elif item.get_closest_marker("slow") is None and item.get_closest_marker("heavy") is None and _quick(item):
            item.add_marker(pytest.mark.quick)


# -- the quick tier ---------------------------------------------------------------------------------
#
# ``pytest -m quick``: the tests that start no process, server, socket or thread and never sleep,
# for the inner loop (the README's command still runs everything). A test is quick when neither
# its own source nor that of the fixtures it asks for and of the module's functions and classes it names
# (followed three deep) mentions any of these.
_NOT_QUICK = re.compile(
    r"subprocess|Popen|serve_in_thread|start_subprocess|RunningServer|kvcm_server|RedisServer|redis_"
    r"|FakeEnginePublisher|\bzmq\b|socket|[Tt]hread|sleep\(|wait_for|\.client\(|Client\(|http"
)
_SOURCES: dict[object, str] = {}


def _source(obj: object) -> str:
    if obj not in _SOURCES:
        try:
            _SOURCES[obj] = inspect.getsource(obj)  # type: ignore[arg-type]
        except (OSError, TypeError):
            _SOURCES[obj] = ""
    return _SOURCES[obj]


def _quick(item: pytest.Item) -> bool:
    function = getattr(item, "function", None)
    if function is None:
        return False
    module = inspect.getmodule(function)
    info = item._fixtureinfo  # type: ignore[attr-defined]
    # the fixtures it asks for (autouse ones, such as kvcm_store, only steer servers it starts)
    todo = [function] + [d.func for name in info.argnames for d in info.name2fixturedefs.get(name, ())]
    seen: set[object] = set()
    for _ in range(4):
        named = []
        for obj in todo:
            if obj in seen:
                continue
            seen.add(obj)
            text = _source(obj)
            if _NOT_QUICK.search(text):
                return False
            named += [getattr(module, name) for name in re.findall(r"\b[A-Za-z_]\w*\b", text)
                      if callable(getattr(module, name, None)) and getattr(getattr(module, name), "__module__", None)
                      == getattr(module, "__name__", "")]  # fmt: skip
        todo = named
    return True
