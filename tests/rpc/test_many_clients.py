"""Many concurrent clients: processes x DEALER sockets x mixed data-plane
operations against one server subprocess. Every request gets exactly one reply with its own
msgid and no error; once the clients are gone the server holds no more descriptors than before."""

from __future__ import annotations

import multiprocessing as mp
import os
from typing import Any

import msgpack
import pytest
import zmq

from kvcm.testing import serve_in_subprocess
from tests.helpers import register, wait_for


def _request(msgid: int, method: str, params: dict[str, Any]) -> bytes:
    return msgpack.packb([0, msgid, method, [params]])


def _next_op(state: dict[str, Any], base: int, step: int) -> tuple[str, dict[str, Any]]:
    """Per socket: start -> lookup -> finish -> lookup -> ... over keys of its own."""
    if state.get("session"):
        return "finish_write_cache", {"instance_id": "inst", "write_session_id": state["session"],
                                      "success_blocks": {"offset": state["count"]}}
    keys = [base + 4 * step + j for j in range(4)]
    if step % 2:
        return "get_cache_location", {"instance_id": "inst", "query_type": "prefix_match",
                                      "block_keys": [base + j for j in range(4)]}
    return "start_write_cache", {"instance_id": "inst", "block_keys": keys}


def _client_process(endpoint: str, proc: int, sockets: int, ops: int, out: Any) -> None:
    ctx = zmq.Context()
    socks = [ctx.socket(zmq.DEALER) for _ in range(sockets)]
    for s in socks:
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint)
    states: list[dict[str, Any]] = [{} for _ in socks]
    problems: list[str] = []
    done = 0
    for step in range(ops):
        methods = []
        for i, s in enumerate(socks):
            method, params = _next_op(states[i], (proc * 1000 + i) * 100_000 + 1, step)
            methods.append(method)
            s.send(_request(step, method, params))
        for i, s in enumerate(socks):
            if not s.poll(30_000):
                problems.append(f"proc {proc} socket {i} step {step}: no reply")
                continue
            _, msgid, err, result = msgpack.unpackb(s.recv())
            if msgid != step or err is not None:
                problems.append(f"proc {proc} socket {i} step {step}: msgid {msgid}, error {err}")
                continue
            done += 1
            if methods[i] == "start_write_cache":
                states[i] = {"session": result["write_session_id"], "count": len(result["locations"])}
            elif methods[i] == "finish_write_cache":
                states[i] = {}
    for i, s in enumerate(socks):  # nothing more may arrive: no duplicated replies
        if s.poll(100):
            problems.append(f"proc {proc} socket {i}: an extra reply")
        s.close(0)
    ctx.term()
    out.put((done, problems))


def _descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _run(processes: int, sockets: int, ops: int) -> None:
    with serve_in_subprocess() as srv:
        assert srv.process is not None
        with srv.client() as c:
            register(c, "inst")
            c.call("check_health")
        baseline = _descriptors(srv.process.pid)
        spawn = mp.get_context("spawn")
        out = spawn.Queue()
        procs = [spawn.Process(target=_client_process, args=(srv.endpoint, p, sockets, ops, out))
                 for p in range(processes)]
        for p in procs:
            p.start()
        results = [out.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(30)
        problems = [x for _, found in results for x in found]
        assert problems == []
        assert sum(done for done, _ in results) == processes * sockets * ops
        # the server notices the peers' disconnects asynchronously
        wait_for(lambda: _descriptors(srv.process.pid) <= baseline, timeout=20, interval=0.1)
        assert _descriptors(srv.process.pid) <= baseline


def test_many_clients():
    _run(processes=2, sockets=25, ops=40)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_many_clients_full_size():
    """The full size: 4 processes x 50 DEALERs x 500 operations."""
    _run(processes=4, sockets=50, ops=500)
