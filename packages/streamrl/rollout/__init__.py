"""streamrl.rollout."""
