"""streamrl.tools."""
