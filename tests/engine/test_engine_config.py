"""Typed configuration: EngineArgs resolves once into the parts of an EngineConfig, each
component is built from its part, and max_num_seqs crosses to the engine's process once."""
from __future__ import annotations

import ast
import dataclasses
import os
import pickle
import re
import threading
import typing

import pytest

from tritium import EngineArgs, SamplingParams
from tritium import engine_config
from tritium.drivers import engine_process
from tritium.core.block_manager import BlockManager
from tritium.drivers.messages import Ready
from tritium.core.scheduler import Scheduler
from tritium.core.sequence import Sequence
from tritium.engine_config import EngineConfig, ModelLimits, SchedulerConfig

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PARTS = [cls for cls in vars(engine_config).values()
         if isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__module__ == engine_config.__name__]


def _no_limits(hf_config: dict) -> ModelLimits:
    return ModelLimits(None, None)


def _field_names(cls: type, seen: set[type] | None = None) -> set[str]:
    """Every field name of a dataclass and of the dataclasses its fields hold, at any depth."""
    seen = set() if seen is None else seen
    if cls in seen:
        return set()
    seen.add(cls)
    names: set[str] = set()
    for name, hint in typing.get_type_hints(cls).items():
        names.add(name)
        for t in (hint, *typing.get_args(hint)):
            if isinstance(t, type) and dataclasses.is_dataclass(t):
                names |= _field_names(t, seen)
    return names


def test_the_engine_process_reply_has_no_max_num_seqs():
    """The parent resolves the scheduler's part from the EngineArgs it sent: the reply brings
    only what the engine's process found out (the model's part, the built engine's limits)."""
    names = _field_names(Ready)
    assert "max_num_seqs" not in names and "max_model_len" in names
    # The test would see it: the old reply carried the resolved EngineArgs.
    assert "max_num_seqs" in _field_names(EngineArgs)


def test_max_num_seqs_crosses_to_the_engine_process_once(llama_dir, monkeypatch):
    """What comes back over the socket, byte for byte, never names max_num_seqs; the parent
    still checks n against the max_num_seqs of its own configuration."""
    received: list[bytes] = []

    class RecordingConnection(engine_process.Connection):
        def recv(self):
            raw = self.recv_bytes()
            received.append(raw)
            return pickle.loads(raw)

    monkeypatch.setattr(engine_process, "Connection", RecordingConnection)
    engine = engine_process.EngineProcess(EngineArgs(model=llama_dir, max_model_len=128, max_num_seqs=3))
    try:
        assert isinstance(pickle.loads(received[0]), Ready)
        assert engine.config.scheduler_config.max_num_seqs == 3
        with pytest.raises(ValueError, match=re.escape("n=4 is larger than max_num_seqs=3.")):
            engine.add_request("wide", [0, 5, 7], SamplingParams(n=4, max_tokens=2), lambda out: None)
        done = threading.Event()
        engine.add_request("ok", [0, 5, 7], SamplingParams(n=3, max_tokens=2, temperature=0),
                           lambda out: out.finished and done.set())
        assert done.wait(60)
    finally:
        engine.shutdown()
    assert len(received) > 1 and not any(b"max_num_seqs" in raw for raw in received)


def test_every_default_is_written_once_in_engine_args():
    """The parts have no defaults: only EngineArgs's are the engine's."""
    with_defaults = [f"{cls.__name__}.{f.name}" for cls in PARTS for f in dataclasses.fields(cls)
                     if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING]
    assert with_defaults == []
    assert {"ModelConfig", "CacheConfig", "SchedulerConfig", "ParallelConfig", "LoRAConfig",
            "SpeculativeConfig", "CompilationConfig", "DeviceConfig"} <= {cls.__name__ for cls in PARTS}


def test_engine_args_resolve_into_the_parts(llama_dir):
    args = EngineArgs(model=llama_dir, max_num_seqs=5, block_size=8, enable_lora=True, max_loras=2,
                      speculative_config={"num_speculative_tokens": 3}, enable_chunked_prefill=False)
    config = args.create_engine_config(args.create_model_config(_no_limits))
    assert isinstance(config, EngineConfig)
    assert config.model_config.tokenizer == llama_dir and config.model_config.max_model_len == 2048
    assert config.scheduler_config.max_num_seqs == 5 and config.cache_config.block_size == 8
    # Without chunked prefill the budget defaults to a whole prompt.
    assert config.scheduler_config.max_num_batched_tokens == 8192
    assert config.lora_config is not None and config.lora_config.max_loras == 2
    assert config.speculative_config.num_speculative_tokens == 3
    plain = EngineArgs(model=llama_dir, max_model_len=64)
    plain_config = plain.create_engine_config(plain.create_model_config(_no_limits))
    assert plain_config.lora_config is None and plain_config.speculative_config is None
    assert plain_config.scheduler_config.max_num_seqs == 256


def test_the_scheduler_is_built_from_its_part_alone(llama_dir):
    """max_num_seqs=2 reaches the scheduler through SchedulerConfig: two of three run."""
    args = EngineArgs(model=llama_dir, max_model_len=64, max_num_seqs=2)
    config = args.create_engine_config(args.create_model_config(_no_limits)).scheduler_config
    assert isinstance(config, SchedulerConfig)
    sched = Scheduler(config, BlockManager(16, 4, True))
    for i in range(3):
        sched.add(Sequence(f"r{i}", [1, 2, 3], 3, SamplingParams()))
    step = sched.schedule()
    assert [sched.sequence(it.seq_id).request_id for it in step.scheduled] == ["r0", "r1"]


def test_only_the_drivers_read_engine_args():
    """The worker, layers and models, and the engine's components, are built from parts of the
    EngineConfig; EngineArgs is read where it is resolved (the drivers) and where it is made (a
    model's configuration, the `tritium serve` flags)."""
    importers = []
    for folder, _, files in os.walk(os.path.join(_ROOT, "backend")):
        for name in (n for n in files if n.endswith(".py")):
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
            if any(isinstance(node, ast.ImportFrom) and any(a.name == "EngineArgs" for a in node.names)
                   for node in ast.walk(tree)):
                importers.append(os.path.relpath(path, _ROOT))
    assert sorted(importers) == ["backend/__init__.py", "backend/cli/engine_flags.py", "backend/drivers/engine_process.py",
                                 "backend/drivers/process_main.py", "backend/drivers/streaming_engine.py",
                                 "backend/engine/llm_engine.py", "backend/llm.py",
                                 "backend/serving/triton_config.py"]
