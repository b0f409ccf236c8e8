"""Trace readers: each format's records, the schema round trip, and errors with line numbers."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from kvcm.cache.keys import chain_hash_ids
from kvcm.optimizer.kvcm_events import event_line
from kvcm.optimizer.trace import Record, TraceError
from kvcm.optimizer.trace_readers import READERS, dump_schema, parse_options, read_trace
from kvcm.optimizer.vllm_capture import capture_line
from kvcm.proto.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, encode_batch

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "vllm_events.jsonl"  # captured vLLM event payloads


def _write(tmp_path: Path, lines: list, name: str = "t.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return path


def _req(ts, ids, n_in, n_out=1):
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}


# --- registry and options -----------------------------------------------------------------------


def test_registry_names():
    assert set(READERS) == {"mooncake", "qwen_bailian", "kvcm_events", "vllm_events", "kvcm_schema"}
    assert READERS["mooncake"].block_size == 512


def test_unknown_format_and_option_list_the_valid_ones(tmp_path):
    path = _write(tmp_path, [_req(0, [1], 5)])
    with pytest.raises(ValueError, match="unknown trace format 'csv'; valid: mooncake, qwen_bailian"):
        read_trace(path, "csv")
    with pytest.raises(ValueError, match="no option colour; options: instance, time_scale"):
        read_trace(path, "mooncake", colour=1)
    with pytest.raises(FileNotFoundError):
        read_trace(tmp_path / "missing.jsonl", "mooncake")


def test_parse_options_converts_to_the_defaults_types():
    assert parse_options("mooncake", ["time_scale=1", "instance=a"]) == {"time_scale": 1.0, "instance": "a"}
    assert parse_options("vllm_events", ["removals=true"]) == {"removals": True}
    with pytest.raises(ValueError, match="bad trace option 'nope=1'"):
        parse_options("mooncake", ["nope=1"])
    with pytest.raises(ValueError, match="bad value"):
        parse_options("vllm_events", ["removals=maybe"])


# --- mooncake / bailian -------------------------------------------------------------------------


def test_mooncake_lines_become_turns_with_chained_keys(tmp_path):
    path = _write(tmp_path, [_req(0, [0, 1, 2], 1100, 7), "", _req(1500, [0, 1, 5], 1024)])
    trace = read_trace(path, "mooncake")
    records = list(trace)
    assert [r.ts for r in records] == [0.0, 1.5]  # milliseconds -> seconds
    assert records[0] == Record(0.0, "instance", "turn", chain_hash_ids([0, 1, 2]), tokens=1100,
                                output_tokens=7)  # fmt: skip
    assert records[1].keys[:2] == records[0].keys[:2] and records[1].keys[2] != records[0].keys[2]
    assert trace.block_size_of("instance") == 512


def test_same_hash_id_after_a_different_prefix_is_a_different_key(tmp_path):
    path = _write(tmp_path, [_req(0, [1, 2], 10), _req(1, [3, 2], 10)])
    first, second = read_trace(path, "mooncake")
    assert first.keys[1] != second.keys[1]


def test_bailian_uses_seconds_and_16_token_blocks(tmp_path):
    path = _write(tmp_path, [_req(2.5, [4], 16)])
    trace = read_trace(path, "qwen_bailian", instance="qwen")
    (record,) = trace
    assert (record.ts, record.instance, trace.block_size) == (2.5, "qwen", 16)


@pytest.mark.parametrize(
    "bad, message",
    [
        ("{not json", "t.jsonl:2: not valid JSON"),
        ("[1, 2]", "t.jsonl:2: expected a JSON object, got list"),
        ('{"timestamp": 0, "input_length": 3}', "t.jsonl:2: missing field 'hash_ids'"),
        ('{"timestamp": 0, "input_length": 3, "hash_ids": [1, "x"]}', "t.jsonl:2: field 'hash_ids' must be a list of integers"),
        ('{"timestamp": "0", "input_length": 3, "hash_ids": [1]}', "t.jsonl:2: field 'timestamp' has type str"),
        ('{"timestamp": 0, "input_length": -3, "hash_ids": [1]}', "t.jsonl:2: input_length is negative"),
        ('{"timestamp": true, "input_length": 3, "hash_ids": [1]}', "t.jsonl:2: field 'timestamp' has type bool"),
    ],
)  # fmt: skip
def test_bad_lines_fail_with_their_line_number(tmp_path, bad, message):
    path = _write(tmp_path, [_req(0, [1], 5), bad, _req(2, [1], 5)])
    records = iter(read_trace(path, "mooncake"))
    assert next(records).keys  # the good first line streams before the bad one is read
    with pytest.raises(TraceError, match=message.replace("[", r"\[")):
        next(records)


# --- kvcm_schema --------------------------------------------------------------------------------


def test_schema_round_trip_keeps_every_field_and_block_sizes(tmp_path):
    records = [
        Record(1.0, "a", "turn", [1, 2, 3], tokens=40, output_tokens=3),
        Record(2.0, "b", "read", [4, 5], mask=[True, False]),
        Record(3.0, "b", "write", [6], parent=5),
        Record(4.0, "a", "remove", [2]),
        Record(5.0, "b", "clear"),
    ]
    src = _write(tmp_path, [{"kvcm_schema": 1, "block_size": 8, "instances": {"b": {"block_size": 32}}}]
                 + [r.to_json() for r in records], "in.jsonl")  # fmt: skip
    out = tmp_path / "out.jsonl"
    assert dump_schema(read_trace(src, "kvcm_schema"), out) == 5
    again = read_trace(out, "kvcm_schema")
    assert list(again) == records
    assert again.block_size_of("a") == 8 and again.block_size_of("b") == 32


def test_mooncake_dumps_to_schema_and_replays_the_same(tmp_path):
    src = _write(tmp_path, [_req(0, [0, 1], 1000), _req(5, [0, 1, 2], 1200)])
    out = tmp_path / "schema.jsonl"
    dump_schema(read_trace(src, "mooncake"), out)
    header = json.loads(out.read_text().splitlines()[0])
    assert header == {"kvcm_schema": 1, "block_size": 512, "instances": {}}
    assert list(read_trace(out, "kvcm_schema")) == list(read_trace(src, "mooncake"))


def test_schema_rejects_unknown_ops_and_bad_masks(tmp_path):
    path = _write(tmp_path, [{"ts": 0, "instance": "a", "op": "evict"}])
    with pytest.raises(TraceError, match=r":1: unknown op 'evict'"):
        list(read_trace(path, "kvcm_schema"))
    path = _write(tmp_path, [{"ts": 0, "instance": "a", "op": "read", "keys": [1], "mask": [1]}])
    with pytest.raises(TraceError, match="mask must be"):
        list(read_trace(path, "kvcm_schema"))


# --- kvcm_events --------------------------------------------------------------------------------


def _ev(kind, t_us, source="inst", **fields):
    return event_line(kind, source, t_us, f"id{t_us}", **fields)


def _kvcm_log(tmp_path):
    return _write(tmp_path, [
        _ev("GetCacheLocation", 1_000_000, query_type="prefix_match", keys=[1, 2, 3],
            tokens=list(range(40)), block_mask=1, sw_size=-1, location_spec_names=[]),
        _ev("GetCacheLocation", 1_100_000, query_type="batch_get", keys=[1], tokens=[]),
        _ev("StartWriteCache", 1_200_000, write_session_id="s1", keys=[1, 2, 3, 4, 5], tokens=[],
            block_mask={"offset": 2}, location_spec_group_names=[], write_timeout_seconds=30),
        _ev("StartWriteCache", 1_300_000, write_session_id="s2", keys=[8, 9], tokens=[],
            block_mask=None, write_timeout_seconds=30),
        _ev("FinishWriteCache", 1_400_000, write_session_id="s1", success_block=2),
        _ev("FinishWriteCache", 1_500_000, write_session_id="lost", success_block=1),
        _ev("CacheReclaimSubmit", 1_600_000, block_keys=[4], location_ids=[["l1"]], delay_us=0),
        _ev("GetCacheLocation", 1_700_000, source="other", keys=[7, 8],
            block_mask={"bool_masks": [True, False]}),
    ])  # fmt: skip


def test_kvcm_events_reads_writes_pairing_and_counts(tmp_path):
    trace = read_trace(_kvcm_log(tmp_path), "kvcm_events", block_size=4)
    records = list(trace)
    assert records == [
        Record(1.0, "inst", "read", [1, 2, 3], mask=1, tokens=40),
        # stored 1, 2 (server had them) + the first two new keys that succeeded (3, 4)
        Record(1.4, "inst", "write", [1, 2, 3, 4], tokens=3 * 4, output_tokens=(5 - 3 + 1) * 4),
        Record(1.7, "other", "read", [7, 8], mask=[True, False]),
    ]
    counts = trace.counts
    assert counts["skipped_query_batch_get"] == 1 and counts["paired_writes"] == 1
    assert counts["unpaired_writes"] == 1 and counts["finish_without_start"] == 1
    assert counts["unfinished_writes"] == 1 and counts["reclaim_events"] == 1
    assert counts["unpaired_reads"] == 1


def test_kvcm_events_can_apply_the_servers_reclaims(tmp_path):
    records = list(read_trace(_kvcm_log(tmp_path), "kvcm_events", apply_reclaims=True))
    assert Record(1.6, "inst", "remove", [4]) in records


def test_kvcm_events_bool_success_mask_and_bad_masks(tmp_path):
    path = _write(tmp_path, [
        _ev("StartWriteCache", 0, write_session_id="s", keys=[1, 2, 3], block_mask=[False, True, False]),
        _ev("FinishWriteCache", 10, write_session_id="s", success_blocks=[False, True]),
        _ev("GetCacheLocation", 20, keys=[1, 2], block_mask=[True]),
    ])  # fmt: skip
    records = iter(read_trace(path, "kvcm_events"))
    assert next(records).keys == [2, 3]
    with pytest.raises(TraceError, match=r":3: block_mask has 1 entries for 2 keys"):
        next(records)


def test_kvcm_events_read_every_logged_mask_shape(tmp_path):
    """Masks as older logs hold them (both fields, one null; Tair's {"values": [...]}) read
    like the ones logged as sent."""
    shapes = [{"offset": None, "bool_masks": [True, False]}, {"offset": None, "bool_masks": {"values": [True, False]}},
              {"bool_masks": [True, False]}, {"offset": 1, "bool_masks": None}, {"offset": 1}]
    path = _write(tmp_path, [_ev("GetCacheLocation", 10 * i, keys=[1, 2], block_mask=m) for i, m in enumerate(shapes)])
    assert [r.mask for r in read_trace(path, "kvcm_events")] == [[True, False]] * 3 + [1, 1]


def test_kvcm_events_unknown_type_is_counted_missing_field_is_an_error(tmp_path):
    path = _write(tmp_path, [{"type": "Heartbeat", "trigger_time_us": 0, "source": "a"},
                             {"type": "GetCacheLocation", "source": "a", "keys": [1]}])  # fmt: skip
    trace = read_trace(path, "kvcm_events")
    with pytest.raises(TraceError, match=r":2: missing field 'trigger_time_us'"):
        list(trace)
    assert trace.counts["skipped_type_Heartbeat"] == 1


# --- vllm_events --------------------------------------------------------------------------------


def _stored(hashes, parent, n_tokens=32, medium="GPU"):
    return BlockStored(hashes, parent, list(range(n_tokens)), 16, None, medium, None)


def _capture(tmp_path, batches, encoding="map", seqs=None):
    lines = []
    for i, (ts, events) in enumerate(batches):
        payload = encode_batch(events, ts, 0, encoding)
        seq = seqs[i] if seqs else i
        lines.append(capture_line(ts + 0.01, "engine-0", seq, "kv", payload))
    return _write(tmp_path, lines, f"cap_{encoding}.jsonl")


BATCHES = [
    (10.0, [_stored([101, 102], None), _stored([103], 102, 16)]),
    (11.0, [BlockRemoved([103], "GPU"), _stored([201], None, 16, medium="CPU")]),
    (12.0, [AllBlocksCleared(), _stored([b"\x00" * 24 + (7).to_bytes(8, "big")], -1 & (2**64 - 1))]),
]


@pytest.mark.parametrize("encoding", ["map", "array", "mixed"])
def test_vllm_capture_replays_stores_in_every_encoding(tmp_path, encoding):
    trace = read_trace(_capture(tmp_path, BATCHES, encoding), "vllm_events")
    records = list(trace)
    assert records == [
        Record(10.0, "engine-0", "turn", [101, 102], tokens=32),
        Record(10.0, "engine-0", "turn", [103], parent=102, tokens=16),
        Record(12.0, "engine-0", "turn", [7], parent=2**64 - 1, tokens=32),  # bytes: last 8 bytes
    ]
    assert trace.block_size_of("engine-0") == 16
    assert trace.counts["removed_blocks"] == 1 and trace.counts["cleared"] == 1
    assert trace.counts["skipped_medium"] == 1


def test_vllm_capture_removals_and_medium_options(tmp_path):
    path = _capture(tmp_path, BATCHES)
    ops = [(r.op, r.keys) for r in read_trace(path, "vllm_events", removals=True, medium="all")]
    assert ops == [("turn", [101, 102]), ("turn", [103]), ("remove", [103]), ("turn", [201]),
                   ("clear", []), ("turn", [7])]  # fmt: skip
    cpu = [r.keys for r in read_trace(path, "vllm_events", medium="cpu")]
    assert cpu == [[201]]


def test_vllm_capture_counts_sequence_gaps(tmp_path):
    path = _capture(tmp_path, BATCHES, seqs=[0, 3, 1])
    trace = read_trace(path, "vllm_events")
    list(trace)
    assert trace.counts["seq_gaps"] == 1 and trace.counts["seq_lost"] == 2
    assert trace.counts["seq_restarts"] == 1


def test_vllm_capture_bad_payloads_name_the_line(tmp_path):
    good = capture_line(1.0, "e", 0, "", encode_batch([], 1.0))
    for bad, message in (("%%%", "not base64"), (base64.b64encode(b"\xc1").decode(), "not a KVEventBatch")):
        line = json.dumps({"ts": 1.0, "source": "e", "seq": 1, "topic": "", "payload_b64": bad})
        path = _write(tmp_path, [good, line])
        with pytest.raises(TraceError, match=f":2: .*{message}"):
            list(read_trace(path, "vllm_events"))


def test_vllm_capture_decodes_the_shared_golden_payloads(tmp_path):
    lines = []
    for i, line in enumerate(GOLDEN.read_text().splitlines()):
        golden = json.loads(line)
        lines.append(json.dumps({"ts": golden["ts"], "source": golden["encoding"], "seq": i,
                                 "topic": "", "payload_b64": golden["payload_b64"]}))  # fmt: skip
    by_source: dict[str, list] = {}
    for record in read_trace(_write(tmp_path, lines), "vllm_events", medium="all", removals=True):
        by_source.setdefault(record.instance, []).append((record.op, record.keys, record.parent))
    assert set(by_source) == {"map", "array", "mixed"}
    assert by_source["map"] == by_source["array"] == by_source["mixed"]
