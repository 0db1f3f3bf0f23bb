"""Speculative decoding with EAGLE heads (backend/spec_decode/eagle.py): heads in the published
layouts (built by scripts/build_eagle_head.py, random weights) load and speculate; greedy tokens
equal Hugging Face's; and every proposal the engine makes is the one a plain-PyTorch reading of
the layout (eagle_reference.py) drafts from Hugging Face's hidden states of the tokens so far, so
the head's first pass pairs the right target rows with the right tokens step after step."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tritium import LLM, SamplingParams
from scripts.build_eagle_head import build_eagle1_head, build_eagle3_head
from eagle_reference import ReferenceHead, hf_hidden_states

K = 3
ENGINE = dict(device="cpu", dtype="float32", num_kv_blocks=512)


def _prompts(seed: int, lengths) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=gen).tolist() for n in lengths]


def _reference_chain(ref: ReferenceHead, hf, method: str, aux_ids, tokens: list[int], k: int) -> list[int]:
    """The head's k greedy drafts after `tokens` (the last just sampled), from Hugging Face's
    hidden states of tokens[:-1]: row t pairs hidden state t with token t + 1."""
    hidden_states, last_output, _ = hf_hidden_states(hf, tokens[:-1])
    if method == "eagle3":
        layer_inputs = hidden_states[:-1] + [last_output]
        target = torch.cat([layer_inputs[i] for i in aux_ids], dim=-1)
    else:
        target = hidden_states[-1]
    ids, hidden, drafts = tokens[1:], ref.combine(target), []
    for _ in range(k):
        nxt, _, logits = ref.run(ids, hidden)
        drafts.append(ref.to_target(int(logits[-1].argmax())))
        ids, hidden = ids + drafts[-1:], torch.cat([hidden, nxt[-1:]])
    return drafts


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_eagle_heads_speculate_and_greedy_tokens_equal_hugging_face(llama_dir, tmp_path, method):
    from hf_reference import hf_greedy_generate
    if method == "eagle3":  # a 200-token draft vocabulary; the two-layer target's layers 0, 1, 2
        head = build_eagle3_head(str(tmp_path / "eagle3"), llama_dir, seed=3, draft_vocab_size=200,
                                 aux_layer_ids=[0, 1, 2])
    else:
        head = build_eagle1_head(str(tmp_path / "eagle"), llama_dir, seed=5)
    prompts = _prompts(4, (9, 30, 17))
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, torch_dtype=torch.float32)
    # Prompt chunks of at most 16 tokens: the head follows the target chunk by chunk.
    llm = LLM(llama_dir, speculative_config={"method": method, "model": head, "num_speculative_tokens": K},
              max_num_batched_tokens=16, **ENGINE)
    drafter = llm.engine.executor.worker.drafter
    replays = []
    if method == "eagle3":  # the passes through the graphs' buffers (run eagerly on the CPU)
        drafter.build_graphs(capture=False)
        for graphs in (drafter.decode_graphs, drafter.prefill_graphs):
            run = graphs.run
            graphs.run = lambda *a, _run=run, _g=graphs: replays.append(type(_g).__name__) or _run(*a)
    made, propose = [], drafter.propose

    def recording(step, starts, states, target):
        out = propose(step, starts, states, target)
        made.extend((list(states[sid].token_ids), drafts) for sid, drafts in out.items())
        return out
    drafter.propose = recording
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert got == hf_greedy_generate(hf, prompts, 16)
    st = llm.engine.get_stats()
    assert st.spec_decode_num_drafts > 0 and st.spec_decode_num_draft_tokens > 0
    ref = ReferenceHead(method, head, {name: p.detach() for name, p in hf.named_parameters()})
    aux = drafter.model.aux_layer_ids
    checked = 0
    for tokens, drafts in made[::3]:  # a third of them: each costs a few Hugging Face passes
        assert drafts == _reference_chain(ref, hf, method, aux, tokens, len(drafts)), tokens
        checked += 1
    assert checked >= 5
    assert set(replays) == ({"HeadDecodeGraphs", "HeadPrefillGraphs"} if method == "eagle3" else set())


def test_eagle3_with_preemption_and_prefix_caching_equals_plain_decoding(llama_dir, tmp_path):
    head = build_eagle3_head(str(tmp_path / "eagle3"), llama_dir, seed=9, draft_vocab_size=300,
                             aux_layer_ids=[0, 1, 2])
    shared = _prompts(5, (32,))[0]
    prompts = [shared + p for p in _prompts(6, (5, 9, 3, 12))]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine = dict(device="cpu", dtype="float32", block_size=16, num_kv_blocks=14, max_num_batched_tokens=64,
                  enable_prefix_caching=True)
    want = [o.outputs[0].token_ids for o in LLM(llama_dir, **engine).generate(prompts, params)]
    llm = LLM(llama_dir, speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": K},
              **engine)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.block_manager.prefix_cache_hits > 0
    assert llm.engine.get_stats().spec_decode_num_drafts > 0
