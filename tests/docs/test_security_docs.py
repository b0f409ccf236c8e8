"""docs/security.md states who may call what, and every bound, exactly as the code has them: the
role table is generated from the server's method table, the bounds table from kvcm.config. On a
mismatch the assertion prints the text to paste."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

from kvcm import config as kvcm_config
from kvcm.testing import serve_in_thread

PAGE = Path(__file__).resolve().parents[2] / "docs" / "security.md"
BEGIN, END = "<!-- roles: begin (generated: tests/docs/test_security_docs.py) -->", "<!-- roles: end -->"

#: What limits a `user` beyond its role, for the methods where more than its groups applies.
NOTES = {
    "report_events": "its groups; only push sources it registered ([below](#push-sources))",
    "list_event_sources": "its groups (the list is filtered)",
    "list_instance_info": "its groups (the list is filtered)",
    "whoami": "itself",
    "check_health": "any caller with valid credentials",
    "get_manager_cluster_info": "any caller with valid credentials",
    "get_shard_map": "any caller with valid credentials",
}

#: A config key that bounds work, memory or an index kvcm keeps for others.
BOUND = re.compile(r"max_|limit|reserved|per_peer|per_user|per_account|per_source|budget")


def role_table() -> str:
    with serve_in_thread(overrides={"http": {"port": 0}}) as server:
        methods = server.app.dispatcher.methods
    rows = ["| method | `user` may call it | `admin` |", "|---|---|---|"]
    for name in sorted(methods):
        user = "no" if methods[name].admin else "yes: " + NOTES.get(name, "within its groups")
        rows.append(f"| `{name}` | {user} | yes |")
    return "\n".join(rows)


def test_the_role_table_is_the_method_table():
    text = PAGE.read_text()
    assert BEGIN in text and END in text
    documented = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    expected = role_table()
    assert documented == expected, f"paste between the markers of docs/security.md:\n{expected}"


def bound_keys() -> dict[str, typing.Any]:
    out = {}
    for section in dataclasses.fields(kvcm_config.Config):
        kind = typing.get_type_hints(kvcm_config.Config)[section.name]
        for key in dataclasses.fields(kind):
            if BOUND.search(key.name) and "backoff" not in key.name and section.name != "store":
                out[f"{section.name}.{key.name}"] = getattr(kind(), key.name)
    return out


def test_every_bound_is_listed_with_its_default():
    listed = dict(re.findall(r"^\| `([a-z_]+\.[a-z_]+)` \| `([^`]*)` \|", PAGE.read_text(), re.M))
    missing = sorted(set(bound_keys()) - set(listed))
    assert not missing, f"bounds missing from docs/security.md's table: {missing}"
    # Their defaults are checked against kvcm.config by tests/docs/test_docs.py (any `| key | default |` row).
