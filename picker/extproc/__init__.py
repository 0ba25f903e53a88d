"""Envoy's ext_proc protocol: a compiled core (native/extproc, the `picker_extproc_core`
module) speaks it on its own thread; `server` runs what it asks on the asyncio loop (the pick,
by the director) and reports what passes on the response side to the `RoutedRequest`; `tls`
makes the self-signed certificate.

May import: requestcontrol, request (errors), telemetry.
"""
