"""`picker bbr`'s command line: the reference bbr v1.5.0's flags as its chart passes them, and
what the reference refuses."""

from __future__ import annotations

import pytest

from picker.bbr.command import BbrOptions, bbr_options, build_parser
from picker.bbr.plugins import PluginSpec
from picker.serve.flags import FlagError


def options(*argv: str) -> BbrOptions:
    return bbr_options(build_parser().parse_args(list(argv)))


def test_the_reference_charts_arguments() -> None:
    parsed = options(
        "--streaming",
        "--v",
        "3",
        "--plugin",
        'body-field-to-header:model-extractor:{"fieldName":"model","headerName":"X-Gateway-Model-Name"}',
        "--plugin",
        "base-model-to-header:base-model-mapper",
        "--tracing=false",
    )
    assert (parsed.grpc_port, parsed.health_port, parsed.metrics_port) == (9004, 9005, 9090)
    assert parsed.secure_serving and parsed.metrics_endpoint_auth
    assert parsed.plugins == (
        PluginSpec(
            "body-field-to-header", "model-extractor", {"fieldName": "model", "headerName": "X-Gateway-Model-Name"}
        ),
        PluginSpec("base-model-to-header", "base-model-mapper", {}),
    )


def test_namespace_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NAMESPACE", "models")
    assert options().namespace == "models"
    monkeypatch.delenv("NAMESPACE")
    assert options().namespace is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--grpc-port", "0"], 'invalid value 0 for flag "grpc-port"'),
        (["--metrics-port", "70000"], 'invalid value 70000 for flag "metrics-port"'),
        (["--grpc-health-port", "9004"], "port conflict"),
        (["--plugin", "no-name"], "usage: --plugin"),
        (["--secure-serving=maybe"], "invalid boolean"),
    ],
)
def test_what_the_reference_refuses(argv: list[str], message: str) -> None:
    with pytest.raises(FlagError, match=message):
        options(*argv)
