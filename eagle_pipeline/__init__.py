"""Shared code of the EAGLE-3 drafter pipeline: config, artifacts, models, vLLM and speculators glue."""
