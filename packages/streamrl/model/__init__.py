"""streamrl.model."""
