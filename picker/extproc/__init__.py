"""Envoy's ext_proc protocol: the servicer and one state machine per stream (`servicer`), the
messages it sends (`messages`) and its TLS (`tls`). It speaks the protocol only: the body goes
to the director, what passes on the response side is reported to the `RoutedRequest`.

May import: requestcontrol, request (errors), telemetry.
"""
