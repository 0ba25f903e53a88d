"""Shared pieces of the body-based routing tests: the adapter ConfigMap, both routers, requests."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from kubernetes import client

from picker.bbr.adapters import BBR_MANAGED_LABEL

BASE_MODEL = "qwen3-8b"  # the reference's basemodelextractor test data
ADAPTER = "finance-adapter"


def put_adapter_config_map(
    api: client.ApiClient, namespace: str, name: str, base_model: str, adapters: list[str]
) -> None:
    """A ConfigMap mapping `adapters` to `base_model`, labelled for the body-based router."""
    body = client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name=name, labels={BBR_MANAGED_LABEL: "true"}),
        data={"baseModel": base_model, "adapters": "".join(f"- {a}\n" for a in adapters)},
    )
    client.CoreV1Api(api).create_namespaced_config_map(namespace, body)


@dataclass(frozen=True, slots=True)
class Answer:
    """What a client saw: the status, and the echoing backend's JSON (None when not JSON)."""

    status: int
    body: bytes

    def echoed(self) -> dict[str, Any] | None:
        try:
            parsed = json.loads(self.body)
        except ValueError:
            return None
        return parsed if isinstance(parsed, dict) else None

    def upstream_header(self, name: str) -> str | None:
        echoed = self.echoed()
        return None if echoed is None else echoed.get("headers", {}).get(name)


def post(url: str, body: bytes | None, method: str = "POST") -> Answer:
    request = urllib.request.Request(url, data=body, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return Answer(response.status, response.read())
    except urllib.error.HTTPError as error:
        return Answer(error.code, error.read())
