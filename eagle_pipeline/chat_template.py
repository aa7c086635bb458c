"""The chat-template arguments every stage passes to the target: one answer for "reasoning on or off".

Templates switch thinking with different variables: Qwen3 and SmolLM3 read `enable_thinking`, Kimi-K2.5
reads `thinking` and thinks unless it is passed as false (docs/engines.md, "Kimi-K2 and Kimi-K2.5").
Passing the wrong name is silently ignored, so `generation.reasoning: false` would still produce thinking
data. The variable is found in the template itself; `generation.chat_template_kwargs` overrides or adds
arguments for a template this does not cover. Stages 01 and 06 use the same arguments, so the drafter is
trained on the same turn format it is served with.
"""

from __future__ import annotations

import re
from typing import Any

# Known switches, in the order they are looked for. A template may mention several names in passing
# (e.g. in a comment); the first that the template reads as a variable wins.
THINKING_SWITCHES = ("enable_thinking", "thinking")


def thinking_switch(template: str) -> str | None:
    """The template variable that turns thinking on or off, or None when the template has none."""
    for name in THINKING_SWITCHES:
        # A variable use inside a Jinja tag: `{% if thinking is defined %}`, `{{ enable_thinking }}`, ...
        if re.search(r"\{[%{][^%}]*\b" + re.escape(name) + r"\b[^%}]*[%}]\}", template):
            return name
    return None


def chat_template_kwargs(template: str, reasoning: bool, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Arguments for `apply_chat_template` / vLLM's `chat_template_kwargs` for this run."""
    switch = thinking_switch(template)
    kwargs: dict[str, Any] = {switch: reasoning} if switch else {}
    kwargs.update(overrides or {})
    return kwargs
