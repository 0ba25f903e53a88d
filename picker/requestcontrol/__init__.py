"""The director: every request-time hook of one request, in the reference's order (parse →
admission or flow control → prepare data → schedule → pre-request → response received / streaming / complete),
with the request's `CycleState`, in-flight counting and per-request metrics.

May import: config (the installed runtime), flowcontrol, framework, request, datastore, telemetry.
"""
