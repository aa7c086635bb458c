"""Serving the target with vLLM's OpenAI server and measuring speculative decoding on it.

server: the server process; client: requests to it; spec_metrics: its spec-decode counters;
measure: one server per mode and the summary; report: the report files.
"""
