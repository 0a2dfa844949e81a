"""streamrl.tasks."""
