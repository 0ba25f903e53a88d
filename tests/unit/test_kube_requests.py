"""The paths and query strings discovery sends the API server (the requests themselves run against
a real kube-apiserver in tests/e2e/test_kube_discovery.py)."""

from __future__ import annotations

import pytest

from picker.discovery.kube_requests import namespaced_path, query_params


def test_query_params_use_the_api_names_and_its_spelling_of_booleans() -> None:
    query = {"watch": True, "allow_watch_bookmarks": False, "timeout_seconds": 300, "label_selector": "app=a,b=c"}
    assert query_params(query) == [
        ("watch", "true"),
        ("allowWatchBookmarks", "false"),
        ("timeoutSeconds", "300"),
        ("labelSelector", "app=a,b=c"),
    ]


def test_query_params_leave_out_none() -> None:
    assert query_params({"resource_version": None, "field_selector": "metadata.name=p"}) == [
        ("fieldSelector", "metadata.name=p")
    ]


def test_an_unknown_query_argument_is_a_programming_error() -> None:
    with pytest.raises(TypeError, match="limit"):
        query_params({"limit": 5})


def test_core_and_group_paths() -> None:
    assert namespaced_path("ns", "pods") == "/api/v1/namespaces/ns/pods"
    assert (
        namespaced_path("ns", "inferencepools", "inference.networking.k8s.io", "v1")
        == "/apis/inference.networking.k8s.io/v1/namespaces/ns/inferencepools"
    )


def test_path_segments_are_escaped() -> None:
    assert namespaced_path("a/b", "pods") == "/api/v1/namespaces/a%2Fb/pods"
