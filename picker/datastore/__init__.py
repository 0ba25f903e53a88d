"""The pool's endpoints, their latest metrics and the picker's in-flight counts (`store`), the
endpoint values and snapshots the request path reads (`endpoint`), and change listeners.

May import: nothing else of picker.
"""
