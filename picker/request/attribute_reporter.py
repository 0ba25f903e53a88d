"""`request-attribute-reporter`: a number computed by a CEL expression over the response's
usage, reported to the proxy as dynamic metadata (the reference plugin of the same type).

CEL is Google's C++ implementation (`cel-expr-python`), with the reference's environment: one
variable, `usage`, a `google.protobuf.Struct`, so numbers are doubles and a missing key is an
evaluation error. Expressions are compiled and type-checked once, when the config is built;
a report (condition and expression) costs about 15 µs, and the director asks again only when
the usage changes, so a streamed response pays it about twice (before and after its usage).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from picker.framework.handle import Handle
from picker.framework.parameters import Parameters, PluginConfigError
from picker.framework.plugin import DynamicMetadata, ResponseMetadata
from picker.framework.request import InferenceRequest, Usage

log = logging.getLogger(__name__)

DEFAULT_NAMESPACE = "envoy.lb"


class _Cel(NamedTuple):
    environment: Any  # cel.Env with the `usage` variable
    error: Any  # the result types the reporter tells apart
    boolean: Any
    numbers: tuple[Any, ...]  # what an expression may give (cel-go: int64 or float64)


@functools.cache
def _cel() -> _Cel:
    """CEL, imported on first use: only configs with a reporter load its library (~4 MB)."""
    from cel_expr_python import cel

    environment = cel.NewEnv(variables={"usage": cel.Type("google.protobuf.Struct")})
    return _Cel(environment, cel.Type.ERROR, cel.Type.BOOL, (cel.Type.INT, cel.Type.DOUBLE))


def compile_expression(source: str, where: str) -> Any:
    """`source` compiled and type-checked in the reporter's environment; PluginConfigError
    naming `where` and CEL's own message (line, column, caret) if it does not compile."""
    try:
        return _cel().environment.compile(source)
    except RuntimeError as error:
        message = str(error).removeprefix("INVALID_ARGUMENT: ").removesuffix(" [INVALID_ARGUMENT]")
        raise PluginConfigError(f"{where}: failed to compile: {message}") from None


def usage_value(usage: Usage) -> dict[str, Any]:
    """The `usage` variable, shaped as the reference's Usage marshals to JSON (a Struct's
    numbers are doubles): the three counts always, `prompt_token_details.cached_tokens` when
    the response reported cached tokens. A dict of floats reads as that Struct does, and
    costs half as much to hand to CEL."""
    value: dict[str, Any] = {
        "prompt_tokens": float(usage.prompt_tokens),
        "completion_tokens": float(usage.completion_tokens),
        "total_tokens": float(usage.total_tokens),
    }
    if usage.cached_tokens:
        value["prompt_token_details"] = {"cached_tokens": float(usage.cached_tokens)}
    return value


@dataclass(frozen=True, slots=True)
class Attribute:
    """One reported value: dynamic metadata `namespace`/`name` set to `expression` (truncated to
    an integer) when `condition` (None: always) is true."""

    namespace: str
    name: str
    expression: Any  # a compiled cel.Expression
    condition: Any | None


class RequestAttributeReporter(ResponseMetadata):
    """Reports one attribute (`attributes` holds exactly one, as in the reference), e.g.

        attributes:
        - key: {namespace: envoy.lb, name: x-gateway-inference-request-cost}
          expression: usage.prompt_tokens + usage.completion_tokens
          condition: has(usage.completion_tokens)

    As in the reference: a condition that is not `true` reports nothing; the expression must
    give an int or a double, truncated to an integer; zero is not reported; an evaluation error
    is logged and reports nothing. The namespace must be one the proxy accepts (Envoy's
    ext_proc `metadata_options.receiving_namespaces`; the shipped configs accept `envoy.lb`).

    Differences: `prompt_token_details` holds the cached tokens under either spelling the
    model server uses (the reference reads only its misspelt `prompt_token_details`, which vLLM
    does not send), and is absent when they are zero; unknown parameters are errors (the
    reference ignores them).
    """

    plugin_type = "request-attribute-reporter"

    def __init__(self, name: str, attribute: Attribute) -> None:
        super().__init__(name)
        self.attribute = attribute

    @classmethod
    def create(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> RequestAttributeReporter:
        params = Parameters(parameters)
        attributes = params.mappings("attributes")
        if len(attributes) != 1:
            raise PluginConfigError(f"attributes: must contain exactly one entry, got {len(attributes)}")
        entry = Parameters(attributes[0])
        try:
            key = Parameters(entry.mapping("key"))
            namespace = key.string("namespace", DEFAULT_NAMESPACE) or DEFAULT_NAMESPACE
            key_name = key.string("name", "")
            key.finish()
        except PluginConfigError as error:
            raise PluginConfigError(f"attributes[0].key.{error}") from None
        try:
            expression = entry.string("expression", "")
            condition = entry.string("condition", "")
            entry.finish()
        except PluginConfigError as error:
            raise PluginConfigError(f"attributes[0].{error}") from None
        if not key_name:
            raise PluginConfigError("attributes[0].key.name: must not be empty")
        if not expression:
            raise PluginConfigError("attributes[0].expression: must not be empty")
        attribute = Attribute(
            namespace,
            key_name,
            compile_expression(expression, "attributes[0].expression"),
            compile_expression(condition, "attributes[0].condition") if condition else None,
        )
        reporter = cls(name, attribute)
        params.finish()
        effective = {"key": {"namespace": namespace, "name": key_name}, "expression": expression}
        if condition:
            effective["condition"] = condition
        reporter.parameters = {"attributes": [effective]}
        return reporter

    def response_metadata(self, request: InferenceRequest, usage: Usage) -> DynamicMetadata:
        attribute, cel = self.attribute, _cel()
        variables = cel.environment.Activation({"usage": usage_value(usage)})  # shared by both programs
        if attribute.condition is not None:
            met = attribute.condition.eval(variables)
            if met.type() == cel.error:
                log.error("request %s: condition of %s failed: %s", request.request_id, self.name, met.value())
                return {}
            if met.type() != cel.boolean or met.value() is not True:
                return {}
        result = attribute.expression.eval(variables)
        if result.type() == cel.error:
            log.error("request %s: expression of %s failed: %s", request.request_id, self.name, result.value())
            return {}
        value = result.value()
        if result.type() not in cel.numbers or not math.isfinite(value):
            log.error(
                "request %s: expression of %s gave %r, not a finite int or double", request.request_id, self.name, value
            )
            return {}
        number = int(value)  # truncated toward zero, as Go's int64(float64)
        if number == 0:
            return {}
        return {attribute.namespace: {attribute.name: float(number)}}
