"""A Llama checkpoint whose weights are written by hand so that its greedy answers are a script:
a model that calls tools the way Qwen2.5 does (hermes `<tool_call>` JSON, from a chat template
that renders tools, assistant calls and tool results), for agent-loop tests through the real
engine, router and OpenAI client, where a random tiny model would never call anything.

One layer, hidden size 128, a word-level tokenizer whose script pieces are single tokens:
- the embedding of token t is the unit vector e_t;
- attention head 0 looks for `<tool_response>` in the context: its query is the same at every
  position, its key is large only at that token, and its value there writes a flag into
  hidden dimension FLAG (else the head averages zero values); rope barely turns the
  dimension it uses (base 1e9, the slowest pair); head 1 and the MLP are zero;
- the LM head maps the last token t to its successor: SCRIPT's next piece when no tool result
  is in the context (weight 2), ANSWER's when one is (weight 1, plus 0.2 per unit of the flag
  on every ANSWER piece, which outweighs the 2 once the flag is set).

So after the generation prompt (last token "assistant") it thinks (<think> ... </think>),
writes "Let me check." and two parallel calls, and once the conversation holds a tool result,
the final answer. With `enable_thinking: false` the template ends the prompt in an empty
think block, as Qwen3's does, and the model answers from there without thinking. transformers
runs the checkpoint as any Llama (tests check the engine against it).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

HIDDEN, FLAG, HEAD_DIM = 128, 127, 64
WEATHER_CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TIME_CALL = '{"name": "get_time", "arguments": {"zone": "CET"}}'
THOUGHT = "The user wants the weather and the time."
SCRIPT = ["assistant", "<think>", THOUGHT, "</think>", "Let me check.", "\n<tool_call>\n", WEATHER_CALL,
          "\n</tool_call>\n", "<tool_call>\n", TIME_CALL, "\n</tool_call>", "<|im_end|>"]
"""Turn one: from the generation prompt's last token, the pieces the model writes in order
(with thinking off, the prompt ends in the template's empty think block: from </think> on)."""
ANSWER = ["assistant", "The weather in Paris is sunny and it is 14:05 there.", "<|im_end|>"]
"""Once a tool result is in the context (from </think> too, with thinking off)."""
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PIECES = ["<tool_response>", "</tool_response>", "<tools>", "</tools>", *SCRIPT[1:-1], *ANSWER[1:-1]]
"""Single tokens, none special (as Qwen's tokenizer has <think> and <tool_call>)."""
WORDS = ["[UNK]", "assistant", "user", "system", "tool", "#", "Tools", "What", "is", "the", "weather", "in", "Paris",
         "?", "and", "time", "there"]

TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for tc in message.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{%- if enable_thinking is defined and enable_thinking is false %}
<think>

</think>

{%- endif %}
{% endif %}"""


def _tokenizer() -> Tokenizer:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in PIECES])
    return tok


def make_scripted_model(out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer()
    vocab = tok.get_vocab_size()
    assert vocab < FLAG
    ids = {t: tok.token_to_id(t) for t in {*SCRIPT, *ANSWER, "<tool_response>"}}
    assert None not in ids.values()
    embed = torch.zeros(vocab, HIDDEN)
    embed[torch.arange(vocab), torch.arange(vocab)] = 1.0
    q, k, v, o = (torch.zeros(HIDDEN, HIDDEN) for _ in range(4))
    q[31, :vocab] = 1.4  # head 0, the slowest rope pair: the same query everywhere
    k[31, ids["<tool_response>"]] = 1.4  # scores 1.4 * 1.4 * 128 / 8 = 31 at the tool result, 0 elsewhere
    v[0, ids["<tool_response>"]] = 1.0
    o[FLAG, 0] = 1.0
    head = torch.zeros(vocab, HIDDEN)
    for a, b in zip(SCRIPT, SCRIPT[1:], strict=False):
        head[ids[b], ids[a]] += 2.0
    for a, b in [*zip(ANSWER, ANSWER[1:], strict=False), ("</think>", ANSWER[1])]:
        head[ids[b], ids[a]] += 1.0
        head[ids[b], FLAG] = 0.2
    weights = {"model.embed_tokens.weight": embed, "lm_head.weight": head, "model.norm.weight": torch.ones(HIDDEN),
               "model.layers.0.input_layernorm.weight": torch.ones(HIDDEN),
               "model.layers.0.post_attention_layernorm.weight": torch.ones(HIDDEN),
               "model.layers.0.self_attn.q_proj.weight": q, "model.layers.0.self_attn.k_proj.weight": k,
               "model.layers.0.self_attn.v_proj.weight": v, "model.layers.0.self_attn.o_proj.weight": o,
               "model.layers.0.mlp.gate_proj.weight": torch.zeros(16, HIDDEN),
               "model.layers.0.mlp.up_proj.weight": torch.zeros(16, HIDDEN),
               "model.layers.0.mlp.down_proj.weight": torch.zeros(HIDDEN, 16)}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    eos, bos = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
              "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
              "head_dim": HEAD_DIM, "vocab_size": vocab, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
              "rope_theta": 1e9, "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
              "bos_token_id": bos, "eos_token_id": eos, "attention_bias": False, "mlp_bias": False}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos}))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "unk_token": "[UNK]"}))
    (out / "chat_template.jinja").write_text(TEMPLATE)
    return out
