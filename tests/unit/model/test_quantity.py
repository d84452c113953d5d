"""The one quantity grammar: what Kubernetes writes, bounded, and the config's memoryPerShare in whole MiB."""

from __future__ import annotations

import pytest

from deviceplugin.model.quantity import MAX_QUANTITY_LENGTH, parse_quantity, quantity_mib


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("2", 2),
        ("1536Mi", 1536 * 2**20),
        ("20Gi", 20 * 2**30),
        ("1e3", 1000),
        ("500m", 0.5),
        ("1k", 1000),
        ("1.5Gi", 1.5 * 2**30),
        ("+4Ki", 4096),
        ("-1", -1),
        (" 3 ", 3),
    ],
)
def test_quantities(text: str, value: float) -> None:
    assert parse_quantity(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["1" * (MAX_QUANTITY_LENGTH + 1), "12Xi", "", "--1", "4GB", "Gi", "1e", "1.2.3"])
def test_a_quantity_too_long_or_malformed_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="quantity"):
        parse_quantity(text)


@pytest.mark.parametrize(
    ("text", "mib"), [("4Gi", 4096), ("512Mi", 512), ("8G", 7629), ("1Mi", 1), ("1.5Gi", 1536), ("1048577", 1)]
)
def test_whole_mib_rounded_down(text: str, mib: int) -> None:
    assert quantity_mib(text) == mib


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("4GB", "must be a quantity such as 4Gi or 512Mi, got '4GB'"),
        ("100Ki", "must be at least 1Mi, got '100Ki'"),
        ("-4Gi", "must be at least 1Mi, got '-4Gi'"),
    ],
)
def test_memory_that_is_not_a_quantity_or_under_a_mib_is_refused(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        quantity_mib(text)
