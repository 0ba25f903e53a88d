"""The body-based router's plugins, as the reference BBR v1.5.0 defines them.

A request plugin reads the parsed JSON body and sets request headers the Gateway's routes match
on. `body-field-to-header` copies one top-level field (the model, by default) into a header;
`base-model-to-header` maps the model (a LoRA adapter or a base model) to its base model through
the adapter ConfigMaps (`picker.bbr.adapters`). Values are written as the reference's Go
`fmt.Sprintf("%v", ...)` writes what `encoding/json` decoded, so a number or a null reaches the
header in the same form.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Protocol

from picker.bbr.adapters import AdaptersStore

MODEL_FIELD = "model"
MODEL_HEADER = "X-Gateway-Model-Name"
BASE_MODEL_HEADER = "X-Gateway-Base-Model-Name"
BODY_FIELD_TO_HEADER = "body-field-to-header"
BASE_MODEL_TO_HEADER = "base-model-to-header"


class PluginSpecError(ValueError):
    """A `--plugin` value the reference would refuse too."""


class RequestPlugin(Protocol):
    """Sets request headers from the parsed body."""

    def process(self, body: Mapping[str, Any], headers: dict[str, str]) -> None: ...


def _go_float(number: float) -> str:
    """`%v` of a Go float64 (`%g`, shortest): the shortest digits, in exponent form below 1e-4
    and from 1e6 (Go's exponent has at least two digits)."""
    if number == 0:
        return "-0" if str(number).startswith("-") else "0"
    exact = Decimal(repr(number)).normalize()  # the shortest digits, no trailing zeros
    digits = exact.as_tuple().digits
    magnitude = len(digits) + int(exact.as_tuple().exponent) - 1
    if -4 <= magnitude < 6:
        return format(exact, "f")
    mantissa = "".join(map(str, digits))
    mantissa = mantissa[0] + ("." + mantissa[1:] if len(mantissa) > 1 else "")
    sign = "-" if number < 0 else ""
    return f"{sign}{mantissa}e{'-' if magnitude < 0 else '+'}{abs(magnitude):02d}"


def go_text(value: Any) -> str:
    """A decoded JSON value as Go's `%v` prints it (maps with sorted keys, nulls as `<nil>`)."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "<nil>"
    if isinstance(value, float):
        return _go_float(value)
    if isinstance(value, list):
        return "[" + " ".join(go_text(item) for item in value) + "]"
    if isinstance(value, dict):
        return "map[" + " ".join(f"{key}:{go_text(value[key])}" for key in sorted(value)) + "]"
    raise TypeError(f"not a decoded JSON value: {type(value).__name__}")


@dataclass(frozen=True, slots=True)
class BodyFieldToHeader:
    """Copies body field `field_name` into header `header_name`; absent or empty: nothing."""

    field_name: str
    header_name: str

    def process(self, body: Mapping[str, Any], headers: dict[str, str]) -> None:
        if self.field_name not in body:
            return
        text = go_text(body[self.field_name])
        if text:
            headers[self.header_name] = text


@dataclass(frozen=True, slots=True)
class BaseModelToHeader:
    """Sets `X-Gateway-Base-Model-Name` to the base model of the body's model (empty when it is
    neither a known adapter nor a known base model); nothing when the body has no model."""

    store: AdaptersStore

    def process(self, body: Mapping[str, Any], headers: dict[str, str]) -> None:
        if MODEL_FIELD in body:
            headers[BASE_MODEL_HEADER] = self.store.base_model(go_text(body[MODEL_FIELD]))


@dataclass(frozen=True, slots=True)
class PluginSpec:
    """One `--plugin <type>:<name>[:<json>]` value."""

    type: str
    name: str
    parameters: Mapping[str, Any]


def parse_plugin_spec(text: str) -> PluginSpec:
    """`--plugin` as the reference reads it: type and name required, JSON parameters optional."""
    segments = text.split(":", 2)
    if len(segments) < 2:
        raise PluginSpecError("usage: --plugin <type>:<name>:<json>")
    kind, name = segments[0].strip(), segments[1].strip()
    if not kind:
        raise PluginSpecError("bbr plugin type cannot be empty")
    if not name:
        raise PluginSpecError("bbr plugin name cannot be empty")
    parameters: Any = {}
    raw = segments[2].strip() if len(segments) == 3 else ""
    if raw:
        try:
            parameters = json.loads(raw)
        except ValueError:
            raise PluginSpecError("invalid json") from None
    if not isinstance(parameters, dict):
        raise PluginSpecError(f"the parameters of {kind}#{name} must be a JSON object")
    return PluginSpec(kind, name, parameters)


def _body_field_to_header(spec: PluginSpec, _store: Callable[[], AdaptersStore]) -> RequestPlugin:
    field_name, header_name = spec.parameters.get("fieldName") or "", spec.parameters.get("headerName") or ""
    if not isinstance(field_name, str) or not field_name:
        raise PluginSpecError(f"fieldName is required for plugin '{BODY_FIELD_TO_HEADER}'")
    if not isinstance(header_name, str) or not header_name:
        raise PluginSpecError(f"headerName is required for plugin '{BODY_FIELD_TO_HEADER}'")
    return BodyFieldToHeader(field_name, header_name)


def _base_model_to_header(_spec: PluginSpec, store: Callable[[], AdaptersStore]) -> RequestPlugin:
    return BaseModelToHeader(store())


_FACTORIES: dict[str, Callable[[PluginSpec, Callable[[], AdaptersStore]], RequestPlugin]] = {
    BODY_FIELD_TO_HEADER: _body_field_to_header,
    BASE_MODEL_TO_HEADER: _base_model_to_header,
}


def request_plugins(specs: Sequence[PluginSpec], store: Callable[[], AdaptersStore]) -> list[RequestPlugin]:
    """The plugins `specs` name, in order; none named: the reference's default pair (the model
    into `X-Gateway-Model-Name`, then its base model). `store` gives the adapter store, made
    (and watched) only when a plugin needs it."""
    if not specs:
        return [BodyFieldToHeader(MODEL_FIELD, MODEL_HEADER), BaseModelToHeader(store())]
    plugins = []
    for spec in specs:
        factory = _FACTORIES.get(spec.type)
        if factory is None:
            raise PluginSpecError(f"unknown plugin type {spec.type!r} (no factory registered)")
        plugins.append(factory(spec, store))
    return plugins
