"""perfmon.agent."""
