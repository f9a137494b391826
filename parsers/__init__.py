"""perfmon.parsers."""
