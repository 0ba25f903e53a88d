"""GET requests to the Kubernetes API through the official client's `ApiClient` (its credentials,
TLS and token refresh), without its generated API classes.

The client's `CoreV1Api` and `CustomObjectsApi` modules (63,000 and 9,000 generated lines, with
pydantic validation on every call) take seconds to import on a busy node, and discovery reads
raw JSON anyway: the paths and query parameters it needs are few and stable.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from picker.discovery.kube_reflector import ListCall

_QUERY_NAMES = {
    "allow_watch_bookmarks": "allowWatchBookmarks",
    "field_selector": "fieldSelector",
    "label_selector": "labelSelector",
    "resource_version": "resourceVersion",
    "timeout_seconds": "timeoutSeconds",
    "watch": "watch",
}


def query_params(query: dict[str, str | int | bool | None]) -> list[tuple[str, str]]:
    """The API's query parameters for snake_case arguments; None leaves a parameter out."""
    params: list[tuple[str, str]] = []
    for name, value in query.items():
        if value is None:
            continue
        if name not in _QUERY_NAMES:
            raise TypeError(f"unknown query argument {name!r}")
        params.append((_QUERY_NAMES[name], str(value).lower() if isinstance(value, bool) else str(value)))
    return params


def get(
    api: client.ApiClient, path: str, request_timeout: Any, **query: str | int | bool | None
) -> urllib3.BaseHTTPResponse:
    """GET `path` (already escaped) with `query`; the unread response, or ApiException for a
    status other than 2xx."""
    method, url, headers, body, post_params = api.param_serialize(
        method="GET",
        resource_path=path,
        query_params=query_params(query),
        header_params={"Accept": "application/json"},
        auth_settings=["BearerToken"],
    )
    response = api.call_api(method, url, headers, body, post_params, _request_timeout=request_timeout)
    if not 200 <= response.status <= 299:
        read_body: Callable[[], object] = response.read  # untyped upstream; the exception reads the body
        read_body()
        raise ApiException.from_response(http_resp=response, body=None, data=None)
    raw: urllib3.BaseHTTPResponse = response.response
    return raw


def list_call(api: client.ApiClient, path: str, **fixed: str | int | bool | None) -> ListCall:
    """A `ListCall` for the collection at `path`, with `fixed` query arguments on every call."""

    def call(_request_timeout: Any = None, **query: str | int | bool | None) -> urllib3.BaseHTTPResponse:
        return get(api, path, _request_timeout, **fixed, **query)

    return call


def _group_path(group: str, version: str) -> str:
    return f"/apis/{quote(group, safe='')}/{quote(version, safe='')}"


def namespaced_path(namespace: str, plural: str, group: str = "", version: str = "v1") -> str:
    """The path of a namespaced collection: the core group's when `group` is empty."""
    prefix = _group_path(group, version) if group else f"/api/{quote(version, safe='')}"
    return f"{prefix}/namespaces/{quote(namespace, safe='')}/{quote(plural, safe='')}"


def served_resources(api: client.ApiClient, group: str, version: str, request_timeout: float) -> set[str]:
    """The resource names (plurals and subresources) API discovery lists for group/version;
    ApiException (404 when the group/version is not served) otherwise."""
    response = get(api, _group_path(group, version), request_timeout)
    try:
        body = json.loads(response.data)
    finally:
        response.release_conn()
    return {str(resource["name"]) for resource in body.get("resources") or ()}
