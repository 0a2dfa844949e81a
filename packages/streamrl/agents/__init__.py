"""Agents, environments and the tools they use (see `base` for the protocol)."""
