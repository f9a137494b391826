"""perfmon.probes."""
