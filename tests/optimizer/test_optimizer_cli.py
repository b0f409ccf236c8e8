"""``kvcm optimize`` (through ``kvcm.optimizer.cli.main``): runs, outputs and errors."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcm.optimizer.cli import SAMPLES_DIR, add_optimize_parser, main

# The sample kvcm ships (Mooncake's synthetic trace, Apache-2.0, Mooncake FAST'25), so the pinned
# figures never depend on a directory outside the repo.
MOONCAKE = str(SAMPLES_DIR / "mooncake.jsonl.gz")


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_single_replay_prints_a_table(capsys):
    code, out, _ = run(capsys, MOONCAKE, "--format", "mooncake", "--block-size", "512",
                       "--policy", "lru", "--capacity", "10000")  # fmt: skip
    assert code == 0
    assert "instance" in out and "0.4235" in out and "cap=10000" in out


def test_json_reports_the_unbounded_mooncake_ratio(capsys, tmp_path):
    code, out, _ = run(capsys, MOONCAKE, "--json", "--out", tmp_path, "--plot", tmp_path / "t.png",
                       "--prefill-tps", "10000", "--gpu-price", "2")  # fmt: skip
    assert code == 0
    summary = json.loads(out)
    assert round(summary["total"]["token_hit_rate"], 3) == 0.651
    assert summary["cost"]["tokens_saved"] == summary["total"]["hit_tokens"]
    assert {p.name for p in tmp_path.iterdir()} == {"instance_hit_rates.csv", "summary.json", "t.png"}


@pytest.mark.heavy
def test_sweep_with_policies_writes_csv_json_and_a_png(capsys, tmp_path):
    png = tmp_path / "sweep.png"
    code, out, _ = run(capsys, MOONCAKE, "--limit", "600", "--sweep", "--points", "5",
                       "--policies", "lru,lfu,leaf_lru", "--plot", png, "--out", tmp_path, "-q")  # fmt: skip
    assert code == 0
    assert out.startswith("unbounded: working set") and len(out.splitlines()) == 2 + 15
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    points = json.loads((tmp_path / "sweep.json").read_text())["points"]
    assert [p["policy"] for p in points] == ["lru"] * 5 + ["lfu"] * 5 + ["leaf_lru"] * 5
    assert (tmp_path / "sweep.csv").read_text().count("\n") == 16


def test_explicit_capacities_and_a_policy_comparison(capsys):
    code, out, _ = run(capsys, MOONCAKE, "--limit", "300", "--sweep", "--capacities", "100,1000",
                       "--json")  # fmt: skip
    assert code == 0
    assert [p["capacity"] for p in json.loads(out)["points"]] == [100, 1000]
    code, out, _ = run(capsys, MOONCAKE, "--limit", "300", "--capacity", "500",
                       "--policies", "lru,ttl", "--policy-opt", "ttl.ttl_seconds=1", "--json")  # fmt: skip
    points = json.loads(out)["points"]
    assert [(p["policy"], p["capacity"]) for p in points] == [("lru", 500), ("ttl", 500)]
    assert points[1]["hit_blocks"] < points[0]["hit_blocks"]


def test_dump_schema_then_replay_it(capsys, tmp_path):
    src = tmp_path / "t.jsonl"
    src.write_text("".join(json.dumps({"timestamp": i * 100, "input_length": 40, "output_length": 1,
                                       "hash_ids": [0, 1, i % 3]}) + "\n" for i in range(20)))  # fmt: skip
    schema = tmp_path / "s.jsonl"
    code, _, err = run(capsys, src, "--block-size", "16", "--dump-schema", schema)
    assert code == 0 and "wrote 20 records" in err
    _, direct, _ = run(capsys, src, "--block-size", "16", "--json")
    _, again, _ = run(capsys, schema, "--format", "kvcm_schema", "--json")
    assert json.loads(direct)["total"] == json.loads(again)["total"]


def test_toml_config_with_two_instances_and_tiers(capsys, tmp_path):
    trace = tmp_path / "t.jsonl"
    lines = [{"kvcm_schema": 1, "block_size": 16}]
    for i in range(60):
        lines.append({"ts": i, "instance": "ab"[i % 2], "op": "turn", "keys": [1, 2, 3 + i % 7]})
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    config = tmp_path / "c.toml"
    config.write_text(f"""
[trace]
path = "{trace}"
format = "kvcm_schema"

[replay]
promote = true

[[groups]]
name = "g"
instances = ["a", {{ id = "b", block_size = 32 }}]
[[groups.tiers]]
name = "hbm"
capacity = 4
[[groups.tiers]]
name = "ssd"
capacity = 6
policy = "leaf_lru"
""")
    code, out, err = run(capsys, "--config", config, "--json", "--export-tree", tmp_path / "trees")
    assert code == 0, err
    summary = json.loads(out)
    assert set(summary["instances"]) == {"a", "b"}
    assert [t["name"] for t in summary["groups"][0]["tiers"]] == ["hbm", "ssd"]
    assert summary["instances"]["b"]["tier_hit_blocks"][1] > 0
    assert (tmp_path / "trees" / "radix_tree_a.json").exists()
    assert (tmp_path / "trees" / "radix_tree_b.dot").read_text().startswith("digraph")


@pytest.mark.parametrize(
    "argv, code, message",
    [
        (["--policies", "lru,fifo"], 2, "unknown policy 'fifo'; valid: lru, lfu"),
        (["--capacity", "ten"], 2, "bad capacity 'ten'"),
        (["--capacity", "1GiB"], 2, "byte capacity needs block_bytes"),
        (["--trace-opt", "speed=2"], 2, "bad trace option 'speed=2'"),
        (["--policy-opt", "lru.ttl_seconds=3"], 2, "no option ttl_seconds"),
        ([], 1, ":2: missing field 'hash_ids'"),
    ],
)
def test_errors_exit_with_a_clear_message(capsys, tmp_path, argv, code, message):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 3, "hash_ids": [1]}\n{"timestamp": 1}\n')
    got, _, err = run(capsys, trace, *argv)
    assert got == code and message in err


def test_config_errors_name_the_key(capsys, tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('[replay]\nmode = "fast"\n')
    assert run(capsys, "t.jsonl", "--config", config)[2].count("replay.mode must be one of") == 1
    config.write_text("[[groups]]\nname = 'g'\ncolor = 1\n")
    assert "groups[0]: unknown key 'color'" in run(capsys, "t.jsonl", "--config", config)[2]
    assert "no trace: give TRACE" in run(capsys)[2]


def test_add_optimize_parser_wires_into_a_parent_cli():
    parser = argparse.ArgumentParser(prog="kvcm")
    add_optimize_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["optimize", "t.jsonl", "--sweep", "--policies", "lru,lfu"])
    assert args.command == "optimize" and args.sweep and args.run.__name__ == "run_optimize"


def test_python_dash_m_runs():
    proc = subprocess.run(
        [sys.executable, "-m", "kvcm.optimizer", "--help"],
        capture_output=True, text=True, check=False, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert proc.returncode == 0 and "--sweep" in proc.stdout


def test_kvcm_main_cli_dispatches_optimize(capsys, tmp_path):
    kvcm_cli = pytest.importorskip("kvcm.cli")
    src = tmp_path / "t.jsonl"
    src.write_text('{"timestamp": 0, "input_length": 20, "hash_ids": [1, 2]}\n' * 2)
    assert kvcm_cli.main(["optimize", str(src), "--block-size", "16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["total"]["hit_blocks"] == 2


def test_the_servers_event_log_replays(capsys, tmp_path):
    eventlog = pytest.importorskip("kvcm.publish.eventlog")
    path = tmp_path / "events.jsonl"
    log = eventlog.EventLog(str(path))
    log.get_cache_location("inst", "prefix_match", [1, 2], block_mask={"offset": 0})
    log.start_write_cache("inst", "s1", [1, 2, 3], block_mask={"offset": 0})
    log.finish_write_cache("inst", "s1", success_block={"offset": 3})
    log.get_cache_location("inst", "prefix_match", [1, 2, 3, 4], block_mask=None)
    log.cache_reclaim_submit("inst", [3], [["loc"]], 0)
    log.close()
    code, out, _ = run(capsys, path, "--format", "kvcm_events", "--json")
    summary = json.loads(out)
    assert code == 0 and summary["total"]["external_hit_blocks"] == 3
    assert summary["trace_counts"]["paired_writes"] == 1


def test_list_samples_names_the_shipped_trace(capsys):
    code, out, _ = run(capsys, "--list-samples")
    assert code == 0
    name, fmt, path, about = out.splitlines()[0].split("\t")
    assert (name, fmt) == ("mooncake", "mooncake") and "Mooncake" in about
    assert Path(path).is_file() and Path(path).parent.name == "samples"
    assert Path(path).stat().st_size < 1 << 20  # package data stays small


def test_sample_replays_the_shipped_trace_like_the_file(capsys):
    code, out, _ = run(capsys, "--sample", "mooncake", "--json")
    assert code == 0
    assert round(json.loads(out)["total"]["token_hit_rate"], 3) == 0.651
    _, direct, _ = run(capsys, MOONCAKE, "--json")
    assert json.loads(direct)["total"] == json.loads(out)["total"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--sample", "nope"], "unknown sample 'nope'; valid: mooncake"),
        (["--sample", "mooncake", "t.jsonl"], "either TRACE or --sample"),
    ],
)
def test_sample_errors(capsys, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == 2 and message in err


def test_the_sample_is_package_data():
    """``pip install .`` ships it: pyproject's package-data covers the samples directory."""
    from kvcm.optimizer.cli import SAMPLES, SAMPLES_DIR

    root = Path(__file__).resolve().parents[2]
    pyproject = (root / "pyproject.toml").read_text()
    assert '"kvcm.optimizer" = ["samples/*.jsonl.gz"' in pyproject
    assert all(s.path.parent == SAMPLES_DIR and s.file.endswith(".jsonl.gz") for s in SAMPLES.values())


def test_the_quick_start_runs_outside_a_checkout(tmp_path):
    """``kvcm optimize --sample mooncake`` needs no file of the repository's tests/ (run from an
    empty directory)."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-m", "kvcm", "optimize", "--sample", "mooncake"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "instance                     3993     121877    0.6396  0.0000  0.6396    0.6512" in done.stdout


def test_plot_without_matplotlib_fails_before_the_sweep(tmp_path):
    """A missing matplotlib is one line and exit 2 at once: no replay, no --out directory."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "matplotlib.py").write_text("raise ImportError('no matplotlib in this test')\n")
    out_dir = tmp_path / "out"
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # this checkout, wherever the child runs
    env["PYTHONPATH"] = os.pathsep.join([str(shim), root, *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run([sys.executable, "-m", "kvcm", "optimize", MOONCAKE, "--format", "mooncake", "--sweep",
                           "--out", str(out_dir), "--plot", str(out_dir / "sweep.png")],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "matplotlib" in done.stderr, done.stderr
    assert done.stdout == ""
    assert not out_dir.exists()
