"""Plain-PyTorch EAGLE heads written from the checkpoint layout (docs/speculative_decoding.md),
independent of backend/: dense causal attention over a whole draft sequence, Hugging Face's
rotary embedding, the tensors read straight from the head's safetensors."""
from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class ReferenceHead:
    """One EAGLE head over one sequence: `run(ids, hidden)` gives every row's (hidden for the next
    step, normed hidden, logits over the draft vocabulary), positions 0..len-1."""

    def __init__(self, method: str, head_dir: str, target_weights: dict[str, torch.Tensor]) -> None:
        with open(os.path.join(head_dir, "config.json"), encoding="utf-8") as f:
            self.config = json.load(f)
        self.method = method
        self.w = load_file(os.path.join(head_dir, "model.safetensors"))
        self.embed = self.w.get("embed_tokens.weight", target_weights["model.embed_tokens.weight"])
        self.lm_head = self.w.get("lm_head.weight", target_weights["lm_head.weight"])
        c = self.config
        self.eps = c["rms_norm_eps"]
        self.heads, self.kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
        self.head_dim = c.get("head_dim") or c["hidden_size"] // self.heads
        self.rope = LlamaRotaryEmbedding(LlamaConfig(**{**c, "head_dim": self.head_dim}))

    def attention(self, p: str, x: torch.Tensor) -> torch.Tensor:
        w, n = self.w, x.shape[0]
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(n, self.heads, self.head_dim).transpose(0, 1)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).view(n, self.kv_heads, self.head_dim).transpose(0, 1)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(n, self.kv_heads, self.head_dim).transpose(0, 1)
        cos, sin = self.rope(x[None], torch.arange(n)[None])
        q, k = apply_rotary_pos_emb(q[None], k[None], cos, sin)
        group = self.heads // self.kv_heads
        k, v = k[0].repeat_interleave(group, 0), v[None].repeat_interleave(group, 1)[0]
        scores = q[0] @ k.transpose(-1, -2) / self.head_dim ** 0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, self.heads * self.head_dim)
        return out @ w[p + "self_attn.o_proj.weight"].T

    def mlp(self, p: str, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        return (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T

    def run(self, ids: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        w, eps = self.w, self.eps
        embeds = self.embed[torch.tensor(ids)]
        if self.method == "eagle3":
            # attention input: cat(input_layernorm(embeds), hidden_norm(hidden)); residual: hidden
            x = torch.cat([rms(embeds, w["midlayer.input_layernorm.weight"], eps),
                           rms(hidden, w["midlayer.hidden_norm.weight"], eps)], dim=-1)
            residual = rms(hidden, w["midlayer.hidden_norm.weight"], eps) \
                if self.config.get("norm_before_residual") else hidden
            r = residual + self.attention("midlayer.", x)
            out = r + self.mlp("midlayer.", rms(r, w["midlayer.post_attention_layernorm.weight"], eps))
            normed = rms(out, w["norm.weight"], eps)
            return out, normed, normed @ self.lm_head.T
        # EAGLE-1: fc over cat(embeds, hidden); no input_layernorm in the first layer, no final norm
        x = torch.cat([embeds, hidden], dim=-1) @ w["fc.weight"].T
        if "fc.bias" in w:
            x = x + w["fc.bias"]
        for i in range(self.config["num_hidden_layers"]):
            p = f"layers.{i}."
            h = x if i == 0 else rms(x, w[p + "input_layernorm.weight"], eps)
            r = x + self.attention(p, h)
            x = r + self.mlp(p, rms(r, w[p + "post_attention_layernorm.weight"], eps))
        return x, x, x @ self.lm_head.T

    def combine(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return target_hidden @ self.w["fc.weight"].T if self.method == "eagle3" else target_hidden

    def to_target(self, draft_id: int) -> int:
        return draft_id + int(self.w["d2t"][draft_id]) if "d2t" in self.w else draft_id


def hf_hidden_states(hf_model, ids: list[int]) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Hugging Face's hidden_states (hidden_states[i]: the input of layer i; the last: after the
    final norm), the last layer's output before the norm, and the logits, for one sequence."""
    captured = []
    hook = hf_model.model.layers[-1].register_forward_hook(
        lambda m, a, out: captured.append(out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        out = hf_model(torch.tensor([ids]), output_hidden_states=True)
    hook.remove()
    return [h[0] for h in out.hidden_states], captured[0][0], out.logits[0]
