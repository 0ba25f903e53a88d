"""EndpointPickerConfig: strict decoding (`schema`, with Kubernetes quantities: `quantity`),
defaults and plugin instantiation (`loader`), the runtime built from it and the holder that
installs, reloads and retires runtimes and names the config in force (`runtime`), objectives
(`objectives`), model rewrites (`model_rewrites`) and `picker config validate|show` (`cli`).

May import: plugins (the registry), framework, scheduling, datalayer, datastore, flowcontrol, telemetry.
"""
