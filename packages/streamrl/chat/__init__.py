"""Tokens in, tokens out: the transcript and tool-call format (`transcript`), Hugging Face
tokenizers and chat templates (`hf`), and the built-in tiny tokenizer (`tiny_tokenizer`)."""
