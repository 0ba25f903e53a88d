"""Logging as the reference EPP's flags describe it: `-v` levels and the zap options, mapped
onto Python logging.

Verbosity uses the reference's levels. Python levels stand for them: INFO is V(2) (DEFAULT,
what `log.info` says), VERBOSE (15) is V(3), DEBUG is V(4) (one line per routed request) and
TRACE (5) is V(5); warnings and errors always show. Other libraries' loggers show INFO and up.

The JSON encoder (python-json-logger, serialising with orjson) writes one object per line with
zap's keys: `level`, `ts`, `logger`, `caller`, `msg`, the record's extra fields, `error` and
`stacktrace`. The console encoder writes zap's tab-separated console lines. With JSON nothing
may reach stderr as plain text: warnings, uncaught exceptions and logging's own failures become
records, and what native code writes to file descriptor 2 (gRPC's C core) is read back and
wrapped, one record per line.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import logging
import os
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType
from typing import IO, Any

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.orjson import OrjsonFormatter

DEFAULT_VERBOSITY = 2  # the reference's logutil.DEFAULT
VERBOSE = 15  # V(3)
TRACE = 5  # V(5)
# V(0) and V(1): above INFO, below WARNING. The picker logs nothing there, so `-v=0`/`-v=1`
# and `--zap-log-level=info|debug` hide its info lines and keep warnings, as in the reference.
_ABOVE_INFO = logging.INFO + 1

logging.addLevelName(VERBOSE, "VERBOSE")
logging.addLevelName(TRACE, "TRACE")

ENCODERS = ("json", "console")
ZAP_LEVEL_NAMES = ("debug", "info", "error", "panic")
STACKTRACE_LEVEL_NAMES = ("info", "error", "panic")
TIME_ENCODINGS = ("epoch", "millis", "nano", "iso8601", "rfc3339", "rfc3339nano")


def verbosity_level(verbosity: int) -> int:
    """The Python level of V(`verbosity`) messages, and the threshold `-v=verbosity` sets."""
    if verbosity <= 1:
        return _ABOVE_INFO
    steps = {2: logging.INFO, 3: VERBOSE, 4: logging.DEBUG}
    return steps.get(verbosity, max(1, TRACE - (verbosity - 5)))


def parse_zap_level(text: str) -> str:
    """A `--zap-log-level` value: debug, info, error, panic, or an integer > 0 (a V level)."""
    value = text.strip().lower()
    if value in ZAP_LEVEL_NAMES or (value.isdigit() and int(value) > 0):
        return value
    raise ValueError(f"invalid log level {text!r}: one of {', '.join(ZAP_LEVEL_NAMES)} or an integer > 0")


def _choice(kind: str, choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in choices:
            raise ValueError(f"invalid {kind} {text!r}: one of {', '.join(choices)}")
        return value

    return parse


parse_encoder = _choice("encoder", ENCODERS)
parse_stacktrace_level = _choice("stacktrace level", STACKTRACE_LEVEL_NAMES)
parse_time_encoding = _choice("time encoding", TIME_ENCODINGS)


@dataclass(frozen=True, slots=True)
class LogSettings:
    """The reference's logging flags: `-v` and controller-runtime's zap options.

    `development` (`--zap-devel`, default true as in the reference) picks the defaults the
    explicit options override: the console encoder and stack traces from warnings up; false
    picks JSON and stack traces on errors. `level` (`--zap-log-level`), when set, overrides
    `-v`: `info` is V(0), `debug` V(1), an integer n V(n). `time_encoding` defaults to epoch
    seconds in JSON (what the reference writes) and ISO 8601 on the console.
    """

    verbosity: int = DEFAULT_VERBOSITY
    development: bool = True
    encoder: str | None = None
    level: str | None = None
    stacktrace_level: str | None = None
    time_encoding: str | None = None

    @property
    def json(self) -> bool:
        return (self.encoder or ("console" if self.development else "json")) == "json"

    @property
    def times(self) -> str:
        """The time encoding in force."""
        return self.time_encoding or ("epoch" if self.json else "iso8601")

    @property
    def threshold(self) -> int:
        """The lowest Python level the picker's loggers emit."""
        if self.level is None:
            return verbosity_level(self.verbosity if self.verbosity >= 0 else DEFAULT_VERBOSITY)
        named = {"debug": verbosity_level(1), "info": verbosity_level(0), "error": logging.ERROR}
        if self.level == "panic":
            return logging.CRITICAL
        return named[self.level] if self.level in named else verbosity_level(int(self.level))

    @property
    def stack_threshold(self) -> int:
        """Records at or above this level carry the stack they were logged from."""
        if self.stacktrace_level is None:
            return logging.WARNING if self.development else logging.ERROR
        return {"info": _ABOVE_INFO, "error": logging.ERROR, "panic": logging.CRITICAL}[self.stacktrace_level]


_LEVEL_KEYS = {
    logging.CRITICAL: "fatal",
    logging.ERROR: "error",
    logging.WARNING: "warn",
    logging.INFO: "info",
    VERBOSE: "info",  # the reference encodes V(1)-V(3) as info
    logging.DEBUG: "debug",
}


def level_key(levelno: int) -> str:
    """zap's lower-case level name for a Python level (between names: the one below)."""
    for level, name in _LEVEL_KEYS.items():
        if levelno >= level:
            return name
    return "trace"


def _timestamp(created: float, encoding: str) -> float | int | str:
    if encoding == "epoch":
        return created
    if encoding == "millis":
        return created * 1e3
    if encoding == "nano":
        return int(created * 1e9)
    moment = datetime.fromtimestamp(created).astimezone()
    if encoding == "iso8601":
        return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}" + moment.strftime("%z")
    offset = moment.strftime("%z")
    zone = "Z" if offset == "+0000" else f"{offset[:3]}:{offset[3:]}"
    stamp = moment.strftime("%Y-%m-%dT%H:%M:%S")
    if encoding == "rfc3339nano" and moment.microsecond:
        stamp += f".{moment.microsecond:06d}".rstrip("0")
    return stamp + zone


def _call_stack(record: logging.LogRecord) -> str:
    """The stack that logged `record`, up to the logging call (formatting runs inside it)."""
    frames = traceback.extract_stack()
    for index in range(len(frames) - 1, -1, -1):
        frame = frames[index]
        if frame.filename == record.pathname and frame.lineno == record.lineno:
            return "".join(traceback.format_list(frames[: index + 1])).rstrip("\n")
    return ""


_RESERVED = frozenset(RESERVED_ATTRS) | {"taskName", "message"}


def extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    """What the caller passed as `extra=` (the record's non-standard attributes)."""
    return {k: v for k, v in record.__dict__.items() if k not in _RESERVED and not k.startswith("_")}


def _message(record: logging.LogRecord) -> str:
    try:
        return record.getMessage()
    except Exception:  # a bad format string must not lose the record
        return f"{record.msg!r} % {record.args!r}"


class JsonFormatter(OrjsonFormatter):
    """One JSON object per record, with zap's keys; never raises."""

    def __init__(self, settings: LogSettings) -> None:
        super().__init__(reserved_attrs=sorted(_RESERVED))
        self.time_encoding = settings.times
        self.stack_threshold = settings.stack_threshold

    def format(self, record: logging.LogRecord) -> str:
        try:
            text: str = super().format(record)
            return text
        except Exception as error:
            # orjson refuses some values (lone surrogates, huge integers): the stdlib encoder
            # escapes them; anything else becomes its repr.
            fields = {
                "level": level_key(record.levelno),
                "ts": _timestamp(record.created, self.time_encoding),
                "logger": record.name,
                "msg": _message(record),
                **extra_fields(record),
                "logError": f"{type(error).__name__}: {error}",
            }
            return json.dumps(fields, default=repr, ensure_ascii=True)

    def add_fields(self, log_data: dict[str, Any], record: logging.LogRecord, message_dict: dict[str, Any]) -> None:
        log_data["level"] = level_key(record.levelno)
        log_data["ts"] = _timestamp(record.created, self.time_encoding)
        log_data["logger"] = record.name
        log_data["caller"] = f"{record.filename}:{record.lineno}"
        log_data["msg"] = _message(record)
        log_data.update(extra_fields(record))
        if record.exc_info and record.exc_info[1] is not None:
            log_data["error"] = f"{type(record.exc_info[1]).__name__}: {record.exc_info[1]}"
        stack = message_dict.get("exc_info") or message_dict.get("stack_info")
        if not stack and record.levelno >= self.stack_threshold:
            stack = _call_stack(record)
        if stack:
            log_data["stacktrace"] = stack


class ConsoleFormatter(logging.Formatter):
    """zap's console layout: time, LEVEL, logger, caller, message, extra fields as JSON;
    a traceback or stack on the lines after."""

    def __init__(self, settings: LogSettings) -> None:
        super().__init__()
        self.time_encoding = settings.times
        self.stack_threshold = settings.stack_threshold

    def format(self, record: logging.LogRecord) -> str:
        parts = [
            str(_timestamp(record.created, self.time_encoding)),
            level_key(record.levelno).upper(),
            record.name,
            f"{record.filename}:{record.lineno}",
            _message(record),
        ]
        extra = extra_fields(record)
        if extra:
            parts.append(json.dumps(extra, default=repr))
        line = "\t".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        elif record.stack_info:
            line += "\n" + self.formatStack(record.stack_info)
        elif record.levelno >= self.stack_threshold:
            line += "\n" + _call_stack(record)
        return line


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        # The formatters never raise, so only the stream itself failed: nothing left to tell.
        pass


class _NativeStderr:
    """Whatever reaches file descriptor 2 without logging (gRPC's C core, the interpreter)
    becomes one record per line: fd 2 is a pipe a thread reads, the handler writes to a
    duplicate of the real stderr."""

    def __init__(self) -> None:
        self.real = os.dup(2)
        read, write = os.pipe()
        with contextlib.suppress(OSError, AttributeError):  # a bigger buffer where Linux allows
            import fcntl

            fcntl.fcntl(write, fcntl.F_SETPIPE_SZ, 1 << 20)
        os.dup2(write, 2)
        os.close(write)
        self.stream: IO[str] = open(  # noqa: SIM115 (lives as long as the process logs)
            os.dup(self.real), "w", buffering=1, encoding="utf-8", errors="backslashreplace"
        )
        # A crash in native code cannot run Python: its dump goes to the real stderr as is.
        faulthandler.enable(self.stream)
        self._thread = threading.Thread(target=self._pump, args=(read,), name="stderr-to-log", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    @staticmethod
    def _pump(read: int) -> None:
        log = logging.getLogger("stderr")
        with open(read, "rb") as pipe:
            for raw in pipe:
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                if line:
                    log.log(_native_level(line), "%s", line)

    def close(self) -> None:
        """Put the real stderr back on fd 2 (the pipe then ends) and wait for the last lines."""
        os.dup2(self.real, 2)
        self._thread.join(timeout=2)


def _native_level(line: str) -> int:
    """gRPC's (absl's) lines start with a severity letter and a date: `E1201 23:00:26...`."""
    if len(line) > 5 and line[1:5].isdigit():
        return {"E": logging.ERROR, "W": logging.WARNING, "F": logging.CRITICAL}.get(line[0], logging.INFO)
    return logging.ERROR


_native: _NativeStderr | None = None


def configure(settings: LogSettings, stream: IO[str] | None = None) -> None:
    """Install the handler on the root logger as `settings` say, for the whole process.

    `stream` (tests) replaces stderr; only without it is fd 2 captured (JSON encoder only).
    """
    global _native
    if stream is None:
        if settings.json and _native is None:
            with contextlib.suppress(OSError):  # no usable fd 2 (closed): log to sys.stderr as is
                _native = _NativeStderr()
        stream = _native.stream if _native is not None else sys.stderr
    handler = _Handler(stream)
    handler.setFormatter(JsonFormatter(settings) if settings.json else ConsoleFormatter(settings))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    threshold = settings.threshold
    root.setLevel(max(threshold, logging.INFO))
    logging.getLogger("picker").setLevel(threshold)
    logging.captureWarnings(True)
    sys.excepthook = _log_uncaught
    threading.excepthook = _log_uncaught_in_thread


def _log_uncaught(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
    logging.getLogger("picker").critical("uncaught exception", exc_info=(kind, error, tb))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_value is not None:
        logging.getLogger("picker").critical(
            "uncaught exception in thread %s",
            args.thread.name if args.thread is not None else "?",
            exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
        )
