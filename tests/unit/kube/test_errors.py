"""API errors are logged as one line."""

from __future__ import annotations

import json

from kubernetes.client.exceptions import ApiException

from deviceplugin.kube.errors import error_line


def test_a_403_is_one_line_with_its_status_reason_and_message_but_no_headers() -> None:
    err = ApiException(status=403, reason="Forbidden")
    err.headers = {"Audit-Id": "x", "Content-Type": "application/json"}
    err.body = json.dumps(
        {"kind": "Status", "message": 'resourceclaims is forbidden: User "system:serviceaccount:x:y" cannot list'}
    )
    assert "\n" in str(err)  # what the client prints by itself
    line = error_line(err)
    assert line == '403 Forbidden: resourceclaims is forbidden: User "system:serviceaccount:x:y" cannot list'


def test_other_errors_give_their_type_and_first_line() -> None:
    assert error_line(RuntimeError("a watch event over 8 bytes\nmore")) == "RuntimeError: a watch event over 8 bytes"


def test_a_rest_api_error_is_its_status_reason_and_message() -> None:
    from deviceplugin.kube.rest import ApiError

    assert error_line(ApiError(404, "NotFound", 'resourceclaims.resource.k8s.io "c" not found')) == (
        '404 NotFound: resourceclaims.resource.k8s.io "c" not found'
    )
