"""`kvcm call` and `python -m kvcm` against a real server."""

from __future__ import annotations

import json
import subprocess
import sys

from kvcm.cli import main
from kvcm.testing import serve_in_thread


def test_call_prints_json(capsys):
    with serve_in_thread() as server:
        assert main(["call", "check_health", "{}", "--endpoint", server.endpoint]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["status"] == "ok"
        assert main(["call", "get_instance_info", '{"instance_id": "missing"}', "--endpoint", server.endpoint]) == 1
        assert "INSTANCE_NOT_EXIST" in capsys.readouterr().err
        assert main(["call", "check_health", "{not json", "--endpoint", server.endpoint]) == 2


def test_python_dash_m_entry_point():
    with serve_in_thread() as server:
        done = subprocess.run([sys.executable, "-m", "kvcm", "call", "list_storage", "--endpoint", server.endpoint],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "default-file" in done.stdout


def test_an_endpoint_with_no_server_says_so(capsys, tmp_path):
    assert main(["call", "check_health", "{}", "--endpoint", f"ipc://{tmp_path}/nobody", "--timeout", "0.2"]) == 1
    assert "no server answered at ipc://" in capsys.readouterr().err


def test_a_server_that_never_answers_times_out_cleanly(capsys, tmp_path):
    import zmq

    mute = zmq.Context.instance().socket(zmq.ROUTER)  # accepts the connection, never replies
    mute.bind(f"ipc://{tmp_path}/mute")
    try:
        assert main(["call", "check_health", "{}", "--endpoint", f"ipc://{tmp_path}/mute", "--timeout", "0.2"]) == 1
    finally:
        mute.close(linger=0)
    assert "TIMEOUT" in capsys.readouterr().err


def test_a_closed_pipe_is_no_error():
    """`kvcm call ... | head`: the reader leaving early ends the command quietly."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "kvcm", "config", "show"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the child writes anything
    err = proc.stderr.read().decode()
    assert proc.wait(30) == 0 and "Traceback" not in err, err
