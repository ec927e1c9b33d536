"""Chat templates render to the same prompt tokens as transformers' apply_chat_template."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine.types import InvalidRequestError
from router.chat_template import ChatTemplate, ChatTemplateError
from router.frontend import Frontend

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Capital of Italy?"}],
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "Hi there"},
     {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Tell me a joke ✨ über"}],
    [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}, {"role": "user", "content": ""}],
]


@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen2_dir", "smollm2_dir"])
def test_prompt_tokens_equal_transformers_apply_chat_template(model: str, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(model)
    frontend = Frontend(model_dir)
    reference = AutoTokenizer.from_pretrained(model_dir)
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            want = reference.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 tokenize=True, return_dict=False)
            got = frontend.chat_token_ids(messages, 8192, add_generation_prompt)
            assert got == list(want), (model, messages)


@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen2_dir", "smollm2_dir"])
def test_continuing_the_final_message_renders_as_transformers_does(model: str, request: pytest.FixtureRequest) -> None:
    """continue_final_message: the prompt ends right after the final message's text (its own
    trailing space kept where the template keeps it), as transformers renders it."""
    model_dir = request.getfixturevalue(model)
    frontend = Frontend(model_dir)
    reference = AutoTokenizer.from_pretrained(model_dir)
    for begun in ("The capital of France is", "Sure, here it is: ", "", "Über ✨"):
        messages = [{"role": "user", "content": "What is the capital of France?"},
                    {"role": "assistant", "content": begun}]
        want = reference.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True,
                                             tokenize=True, return_dict=False)
        got = frontend.chat_token_ids(messages, 8192, False, None, continue_final=True)
        assert got == list(want), (model, begun)
    with pytest.raises(InvalidRequestError, match="send add_generation_prompt false"):
        frontend.chat_token_ids(messages, 8192, True, None, continue_final=True)


def test_a_final_message_is_continued_where_its_template_wrote_it(tiny_llama_dir: str, tmp_path: Path) -> None:
    """A template that trims the text ends the prompt at the trimmed text; one that rewrites
    it (here: upper case) cannot be continued, and says so."""
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes and "}]
    trims, rewrites = tmp_path / "trims.jinja", tmp_path / "rewrites.jinja"
    trims.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content | trim }}\n{% endfor %}")
    rewrites.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content | upper }}\n{% endfor %}")
    template = ChatTemplate.load(tiny_llama_dir, str(trims))
    assert template is not None and template.render(conversation, False, continue_final=True) == (
        "[user] hi\n[assistant] yes and")
    template = ChatTemplate.load(tiny_llama_dir, str(rewrites))
    assert template is not None
    with pytest.raises(ChatTemplateError, match="does not write the final message's text as it was sent"):
        template.render(conversation, False, continue_final=True)


def test_the_smollm2_template_comes_from_the_gguf_metadata(smollm2_dir: str) -> None:
    frontend = Frontend(smollm2_dir)
    text = frontend.chat_template.render([{"role": "user", "content": "Hi"}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_a_template_that_raises_is_a_clear_invalid_request(tiny_llama_dir: str) -> None:
    frontend = Frontend(tiny_llama_dir)
    with pytest.raises(InvalidRequestError, match="roles must be user or assistant after the system message"):
        frontend.chat_token_ids([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], 8192)
    with pytest.raises(InvalidRequestError, match="messages hold 1000 characters; the model's context is 10 tokens"):
        frontend.chat_token_ids([{"role": "user", "content": "x" * 1000}], 10)


def test_where_the_template_comes_from(tmp_path: Path, tiny_llama_dir: str) -> None:
    assert Frontend(str(tmp_path)).chat_template is None  # no tokenizer, no template
    with pytest.raises(InvalidRequestError, match="this model has no chat template"):
        Frontend(str(tmp_path)).chat_token_ids([{"role": "user", "content": "a"}], 100)
    override = tmp_path / "t.jinja"
    override.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{{ eos_token }}")
    assert ChatTemplate.load(tiny_llama_dir, str(override)).render([{"role": "user", "content": "hi"}]) == "[user] hi\n</s>"
    sidecar = tmp_path / "sidecar"
    sidecar.mkdir()
    (sidecar / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<B>", "special": True}, "chat_template": [
            {"name": "tool_use", "template": "tools"}, {"name": "default", "template": "{{ bos_token }}default"}]}))
    assert ChatTemplate.load(str(sidecar)).render([]) == "<B>default"  # a named list: the default one
    (sidecar / "chat_template.jinja").write_text("sidecar {{ messages | length }}")
    assert ChatTemplate.load(str(sidecar)).render([{"role": "user", "content": "x"}]) == "sidecar 1"  # the file wins
    with pytest.raises(ChatTemplateError, match="cannot read the chat template"):
        ChatTemplate.load(tiny_llama_dir, str(tmp_path / "missing.jinja"))
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}", {})


def test_the_sandbox_refuses_to_reach_python_internals() -> None:
    template = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}", {})
    with pytest.raises(ChatTemplateError):
        template.render([])
    tojson = ChatTemplate("{{ messages | tojson }}", {})
    assert tojson.render([{"role": "user", "content": "über"}]) == '[{"role": "user", "content": "über"}]'


def test_template_kwargs_that_would_set_the_calls_own_arguments_are_refused(tiny_llama_dir: str) -> None:
    frontend = Frontend(tiny_llama_dir)
    messages = [{"role": "user", "content": "a"}]
    for kwargs, taken in (({"messages": []}, "messages"), ({"add_generation_prompt": False}, "add_generation_prompt"),
                          ({"bos_token": "x", "messages": 1}, "bos_token, messages")):
        with pytest.raises(InvalidRequestError, match=f"chat_template_kwargs may not set {taken}: "):
            frontend.chat_token_ids(messages, 8192, True, kwargs)
    assert frontend.chat_token_ids(messages, 8192, True, {"enable_thinking": False})  # others reach the template
