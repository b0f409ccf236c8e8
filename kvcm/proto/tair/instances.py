"""Tair's instance registration (location specs, spec groups, model deployment) and instance
info, and the endpoints of Tair's cluster info."""

from __future__ import annotations

from kvcm.errors import InvalidArgument
from kvcm.proto.tair.fields import (
    as_list,
    as_map,
    as_maps,
    boolean,
    int32,
    int64,
    message,
    messages,
    out64,
    path,
    text,
    texts,
)
from kvcm.proto.tair.shapes import fill
from kvcm.proto.wire import Decoded, DecodedMap, Encodable

_SPEC_INFO = frozenset({"name", "size"})
_SPEC_GROUP = frozenset({"name", "spec_names"})
_DEPLOYMENT = frozenset({"model_name", "dtype", "use_mla", "tp_size", "dp_size", "lora_name", "pp_size", "extra",
                         "user_data", "use_eagle_pop"})
_DEPLOYMENT_INTS = ("tp_size", "dp_size", "pp_size")


def spec_infos_in(value: Decoded, where: str) -> list[dict[str, Encodable]]:
    out: list[dict[str, Encodable]] = []
    for i, raw in enumerate(messages(value, where)):
        item = message(raw, f"{where}[{i}]", _SPEC_INFO)
        out.append({"name": text(item.get("name"), f"{where}[{i}].name"), "size": int64(item.get("size"), f"{where}[{i}].size")})
    return out


def spec_groups_in(value: Decoded, where: str) -> list[dict[str, Encodable]]:
    out: list[dict[str, Encodable]] = []
    for i, raw in enumerate(messages(value, where)):
        item = message(raw, f"{where}[{i}]", _SPEC_GROUP)
        out.append({"name": text(item.get("name"), f"{where}[{i}].name"),
                    "spec_names": texts(item.get("spec_names"), f"{where}[{i}].spec_names")})
    return out


def deployment_in(value: Decoded, where: str) -> dict[str, Encodable]:
    deployment = message(value, where, _DEPLOYMENT)
    out: dict[str, Encodable] = {}
    for key in ("model_name", "dtype", "lora_name", "extra", "user_data"):
        if key in deployment:
            out[key] = text(deployment[key], path(where, key))
    for key in _DEPLOYMENT_INTS:
        if key in deployment:
            out[key] = int32(deployment[key], path(where, key))
    if "use_mla" in deployment:
        out["use_mla"] = boolean(deployment["use_mla"], path(where, "use_mla"))
    if boolean(deployment.get("use_eagle_pop"), path(where, "use_eagle_pop")):
        raise InvalidArgument(f"{where}.use_eagle_pop: kvcm does not shorten the full-attention prefix (docs/tair.md)")
    return out


def instance_out(info: DecodedMap) -> dict[str, Encodable]:
    """kvcm's instance info as Tair's InstanceInfo, every field printed. ``default_query_type`` is
    Tair's zero value: kvcm keeps none (a lookup names its query type)."""
    deployment = as_map(info.get("model_deployment") or {})
    tair_deployment = {name: deployment[name] for name in _DEPLOYMENT if name in deployment}
    return fill("InstanceInfo", {
        "quota_group_name": info.get("quota_group_name", ""),
        "instance_group_name": info["instance_group_name"],
        "instance_id": info["instance_id"],
        "block_size": info["block_size"],
        "location_spec_infos": [{"name": s["name"], "size": out64(s["size"])} for s in as_maps(info["location_spec_infos"])],
        "model_deployment": fill("ModelDeployment", tair_deployment),
        "location_spec_groups": [{"name": g["name"], "spec_names": list(as_list(g["spec_names"]))}
                                 for g in as_maps(info.get("location_spec_groups") or [])],
    })


def endpoint_parts(endpoint: str) -> tuple[str, int]:
    """``tcp://host:port`` -> (host, port); ("", 0) for ipc:// and what does not parse."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme != "tcp":
        return "", 0
    host, _, port = rest.rpartition(":")
    host = host.strip("[]")
    return (host, int(port)) if port.isdigit() else ("", 0)
