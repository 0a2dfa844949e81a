"""streamrl.rl."""
