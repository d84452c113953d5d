"""The DRA names the node's driver publishes and the scheduler extender reads: the driver's name for a domain and
the capacities of a shared device. Pure, like `annotation.py`, so the extender needs nothing of `dra/`."""

from __future__ import annotations

DRIVER_PREFIX = "gpu-share"

CAPACITY_SHARES = "shares"
CAPACITY_MEMORY = "memory"


def driver_name(domain: str) -> str:
    """The DRA driver's name: `gpu-share.<domain>` (a DNS subdomain, as `results[].driver` names it)."""
    return f"{DRIVER_PREFIX}.{domain}"
