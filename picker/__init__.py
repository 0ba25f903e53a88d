"""picker: an ext_proc endpoint picker for Gateway API inference gateways.

Packages, in the order one request crosses them (README "How a request flows"): `extproc` (the
Envoy stream) → `requestcontrol` (the director: every request-time hook) → `request` (parsing)
→ `prefix` / `kvevents` (data producers) → `scheduling` (profiles) → back to Envoy. Beside the
request path: `discovery` and `datalayer` fill the `datastore`; `config` builds and reloads the
runtime from an EndpointPickerConfig; `telemetry` exports what happened. `framework` holds the
plugin interfaces everything implements, `plugins` the one list of plugin types. The simulator
(`sim/`, `picker_sim`) and the benchmarks (`bench/`, `picker_bench`) are distributions of their
own in this repository, outside this package's wheel; picker never imports them (`picker sim`,
`picker bench` and `picker demo` dispatch to them by name).

Dependencies point one way (tests/unit/test_architecture.py checks it): a package imports only
packages listed as its dependencies in its own docstring.
"""
