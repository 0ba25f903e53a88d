"""The scheduler (profiles: filters → weighted scorers → picker) and the built-in filters,
scorers, pickers, profile handler and saturation detector.

May import: framework, datastore, request (errors), telemetry.
"""
