"""Serving the target with vLLM's OpenAI server and measuring speculative decoding on it."""
