"""`picker serve`: the ext_proc endpoint picker, with the reference EPP's flags.

`flags` parses and checks the command line into `options.ServeOptions`, a frozen value read
by everything after; `server` is the composition root that builds and runs the picker from
it; `main` is the command, in one process or as `--workers` under a supervisor.

May import: anything; it is the composition root, and only the `picker` command imports it.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import logging
import os

from picker.config.schema import ConfigError
from picker.discovery.static import EndpointListError
from picker.serve.flags import FlagError, build_parser, encoder_hint, log_settings, processed_flags, serve_options
from picker.serve.options import ServeOptions
from picker.serve.server import run
from picker.telemetry import logging as logs
from picker.telemetry.http import AccessReviewer
from picker.workers.role import WorkerRole

log = logging.getLogger("picker")

_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
_MMAP_THRESHOLD_BYTES = 256 << 10


def _return_large_buffers_to_the_os() -> None:
    """Serve blocks of 256 KiB and more (request bodies) from mmap, so freeing them returns the
    memory: glibc otherwise raises its threshold after the first large free and keeps later
    large bodies in its heaps, and RSS ratchets up after bursts of big requests."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return  # the operator chose
    try:
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
    except (OSError, AttributeError):
        pass  # not glibc (musl, macOS): that allocator's own policy applies


def main(argv: list[str]) -> int:
    """`picker serve ARGV`: 2 for flags that do not parse, 1 for a start that fails, else 0."""
    try:
        args = build_parser().parse_args(argv)
    except FlagError as error:
        logs.configure(encoder_hint(argv))
        log.error("invalid flags: %s", error)
        return 2
    logs.configure(log_settings(args))
    log.info("flags processed", extra={"flags": processed_flags(args)})
    _return_large_buffers_to_the_os()
    try:
        options = serve_options(args)
    except (EndpointListError, ConfigError, ValueError) as error:
        log.error("cannot start: %s", error)
        return 1
    import uvloop

    if options.serving.workers == 1:
        return uvloop.run(run(options))
    from picker.workers.supervisor import supervise

    # The parent's metrics port reviews; the workers' are private.
    worker_options = dataclasses.replace(
        options, features=dataclasses.replace(options.features, metrics_endpoint_auth=False)
    )
    return uvloop.run(supervise(options.serving, worker_options, serve_worker, lambda: metrics_reviewer(options)))


def serve_worker(options: ServeOptions, role: WorkerRole) -> None:
    """A `--workers` process: the picker as `picker serve` runs it, its exit code the process's."""
    import uvloop

    logs.configure(options.logging)
    _return_large_buffers_to_the_os()
    raise SystemExit(uvloop.run(run(options, role)))


async def metrics_reviewer(options: ServeOptions) -> AccessReviewer | None:
    """The access reviewer of the `--workers` parent's metrics port (`--metrics-endpoint-auth`)."""
    if not options.features.metrics_endpoint_auth:
        return None
    from picker.discovery.kubernetes import KubeCredentialsError, api_client
    from picker.telemetry.access_review import KubeAccessReviewer

    try:
        api = await asyncio.to_thread(api_client, options.discovery.kubeconfig)
    except KubeCredentialsError as exc:
        raise FlagError(f"--metrics-endpoint-auth: {exc}") from None
    return KubeAccessReviewer(api)
