"""Kubernetes quantities ("2", "500m", "1536Mi", "20Gi", "1e3"), the one grammar of every part that reads them:
the config's `memoryPerShare`, DRA capacities and consumed capacities, and the extender's pod requests.

Bounded: a quantity longer than `MAX_QUANTITY_LENGTH` characters is refused before it is matched.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

MAX_QUANTITY_LENGTH = 64
MIB = 2**20

_QUANTITY = re.compile(r"([+-]?(?:\d+\.?\d*|\.\d+))(?:([eE][+-]?\d{1,3})|(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?)")
_SUFFIX = {
    "": Decimal(1),
    "m": Decimal("0.001"),
    "k": Decimal(10) ** 3,
    "M": Decimal(10) ** 6,
    "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15,
    "E": Decimal(10) ** 18,
    **{s: Decimal(1024) ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
}


def parse_quantity(text: str) -> Decimal:
    """A Kubernetes Quantity as a Decimal; ValueError naming the text otherwise."""
    if len(text) > MAX_QUANTITY_LENGTH:
        raise ValueError(f"quantity longer than {MAX_QUANTITY_LENGTH} characters")
    match = _QUANTITY.fullmatch(text.strip())
    if not match:
        raise ValueError(f"not a quantity: {text!r}")
    number, exponent, suffix = match.groups()
    try:
        value = Decimal(number)
        return value * (Decimal(10) ** int(exponent[1:]) if exponent else _SUFFIX[suffix or ""])
    except (InvalidOperation, KeyError):
        raise ValueError(f"not a quantity: {text!r}") from None


def quantity_mib(text: str) -> int:
    """A quantity of bytes in whole MiB, rounded down (`8G` is 7629); ValueError when it is not a quantity or is
    under 1 MiB."""
    try:
        value = parse_quantity(text)
    except ValueError:
        raise ValueError(f"must be a quantity such as 4Gi or 512Mi, got {text[:MAX_QUANTITY_LENGTH]!r}") from None
    mib = int(value // MIB)
    if mib < 1:
        raise ValueError(f"must be at least 1Mi, got {text!r}")
    return mib
