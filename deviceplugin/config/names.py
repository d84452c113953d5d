"""Kubernetes extended-resource name rules, as the kubelet checks them in Register."""

from __future__ import annotations

import re

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def resource_name_problem(name: str) -> str | None:
    """Why `name` is not a valid extended resource name, or None when it is."""
    if "/" not in name:
        return "must be <domain>/<name>"
    if "kubernetes.io/" in name:
        return "must not use the kubernetes.io domain"
    if name.startswith("requests."):
        return "must not start with 'requests.'"
    prefix, _, local = ("requests." + name).partition("/")
    if "/" in local:
        return "must contain exactly one '/'"
    if len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix):
        return "domain must be a lowercase DNS subdomain ([a-z0-9.-], starting and ending alphanumeric)"
    if len(local) > 63 or not _NAME.match(local):
        return "name part must be 1-63 characters of [A-Za-z0-9-_.], starting and ending alphanumeric"
    return None
