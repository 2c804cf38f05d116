"""Ember: an OpenAI- and Anthropic-compatible LLM inference server."""
