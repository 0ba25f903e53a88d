"""Flow control: requests held at the picker while the pool is saturated, dispatched by strict
priority, fairness between flows and ordering within a flow. The policy plugins (`policies`),
the resolved settings (`settings`), the queues (`queues`) and the controller (`controller`).

May import: framework, datastore (windowed rates), request (errors as HTTP answers), telemetry.
"""
