"""ChatFormatter: Hugging Face-style Jinja chat templates and MLC's conv_template fallback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from app.errors import LlmchatError
from app.inference.api import Message
from app.inference.engine.chat_template import BUILTIN_CONV_TEMPLATES, ChatFormatter
from app.inference.engine.tokenizer import Tokenizer

SMOLLM2_METADATA = Path("/work/shared/fixtures/smollm2/smollm2_gguf_metadata.json")
# Meta-Llama-3-8B-Instruct's chat template (tokenizer_config.json).
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# A Mistral-style template that rejects non-alternating roles with raise_exception.
ALTERNATING_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)

CHAT = [
    Message("user", "What is the capital of Japan?"),
    Message("assistant", "Tokyo."),
    Message("user", "And of France?"),
]


def _smollm2_template() -> str:
    if not SMOLLM2_METADATA.is_file():
        pytest.skip("shared SmolLM2 fixture not present")
    return json.loads(SMOLLM2_METADATA.read_text())["tokenizer.chat_template"]


def test_smollm2_template_renders_chatml_with_its_own_default_system() -> None:
    formatter = ChatFormatter.from_template(
        _smollm2_template(), bos_token="<|im_start|>", eos_token="<|im_end|>"
    )
    assert formatter.render(CHAT) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of Japan?<|im_end|>\n"
        "<|im_start|>assistant\nTokyo.<|im_end|>\n"
        "<|im_start|>user\nAnd of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_smollm2_template_with_user_system_prompt() -> None:
    formatter = ChatFormatter.from_template(_smollm2_template())
    text = formatter.render(
        [Message("system", "You are terse."), Message("user", "Hi")], add_generation_prompt=False
    )
    assert text == "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_llama3_template_bos_and_no_invented_system_prompt() -> None:
    formatter = ChatFormatter.from_template(
        LLAMA3_TEMPLATE, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"
    )
    text = formatter.render([Message("user", "  Hello  ")])
    assert text == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert "system" not in text


def test_hf_environment_features() -> None:
    template = (
        "{% for message in messages %}\n"
        "    {{ message['role'] }}: {{ message['content'] | tojson }}\n"
        "    {% if loop.index0 == 1 %}{% break %}{% endif %}\n"
        "{% endfor %}\n"
        "{% generation %}{{ strftime_now('%Y') | length }}{% endgeneration %}"
    )
    formatter = ChatFormatter.from_template(template)
    text = formatter.render([Message("user", "héllo"), Message("assistant", "ok"), Message("user", "never")])
    # trim_blocks drops the newline after a block tag, lstrip_blocks the indentation before one,
    # tojson keeps non-ASCII text (ensure_ascii=False) as transformers does, break works
    assert text == '    user: "héllo"\n    assistant: "ok"\n4'


def test_raise_exception_becomes_a_clear_error() -> None:
    formatter = ChatFormatter.from_template(
        ALTERNATING_TEMPLATE, bos_token="<s>", eos_token="</s>", source="/m/x"
    )
    assert (
        formatter.render(CHAT)
        == "<s>[INST] What is the capital of Japan? [/INST]Tokyo.</s>[INST] And of France? [/INST]"
    )
    with pytest.raises(LlmchatError) as err:
        formatter.render([Message("assistant", "first")])
    assert "/m/x" in str(err.value)
    assert "roles must alternate" in str(err.value)


def test_broken_template_names_the_model_dir(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{% for m in messages %}{{ m"})
    )
    with pytest.raises(LlmchatError) as err:
        ChatFormatter.from_model_dir(tmp_path, {})
    assert str(tmp_path) in str(err.value)
    assert "does not parse" in str(err.value)


def test_template_runtime_error_names_the_model_dir(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{{ messages[0].content.nope() }}"})
    )
    formatter = ChatFormatter.from_model_dir(tmp_path, {})
    with pytest.raises(LlmchatError) as err:
        formatter.render([Message("user", "x")])
    assert str(tmp_path) in str(err.value)


def test_sandbox_blocks_attribute_escapes() -> None:
    formatter = ChatFormatter.from_template("{{ messages.__class__.__mro__ }}", source="evil")
    with pytest.raises(LlmchatError, match="evil"):
        formatter.render([Message("user", "x")])


def test_from_model_dir_prefers_tokenizer_config_template(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": [
                    {"name": "tool_use", "template": "TOOLS"},
                    {"name": "default", "template": LLAMA3_TEMPLATE},
                ],
                "bos_token": {"content": "<|begin_of_text|>", "special": True},
                "eos_token": "<|eot_id|>",
            }
        )
    )
    mlc = {"conv_template": BUILTIN_CONV_TEMPLATES["llama-3"]}
    formatter = ChatFormatter.from_model_dir(tmp_path, mlc)
    assert formatter.kind == "jinja"
    assert formatter.render([Message("user", "Hi")]).startswith("<|begin_of_text|><|start_header_id|>user")
    # the MLC template's stops still apply; its system prefix ids do not (the template writes BOS)
    assert formatter.stop_token_ids == [128001, 128009]
    assert "<|eot_id|>" in formatter.stop_strings
    assert formatter.prefix_token_ids == []


def test_from_model_dir_reads_chat_template_jinja_file(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    )
    assert ChatFormatter.from_model_dir(tmp_path).render([Message("user", "a")]) == "<user>a"


def test_mlc_conv_template_fallback_chatml_like(tmp_path: Path) -> None:
    conv = dict(BUILTIN_CONV_TEMPLATES["qwen2"])
    formatter = ChatFormatter.from_model_dir(tmp_path, {"conv_template": conv})
    assert formatter.kind == "conv_template"
    # the model's own default system message (written in its mlc-chat-config.json) is used
    assert formatter.render([Message("user", "Hi")]) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert formatter.render([Message("system", "Be brief."), *CHAT]) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of Japan?<|im_end|>\n"
        "<|im_start|>assistant\nTokyo.<|im_end|>\n"
        "<|im_start|>user\nAnd of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert formatter.stop_strings == ["<|endoftext|>", "<|im_end|>"]
    assert formatter.stop_token_ids == [151643, 151645]


def test_conv_template_without_system_message_invents_none() -> None:
    formatter = ChatFormatter.from_conv_template("chatml_nosystem")
    assert (
        formatter.render([Message("user", "Hi")]) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_conv_template_llama2_and_mistral_layouts() -> None:
    llama2 = ChatFormatter.from_conv_template("llama-2")
    assert llama2.render([Message("system", "S"), *CHAT]) == (
        "[INST] <<SYS>>\nS\n<</SYS>>\n\nWhat is the capital of Japan? [/INST] Tokyo. </s>"
        "<s>[INST] And of France? [/INST] "
    )
    assert llama2.prefix_token_ids == [1]
    assert llama2.stop_strings == ["[INST]"]
    mistral = ChatFormatter.from_conv_template("mistral_default")
    assert mistral.render([Message("system", "Sys."), Message("user", "Hi")]) == "[INST] Sys.Hi [/INST]"


def test_conv_template_llama3_with_role_templates() -> None:
    conv = {**BUILTIN_CONV_TEMPLATES["llama-3"], "role_templates": {"user": "Q: {user_message}"}}
    formatter = ChatFormatter.from_conv_template(conv)
    assert formatter.render([Message("system", "S"), Message("user", "Hi")]) == (
        "<|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nQ: Hi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_unknown_or_malformed_conv_template(tmp_path: Path) -> None:
    with pytest.raises(LlmchatError, match="does not know"):
        ChatFormatter.from_model_dir(tmp_path, {"conv_template": "vicuna_v9"})
    with pytest.raises(LlmchatError, match="malformed"):
        ChatFormatter.from_model_dir(tmp_path, {"conv_template": {"roles": {"user": "U"}, "seps": []}})
    with pytest.raises(LlmchatError, match="no chat template"):
        ChatFormatter.from_model_dir(tmp_path, {})


def _tiny_tokenizer(specials: list[str]) -> Tokenizer:
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(["Hello user assistant system header"] * 10, trainer)
    bos = hf.token_to_id(specials[0])
    return Tokenizer.from_tokenizers(hf, bos_id=bos, eos_ids=[hf.token_to_id(specials[-1])], add_bos=True)


def test_encode_prompt_gives_exactly_one_bos() -> None:
    specials = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok = _tiny_tokenizer(specials)
    jinja = ChatFormatter.from_template(LLAMA3_TEMPLATE, bos_token="<|begin_of_text|>")
    ids = jinja.encode_prompt(tok, [Message("user", "Hello")])
    assert ids.count(tok.bos_id) == 1 and ids[0] == tok.bos_id
    conv = ChatFormatter.from_conv_template(
        {**BUILTIN_CONV_TEMPLATES["llama-3"], "system_prefix_token_ids": [0]}
    )
    ids = conv.encode_prompt(tok, [Message("user", "Hello")])
    assert ids.count(tok.bos_id) == 1 and ids[0] == tok.bos_id
    assert ids[1] == tok.token_to_id("<|start_header_id|>")
