"""Conversations in the shapes people have them -> the messages a chat template renders.

Two shapes are read. ``format: chat`` is OpenAI's: ``{"role", "content"}`` messages, where the
content may also be a list of text parts, and an assistant message may carry ``tool_calls`` instead
of content. ``format: sharegpt`` is ShareGPT's: ``{"from", "value"}`` with its role names (human,
gpt, ...), an optional record-level ``system`` prompt, and ``function_call`` / ``observation``
turns. Both become one list of ``{"role", "content", ...}`` with the roles system, user, assistant
and tool, which ``data.py`` renders with the tokenizer's chat template. A record-level ``tools``
list (function definitions) goes to the template beside the messages.

A conversation that cannot be read raises ``BadChat`` with the reason the data report counts.
"""

from __future__ import annotations

import json
from typing import Any

# ShareGPT's role names (as written by ShareGPT, FastChat, LLaMA-Factory, axolotl), lower-cased.
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "chatgpt": "assistant",
    "function_call": "assistant",  # an assistant turn that calls a tool
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
    "function_response": "tool",
    "ipython": "tool",
}
MALFORMED = "malformed message (each needs a string 'role' and 'content')"
MALFORMED_SHAREGPT = "malformed message (each needs a string 'from' and 'value')"


class BadChat(Exception):
    """The conversation cannot be used; ``args[0]`` is the reason the report counts."""


def _json_list(value: Any, name: str) -> list:
    """A list, or a JSON string holding one (a CSV cell); else BadChat."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):  # RecursionError: nested too deeply for the parser
            raise BadChat(f"field {name!r} is not a list of messages") from None
    if not isinstance(value, list) or not value:
        raise BadChat(f"field {name!r} is not a list of messages")
    return value


def _content_text(content: Any) -> str | None:
    """A message's content as text: a string, or a list of OpenAI text parts joined; else None."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        parts = [p.get("text") if isinstance(p, dict) and p.get("type") == "text" else None for p in content]
        if all(isinstance(p, str) for p in parts):
            return "".join(parts)  # type: ignore[arg-type]
    return None


def openai_messages(value: Any, name: str) -> list[dict]:
    """``format: chat``: OpenAI-style messages, checked and cleaned for the template."""
    messages = []
    for message in _json_list(value, name):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadChat(MALFORMED)
        content = _content_text(message.get("content"))
        calls = message.get("tool_calls")
        if content is None:
            if message.get("content") is not None or not (isinstance(calls, list) and calls):
                raise BadChat(MALFORMED)
            content = ""  # an assistant turn that only calls tools
        # Readers fill keys other records have with None; a template would render them.
        cleaned = {k: v for k, v in message.items() if v is not None}
        cleaned["content"] = content
        if not cleaned.get("tool_calls"):  # an empty list: no calls, nothing for the template
            cleaned.pop("tool_calls", None)
        messages.append(cleaned)
    return messages


def _tool_call(value: str) -> list[dict] | None:
    """A ShareGPT ``function_call`` value (``{"name", "arguments"}`` or a list of them) as OpenAI
    ``tool_calls``; None when it is not one."""
    try:
        call = json.loads(value)
    except (ValueError, RecursionError):
        return None
    calls = call if isinstance(call, list) else [call]
    if not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        return None
    return [
        {"type": "function", "function": {"name": c["name"], "arguments": c.get("arguments", {})}}
        for c in calls
    ]


def sharegpt_messages(record: dict, name: str) -> list[dict]:
    """``format: sharegpt``: ``{"from", "value"}`` turns mapped onto the template's roles; a
    record-level ``system`` string comes first unless the turns hold a system message."""
    messages = []
    for turn in _json_list(record.get(name), name):
        if not isinstance(turn, dict) or not isinstance(turn.get("from"), str):
            raise BadChat(MALFORMED_SHAREGPT)
        value = turn.get("value")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str):
            raise BadChat(MALFORMED_SHAREGPT)
        speaker = turn["from"].strip().lower()
        if speaker not in SHAREGPT_ROLES:
            known = ", ".join(SHAREGPT_ROLES)
            raise BadChat(f"unknown ShareGPT role {turn['from'][:20]!r} (known: {known})")
        calls = _tool_call(value) if speaker == "function_call" else None
        if calls:
            messages.append({"role": "assistant", "content": "", "tool_calls": calls})
        else:
            messages.append({"role": SHAREGPT_ROLES[speaker], "content": value})
    system = record.get("system")
    if isinstance(system, str) and system.strip() and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    return messages


def record_tools(record: dict) -> list | None:
    """A record's ``tools`` (function definitions): a list, or a JSON string of one; None when the
    record has none. BadChat when it has something else."""
    tools = record.get("tools")
    if tools is None or tools == "" or tools == []:
        return None
    try:
        tools = json.loads(tools) if isinstance(tools, str) else tools
    except (ValueError, RecursionError):
        raise BadChat("field 'tools' is not a list of tool definitions") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BadChat("field 'tools' is not a list of tool definitions")
    return tools or None


# Chat templates by name, for a tokenizer that has none (a base model's): ``data.chat_template``.
# The model's own template always wins. Roles a template has no place for are refused by it
# (``raise_exception``), which the data report counts as a chat template error.
_CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
_MISTRAL = (  # [INST] turns; a system prompt goes into the next user turn
    "{%- set ns = namespace(system='') -%}{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{%- set ns.system = message['content'] + '\\n\\n' -%}"
    "{%- elif message['role'] == 'user' -%}{{ '[INST] ' + ns.system + message['content'] + ' [/INST]' }}"
    "{%- set ns.system = '' -%}"
    "{%- elif message['role'] == 'assistant' -%}{{ message['content'] + eos_token }}"
    "{%- else -%}{{ raise_exception('the mistral template has no role ' + message['role']) }}"
    "{%- endif -%}{%- endfor -%}"
)
_GEMMA = (  # user / model turns; a system prompt goes into the next user turn
    "{%- set ns = namespace(system='') -%}{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{%- set ns.system = message['content'] + '\\n\\n' -%}"
    "{%- elif message['role'] in ('user', 'assistant') -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else 'user' -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (ns.system if role == 'user' else '')"
    " + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{%- if role == 'user' -%}{%- set ns.system = '' -%}{%- endif -%}"
    "{%- else -%}{{ raise_exception('the gemma template has no role ' + message['role']) }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
NAMED_TEMPLATES = {
    "chatml": _CHATML,
    "qwen": _CHATML,
    "llama3": _LLAMA3,
    "mistral": _MISTRAL,
    "gemma": _GEMMA,
}
