"""The model configuration Tritium's Triton interface needs: what auto-complete fills in, what it refuses.

Triton's vLLM backend lets a config.pbtxt say only `backend` and `instance_group`: its
`auto_complete_config` adds the inputs and outputs, a decoupled transaction policy and
max_batch_size 0. Tritium does the same, and refuses, naming the key, a configuration that
contradicts what the engine needs (a policy that is not decoupled, Triton-side batching, an input
of a type the request parser cannot read). Configurations are Triton's JSON form (`as_dict()`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Protocol

from .triton_request import FLAG_INPUTS

_INTEGER_TYPES = frozenset({"TYPE_INT8", "TYPE_INT16", "TYPE_INT32", "TYPE_INT64",
                            "TYPE_UINT8", "TYPE_UINT16", "TYPE_UINT32", "TYPE_UINT64"})

_DECOUPLED = ("model_transaction_policy: the engine streams its responses, so the model must be "
              "decoupled: set model_transaction_policy { decoupled: true }, or leave it out and let "
              "Triton auto-complete it (without --disable-auto-complete-config).")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the interface: what auto-complete declares, and what a declaration may say.

    `accepted_types`: the data types the request parser reads (default: `data_type` only).
    `single`: a request's tensor holds exactly one element, so no fixed dimension may exceed 1.
    """

    name: str
    data_type: str
    dims: tuple[int, ...]
    single: bool = True
    accepted_types: frozenset[str] = frozenset()

    def accepts(self, data_type: str) -> bool:
        return data_type in (self.accepted_types or {self.data_type})

    def as_input(self) -> dict[str, Any]:
        # Every input is optional: a prompt comes as text_input or as input_ids.
        return {"name": self.name, "data_type": self.data_type, "dims": list(self.dims), "optional": True}

    def as_output(self) -> dict[str, Any]:
        return {"name": self.name, "data_type": self.data_type, "dims": list(self.dims)}


# In model_repository/llm/config.pbtxt's order.
INPUTS = (TensorSpec("text_input", "TYPE_STRING", (1,)),
          TensorSpec("input_ids", "TYPE_INT32", (-1,), single=False, accepted_types=_INTEGER_TYPES),
          TensorSpec("stream", "TYPE_BOOL", (1,)),
          TensorSpec("sampling_parameters", "TYPE_STRING", (1,)),
          *(TensorSpec(name, "TYPE_BOOL", (1,)) for name in FLAG_INPUTS if name != "stream"))
# One element per sample (n), except the prompt's token counts; prompt_logprobs (JSON),
# num_cached_tokens, stop_reason (JSON) and kv_transfer_params (JSON: a prefill instance's, in
# its final response) are Tritium's own.
OUTPUTS = (TensorSpec("text_output", "TYPE_STRING", (-1,), single=False),
           TensorSpec("finish_reason", "TYPE_STRING", (-1,), single=False),
           TensorSpec("cumulative_logprob", "TYPE_FP32", (-1,), single=False),
           TensorSpec("logprobs", "TYPE_STRING", (-1,), single=False),
           TensorSpec("prompt_logprobs", "TYPE_STRING", (-1,), single=False),
           TensorSpec("num_input_tokens", "TYPE_UINT32", (1,)),
           TensorSpec("num_output_tokens", "TYPE_UINT32", (-1,), single=False),
           TensorSpec("num_cached_tokens", "TYPE_UINT32", (1,)),
           TensorSpec("stop_reason", "TYPE_STRING", (-1,), single=False),
           TensorSpec("kv_transfer_params", "TYPE_STRING", (1,)))


@dataclass(frozen=True)
class Completion:
    """What auto-complete adds to a configuration: the tensors it does not declare."""

    inputs: list[dict[str, Any]]
    outputs: list[dict[str, Any]]


def complete_model_config(config: Mapping[str, Any]) -> Completion:
    """The inputs and outputs to add to `config`. Raises ValueError naming a key that contradicts
    what the engine needs."""
    # Triton's JSON form holds the policy only when config.pbtxt sets one.
    if (config.get("model_transaction_policy") or {}).get("decoupled", True) is False:
        raise ValueError(_DECOUPLED)
    _check_common(config)
    declared_inputs = {t.get("name") for t in config.get("input") or ()}
    declared_outputs = {t.get("name") for t in config.get("output") or ()}
    return Completion([s.as_input() for s in INPUTS if s.name not in declared_inputs],
                      [s.as_output() for s in OUTPUTS if s.name not in declared_outputs])


class ModelConfig(Protocol):
    """What auto-complete is handed: the python backend's `pb_utils.ModelConfig`."""

    def as_dict(self) -> dict[str, Any]: ...
    def add_input(self, input: dict[str, Any]) -> None: ...
    def add_output(self, output: dict[str, Any]) -> None: ...
    def set_model_transaction_policy(self, transaction_policy_dict: dict[str, Any]) -> None: ...
    def set_max_batch_size(self, max_batch_size: int) -> None: ...


def auto_complete(model_config: ModelConfig) -> ModelConfig:
    """Fill in what the configuration leaves out, as Triton's vLLM backend does: the inputs and
    outputs, a decoupled policy, max_batch_size 0. Raises ValueError naming a contradicting key."""
    completion = complete_model_config(model_config.as_dict())
    for tensor in completion.inputs:
        model_config.add_input(tensor)
    for tensor in completion.outputs:
        model_config.add_output(tensor)
    model_config.set_model_transaction_policy({"decoupled": True})
    model_config.set_max_batch_size(0)
    return model_config


def check_model_config(config: Mapping[str, Any]) -> list[str]:
    """Check the configuration a model is loaded with (auto-completed, unless the server runs with
    --disable-auto-complete-config). Returns log lines for declared inputs Tritium does not read;
    raises ValueError naming a key that contradicts what the engine needs."""
    if not (config.get("model_transaction_policy") or {}).get("decoupled"):
        raise ValueError(_DECOUPLED)
    return _check_common(config)


def _check_common(config: Mapping[str, Any]) -> list[str]:
    batch = int(config.get("max_batch_size") or 0)
    if batch != 0:
        raise ValueError(f"max_batch_size: the engine batches requests itself (continuous batching), "
                         f"so Triton must not: set max_batch_size: 0 or leave it out, got {batch}.")
    notes = []
    inputs = {s.name: s for s in INPUTS}
    for tensor in config.get("input") or ():
        spec = inputs.get(tensor.get("name"))
        if spec is None:
            if not tensor.get("optional"):
                raise ValueError(f"input '{tensor.get('name')}': Tritium does not read it, and the "
                                 f"configuration makes every request carry it; valid inputs: "
                                 f"{', '.join(inputs)}.")
            notes.append(f"tritium: input '{tensor.get('name')}' is declared, but Tritium does not read "
                         f"it: a request that carries it is refused.")
            continue
        _check_tensor("input", spec, tensor)
    outputs = {s.name: s for s in OUTPUTS}
    for tensor in config.get("output") or ():
        spec = outputs.get(tensor.get("name"))
        if spec is not None:  # an output Tritium never sends does no harm
            _check_tensor("output", spec, tensor)
    return notes


def _check_tensor(kind: str, spec: TensorSpec, tensor: Mapping[str, Any]) -> None:
    data_type = tensor.get("data_type", "TYPE_INVALID")
    if data_type != "TYPE_INVALID" and not spec.accepts(data_type):
        allowed = sorted(spec.accepted_types) if spec.accepted_types else [spec.data_type]
        raise ValueError(f"{kind} '{spec.name}': data_type must be {' or '.join(allowed)}, got {data_type}.")
    dims = [int(d) for d in tensor.get("dims") or ()]
    if spec.single and any(d not in (-1, 1) for d in dims):
        raise ValueError(f"{kind} '{spec.name}': dims must hold one element ([ 1 ]), got {dims}.")
