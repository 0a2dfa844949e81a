"""streamrl.endpoint: the OpenAI-compatible endpoint an episode's agent calls (issue 31)."""
