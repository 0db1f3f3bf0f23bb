"""EAGLE draft heads built in the published layouts (scripts/build_eagle_head.py) load, draft
through the paged KV cache exactly as a plain-PyTorch reading of the layout does
(eagle_reference.py), and refuse broken checkpoints with clear errors; the target keeps the
hidden states they read, equal to Hugging Face's."""
from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tritium.layers.forward_context import set_attention_metadata
from tritium.models.eagle import EagleDraftHead, SharedWeights
from tritium.models.llama import LlamaForCausalLM
from tritium.models.loader import load_safetensors
from scripts.build_default_model import build_model
from scripts.build_eagle_head import build_eagle1_head, build_eagle3_head
from eagle_reference import ReferenceHead, hf_hidden_states
from step_helpers import make_state, pack

BLOCK = 16
PROMPTS = [[5, 77, 301, 9, 42, 250, 17, 3, 498, 66, 120], [7, 400, 8, 31, 200, 99, 4, 56, 11, 370,
                                                          27, 205, 88, 64, 3, 19, 141, 7, 260]]
ATOL = 2e-4
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


@pytest.fixture(scope="module")
def target8_dir(tmp_path_factory) -> str:
    """Eight layers, so that vLLM's default auxiliary layers (2, 4, 5) are three distinct ones."""
    return build_model(str(tmp_path_factory.mktemp("tiny-llama8")), seed=8, num_hidden_layers=8,
                       num_attention_heads=4, num_key_value_heads=2, rope_scaling=LLAMA3_ROPE)


def load_target(model_dir: str) -> tuple[LlamaForCausalLM, dict]:
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        model = LlamaForCausalLM(json.load(f), torch.float32)
    load_safetensors(model, model_dir)
    return model.eval(), load_file(os.path.join(model_dir, "model.safetensors"))


def bind_cache(model, num_blocks: int = 8) -> None:
    """Each attention layer's own K and V blocks, as the worker binds its pool."""
    for attn in model.attention_layers():
        shape = (num_blocks, BLOCK, attn.num_kv_heads, attn.head_dim)
        attn.k_cache, attn.v_cache = torch.zeros(shape), torch.zeros(shape)


def run(model, items, *inputs, **kwargs):
    """The model's forward over the packed (state, new tokens) items, as the runner runs a step."""
    batch = pack(items, BLOCK)
    metadata = batch.attention_metadata(lambda a, dtype: torch.from_numpy(a).to(dtype))
    with torch.inference_mode(), set_attention_metadata(metadata):
        return model(torch.from_numpy(batch.input_ids), torch.from_numpy(batch.positions), *inputs, **kwargs)


def states(token_lists: list[list[int]], computed: list[int]):
    """Worker states of the sequences, two blocks each, `computed` tokens of each already cached."""
    return [make_state(i, tokens, [2 * i, 2 * i + 1], c)
            for i, (tokens, c) in enumerate(zip(token_lists, computed))]


def draft_and_compare(method: str, head_dir: str, target_dir: str, num_steps: int = 3) -> None:
    """Target prefill keeping hidden states, head prefill over the shifted tokens, then
    `num_steps` single-token draft steps, for two sequences at once; every output against the
    reference, which starts from Hugging Face's hidden states."""
    target, target_weights = load_target(target_dir)
    head = EagleDraftHead.from_pretrained(method, head_dir, target, torch.float32)
    head.request_target_hidden_states(target)
    bind_cache(target), bind_cache(head)
    ref = ReferenceHead(method, head_dir, target_weights)
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    target_states = states(PROMPTS, [0, 0])
    run(target, [(s, len(p)) for s, p in zip(target_states, PROMPTS)])
    ours = target.model.aux_hidden_states.split([len(p) for p in PROMPTS])
    seqs = []  # per sequence: draft input ids, reference hidden inputs
    for p, aux in zip(PROMPTS, ours):
        hidden_states, last_output, logits = hf_hidden_states(hf, p)
        if method == "eagle3":  # id i: the input of layer i; id L: the last layer's output, unnormed
            layer_inputs = hidden_states[:-1] + [last_output]
            want = torch.cat([layer_inputs[i] for i in head.aux_layer_ids], dim=-1)
        else:
            want = hidden_states[-1]
        torch.testing.assert_close(aux, want, atol=1e-5, rtol=1e-5)
        # row t: the target's hidden state at t with the token at t + 1 (the last: the sampled one)
        seqs.append((p[1:] + [int(logits[-1].argmax())], ref.combine(want)))
    head_states = states([ids for ids, _ in seqs], [0, 0])
    hidden = head.combine_hidden_states(target.model.aux_hidden_states)
    nxt, normed = run(head, [(s, len(ids)) for s, (ids, _) in zip(head_states, seqs)], hidden)
    offsets = [0, len(PROMPTS[0])]
    for step in range(num_steps + 1):
        drafts, last_hidden = [], []
        for i, (ids, ref_hidden) in enumerate(seqs):
            ref_next, ref_normed, ref_logits = ref.run(ids, ref_hidden)
            rows = slice(offsets[i], offsets[i] + len(ids)) if step == 0 else slice(i, i + 1)
            last = slice(len(ids) - 1, len(ids)) if step else slice(0, len(ids))
            torch.testing.assert_close(nxt[rows], ref_next[last], atol=ATOL, rtol=ATOL)
            torch.testing.assert_close(normed[rows], ref_normed[last], atol=ATOL, rtol=ATOL)
            logits = head.compute_logits(normed[rows][-1:])
            torch.testing.assert_close(logits[0], ref_logits[-1], atol=ATOL, rtol=ATOL)
            assert logits.shape[-1] == head.spec.draft_vocab_size
            draft = int(head.draft_to_target(logits.argmax(-1))[0])
            assert draft == ref.to_target(int(ref_logits[-1].argmax()))
            drafts.append(draft)
            last_hidden.append(nxt[rows][-1:])
            seqs[i] = (ids + [draft], torch.cat([ref_hidden, ref_next[-1:]]))
        if step == num_steps:
            break
        # a draft step: each sequence's last draft at the next position, its hidden state the
        # head's own output of the step before
        head_states = states([ids for ids, _ in seqs], [len(ids) - 1 for ids, _ in seqs])
        nxt, normed = run(head, [(s, 1) for s in head_states], torch.cat(last_hidden))


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_eagle3_head_drafts_as_the_layout_defines(target8_dir, tmp_path, norm_before_residual):
    head_dir = build_eagle3_head(str(tmp_path / "eagle3"), target8_dir, seed=3, draft_vocab_size=200,
                                 norm_before_residual=norm_before_residual)
    draft_and_compare("eagle3", head_dir, target8_dir)


def test_eagle3_head_of_its_own_width_with_named_layers(llama_dir, tmp_path):
    # a 32-wide head on a 64-wide target (target_hidden_size), its own embedding, the full
    # vocabulary, and the layers named in its config: the embeddings (0) and the last layer's output (2)
    head_dir = build_eagle3_head(str(tmp_path / "eagle3"), llama_dir, seed=4, aux_layer_ids=[2, 0, 1],
                                 hidden_size=32)
    draft_and_compare("eagle3", head_dir, llama_dir)


# two layers (the second with its input_layernorm) and fc's bias; one layer, no bias, the config
# silent about it (the checkpoint decides)
@pytest.mark.parametrize("num_layers, fc_bias, state_bias", [(2, True, True), (1, False, False)])
def test_eagle1_head_drafts_as_the_layout_defines(llama_dir, tmp_path, num_layers, fc_bias, state_bias):
    head_dir = build_eagle1_head(str(tmp_path / "eagle"), llama_dir, seed=5, num_hidden_layers=num_layers,
                                 fc_bias=fc_bias, state_bias=state_bias)
    draft_and_compare("eagle", head_dir, llama_dir)


def test_target_keeps_hidden_states_of_every_row_while_returning_the_sampled_ones(target8_dir):
    target, _ = load_target(target8_dir)
    bind_cache(target)
    hf = AutoModelForCausalLM.from_pretrained(target8_dir, dtype=torch.float32)
    hidden_states, last_output, _ = hf_hidden_states(hf, PROMPTS[1])
    full = run(target, [(states([PROMPTS[1]], [0])[0], len(PROMPTS[1]))])
    rows = torch.tensor([18, 3])
    for layers, final, want in [((8, 0, 5), False, [hidden_states[0], hidden_states[5], last_output]),
                                ((), True, [hidden_states[-1]])]:
        target.model.keep_hidden_states(layers, final)
        bind_cache(target)
        got = run(target, [(states([PROMPTS[1]], [0])[0], len(PROMPTS[1]))], rows)
        torch.testing.assert_close(got, full[rows], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(target.model.aux_hidden_states, torch.cat(want, dim=-1),
                                   atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=re.escape(
            "model: auxiliary hidden state layers (2, 9) must be distinct layer ids in 0..8")):
        target.model.keep_hidden_states((2, 9))


def test_shared_and_own_embeddings_are_reported(llama_dir, tmp_path):
    target, _ = load_target(llama_dir)
    shared = EagleDraftHead.from_pretrained("eagle", build_eagle1_head(str(tmp_path / "a"), llama_dir, 1),
                                            target, torch.float32)
    assert shared.share_target_weights(target) == SharedWeights(own_embed_tokens=False, own_lm_head=False)
    assert shared.embed_tokens.weight is target.model.embed_tokens.weight
    assert shared.lm_head.weight is target.lm_head.weight
    own_dir = build_eagle3_head(str(tmp_path / "b"), llama_dir, 1, 100, [0, 1, 2], own_embed_tokens=True)
    own = EagleDraftHead.from_pretrained("eagle3", own_dir, target, torch.float32)
    assert own.share_target_weights(target) == SharedWeights(own_embed_tokens=True, own_lm_head=True)
    checkpoint = load_file(os.path.join(own_dir, "model.safetensors"))
    torch.testing.assert_close(own.embed_tokens.weight, checkpoint["embed_tokens.weight"])


def edited_head(tmp_path, llama_dir, edit) -> str:
    head_dir = build_eagle3_head(str(tmp_path / "ok"), llama_dir, seed=6, draft_vocab_size=100,
                                 aux_layer_ids=[0, 1, 2])
    broken = str(tmp_path / "broken")
    shutil.copytree(head_dir, broken)
    tensors = load_file(os.path.join(broken, "model.safetensors"))
    edit(tensors)
    save_file({k: v.contiguous().clone() for k, v in tensors.items()}, os.path.join(broken, "model.safetensors"))
    return broken


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("midlayer.hidden_norm.weight"),
     "eagle head: checkpoint '{dir}' lacks tensor 'midlayer.hidden_norm.weight' (shape (64,)) of the EAGLE-3 layout"),
    (lambda t: t.pop("d2t"), "eagle head: checkpoint '{dir}' lacks tensor 'd2t' (shape (100,)) of the EAGLE-3 layout"),
    (lambda t: t.update({"fc.weight": t["fc.weight"][:, :128]}),
     "eagle head: tensor 'fc.weight' has shape (64, 128), expected (64, 192)"),
    (lambda t: t.update({"midlayer.self_attn.q_proj.weight": t["midlayer.self_attn.q_proj.weight"][:, :64]}),
     "eagle head: tensor 'midlayer.self_attn.q_proj.weight' has shape (64, 64), expected (64, 128)"),
    (lambda t: t.update({"layers.0.hidden_norm.weight": t["midlayer.hidden_norm.weight"]}),
     "eagle head: checkpoint tensor 'layers.0.hidden_norm.weight' is not part of the EAGLE-3 layout"),
    (lambda t: t["t2d"].__setitem__(t["t2d"].nonzero()[0], False),
     "eagle head: t2d does not mark exactly the target tokens d2t maps to"),
])
def test_broken_checkpoints_are_refused_by_name(llama_dir, tmp_path, edit, message):
    target, _ = load_target(llama_dir)
    broken = edited_head(tmp_path, llama_dir, edit)
    with pytest.raises(ValueError, match="^" + re.escape(message.format(dir=broken)) + "$"):
        EagleDraftHead.from_pretrained("eagle3", broken, target, torch.float32)


def test_eagle1_bias_the_config_states_must_be_there(llama_dir, tmp_path):
    target, _ = load_target(llama_dir)
    head_dir = build_eagle1_head(str(tmp_path / "e"), llama_dir, seed=2, fc_bias=False, state_bias=False)
    with open(os.path.join(head_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    with open(os.path.join(head_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump({**config, "bias": True}, f)
    with pytest.raises(ValueError, match="^" + re.escape(
            f"eagle head: checkpoint '{head_dir}' lacks tensor 'fc.bias' (shape (64,)) of the EAGLE-1 layout") + "$"):
        EagleDraftHead.from_pretrained("eagle", head_dir, target, torch.float32)


def test_configs_that_do_not_fit_the_target_are_refused(llama_dir, tmp_path):
    target, _ = load_target(llama_dir)
    head_dir = build_eagle3_head(str(tmp_path / "h"), llama_dir, seed=7, draft_vocab_size=100)
    with pytest.raises(ValueError, match=re.escape(
            "eagle head: auxiliary layers (2, 1, -1) (from the default (2, L // 2, L - 3) for the "
            "target's 2 layers) must be 3 distinct target layer ids in 0..2")):
        EagleDraftHead.from_pretrained("eagle3", head_dir, target, torch.float32)
    with pytest.raises(ValueError, match=re.escape(
            "eagle head: architectures ['LlamaForCausalLMEagle3'] is an EAGLE-3 head; use method 'eagle3'")):
        EagleDraftHead.from_pretrained("eagle", head_dir, target, torch.float32)
    os.rename(os.path.join(head_dir, "model.safetensors"), os.path.join(head_dir, "pytorch_model.bin"))
    with pytest.raises(ValueError, match=re.escape(f"eagle head: '{head_dir}' has no *.safetensors file")):
        EagleDraftHead.from_pretrained("eagle3", head_dir, target, torch.float32)
