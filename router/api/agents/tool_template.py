"""The chat template a request with tools is rendered with.

Why a template of kvroute's own: the model's template is used whenever it can show tools
(it mentions ``tools``), as vLLM uses it. A ChatML model whose template cannot (the
built-in ``tiny`` and ``smollm2-135m`` among them) would otherwise drop the tools and
every tool call and result from its prompt without a word, and ``--tool-call-parser
hermes`` would wait for calls the model was never taught to write. For those, tools,
calls and results are rendered in the Hermes/Qwen2.5 way (the format the ``hermes``
parser reads): the tools in the system turn inside ``<tools>``, an assistant's calls as
``<tool_call>`` JSON, tool results as ``<tool_response>`` in a user turn. A chat without
tools, calls or results keeps the model's own template byte for byte. A template that is
neither (not ChatML, no tools) is used as it is, as vLLM would.
"""

from __future__ import annotations

from typing import Any

CHATML_TOOLS_TEMPLATE = (
    # Every newline is an expression: transformers renders with trim_blocks.
    "{%- set first = messages[0] if messages else none -%}"
    "{%- set skip = 1 if (first and first.role in ('system', 'developer')) else 0 -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if skip -%}{{- first.content + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'"
    " + 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name '"
    " + 'and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'"
    ' + \'{"name": <function-name>, "arguments": <args-json-object>}\''
    " + '\\n</tool_call><|im_end|>\\n' -}}"
    "{%- elif skip -%}"
    "{{- '<|im_start|>' + first.role + '\\n' + first.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages[skip:] -%}"
    "{%- if message.role == 'tool' -%}"
    "{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' -}}"
    "{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- elif message.role == 'assistant' and message.tool_calls -%}"
    "{{- '<|im_start|>assistant' -}}"
    "{%- if message.content -%}{{- '\\n' + message.content -}}{%- endif -%}"
    "{%- for call in message.tool_calls -%}"
    "{{- '\\n<tool_call>\\n{\"name\": ' + (call.function.name | tojson) + ', \"arguments\": '"
    " + (call.function.arguments | tojson) + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def renders_tools(template: str | None) -> bool:
    """Whether a template can show tools (it reads a ``tools`` variable)."""
    return bool(template) and "tools" in template  # type: ignore[operator]


def template_for(tokenizer: Any, with_tools: bool) -> str | None:
    """The template to render with: None for the model's own, or kvroute's ChatML one for
    a chat with tools on a ChatML model whose template cannot show them."""
    own = getattr(tokenizer, "chat_template", None)
    if not with_tools or not isinstance(own, str) or renders_tools(own):
        return None
    return CHATML_TOOLS_TEMPLATE if "<|im_start|>" in own else None
