"""`picker serve --workers N`: several picker processes on one ext_proc port under one parent
(`supervisor`), whose /metrics page merges the workers' (`metrics`); `role` is what a worker
is told.

May import: telemetry.
"""
