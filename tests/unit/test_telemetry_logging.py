"""The log encoders: every JSON record parses whatever it carries; the console layout; the
V(4) line of a routed request and its absence below V(4); gRPC health semantics with leader
election (which `picker serve` cannot turn on yet)."""

from __future__ import annotations

import io
import json
import logging
import re
import sys
import threading
import warnings
from collections.abc import Iterator

import pytest
from grpc_health.v1 import health_pb2

from picker.config.runtime import RuntimeHolder
from picker.datastore.endpoint import Endpoint
from picker.datastore.store import Datastore
from picker.requestcontrol.director import Director
from picker.telemetry import logging as logs
from picker.telemetry.health import EXT_PROC_SERVICE, HealthServicer

HEADER = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"


@pytest.fixture()
def restore_logging() -> Iterator[None]:
    """`configure` sets up the whole process; put back what pytest had."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    picker_level = logging.getLogger("picker").level
    hooks = sys.excepthook, threading.excepthook
    yield
    sys.excepthook, threading.excepthook = hooks
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)
    logging.getLogger("picker").setLevel(picker_level)
    logging.captureWarnings(False)


def configured(settings: logs.LogSettings) -> io.StringIO:
    stream = io.StringIO()
    logs.configure(settings, stream)
    return stream


def records(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_parse_whatever_the_record_carries(restore_logging: None) -> None:
    stream = configured(logs.LogSettings(encoder="json"))
    log = logging.getLogger("picker.test")
    log.info('quotes " and \\ backslashes\nand a newline %s', "\t")
    log.info("a lone surrogate \udcff and a huge int", extra={"big": 1 << 80, "raw": b"\xff"})
    log.info("bad format %d", "not a number")
    log.info("extra fields", extra={"x-request-id": "r1", "scores": {"queue": 0.5}})
    try:
        raise ValueError('boom "quoted"')
    except ValueError:
        log.exception("it failed")
    log.warning("a warning carries its stack (development mode)")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("a Python warning", UserWarning, stacklevel=1)
    lines = records(stream)
    assert [r["msg"] for r in lines][:2] == ['quotes " and \\ backslashes\nand a newline \t', lines[1]["msg"]]
    assert lines[1]["big"] == 1 << 80 and "logError" in lines[1]  # the stdlib encoder's fallback
    assert "bad format" in str(lines[2]["msg"])
    assert lines[3]["x-request-id"] == "r1" and lines[3]["scores"] == {"queue": 0.5}
    assert lines[4]["level"] == "error" and lines[4]["error"] == 'ValueError: boom "quoted"'
    assert "Traceback" in str(lines[4]["stacktrace"]) and "raise ValueError" in str(lines[4]["stacktrace"])
    assert lines[5]["level"] == "warn" and "test_json_lines_parse" in str(lines[5]["stacktrace"])
    assert lines[6]["logger"] == "py.warnings" and "a Python warning" in str(lines[6]["msg"])
    for record in lines:
        assert {"level", "ts", "logger", "msg"} <= record.keys()


def test_production_mode_levels_keys_and_times(restore_logging: None) -> None:
    stream = configured(logs.LogSettings(verbosity=5, development=False, time_encoding="rfc3339nano"))
    log = logging.getLogger("picker.test")
    log.log(logs.TRACE, "trace")
    log.debug("debug")
    log.log(logs.VERBOSE, "verbose")
    log.info("info")
    log.warning("warn, no stack below error in production")
    logging.getLogger("other.library").debug("third-party debug stays hidden")
    lines = records(stream)
    assert [(r["level"], r["msg"]) for r in lines] == [
        ("trace", "trace"),
        ("debug", "debug"),
        ("info", "verbose"),
        ("info", "info"),
        ("warn", "warn, no stack below error in production"),
    ]
    assert "stacktrace" not in lines[-1]
    assert str(lines[0]["ts"])[:2] == "20" and str(lines[0]["caller"]).startswith("test_telemetry_logging.py:")


def test_console_lines_are_zaps_layout(restore_logging: None) -> None:
    stream = configured(logs.LogSettings(development=False, encoder="console", time_encoding="epoch"))
    logging.getLogger("picker.test").info("hello %s", "world", extra={"model": "m"})
    (line,) = stream.getvalue().splitlines()
    ts, level, logger, caller, message, fields = line.split("\t")
    assert float(ts) > 0 and level == "INFO" and logger == "picker.test"
    assert re.fullmatch(r"test_telemetry_logging\.py:\d+", caller)
    assert message == "hello world" and json.loads(fields) == {"model": "m"}


def director() -> Director:
    store = Datastore()
    store.set_endpoints([Endpoint("10.0.0.1", 8000), Endpoint("10.0.0.2", 8000)])
    holder = RuntimeHolder(store)
    holder.load_text(HEADER + "plugins: [{type: queue-scorer}, {type: kv-cache-utilization-scorer}]\n")
    return Director(store, holder)


BODY = b'{"model": "m", "prompt": "a secret prompt"}'


async def test_a_routed_request_logs_one_line_at_v4_and_nothing_below(restore_logging: None) -> None:
    d = director()
    quiet = configured(logs.LogSettings(encoder="json"))
    (await d.route(BODY, {"x-request-id": "below-v4"}, None)).finish()
    assert quiet.getvalue() == ""
    stream = configured(logs.LogSettings(verbosity=4, encoder="json"))
    headers = {"x-request-id": "r-42", "x-gateway-inference-objective": "chat"}
    routed = await d.route(BODY, headers, None)
    routed.finish()
    (line,) = records(stream)
    assert line["msg"] == "request routed" and line["level"] == "debug"
    assert line["x-request-id"] == "r-42" and line["model"] == "m" and line["objective"] == "chat"
    assert line["endpoint"] == routed.destination and line["candidates"] == 2
    assert set(line["scores"]) == {"queue-scorer", "kv-cache-utilization-scorer"}  # type: ignore[arg-type]
    assert isinstance(line["decisionSeconds"], float) and line["decisionSeconds"] >= 0
    assert "secret" not in stream.getvalue()  # no prompt text below V(5)


def _status(servicer: HealthServicer, service: str) -> int:
    status: int = servicer.status(service).status
    return status


SERVING, NOT_SERVING, UNKNOWN = (
    health_pb2.HealthCheckResponse.SERVING,
    health_pb2.HealthCheckResponse.NOT_SERVING,
    health_pb2.HealthCheckResponse.SERVICE_UNKNOWN,
)


def test_health_with_leader_election_as_the_reference() -> None:
    state = {"synced": True, "leader": False, "draining": False}
    servicer = HealthServicer(lambda: state["synced"], lambda: state["draining"], lambda: state["leader"])
    follower = {name: _status(servicer, name) for name in ("liveness", "readiness", "", EXT_PROC_SERVICE, "other")}
    assert follower == {
        "liveness": SERVING,
        "readiness": NOT_SERVING,
        "": NOT_SERVING,
        EXT_PROC_SERVICE: NOT_SERVING,
        "other": UNKNOWN,
    }
    state["leader"] = True
    assert [_status(servicer, n) for n in ("liveness", "readiness", "", EXT_PROC_SERVICE)] == [SERVING] * 4
    state["synced"] = False
    assert [_status(servicer, n) for n in ("liveness", "readiness")] == [SERVING, NOT_SERVING]


def test_health_without_leader_election_answers_every_name_from_sync() -> None:
    state = {"synced": False, "draining": False}
    servicer = HealthServicer(lambda: state["synced"], lambda: state["draining"])
    names = ("liveness", "readiness", "inference-extension", "", EXT_PROC_SERVICE, "anything")
    assert [_status(servicer, n) for n in names] == [NOT_SERVING] * len(names)
    state["synced"] = True
    assert [_status(servicer, n) for n in names] == [SERVING] * len(names)
    state["draining"] = True  # the picker's addition: readiness goes, liveness stays
    assert [_status(servicer, n) for n in names] == [SERVING] + [NOT_SERVING] * (len(names) - 1)
