"""Thin process entrypoints: each wires parts from `streamrl` and runs them."""
