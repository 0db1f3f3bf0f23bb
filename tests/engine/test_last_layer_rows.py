"""The last decoder layer runs its output projection and MLP only on the rows a step samples
from (`logits_indices`); every token's keys and values are still stored."""
from __future__ import annotations

import torch

from tritium import EngineArgs, LLMEngine
from tritium.sampling_params import SamplingParams

from step_helpers import make_state, pack


def _prompt_batch(lengths: list[int], block_size: int = 16):
    rng = torch.Generator().manual_seed(11)
    items, next_block = [], 0
    for i, n in enumerate(lengths):
        blocks = -(-n // block_size)
        s = make_state(i, torch.randint(3, 250, (n,), generator=rng).tolist(),
                       list(range(next_block, next_block + blocks)))
        next_block += blocks
        items.append((s, n))
    return pack(items, block_size)


def test_logits_indices_give_those_rows_and_store_every_key(model_dir):
    args = EngineArgs(model=model_dir, num_kv_blocks=16, max_num_seqs=4, max_model_len=128)
    full, pruned = LLMEngine(args).executor.runner, LLMEngine(args).executor.runner
    batch = _prompt_batch([5, 17, 30])
    want = full.forward_eager(batch)
    # out of order and with a repeat (two samples from one sequence), as launch may ask
    rows = [51, 4, 21, 4]
    got = pruned.forward_eager(batch, logits_indices=torch.tensor(rows))
    assert got.shape == (4, want.shape[1])
    torch.testing.assert_close(got, want[rows], atol=1e-5, rtol=1e-5)
    assert torch.equal(pruned.kv_cache, full.kv_cache)
    # a step that samples nothing (a prompt chunk that does not end its prompt)
    empty = LLMEngine(args).executor.runner
    assert empty.forward_eager(batch, logits_indices=torch.tensor([], dtype=torch.int64)).shape[0] == 0
    assert torch.equal(empty.kv_cache, full.kv_cache)


def test_eager_steps_run_the_last_mlp_on_sampled_rows_only(llama_dir):
    # On the CPU every step is eager (a GPU replays CUDA graphs, which hooks do not see).
    engine = LLMEngine(EngineArgs(model=llama_dir, device="cpu", num_kv_blocks=32, max_num_seqs=4,
                                  max_model_len=128, max_num_batched_tokens=32))
    layers = engine.executor.worker.model.model.layers
    steps: list[list[int]] = []  # per forward: [rows through the first MLP, through the last]
    layers[0].mlp.register_forward_hook(lambda m, a, out: steps.append([a[0].shape[0], 0]))
    layers[-1].mlp.register_forward_hook(lambda m, a, out: steps[-1].__setitem__(1, a[0].shape[0]))
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    def run(prompts: dict[str, int]) -> list[list[int]]:
        start = len(steps)
        for rid, n in prompts.items():
            engine.add_request(rid, list(range(3, 3 + n)), params)
        while engine.has_unfinished_requests():
            engine.step()
        return steps[start:]

    # 70 tokens in chunks of 32, 32, 6: the first two sample nothing and skip the last MLP.
    assert run({"long": 70}) == [[32, 0], [32, 0], [6, 1], [1, 1]]
    # two whole prompts in one step: two rows; then both decode
    assert run({"a": 10, "b": 12}) == [[22, 2], [2, 2]]
