"""Folding a request's delta outputs that queued up while the response sender was busy: one
response carries them all."""
from __future__ import annotations

from tritium.engine.request import accumulate
from tritium.outputs import CompletionOutput, RequestOutput


def fold_outputs(items: list[tuple[str, RequestOutput]]) -> list[tuple[str, RequestOutput]]:
    """(request id, delta output) pairs -> one per request, in first-seen order, its deltas
    folded together: a sender that fell behind sends one response with several tokens. A lone
    delta passes through as is; folding works on a copy, never on the engine's objects."""
    groups: dict[str, list[RequestOutput]] = {}
    order: list[tuple[str, list[RequestOutput]]] = []
    for request_id, output in items:
        group = groups.get(request_id)
        if group is None or group[-1].finished:
            group = groups[request_id] = []
            order.append((request_id, group))
        group.append(output)
    return [(request_id, group[0] if len(group) == 1 else _fold(group)) for request_id, group in order]


def _fold(outputs: list[RequestOutput]) -> RequestOutput:
    if all(len(o.outputs) == 1 and o.outputs[0].index == 0 and o.outputs[0].logprobs is None
           and o.prompt_logprobs is None for o in outputs):
        # The common case (one sample, no logprobs): one copy, without accumulate's dict work
        # per delta; the backlog of a slow round is made of these.
        last = outputs[-1]
        c = last.outputs[0]
        token_ids = [t for o in outputs for t in o.outputs[0].token_ids]
        text = "".join([o.outputs[0].text for o in outputs])
        return RequestOutput(last.request_id, outputs[0].prompt, outputs[0].prompt_token_ids,
                             [CompletionOutput(0, text, token_ids, c.cumulative_logprob, None, c.finish_reason,
                                               c.stop_reason)], last.finished,
                             num_cached_tokens=last.num_cached_tokens, error=last.error, metrics=outputs[0].metrics,
                             kv_transfer_params=last.kv_transfer_params)
    total = accumulate(None, outputs[0])
    for output in outputs[1:]:
        total = accumulate(total, output)
    return total
