"""Where endpoints come from: a flag or a watched file (`static`), or the Kubernetes API
(`kubernetes`: InferencePool and Pods, InferenceObjectives, the config's ConfigMap).

May import: datastore.
"""
