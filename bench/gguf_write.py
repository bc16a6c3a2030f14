"""Our Llama-family target as a GGUF file of architecture "llama", for llama.cpp's rows and transformers'.

`write_gguf` writes a models.Transformer and its byte-level BPE tokenizer so that transformers' GGUF reader gives
back the same tensors (Q/K rows through `llama_permute`) and llama.cpp computes the same model up to its kernels'
rounding and the matrices' type (GGUF_WRITE_TYPES). A target outside the plain llama architecture is refused
rather than written wrong.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from models.gguf import GGUFError
from models.text import eos_id

GGUF_WRITE_TYPES = ("f32", "f16", "q8_0", "q4_0")  # the matrices' type; norms stay f32 whatever is asked


def llama_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Q or K rows from the rotate-half layout (ours and Hugging Face's) to the interleaved one llama.cpp's
    llama architecture expects (its convert_hf_to_gguf permute); transformers' GGUF reader applies the
    inverse (`_reverse_permute_weights`), so a file written with this reads back as the same weights."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _refuse_non_llama(cfg) -> None:
    odd = {"qkv_bias": cfg.qkv_bias, "o_bias": cfg.o_bias, "qk_norm": cfg.qk_norm,
           "sliding_window": cfg.sliding_window, "rope_scaling": cfg.rope_scaling,
           "logit_softcap": cfg.logit_softcap, "attn_logit_softcap": cfg.attn_logit_softcap,
           "attn_scale": cfg.attn_scale, "rope_local_theta": cfg.rope_local_theta,
           "norm_unit_offset": cfg.norm_unit_offset, "output_norms": cfg.output_norms}
    odd = {k: v for k, v in odd.items() if v}
    if cfg.hidden_act != "silu":
        odd["hidden_act"] = cfg.hidden_act
    if cfg.partial_rotary_factor != 1.0:
        odd["partial_rotary_factor"] = cfg.partial_rotary_factor
    if cfg.embed_scale != 1.0:
        odd["embed_scale"] = cfg.embed_scale
    if odd:
        raise GGUFError(f"write_gguf writes the plain llama architecture (RMSNorm, RoPE, GQA, SwiGLU); this "
                        f"target sets {odd}")


def write_gguf(model, tokenizer, path, *, dtype: str = "f32", name: str = "eagle3-target", pre: str = "default"
               ) -> Path:
    """Write our Llama-family `model` (models.Transformer) and its byte-level BPE `tokenizer`
    (tokenizers.Tokenizer) as a GGUF of architecture "llama" that llama.cpp runs and transformers reads.

    Invariant: transformers' GGUF reader gives back our tensors (exactly for f32; Q/K rows un-permuted by
    it, see `llama_permute`), so llama.cpp computes our model up to its kernels' rounding and the matrices'
    `dtype` (GGUF_WRITE_TYPES). The vocabulary is written as tokenizer.ggml.model "gpt2" (tokens in id
    order, merges, added special tokens as control tokens, ids past the tokenizer's up to the embedding's
    rows as unused padding); add_bos_token is false, since our prompts carry no BOS. `pre` is
    tokenizer.ggml.pre, the split llama.cpp applies before BPE when it tokenizes text itself (never when it is
    handed ids, as bench.peers does): "gpt-2" is the GPT-2 pattern of a tokenizers ByteLevel pre-tokenizer with
    use_regex (ours), "default" llama.cpp's own, which also splits punctuation and digit runs."""
    from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType, TokenType
    from gguf.quants import quantize

    if dtype not in GGUF_WRITE_TYPES:
        raise GGUFError(f"write_gguf dtype={dtype!r}: expected one of {GGUF_WRITE_TYPES}")
    cfg = model.cfg
    _refuse_non_llama(cfg)
    tok = json.loads(tokenizer.to_str())
    if (tok.get("model") or {}).get("type") != "BPE":
        raise GGUFError(f"write_gguf needs a BPE tokenizer, got {(tok.get('model') or {}).get('type')!r}")
    vocab = tok["model"]["vocab"]
    n_tok = max(vocab.values()) + 1
    for t in tok.get("added_tokens") or []:
        n_tok = max(n_tok, t["id"] + 1)
    if n_tok > cfg.vocab_size:
        raise GGUFError(f"the tokenizer has {n_tok} ids, more than the model's {cfg.vocab_size} embedding rows")
    tokens = [f"[PAD{i}]" for i in range(cfg.vocab_size)]
    types = [TokenType.UNUSED] * cfg.vocab_size
    for text, i in vocab.items():
        tokens[i], types[i] = text, TokenType.NORMAL
    for t in tok.get("added_tokens") or []:
        tokens[t["id"]] = t["content"]
        types[t["id"]] = TokenType.CONTROL if t.get("special") else TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges") or []]

    qtype = {"f32": GGMLQuantizationType.F32, "f16": GGMLQuantizationType.F16,
             "q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}[dtype]
    ftype = {"f32": LlamaFileType.ALL_F32, "f16": LlamaFileType.MOSTLY_F16,
             "q8_0": LlamaFileType.MOSTLY_Q8_0, "q4_0": LlamaFileType.MOSTLY_Q4_0}[dtype]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    w = GGUFWriter(tmp, "llama")
    w.add_name(name)
    w.add_context_length(cfg.context_length or cfg.max_seq_len)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.n_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(ftype)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    eos = eos_id(tokenizer)
    if eos is not None:
        w.add_eos_token_id(eos)
        w.add_bos_token_id(eos)  # llama.cpp wants one; never added (add_bos_token false)
    w.add_add_bos_token(False)

    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}

    def add(gguf_name: str, t: torch.Tensor) -> None:
        a = t.numpy().astype(np.float32)
        if a.ndim == 1 or qtype == GGMLQuantizationType.F32:
            w.add_tensor(gguf_name, a)
        elif qtype == GGMLQuantizationType.F16:
            w.add_tensor(gguf_name, a.astype(np.float16))
        else:
            w.add_tensor(gguf_name, quantize(a, qtype), raw_dtype=qtype)

    add("token_embd.weight", state["embed_tokens.weight"])
    for i in range(cfg.n_layers):
        p, b = f"layers.{i}.", f"blk.{i}."
        add(b + "attn_norm.weight", state[p + "input_layernorm.weight"])
        add(b + "attn_q.weight", llama_permute(state[p + "self_attn.q_proj.weight"], cfg.n_heads))
        add(b + "attn_k.weight", llama_permute(state[p + "self_attn.k_proj.weight"], cfg.n_kv_heads))
        add(b + "attn_v.weight", state[p + "self_attn.v_proj.weight"])
        add(b + "attn_output.weight", state[p + "self_attn.o_proj.weight"])
        add(b + "ffn_norm.weight", state[p + "post_attention_layernorm.weight"])
        add(b + "ffn_gate.weight", state[p + "mlp.gate_proj.weight"])
        add(b + "ffn_up.weight", state[p + "mlp.up_proj.weight"])
        add(b + "ffn_down.weight", state[p + "mlp.down_proj.weight"])
    add("output_norm.weight", state["norm.weight"])
    if not cfg.tie_embeddings:  # without output.weight llama.cpp (and transformers) tie it to token_embd
        add("output.weight", state["lm_head.weight"])
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
