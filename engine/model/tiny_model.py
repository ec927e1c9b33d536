"""Writes deterministic Hugging Face-format checkpoints for tests and benchmarks.

`tiny` (a few MB) is for tests; `small` (~100M parameters) for benchmarks; `llama3-8b`
(Llama-3.1-8B's shapes, random bfloat16 weights, 16 GB in 5 GB shards, written one layer
at a time) for measuring the GPU path at a real model size without a download. The llama
arch uses Llama-3 rope scaling and untied embeddings; qwen2 has q/k/v biases and
tied embeddings; qwen3 normalises each head of q and k and has heads wider than
hidden_size / heads; mixtral, qwen2_moe (a shared expert, one dense layer) and qwen3_moe
are mixtures of 4 experts, 2 per token; mistral attends through a sliding window of 16
keys; gemma3 has Gemma 3's norms (1 + w, around each block), GeGLU, scaled embeddings,
a query scale of its own, a local layer (window 8, its own rope base) before a global one
and soft-capped logits; gemma2 the same less q/k norms and local rope, with attention
scores soft-capped (at 2, so the cap bites); phi3 stores q/k/v and gate/up fused; so between them the tests
cover every model variant we load.

`make_draft_model` writes a draft for speculative decoding from any checkpoint we load:
its first N layers, with its embeddings, final norm, head and tokenizer (a layer-skip
draft: the target's own early layers guess its next tokens, no training needed).
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.model.tiny_tokenizer import BOS_ID, EOS_ID, PAD_ID, SPECIAL_TOKENS, build_tokenizer

SIZES = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048),
    "small": dict(vocab_size=8192, hidden_size=768, intermediate_size=2560, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=8192),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072),
}
WEIGHT_DTYPES = {"llama3-8b": torch.bfloat16}
"""Sizes written in a 16-bit dtype (the others in float32)."""
SHARD_BYTES = 5 * 2**30
"""A checkpoint bigger than this is written in shards with an index, as Hugging Face does."""
ARCHS = ("llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "mistral", "gemma3", "phi3", "gemma2")
SLIDING_WINDOW = 16
"""The tiny mistral's window: prompts of a few blocks already slide it."""
NUM_EXPERTS, EXPERTS_PER_TOKEN = 4, 2


def model_config(arch: str, size: str) -> dict:
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {tuple(SIZES)}, got {size!r}")
    dtype = str(WEIGHT_DTYPES.get(size, torch.float32)).removeprefix("torch.")
    cfg = dict(SIZES[size], hidden_act="silu", rms_norm_eps=1e-5, bos_token_id=BOS_ID,
               eos_token_id=EOS_ID, pad_token_id=PAD_ID, torch_dtype=dtype, use_cache=True)
    cfg.update(_arch_fields(arch, size, cfg))
    if "hidden_activation" in cfg:  # Gemma names it so
        del cfg["hidden_act"]
    return cfg


def _arch_fields(arch: str, size: str, cfg: dict) -> dict:
    """What an architecture's config.json sets beside the size's shape (`cfg`)."""
    layers, wide_heads = cfg["num_hidden_layers"], 2 * cfg["hidden_size"] // cfg["num_attention_heads"]
    experts = dict(num_experts_per_tok=EXPERTS_PER_TOKEN, moe_intermediate_size=cfg["intermediate_size"] // 2,
                   decoder_sparse_step=1)
    if arch == "llama":
        return dict(architectures=["LlamaForCausalLM"], model_type="llama", tie_word_embeddings=False,
                    rope_theta=500000.0, attention_bias=False, mlp_bias=False,
                    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                      original_max_position_embeddings=8192 if size == "llama3-8b" else 256))
    if arch == "qwen2":
        return dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", tie_word_embeddings=True,
                    rope_theta=1000000.0, use_sliding_window=False, sliding_window=None, max_window_layers=layers)
    if arch == "qwen3":  # Qwen3's heads are wider than hidden_size / heads (128 against 64)
        return dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", tie_word_embeddings=True,
                    rope_theta=1000000.0, attention_bias=False, use_sliding_window=False, sliding_window=None,
                    max_window_layers=layers, head_dim=wide_heads)
    if arch == "qwen3_moe":
        return dict(_arch_fields("qwen3", size, cfg), architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                    num_experts=NUM_EXPERTS, norm_topk_prob=True, mlp_only_layers=[], **experts)
    if arch == "qwen2_moe":  # layer 0 dense (mlp_only_layers), the others a mixture beside a shared expert
        return dict(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", tie_word_embeddings=True,
                    rope_theta=1000000.0, use_sliding_window=False, num_experts=NUM_EXPERTS,
                    shared_expert_intermediate_size=cfg["intermediate_size"], norm_topk_prob=False,
                    mlp_only_layers=[0], qkv_bias=True, **experts)
    if arch == "mixtral":
        return dict(architectures=["MixtralForCausalLM"], model_type="mixtral", tie_word_embeddings=False,
                    rope_theta=1000000.0, sliding_window=None, num_local_experts=NUM_EXPERTS,
                    num_experts_per_tok=EXPERTS_PER_TOKEN)
    if arch == "mistral":
        return dict(architectures=["MistralForCausalLM"], model_type="mistral", tie_word_embeddings=False,
                    rope_theta=10000.0, sliding_window=SLIDING_WINDOW)
    if arch == "phi3":
        return dict(architectures=["Phi3ForCausalLM"], model_type="phi3", tie_word_embeddings=False,
                    rope_theta=10000.0, sliding_window=None,
                    original_max_position_embeddings=cfg["max_position_embeddings"])
    gemma = dict(tie_word_embeddings=True, query_pre_attn_scalar=24, sliding_window=8, rms_norm_eps=1e-6,
                 hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=15.0)
    if arch == "gemma2":  # soft-capped attention, a local layer before a global one
        return dict(gemma, architectures=["Gemma2ForCausalLM"], model_type="gemma2", rope_theta=10000.0,
                    head_dim=cfg["hidden_size"] // cfg["num_attention_heads"], attn_logit_softcapping=2.0)
    # gemma3, as transformers 5 writes its config: a rope per layer type
    return dict(gemma, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", head_dim=wide_heads,
                num_key_value_heads=1, attn_logit_softcapping=None,
                layer_types=["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)],
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})


def _weights(cfg: dict, arch: str, seed: int, device: str = "cpu") -> Iterator[dict[str, torch.Tensor]]:
    """The checkpoint's tensors in groups (the embeddings and head, then one layer at a time),
    drawn from one generator in a fixed order, in the config's dtype; on `device` (a GPU draws
    Llama-3-8B's 8 billion in seconds, a CPU in about a minute: other values, same shapes)."""
    g = torch.Generator(device=device).manual_seed(seed)
    dtype = getattr(torch, cfg["torch_dtype"])
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    randn = lambda *shape, std=0.02: (torch.randn(*shape, generator=g, device=device) * std).to(dtype).cpu()  # noqa: E731
    gemma = cfg["model_type"] in ("gemma3_text", "gemma2")
    norm = lambda n=h: randn(n, std=0.1) + (0.0 if gemma else 1.0)  # noqa: E731  (Gemma applies 1 + w)
    # Tied embeddings stay small so the output is not just the input token echoed back.
    embed_std = 0.05 if cfg["tie_word_embeddings"] else 0.5
    w = {"model.embed_tokens.weight": randn(v, h, std=embed_std), "model.norm.weight": norm()}
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = randn(v, h, std=0.05)
    yield w
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w = {p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm()}
        if gemma:
            w[p + "pre_feedforward_layernorm.weight"] = norm()
            w[p + "post_feedforward_layernorm.weight"] = norm()
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            w[p + f"self_attn.{name}_proj.weight"] = randn(rows, h, std=h**-0.5)
            if arch in ("qwen2", "qwen2_moe"):
                w[p + f"self_attn.{name}_proj.bias"] = randn(rows, std=0.1)
        w[p + "self_attn.o_proj.weight"] = randn(h, q, std=q**-0.5)
        if arch in ("qwen3", "qwen3_moe", "gemma3"):
            w[p + "self_attn.q_norm.weight"] = norm(d)
            w[p + "self_attn.k_norm.weight"] = norm(d)
        if "num_experts_per_tok" in cfg and i not in cfg.get("mlp_only_layers", []):
            w.update(_experts(cfg, p, randn))
        else:
            w[p + "mlp.gate_proj.weight"] = randn(inter, h, std=h**-0.5)
            w[p + "mlp.up_proj.weight"] = randn(inter, h, std=h**-0.5)
            w[p + "mlp.down_proj.weight"] = randn(h, inter, std=inter**-0.5)
        if arch == "phi3":  # its checkpoints hold the projections fused: [q; k; v], [gate; up]
            w[p + "self_attn.qkv_proj.weight"] = torch.cat([w.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            w[p + "mlp.gate_up_proj.weight"] = torch.cat([w.pop(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")])
        yield w


def _experts(cfg: dict, p: str, randn: Callable[..., torch.Tensor]) -> dict[str, torch.Tensor]:
    """A layer's mixture of experts under the names its architecture's checkpoints use."""
    h = cfg["hidden_size"]
    mixtral = cfg["model_type"] == "mixtral"
    inter = cfg["intermediate_size"] if mixtral else cfg["moe_intermediate_size"]
    block, gate, up, down = ("block_sparse_moe", "w1", "w3", "w2") if mixtral else ("mlp", "gate_proj", "up_proj", "down_proj")
    num = cfg.get("num_local_experts") or cfg["num_experts"]
    w = {f"{p}{block}.gate.weight": randn(num, h, std=1.0)}  # routers that prefer some experts clearly
    for e in range(num):
        x = f"{p}{block}.experts.{e}."
        w[x + f"{gate}.weight"] = randn(inter, h, std=h**-0.5)
        w[x + f"{up}.weight"] = randn(inter, h, std=h**-0.5)
        w[x + f"{down}.weight"] = randn(h, inter, std=inter**-0.5)
    if cfg.get("shared_expert_intermediate_size"):
        s, inter = f"{p}mlp.shared_expert.", cfg["shared_expert_intermediate_size"]
        w[s + "gate_proj.weight"] = randn(inter, h, std=h**-0.5)
        w[s + "up_proj.weight"] = randn(inter, h, std=h**-0.5)
        w[s + "down_proj.weight"] = randn(h, inter, std=inter**-0.5)
        w[f"{p}mlp.shared_expert_gate.weight"] = randn(1, h, std=h**-0.5)
    return w


def _save_weights(groups: Iterable[dict[str, torch.Tensor]], out: Path) -> None:
    """One model.safetensors, or shards of up to SHARD_BYTES with model.safetensors.index.json
    (a shard is written as soon as it is full: memory holds one shard, not the model)."""
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = total = 0
    weight_map: dict[str, str] = {}
    for group in groups:
        nbytes = sum(t.numel() * t.element_size() for t in group.values())
        if pending and pending_bytes + nbytes > SHARD_BYTES:
            name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
            save_file(pending, str(out / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(pending, name))
            pending, pending_bytes = {}, 0
        pending.update(group)
        pending_bytes += nbytes
        total += nbytes
    if not weight_map:  # it all fits one file
        save_file(pending, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
    save_file(pending, str(out / name), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(pending, name))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


CHAT_TEMPLATES = {
    # Llama 3's shape: BOS, a header per message, content trimmed, an end-of-turn marker; the
    # markers are plain text to this tokenizer (its only special tokens are <s> </s> <pad>)
    "llama": (
        "{{- bos_token }}"
        "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] | trim %}"
        "{%- set messages = messages[1:] %}{%- else %}{%- set system = 'You are a tiny test model.' %}{%- endif %}"
        "{{- '<|start_header_id|>system<|end_header_id|>\n\n' + system + '<|eot_id|>' }}"
        "{%- for message in messages %}"
        "{%- if message['role'] not in ['user', 'assistant'] %}"
        "{{- raise_exception('roles must be user or assistant after the system message') }}{%- endif %}"
        "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
        " + '<|eot_id|>' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"),
    # ChatML, as Qwen2 writes it
    "qwen2": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
        " + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
}
CHAT_TEMPLATES.update(qwen3=CHAT_TEMPLATES["qwen2"], qwen2_moe=CHAT_TEMPLATES["qwen2"],
                      qwen3_moe=CHAT_TEMPLATES["qwen2"], mixtral=CHAT_TEMPLATES["llama"],
                      mistral=CHAT_TEMPLATES["llama"],
                      phi3=CHAT_TEMPLATES["llama"],
                      gemma3="{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + ('model' if "
                             "message['role'] == 'assistant' else message['role']) + '\n' + message['content'] | trim "
                             "+ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}"
                             "{{ '<start_of_turn>model\n' }}{% endif %}")
"""Chat templates the test checkpoints carry (in tokenizer_config.json, as Hugging Face writes them)."""
CHAT_TEMPLATES["gemma2"] = CHAT_TEMPLATES["gemma3"]


def make_tiny_model(out_dir: str | Path, arch: str = "llama", size: str = "tiny", seed: int = 0,
                    device: str = "cpu") -> Path:
    """Write config, weights, tokenizer and generation config; returns the directory. The
    weights are drawn on `device` (the same seed draws other values on another device)."""
    cfg = model_config(arch, size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in (*out.glob("model*.safetensors"), out / "model.safetensors.index.json"):
        stale.unlink(missing_ok=True)
    _save_weights(_weights(cfg, arch, seed, device), out)
    build_tokenizer(cfg["vocab_size"], seed).save(str(out / "tokenizer.json"))
    bos, eos, pad = SPECIAL_TOKENS
    files = {
        "config.json": cfg,
        "generation_config.json": dict(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID),
        "tokenizer_config.json": dict(tokenizer_class="PreTrainedTokenizerFast", bos_token=bos,
                                      eos_token=eos, pad_token=pad, model_max_length=cfg["max_position_embeddings"],
                                      chat_template=CHAT_TEMPLATES[arch]),
    }
    for name, content in files.items():
        (out / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
    return out


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")


def make_draft_model(target_dir: str | Path, out_dir: str | Path, num_layers: int) -> Path:
    """Write a draft of the checkpoint at `target_dir` (a directory, or a GGUF file, converted
    first): its first `num_layers` layers; returns the directory."""
    from engine.checkpoints.gguf_checkpoint import resolve_model_dir
    from engine.checkpoints.weights import CheckpointReader

    src = resolve_model_dir(target_dir)
    cfg = json.loads((src / "config.json").read_text())
    if not 1 <= num_layers <= cfg["num_hidden_layers"]:
        raise ValueError(f"a draft of {target_dir} keeps 1 to {cfg['num_hidden_layers']} layers, not {num_layers}")
    cfg["num_hidden_layers"] = num_layers
    if "max_window_layers" in cfg:
        cfg["max_window_layers"] = min(cfg["max_window_layers"], num_layers)
    ckpt = CheckpointReader(src)
    keep = [n for n in sorted(ckpt.names())
            if not n.startswith("model.layers.") or int(n.split(".")[2]) < num_layers]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = {n: ckpt.get(n, torch.float32, "cpu").contiguous() for n in keep}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out


def _compressed_tensors(weights: str, inputs: dict | None) -> dict:
    """llm-compressor's quantization_config: FP8 `weights` ("tensor" or "channel") and
    `inputs` (a strategy and whether dynamic; None: weights only)."""
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"],
                                          "weights": {**fp8, "strategy": weights, "dynamic": False},
                                          "input_activations": None if inputs is None else {**fp8, **inputs}}}}


FP8_CONFIGS = {
    "fp8-static": {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]},
    "fbgemm": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]},
    "ct-channel-dynamic": _compressed_tensors("channel", {"strategy": "token", "dynamic": True}),
    "ct-channel-static": _compressed_tensors("channel", {"strategy": "tensor", "dynamic": False}),
    "ct-weights-only": _compressed_tensors("tensor", None),
}
"""The quantization_configs `make_fp8_model` writes, as AutoFP8 (fp8, per-tensor weights and
a static input scale), Meta's Llama 3.1 FP8 (fbgemm_fp8) and llm-compressor (compressed-tensors
FP8-dynamic, FP8 with per-channel weights and a static input scale, and weights only) write them."""
FP8_INPUT_SCALE = 8.0 / 448.0
"""The static input scale written: inputs saturate at +-8 (a tiny model's normalised ones
stay within a few units)."""


def make_fp8_model(src_dir: str | Path, out_dir: str | Path, kind: str, dequantized_dir: str | Path | None = None
                   ) -> Path:
    """Write `src_dir`'s checkpoint with its projections (every `*_proj.weight` and every
    expert's weight; not the LM head, the routers or the shared expert's gate) in FP8 as
    Hugging Face lays them out: e4m3 `weight`, float32 `weight_scale` (a
    scalar per tensor, [out, 1] per channel), a scalar `input_scale` where static; and,
    with `dequantized_dir`, the same model with those weights dequantized (float32, no
    quantization_config): the reference. `kind`: a key of FP8_CONFIGS."""
    from engine.model.fp8 import E4M3_MAX, quantize_weight, to_e4m3
    from engine.checkpoints.quant_config import Fp8Scheme
    from engine.checkpoints.weights import CheckpointReader

    quant = FP8_CONFIGS[kind]
    scheme = Fp8Scheme.of(quant)
    src = Path(src_dir)
    cfg = json.loads((src / "config.json").read_text())
    ckpt = CheckpointReader(src)
    fp8: dict[str, torch.Tensor] = {}
    plain: dict[str, torch.Tensor] = {}
    for name in sorted(ckpt.names()):
        w = ckpt.get(name, torch.float32, "cpu").contiguous()
        if not name.endswith(".weight") or not (name.endswith("_proj.weight") or ".experts." in name):
            fp8[name] = plain[name] = w
            continue
        if scheme.weights == "tensor":
            scale = (w.abs().max() / E4M3_MAX).reshape(())
            values = to_e4m3(w / scale)
            fp8[name[:-len("weight")] + "weight_scale"] = scale
        else:
            q = quantize_weight(w)
            values, scale = q.values, q.scale
            fp8[name[:-len("weight")] + "weight_scale"] = scale[:, None].contiguous()
        fp8[name] = values
        if scheme.inputs == "static":
            fp8[name[:-len("weight")] + "input_scale"] = torch.tensor(FP8_INPUT_SCALE)
        plain[name] = values.float() * (scale if scale.dim() == 0 else scale[:, None])
    for out, weights, config in ((Path(out_dir), fp8, {**cfg, "quantization_config": quant}),
                                 *(((Path(dequantized_dir), plain, cfg),) if dequantized_dir else ())):
        out.mkdir(parents=True, exist_ok=True)
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy(src / name, out / name)
    return Path(out_dir)
