"""`picker bbr`: body-based routing, the reference BBR v1.5.0's second ext_proc server.

It reads each request body's `model` and sets `X-Gateway-Model-Name` (and, with the adapter
ConfigMaps, `X-Gateway-Base-Model-Name`), so one Gateway's HTTPRoutes can send each model to its
own InferencePool. It takes the reference `bbr`'s flags (`command`); the ext_proc protocol runs
on the same compiled core as `picker serve`.

May import: extproc, discovery, request, telemetry, serve (the reference flag syntax and the
logging flags `picker serve` has: this is a command root as serve is).
"""
