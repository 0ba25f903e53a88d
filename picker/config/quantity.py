"""Kubernetes resource quantities (`10Gi`, `500M`, `1k`, `1e3`, `1024`), as the reference's
`flowControl` byte and request limits accept them, read as whole numbers.

The grammar is apimachinery's `resource.Quantity`: a decimal number, then at most one suffix,
binary (`Ki` .. `Ei`), decimal (`n`, `u`, `m`, `k`, `M` .. `E`) or an exponent (`e3`, `E-2`).
Like `Quantity.Value()`, a fractional result rounds up.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_QUANTITY = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?$")


def parse_quantity(text: str) -> int:
    """The integer value of a quantity string, rounded up; raises ValueError if malformed."""
    match = _QUANTITY.match(text.strip())
    if match is None:
        raise ValueError(f'must be a quantity such as "10Gi", "500M" or "1024", got "{text}"')
    number, suffix = Fraction(match.group(1)), match.group(2) or ""
    if suffix in _BINARY:
        value = number * _BINARY[suffix]
    elif suffix in _DECIMAL:
        value = number * Fraction(10) ** _DECIMAL[suffix]
    else:
        value = number * Fraction(10) ** int(suffix[1:])
    return math.ceil(value)
