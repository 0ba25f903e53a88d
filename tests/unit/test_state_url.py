"""`--state-store URL` and `--state-store-key KEY`: what is accepted, and a clear error naming the
flag for the rest."""

from __future__ import annotations

import pytest

from picker.serve.flags import FlagError, build_parser, serve_options
from picker.state.sync import stream_name
from picker.state.url import StoreUrl, parse_store_url


def test_a_full_url_is_parsed_and_redacted_for_logs() -> None:
    url = parse_store_url("rediss://picker:s%40cret@redis.example:6380/2")
    assert url == StoreUrl(
        "rediss://picker:s%40cret@redis.example:6380/2", True, "redis.example", 6380, 2, "picker", "s@cret"
    )
    assert url.redacted == "rediss://picker:***@redis.example:6380/2"


def test_defaults_port_6379_and_database_0() -> None:
    url = parse_store_url("redis://10.0.0.9")
    assert (url.tls, url.host, url.port, url.db, url.username, url.password) == (False, "10.0.0.9", 6379, 0, None, None)
    assert parse_store_url("redis://:pw@h:1").redacted == "redis://:***@h:1/0"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("http://h:6379", "got http://"),
        ("h:6379", "redis://[user:pass@]host:port[/db]"),
        ("redis://:6379", "the host is missing"),
        ("redis://h:notaport", "the port is invalid"),
        ("redis://h:6379/x", "the database must be a number"),
        ("redis://h:6379/0?ssl_cert_reqs=none", "query parameters"),
    ],
)
def test_a_bad_url_is_refused_naming_the_flag(text: str, message: str) -> None:
    with pytest.raises(FlagError) as error:
        build_parser().parse_args(["--endpoints", "127.0.0.1:1", "--state-store", text])
    assert "--state-store" in str(error.value) and message in str(error.value)


def test_a_password_is_never_echoed_in_the_error() -> None:
    with pytest.raises(FlagError) as error:
        build_parser().parse_args(["--state-store", "redis://u:topsecret@h:bad"])
    assert "topsecret" not in str(error.value)


def test_without_the_flag_nothing_is_shared() -> None:
    assert build_parser().parse_args(["--endpoints", "127.0.0.1:1"]).state_store is None


def test_the_store_key_names_the_stream_in_place_of_the_pool() -> None:
    args = build_parser().parse_args(
        ["--endpoints", "127.0.0.1:1", "--state-store", "redis://h", "--state-store-key", "team-a/chat"]
    )
    assert stream_name(args.pool_namespace, "", args.state_store_key) == "picker:state:v1:team-a/chat"
    assert stream_name("ns", "") == "picker:state:v1:ns/-" == stream_name("ns", "", None)
    assert stream_name("ns", "pool") == "picker:state:v1:ns/pool"


@pytest.mark.parametrize("key", ["", "has space", "x" * 201, "new\nline"])
def test_a_bad_store_key_is_refused_naming_the_flag(key: str) -> None:
    with pytest.raises(FlagError) as error:
        build_parser().parse_args(["--state-store", "redis://h", "--state-store-key", key])
    assert "--state-store-key" in str(error.value) and "letters, digits" in str(error.value)


def test_a_store_key_without_a_store_is_refused() -> None:
    args = build_parser().parse_args(["--endpoints", "127.0.0.1:1", "--state-store-key", "team-a"])
    with pytest.raises(FlagError, match="give --state-store too"):
        serve_options(args)
