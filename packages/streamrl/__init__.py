"""streamrl: asynchronous agentic RL on JAX, as workers linked by Redis streams."""

__version__ = "0.1.0"
