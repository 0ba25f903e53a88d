"""What a Kubernetes API call through the official client raises when the call fails: an error
status (ApiException), or no answer at all (urllib3's errors are not OSErrors)."""

from __future__ import annotations

import urllib3
from kubernetes.client.exceptions import ApiException

KUBE_API_ERRORS: tuple[type[Exception], ...] = (ApiException, OSError, urllib3.exceptions.HTTPError)
