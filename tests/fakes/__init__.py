"""Fakes at the lowest level only: C libraries with the real ABI (see build.py)."""
