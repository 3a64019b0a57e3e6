"""Render conversational rows (lists of {"role", "content"} messages) to text.

With a tokenizer that has a chat template:
  prompt     = apply_chat_template(prompt, add_generation_prompt=True)
  completion = apply_chat_template(prompt + completion) minus the prompt rendering,
               when the full rendering starts with the prompt rendering (so the
               template's end-of-turn markup is part of what is trained);
               otherwise the completion messages' content.
  conversation = apply_chat_template(messages) (a whole `messages` row, for SFT)
Without one (no tokenizer, or `tokenizer.chat_template` unset), a plain fallback:
  prompt     = "user: hi\\nassistant: "   (one "role: content" line per message)
  completion = content of the first completion message; any further message
               follows as "\\nrole: content".
  conversation = "user: hi\\nassistant: hello"  (so prompt + completion of a split
               conversation reads the same as the whole conversation)
"""

from __future__ import annotations

Message = dict  # {"role": str, "content": str}


def has_chat_template(tokenizer) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def render_prompt(messages: list[Message], tokenizer=None) -> str:
    """Prompt text that ends where the assistant's answer should begin."""
    if has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


def render_completion(prompt: list[Message], completion: list[Message], tokenizer=None) -> str:
    """Text of `completion` as it follows `render_prompt(prompt)`."""
    if has_chat_template(tokenizer):
        prompt_text = render_prompt(prompt, tokenizer)
        full = tokenizer.apply_chat_template(prompt + completion, tokenize=False)
        if full.startswith(prompt_text):
            return full[len(prompt_text):]
        return "".join(m["content"] for m in completion)
    first, *rest = completion
    return first["content"] + "".join(f"\n{m['role']}: {m['content']}" for m in rest)


def render_conversation(messages: list[Message], tokenizer=None) -> str:
    """Text of a whole conversation (TRL's language-modelling rows), every turn included."""
    if has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(messages, tokenize=False)
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)
