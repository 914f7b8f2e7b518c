"""A bare decode loop, no transformers generate: the attention kernel returns its log-sum-exp and
macs_kernels.ops.macs_update turns the query, the key cache and that lse into the MACS state.

This is how MACS goes into an inference engine of your own: per layer and step one extra op that reads
the keys once (the lse saves it the softmax normaliser pass). The attention kernel, by what is there:
  1. flash-attn: flash_attn_with_kvcache(..., return_softmax_lse=True)   (GPU, flash-attn installed)
  2. torch's FlashAttention kernel, aten._scaled_dot_product_flash_attention (GPU)
  3. sdpa for the output plus a logsumexp of the scores                  (CPU)
The model's own modules (a Llama-architecture model) provide projections, RoPE and MLPs; the KV cache is
one preallocated (B, S_max, H_kv, D) buffer per layer, the layout flash-attn wants, and macs_update reads
it through a transposed view. At the end the loop checks its tokens and z-scores against macs_kernels.explain.

    python python/bare_decode_loop.py --max-new-tokens 16
"""
import argparse
import importlib.util

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import macs_kernels
from macs_kernels import qa_messages
from macs_kernels.ops import macs_update, macs_zscore

FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None


def kernel_name(device: torch.device) -> str:
    if device.type != "cuda":
        print("no GPU: flash-attn and torch's flash kernel are skipped; using sdpa plus a logsumexp")
        return "sdpa+logsumexp"
    return "flash-attn" if FLASH_ATTN else "torch-flash"


def decode_attention_with_lse(kernel, q, k_cache, v_cache, length: int, scale: float):
    """q (B, H, D), one query per sequence; caches (B, S_max, H_kv, D) valid up to `length`.
    Returns out (B, H, D) and lse (B, H), natural log over the `length` keys."""
    if kernel == "flash-attn":
        from flash_attn import flash_attn_with_kvcache

        seqlens = torch.full((q.shape[0],), length, dtype=torch.int32, device=q.device)
        out, lse = flash_attn_with_kvcache(q[:, None], k_cache, v_cache, cache_seqlens=seqlens,
                                           softmax_scale=scale, return_softmax_lse=True)
        return out[:, 0], lse[:, :, 0]
    group = q.shape[1] // k_cache.shape[2]
    k, v = (c[:, :length].transpose(1, 2).repeat_interleave(group, dim=1) for c in (k_cache, v_cache))
    if kernel == "torch-flash":  # no GQA in this kernel: K and V repeated to H heads
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q[:, :, None], k, v, scale=scale)[:2]
        return out[:, :, 0], lse[:, :, 0]
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale)[:, :, 0]
    lse = torch.logsumexp(torch.einsum("bhd,bhsd->bhs", q.float(), k.float()) * scale, dim=-1)
    return out, lse


class BareLlama:
    """Forward passes of a transformers Llama model through its modules, with our own attention and cache."""

    def __init__(self, model, batch: int, max_len: int, kernel: str):
        if type(model).__name__ != "LlamaForCausalLM":
            raise SystemExit(f"this recipe drives a Llama-architecture model's modules, not {type(model).__name__}")
        self.model, self.kernel = model, kernel
        attention = model.model.layers[0].self_attn
        config = model.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.dim, self.scale = attention.head_dim, attention.scaling
        shape = (batch, max_len, self.kv_heads, self.dim)
        param = next(model.parameters())
        self.k_cache = [torch.zeros(shape, dtype=param.dtype, device=param.device) for _ in model.model.layers]
        self.v_cache = [torch.zeros_like(k) for k in self.k_cache]

    def forward(self, ids: torch.Tensor, start: int, log_c: torch.Tensor, n_input: int) -> torch.Tensor:
        """ids (B, T) at positions [start, start + T); adds every layer's MACS term of the last query to
        log_c; returns the next-token logits (B, V)."""
        inner, (batch, length) = self.model.model, ids.shape
        x = inner.embed_tokens(ids)
        positions = torch.arange(start, start + length, device=ids.device).expand(batch, length)
        cos, sin = inner.rotary_emb(x, positions)
        end = start + length
        for layer, k_cache, v_cache in zip(inner.layers, self.k_cache, self.v_cache):
            attention = layer.self_attn
            h = layer.input_layernorm(x)
            q = attention.q_proj(h).view(batch, length, self.heads, self.dim).transpose(1, 2)
            k = attention.k_proj(h).view(batch, length, self.kv_heads, self.dim).transpose(1, 2)
            v = attention.v_proj(h).view(batch, length, self.kv_heads, self.dim)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            k_cache[:, start:end] = k.transpose(1, 2)
            v_cache[:, start:end] = v
            if length > 1:  # prefill: causal attention over the prompt; macs_update finds the lse itself
                group = self.heads // self.kv_heads
                keys, values = (c[:, :end].transpose(1, 2).repeat_interleave(group, dim=1) for c in (k_cache, v_cache))
                out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=self.scale)
                query, lse = q[:, :, -1], None
                out = out.transpose(1, 2)
            else:
                out, lse = decode_attention_with_lse(self.kernel, q[:, :, 0], k_cache, v_cache, end, self.scale)
                query, out = q[:, :, 0], out[:, None]
            macs_update(query, k_cache.transpose(1, 2), log_c, input_start=0, input_end=n_input, kv_len=end,
                        scale=self.scale, lse=lse)
            x = x + attention.o_proj(out.reshape(batch, length, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.lm_head(inner.norm(x[:, -1]))


@torch.inference_mode()
def bare_generate(model, input_ids: torch.Tensor, max_new_tokens: int, eos: int | None):
    """Greedy decoding of one unpadded batch; returns (generated ids (B, T), z-scores (T, B, N))."""
    batch, n_input = input_ids.shape
    bare = BareLlama(model, batch, n_input + max_new_tokens, kernel_name(input_ids.device))
    tokens, rows = [], []
    ids, position = input_ids, 0
    for _ in range(max_new_tokens):
        log_c = torch.zeros(batch, n_input, device=input_ids.device)
        logits = bare.forward(ids, position, log_c, n_input)
        rows.append(macs_zscore(log_c, torch.full((batch,), n_input)))
        position += ids.shape[1]
        ids = logits.argmax(-1, keepdim=True)
        tokens.append(ids)
        if eos is not None and bool((ids == eos).all()):
            break
    return torch.cat(tokens, dim=1), torch.stack(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="a Llama-architecture model id or folder (default: the default model)")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model, tokenizer = macs_kernels.load_model(args.model, device=device)
    messages = qa_messages("Who wrote Hamlet?", "Hamlet is a tragedy written by William Shakespeare around 1600.")
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)["input_ids"].to(device)

    generated, z = bare_generate(model, prompt, args.max_new_tokens, tokenizer.eos_token_id)
    print(f"bare loop: {tokenizer.decode(generated[0])!r}")

    reference = macs_kernels.explain(model, tokenizer, input_ids=prompt[0], max_new_tokens=args.max_new_tokens)
    steps = len(reference.generated_ids)
    if generated[0, :steps].tolist() != reference.generated_ids.tolist():
        raise SystemExit("the bare loop's tokens differ from generate's")
    error = (z[:steps, 0].cpu() - reference.paper_step_scores).abs().max().item()  # both z-scores of c
    print(f"{steps} steps; max |z - explain's z| = {error:.2e}")
    if error > 1e-3:
        raise SystemExit("the bare loop's z-scores differ from explain's")


if __name__ == "__main__":
    main()
