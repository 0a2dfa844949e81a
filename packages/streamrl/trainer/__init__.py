"""streamrl.trainer."""
