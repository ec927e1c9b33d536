"""Writes a Hugging Face checkpoint (tests' tiny ones) as llama.cpp would convert it to GGUF:
llama.cpp's tensor names (gguf's own name map), a mixture's experts stacked per layer, the
model's hyperparameters and its byte-level BPE tokenizer in GGUF metadata. (Test-only: it
lets the suite load GGUFs of every family the engine serves, as `serve --model FILE.gguf`
does, where no real file of that family can be had offline.)"""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

ARCHS = {"qwen3": gguf.MODEL_ARCH.QWEN3, "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE, "qwen2": gguf.MODEL_ARCH.QWEN2,
         "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE}
"""Config model_type -> the GGUF architecture written (families that llama.cpp writes
without permuting q and k)."""
EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")


def write_gguf(model_dir: str | Path, out: str | Path, qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32
               ) -> Path:
    model_dir, out = Path(model_dir), Path(out)
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = ARCHS[cfg["model_type"]]
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    _hyperparameters(writer, cfg)
    _tokenizer(writer, model_dir, cfg)
    names = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])
    for name, tensor in _stacked(load_file(str(model_dir / "model.safetensors")), cfg).items():
        base, suffix = name.rsplit(".", 1)
        target = names.get_name(base)
        if target is None:
            raise ValueError(f"no GGUF name for {name}")
        data = tensor.to(torch.float32).numpy()
        if name.endswith("shared_expert_gate.weight"):
            data = data[0]  # llama.cpp stores the shared expert's gate [hidden]
        if qtype != gguf.GGMLQuantizationType.F32 and data.ndim == 2 and data.shape[-1] % 32 == 0:
            writer.add_tensor(f"{target}.{suffix}", gguf.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(f"{target}.{suffix}", np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _hyperparameters(w: gguf.GGUFWriter, cfg: dict) -> None:
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_vocab_size(cfg["vocab_size"])
    if "num_experts" in cfg:
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)


def _tokenizer(w: gguf.GGUFWriter, model_dir: Path, cfg: dict) -> None:
    """The checkpoint's byte-level BPE as llama.cpp's "gpt2" tokenizer model."""
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["id"] for t in tok.get("added_tokens", []) if t.get("special")}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for _, i in vocab])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])


def _stacked(state: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """The state dict with each layer's experts stacked into one tensor per part, as llama.cpp
    stores them ([experts, out, in]); tied embeddings written once."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if ".mlp.experts." in name:
            continue
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        out[name] = t
    for layer in range(cfg["num_hidden_layers"]):
        for part in EXPERT_PARTS:
            first = f"model.layers.{layer}.mlp.experts.0.{part}.weight"
            if first in state:
                out[f"model.layers.{layer}.mlp.experts.{part}.weight"] = torch.stack(
                    [state[f"model.layers.{layer}.mlp.experts.{e}.{part}.weight"] for e in range(cfg["num_experts"])])
    return out
