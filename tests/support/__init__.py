"""Helpers shared by several test modules (fixtures stay in tests/conftest.py)."""
