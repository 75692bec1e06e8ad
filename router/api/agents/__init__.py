"""What agents use beyond a plain chat: tool calling (``tools`` and ``tool_choice`` checked,
the tools shown to the chat template, or to :mod:`.tool_template`'s, and the answer read back
as ``tool_calls`` by the family's parser in :mod:`.tool_parsers`), OpenAI's Responses API
(``POST /v1/responses``, stateless: translated to a chat, answered in its own shape) and
structured outputs (``response_format`` and ``structured_outputs``). A room of its own
because these serve one concern, an agent's loop of calls and results: intake and the
responses read them, and they reuse the chat's path rather than owning a path of their own."""
