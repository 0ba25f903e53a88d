"""The endpoints file: a bad edit keeps the old list, an empty read (a rewrite in progress) too."""

from __future__ import annotations

from pathlib import Path

from picker.datastore.store import Datastore
from picker.discovery.static import EndpointFile


def addresses(store: Datastore) -> list[str]:
    return sorted(store.endpoints())


def test_an_empty_read_is_a_rewrite_in_progress_and_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.yaml"
    path.write_text("- 10.0.0.1:8000\n")
    store = Datastore()
    watched = EndpointFile(store, path)
    watched.load()
    assert addresses(store) == ["10.0.0.1:8000"]
    watched._apply(b"")  # `>` and editors truncate before they write
    assert addresses(store) == ["10.0.0.1:8000"]
    watched._apply(b"- address: not-an-address\n")
    assert addresses(store) == ["10.0.0.1:8000"]
    watched._apply(b"[]\n")  # the way to say "no endpoints"
    assert addresses(store) == []


def test_an_empty_file_at_start_means_no_endpoints(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.yaml"
    path.write_text("")
    store = Datastore()
    EndpointFile(store, path).load()
    assert addresses(store) == []
