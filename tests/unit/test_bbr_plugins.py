"""picker bbr's plugins, body parsing and adapter store, against the reference's cases
(pkg/bbr/plugins/*_test.go, pkg/bbr/config) and Go's `%v` of what `encoding/json` decodes."""

from __future__ import annotations

import pytest

from picker.bbr.adapters import BBR_MANAGED_LABEL, AdapterConfigMapError, AdaptersStore, parse_config_map
from picker.bbr.plugins import (
    BASE_MODEL_HEADER,
    MODEL_HEADER,
    BaseModelToHeader,
    BodyFieldToHeader,
    PluginSpec,
    PluginSpecError,
    go_text,
    parse_plugin_spec,
    request_plugins,
)
from picker.bbr.server import parse_body
from picker.request.errors import RequestError


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"model": 1}', "1"),
        (b'{"model": 1.5}', "1.5"),
        (b'{"model": 100000}', "100000"),
        (b'{"model": 1000000}', "1e+06"),
        (b'{"model": 1234567.5}', "1.2345675e+06"),
        (b'{"model": 123456.7}', "123456.7"),
        (b'{"model": 1e21}', "1e+21"),
        (b'{"model": 0.0001}', "0.0001"),
        (b'{"model": 0.00001}', "1e-05"),
        (b'{"model": -2.5e-7}', "-2.5e-07"),
        (b'{"model": 12345678901234567890}', "1.2345678901234567e+19"),
        (b'{"model": true}', "true"),
        (b'{"model": null}', "<nil>"),
        (b'{"model": ["a", 2, null]}', "[a 2 <nil>]"),
        (b'{"model": {"b": 1, "a": "x"}}', "map[a:x b:1]"),
    ],
)
def test_values_read_as_go_prints_them(body: bytes, expected: str) -> None:
    assert go_text(parse_body(body)["model"]) == expected


@pytest.mark.parametrize("body", [b'{"model": "foo",', b"[1]", b'"model"', b"", b'{"model": NaN}', b'{"a": 1e999}'])
def test_a_body_go_cannot_decode_into_a_map_is_a_bad_request(body: bytes) -> None:
    with pytest.raises(RequestError) as raised:
        parse_body(body)
    assert raised.value.status == 400


def test_a_json_null_body_is_an_empty_map() -> None:
    assert parse_body(b"null") == {}


def store_of(*config_maps: tuple[str, str, dict[str, str]]) -> AdaptersStore:
    store = AdaptersStore()
    store.replace(
        {"metadata": {"namespace": ns, "name": name, "labels": {BBR_MANAGED_LABEL: "true"}}, "data": data}
        for ns, name, data in config_maps
    )
    return store


def test_the_default_plugins_set_the_model_and_its_base_model() -> None:
    store = store_of(("ns", "qwen", {"baseModel": "qwen3-8b", "adapters": "- finance-adapter\n"}))
    plugins = request_plugins((), lambda: store)
    cases = {
        "finance-adapter": ("finance-adapter", "qwen3-8b"),
        "qwen3-8b": ("qwen3-8b", "qwen3-8b"),
        "unknown-model": ("unknown-model", ""),
        "": (None, ""),
    }
    for model, (header, base) in cases.items():
        headers: dict[str, str] = {}
        for plugin in plugins:
            plugin.process({"model": model}, headers)
        assert (headers.get(MODEL_HEADER), headers[BASE_MODEL_HEADER]) == (header, base), model
    headers = {}
    for plugin in plugins:
        plugin.process({"prompt": "no model"}, headers)
    assert headers == {}


def test_adapters_of_several_config_maps_and_names_trimmed() -> None:
    store = store_of(
        ("a", "one", {"baseModel": " base ", "adapters": "- x\n- ' y '\n- ''\n"}),
        ("b", "two", {"baseModel": "base", "adapters": "- z"}),
        ("b", "bad", {"adapters": "- orphan"}),
    )
    assert [store.base_model(m) for m in ("x", " y", "z", "base", "orphan")] == ["base", "base", "base", "base", ""]


def test_unlabelled_config_maps_are_ignored() -> None:
    store = AdaptersStore()
    store.replace([{"metadata": {"name": "plain"}, "data": {"baseModel": "m"}}])
    assert store.base_model("m") == ""


@pytest.mark.parametrize(
    "data", [{}, {"baseModel": "  "}, {"baseModel": "m", "adapters": "a: b"}, {"baseModel": "m", "adapters": "- [x"}]
)
def test_config_maps_the_reference_refuses(data: dict[str, str]) -> None:
    with pytest.raises(AdapterConfigMapError):
        parse_config_map(data)


def test_plugin_specs_as_the_reference_reads_them() -> None:
    spec = parse_plugin_spec('body-field-to-header:m:{"fieldName":"model","headerName":"X-Model"}')
    assert spec == PluginSpec("body-field-to-header", "m", {"fieldName": "model", "headerName": "X-Model"})
    assert parse_plugin_spec("base-model-to-header:b") == PluginSpec("base-model-to-header", "b", {})
    for bad in ("only-type", ":name", "type:", "t:n:{bad"):
        with pytest.raises(PluginSpecError):
            parse_plugin_spec(bad)


def test_plugins_from_specs() -> None:
    store = AdaptersStore()
    specs = [
        parse_plugin_spec('body-field-to-header:m:{"fieldName":"user","headerName":"X-User"}'),
        parse_plugin_spec("base-model-to-header:b"),
    ]
    assert request_plugins(specs, lambda: store) == [BodyFieldToHeader("user", "X-User"), BaseModelToHeader(store)]
    with pytest.raises(PluginSpecError, match="fieldName is required"):
        request_plugins([parse_plugin_spec("body-field-to-header:m:{}")], lambda: store)
    with pytest.raises(PluginSpecError, match="unknown plugin type"):
        request_plugins([parse_plugin_spec("nope:n")], lambda: store)
