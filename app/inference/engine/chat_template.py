"""Chat prompts: the model's Jinja chat template (rendered as Hugging Face does) or MLC's conv_template.

The engine encodes a rendered prompt with ``ChatFormatter.encode_prompt`` (or, equivalently,
``prefix_token_ids + tokenizer.encode(text, add_bos=False)``): a Jinja template writes its own
``{{ bos_token }}``, and MLC's conv_template prepends ``system_prefix_token_ids``.
Generation stops on ``tokenizer.eos_ids | set(formatter.stop_token_ids)`` and on
``formatter.stop_strings``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from app.errors import LlmchatError
from app.inference.api import Message
from app.inference.engine.tokenizer import token_content

if TYPE_CHECKING:
    from app.inference.engine.tokenizer import Tokenizer

# MLC's conv_template names that older mlc-chat-config.json files give as a bare string
# (values as registered in mlc-llm's python/mlc_llm/conversation_template/).
BUILTIN_CONV_TEMPLATES: dict[str, dict[str, Any]] = {
    "chatml": {
        "name": "chatml",
        "system_template": "<|im_start|>system\n{system_message}<|im_end|>\n",
        "system_message": "A conversation between a user and an LLM-based AI assistant. "
        "The assistant gives helpful and honest answers.",
        "roles": {"user": "<|im_start|>user", "assistant": "<|im_start|>assistant"},
        "seps": ["<|im_end|>\n"],
        "role_content_sep": "\n",
        "role_empty_sep": "\n",
        "stop_str": ["<|im_end|>"],
        "stop_token_ids": [2],
    },
    "chatml_nosystem": {
        "name": "chatml_nosystem",
        "system_template": "{system_message}",
        "system_message": "",
        "roles": {"user": "<|im_start|>user", "assistant": "<|im_start|>assistant"},
        "seps": ["<|im_end|>\n"],
        "role_content_sep": "\n",
        "role_empty_sep": "\n",
        "stop_str": ["<|im_end|>"],
        "stop_token_ids": [2],
    },
    "llama-2": {
        "name": "llama-2",
        "system_template": "[INST] <<SYS>>\n{system_message}\n<</SYS>>\n\n",
        "system_message": "You are a helpful, respectful and honest assistant.",
        "roles": {"user": "<s>[INST]", "assistant": "[/INST]", "tool": "[INST]"},
        "seps": [" ", " </s>"],
        "role_content_sep": " ",
        "role_empty_sep": " ",
        "stop_str": ["[INST]"],
        "stop_token_ids": [2],
        "system_prefix_token_ids": [1],
        "add_role_after_system_message": False,
    },
    "llama-3": {
        "name": "llama-3",
        "system_template": "<|start_header_id|>system<|end_header_id|>\n\n{system_message}<|eot_id|>",
        "system_message": "You are a helpful, respectful and honest assistant.",
        "roles": {"user": "<|start_header_id|>user", "assistant": "<|start_header_id|>assistant"},
        "seps": ["<|eot_id|>"],
        "role_content_sep": "<|end_header_id|>\n\n",
        "role_empty_sep": "<|end_header_id|>\n\n",
        "stop_str": ["<|end_of_text|>", "<|eot_id|>"],
        "stop_token_ids": [128001, 128009],
        "system_prefix_token_ids": [128000],
    },
    "llama-3_1": {
        "name": "llama-3_1",
        "system_template": "<|start_header_id|>system<|end_header_id|>\n\n{system_message}<|eot_id|>",
        "system_message": "You are a helpful, respectful and honest assistant.",
        "roles": {
            "user": "<|start_header_id|>user",
            "assistant": "<|start_header_id|>assistant",
            "tool": "<|start_header_id|>ipython",
        },
        "seps": ["<|eot_id|>"],
        "role_content_sep": "<|end_header_id|>\n\n",
        "role_empty_sep": "<|end_header_id|>\n\n",
        "stop_str": [],
        "stop_token_ids": [128001, 128008, 128009],
        "system_prefix_token_ids": [128000],
    },
    "mistral_default": {
        "name": "mistral_default",
        "system_template": "[INST] {system_message}",
        "system_message": "Always assist with care, respect, and truth. Respond with utmost utility yet "
        "securely. Avoid harmful, unethical, prejudiced, or negative content. Ensure replies promote "
        "fairness and positivity.",
        "roles": {"user": "[INST]", "assistant": "[/INST]", "tool": "[INST]"},
        "seps": [" "],
        "role_content_sep": " ",
        "role_empty_sep": "",
        "stop_str": ["</s>"],
        "stop_token_ids": [2],
        "system_prefix_token_ids": [1],
        "add_role_after_system_message": False,
    },
    "qwen2": {
        "name": "qwen2",
        "system_template": "<|im_start|>system\n{system_message}<|im_end|>\n",
        "system_message": "You are a helpful assistant.",
        "roles": {"user": "<|im_start|>user", "assistant": "<|im_start|>assistant"},
        "seps": ["<|im_end|>\n"],
        "role_content_sep": "\n",
        "role_empty_sep": "\n",
        "stop_str": ["<|endoftext|>", "<|im_end|>"],
        "stop_token_ids": [151643, 151645],
    },
}

_PLACEHOLDERS = {
    "system": "{system_message}",
    "user": "{user_message}",
    "assistant": "{assistant_message}",
    "tool": "{tool_message}",
}


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}`` (Hugging Face's assistant-mask marker): renders its body."""

    tags = {"generation"}  # noqa: RUF012 - jinja's own class attribute

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _jinja_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _read_json(path: Path, source: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise LlmchatError(f"cannot read {path} of {source}: {err}", "download the model again") from None
    return data if isinstance(data, dict) else {}


def _pick_template(value: Any) -> str | None:
    """tokenizer_config's chat_template: a string, or a list of {"name", "template"} (use "default")."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default")
        return chosen if isinstance(chosen, str) else None
    return None


class ChatFormatter:
    """Turns a conversation into the prompt text the model was trained on."""

    def __init__(
        self,
        source: str,
        *,
        template: str | None = None,
        conv_template: dict[str, Any] | None = None,
        special_tokens: dict[str, str] | None = None,
        stop_strings: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
    ) -> None:
        if (template is None) == (conv_template is None):
            raise ValueError("give exactly one of template and conv_template")
        self.source = source
        self.template_text = template
        self.conv_template = conv_template
        self.special_tokens = dict(special_tokens or {})
        self.stop_strings: list[str] = list(dict.fromkeys(s for s in stop_strings if s))
        self.stop_token_ids: list[int] = list(dict.fromkeys(int(i) for i in stop_token_ids))
        self.prefix_token_ids: list[int] = []
        self._compiled: jinja2.Template | None = None
        if template is not None:
            try:
                self._compiled = _jinja_environment().from_string(template)
            except jinja2.TemplateError as err:
                raise LlmchatError(
                    f"the chat template of {source} does not parse: {err}",
                    "fix chat_template in tokenizer_config.json, or download the model again",
                ) from None
        else:
            assert conv_template is not None
            self._check_conv_template(conv_template)
            self.prefix_token_ids = [int(i) for i in conv_template.get("system_prefix_token_ids") or []]

    # -- construction --------------------------------------------------------------------
    @classmethod
    def from_template(
        cls,
        template: str,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        source: str = "the model",
        stop_strings: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
    ) -> ChatFormatter:
        """A formatter for a Jinja chat template given as text (tests, GGUF metadata)."""
        special = {k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token)) if v is not None}
        return cls(
            source,
            template=template,
            special_tokens=special,
            stop_strings=stop_strings,
            stop_token_ids=stop_token_ids,
        )

    @classmethod
    def from_conv_template(cls, conv: dict[str, Any] | str, source: str = "the model") -> ChatFormatter:
        """A formatter for MLC's conv_template (the JSON object, or a registered name)."""
        conv_dict = _resolve_conv_template(conv, source)
        return cls(
            source,
            conv_template=conv_dict,
            stop_strings=conv_dict.get("stop_str") or [],
            stop_token_ids=conv_dict.get("stop_token_ids") or [],
        )

    @classmethod
    def from_model_dir(cls, path: str | Path, mlc_config: dict[str, Any] | None = None) -> ChatFormatter:
        """The chat template of tokenizer_config.json (or chat_template.jinja), else MLC's conv_template."""
        model_dir = Path(path)
        source = str(model_dir)
        mlc_config = mlc_config or {}
        config_path = model_dir / "tokenizer_config.json"
        config = _read_json(config_path, source) if config_path.is_file() else {}
        template = _pick_template(config.get("chat_template"))
        if template is None and (model_dir / "chat_template.jinja").is_file():
            template = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
        if template is None and (model_dir / "chat_template.json").is_file():
            template = _pick_template(
                _read_json(model_dir / "chat_template.json", source).get("chat_template")
            )

        conv = mlc_config.get("conv_template")
        conv_dict = _resolve_conv_template(conv, source) if conv else None
        stop_strings = list(conv_dict.get("stop_str") or []) if conv_dict else []
        stop_ids = list(conv_dict.get("stop_token_ids") or []) if conv_dict else []

        if template is not None:
            special = {}
            for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
                content = token_content(config.get(key))
                if content is not None:
                    special[key] = content
            return cls(
                source,
                template=template,
                special_tokens=special,
                stop_strings=stop_strings,
                stop_token_ids=stop_ids,
            )
        if conv_dict is not None:
            return cls(source, conv_template=conv_dict, stop_strings=stop_strings, stop_token_ids=stop_ids)
        raise LlmchatError(
            f"{source} has no chat template: no chat_template in tokenizer_config.json and no "
            "conv_template in mlc-chat-config.json.",
            "use an instruction-tuned (chat) model; its tokenizer_config.json carries the chat template",
        )

    # -- rendering -----------------------------------------------------------------------
    @property
    def kind(self) -> str:
        """ "jinja" or "conv_template"."""
        return "jinja" if self._compiled is not None else "conv_template"

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        """The prompt text for ``messages`` (ending with the assistant's turn header if asked)."""
        if self._compiled is not None:
            return self._render_jinja(messages, add_generation_prompt)
        return self._render_conv(messages, add_generation_prompt)

    def encode_prompt(
        self, tokenizer: Tokenizer, messages: Sequence[Message], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the rendered prompt, with exactly the BOS the template asks for."""
        text = self.render(messages, add_generation_prompt)
        return [*self.prefix_token_ids, *tokenizer.encode(text, add_bos=False)]

    def _render_jinja(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        assert self._compiled is not None
        chat = [{"role": m.role, "content": m.content} for m in messages]
        try:
            return self._compiled.render(
                messages=chat,
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **self.special_tokens,
            )
        except jinja2.TemplateError as err:
            raise LlmchatError(
                f"the chat template of {self.source} failed: {err}",
                "the conversation does not fit what this model's template accepts "
                "(for example roles must alternate user/assistant); try /reset",
            ) from None
        except Exception as err:  # the template's own code failed (a type error inside jinja)
            raise LlmchatError(
                f"the chat template of {self.source} failed: {type(err).__name__}: {err}",
                "fix chat_template in the model's tokenizer_config.json",
            ) from None

    def _render_conv(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        """MLC's Conversation.as_prompt: system, then role/content pairs with separators."""
        conv = self.conv_template
        assert conv is not None
        system_message = conv.get("system_message", "")
        turns: list[tuple[str, str | None]] = []
        for message in messages:
            if message.role == "system":
                system_message = message.content
            else:
                turns.append((message.role, message.content))
        if add_generation_prompt:
            turns.append(("assistant", None))
        system_text = conv.get("system_template", "{system_message}").replace(
            "{system_message}", system_message
        )
        seps = list(conv["seps"])
        if len(seps) == 1:
            seps.append(seps[0])
        roles: dict[str, str] = conv["roles"]
        role_templates = {**_PLACEHOLDERS, **(conv.get("role_templates") or {})}
        role_content_sep = conv.get("role_content_sep", "")
        role_empty_sep = conv.get("role_empty_sep", "")
        add_role_after_system = conv.get("add_role_after_system_message", True)
        parts = [system_text] if system_text else []
        for index, (role, content) in enumerate(turns):
            if role not in roles:
                raise LlmchatError(
                    f"the conv_template of {self.source} has no role {role!r} (it has {', '.join(roles)}).",
                    "use only system, user and assistant messages with this model",
                )
            separator = seps[1] if role == "assistant" else seps[0]
            if content is None:
                parts.append(roles[role] + role_empty_sep)
                continue
            if not add_role_after_system and system_text and index == 0:
                prefix = ""
            else:
                prefix = roles[role] + role_content_sep
            body = role_templates.get(role, _PLACEHOLDERS.get(role, "{user_message}"))
            placeholder = _PLACEHOLDERS.get(role, "")
            parts.append(
                prefix + (body.replace(placeholder, content) if placeholder else content) + separator
            )
        text = "".join(parts)
        # MLC's function-calling placeholder: no functions here
        return text.replace("{function_string}", "")

    def _check_conv_template(self, conv: dict[str, Any]) -> None:
        seps = conv.get("seps")
        roles = conv.get("roles")
        ok = (
            isinstance(seps, list)
            and 1 <= len(seps) <= 2
            and all(isinstance(s, str) for s in seps)
            and isinstance(roles, dict)
            and "user" in roles
            and "assistant" in roles
            and isinstance(conv.get("system_template", ""), str)
            and isinstance(conv.get("system_message", ""), str)
        )
        if not ok:
            raise LlmchatError(
                f"the conv_template in {self.source}/mlc-chat-config.json is malformed "
                "(it needs roles for user and assistant and 1 or 2 seps).",
                "download the model again, or regenerate mlc-chat-config.json with mlc_llm gen_config",
            )


def _resolve_conv_template(conv: Any, source: str) -> dict[str, Any]:
    if isinstance(conv, dict):
        return conv
    if isinstance(conv, str) and conv in BUILTIN_CONV_TEMPLATES:
        return dict(BUILTIN_CONV_TEMPLATES[conv])
    raise LlmchatError(
        f"{source}/mlc-chat-config.json names conv_template {conv!r}, which llmchat does not know "
        f"(known names: {', '.join(BUILTIN_CONV_TEMPLATES)}).",
        "add a chat_template to tokenizer_config.json, or regenerate mlc-chat-config.json with a "
        "current mlc_llm gen_config (it writes the template out in full)",
    )
