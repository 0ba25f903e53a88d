"""The pool's endpoints, their latest metrics and the picker's in-flight counts (`store`), the
endpoint values and snapshots the request path reads (`endpoint`), change listeners, and
events per second over a sliding window (`rate`: completions here, demand in flow control).

May import: nothing else of picker.
"""
