"""The thinking switch is found in the template itself, so `generation.reasoning` means what it says."""

from eagle_pipeline.chat_template import chat_template_kwargs, thinking_switch

# The parts of the templates that matter: Qwen3 reads enable_thinking; Kimi-K2.5 reads thinking and thinks
# unless it is false.
QWEN3_LIKE = "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
KIMI_LIKE = ("<|im_assistant|>assistant<|im_middle|>{%- if thinking is defined and thinking is false -%}<think></think>"
             "{%- else -%}<think>{%- endif -%}")


def test_each_template_gets_its_own_switch():
    assert thinking_switch(QWEN3_LIKE) == "enable_thinking"
    assert thinking_switch(KIMI_LIKE) == "thinking"
    assert thinking_switch("{{ messages[0]['content'] }} thinking is plain text here") is None


def test_reasoning_maps_to_the_switch_and_overrides_win():
    assert chat_template_kwargs(KIMI_LIKE, reasoning=False) == {"thinking": False}
    assert chat_template_kwargs(QWEN3_LIKE, reasoning=True) == {"enable_thinking": True}
    assert chat_template_kwargs("{{ x }}", reasoning=False) == {}
    assert chat_template_kwargs(KIMI_LIKE, reasoning=False, overrides={"thinking": True, "tools": []}) == {"thinking": True, "tools": []}
