"""A model configuration written for Triton's vLLM backend: 1/model.json, its config.pbtxt keys,
vLLM engine arguments Tritium does without (backend/serving/triton_config.py, vllm_compat.py)."""
import json
import os

import pytest

from tritium.serving.triton_config import serving_config
from tritium.serving.triton_request import check_lora


@pytest.fixture
def repo(tmp_path):
    """(root with model directory m, the model's version directory)."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}", encoding="utf-8")
    version = tmp_path / "llm" / "1"
    version.mkdir(parents=True)
    return tmp_path, version


def _model_json(version, values):
    (version / "model.json").write_text(json.dumps(values), encoding="utf-8")


def test_the_vllm_backend_sample_model_json(repo):
    """Its sample's model.json, with only the model path changed."""
    root, version = repo
    _model_json(version, {"model": str(root / "m"), "disable_log_requests": True,
                          "gpu_memory_utilization": 0.5, "enforce_eager": True, "disable_log_stats": False})
    cfg = serving_config({}, str(root), str(version))
    args = cfg.engine_args
    assert (args.model, args.gpu_memory_utilization, args.enforce_eager) == (str(root / "m"), 0.5, True)
    assert not cfg.report_metrics and not cfg.health_check  # off unless set true, as in the vLLM backend
    assert cfg.notes == [
        "tritium: ignoring vLLM engine argument disable_log_requests=true: Tritium does not log requests",
        "tritium: ignoring vLLM engine argument disable_log_stats=false: Tritium logs no periodic "
        "statistics; true also turns the vllm: metrics off, as in the vLLM backend"]


def test_model_json_beside_parameters(repo):
    root, version = repo
    _model_json(version, {"model": "m", "block_size": 32, "max_model_len": 128})
    # model.json's relative paths from the working directory, as vLLM takes them
    cfg = serving_config({"max_num_seqs": "8", "block_size": "32"}, "/nonexistent", str(version), cwd=str(root))
    assert (cfg.engine_args.model, cfg.engine_args.block_size, cfg.engine_args.max_num_seqs) == \
        (str(root / "m"), 32, 8)
    with pytest.raises(ValueError, match=r"^engine argument 'block_size' is set differently in config\.pbtxt "
                                         r"parameters \('16'\) and in 1/model\.json \('32'\)\.$"):
        serving_config({"block_size": "16"}, str(root), str(version), cwd=str(root))
    _model_json(version, {"model": "m", "enable_prefix_caching": False})
    cfg = serving_config({"enable_prefix_caching": "False"}, str(root), str(version), cwd=str(root))
    assert cfg.engine_args.enable_prefix_caching is False


def test_the_vllm_backend_config_keys(repo):
    root, version = repo
    base = {"model": str(root / "m")}
    assert not serving_config(base, str(root)).report_metrics  # unset: off, as in the vLLM backend
    assert serving_config({**base, "REPORT_CUSTOM_METRICS": "true"}, str(root)).report_metrics
    assert serving_config({**base, "REPORT_CUSTOM_METRICS": "True"}, str(root)).report_metrics
    assert not serving_config({**base, "REPORT_CUSTOM_METRICS": "false"}, str(root)).report_metrics
    assert not serving_config({**base, "disable_log_stats": "true"}, str(root)).report_metrics
    assert serving_config({**base, "ENABLE_VLLM_HEALTH_CHECK": "true"}, str(root)).health_check
    assert serving_config({**base, "GPU_DEVICE_IDS": "1, 0"}, str(root)).gpu_device_ids == "1,0"
    with pytest.raises(ValueError, match="^REPORT_CUSTOM_METRICS must be true or false, got 'maybe'"):
        serving_config({**base, "REPORT_CUSTOM_METRICS": "maybe"}, str(root))
    with pytest.raises(ValueError, match="^Invalid value for GPU_DEVICE_IDS: 'a'"):
        serving_config({**base, "GPU_DEVICE_IDS": "a"}, str(root))


def test_unimplemented_vllm_arguments(repo):
    root, version = repo
    _model_json(version, {"model": str(root / "m"), "pipeline_parallel_size": 1, "trust_remote_code": True})
    cfg = serving_config({}, str(root), str(version))
    assert cfg.notes[0] == "tritium: vLLM engine argument pipeline_parallel_size=1 is Tritium's only behaviour"
    _model_json(version, {"model": str(root / "m"), "pipeline_parallel_size": 2})
    with pytest.raises(ValueError, match=r"^vLLM engine argument 'pipeline_parallel_size' is not supported by "
                                         r"Tritium with a value other than 1, got '2'\.$"):
        serving_config({}, str(root), str(version))
    # tensor_parallel_size is Tritium's own engine argument.
    _model_json(version, {"model": str(root / "m"), "tensor_parallel_size": 2})
    assert serving_config({}, str(root), str(version)).engine_args.tensor_parallel_size == 2
    # As the vLLM backend's CI model vllm_invalid_1: an argument no engine knows fails the load.
    _model_json(version, {"model": str(root / "m"), "invalid_attribute": True})
    with pytest.raises(ValueError, match=r"^Unknown engine argument 'invalid_attribute'\. Valid arguments: "):
        serving_config({}, str(root), str(version))
    (version / "model.json").write_text("[1]", encoding="utf-8")
    with pytest.raises(ValueError, match=r"^1/model\.json must be a JSON object of vLLM engine arguments"):
        serving_config({}, str(root), str(version))


def test_lora_messages_are_the_vllm_backends():
    """Its messages whole (its multi-LoRA CI compares them with assertEqual); its log lines, with
    Tritium's hint after them."""
    log: list[str] = []
    check_lora(None, None, log.append)
    check_lora("doll", ["doll", "sheep"], log.append)
    assert log == []
    with pytest.raises(ValueError) as info:
        check_lora("doll", None, log.append)
    assert str(info.value) == "LoRA feature is not enabled."
    with pytest.raises(ValueError) as info:
        check_lora("bactrian", ["doll", "sheep"], log.append)
    assert str(info.value) == "LoRA bactrian is not supported, we currently support ['doll', 'sheep']"
    assert log == [
        "[vllm] LoRA is not enabled, please restart the backend with LoRA enabled. tritium: set enable_lora "
        "and list the adapters in 1/multi_lora.json (or a lora_modules parameter), then load the model again.",
        "[vllm] LoRA bactrian not found. tritium: lora_name must name one of the model's adapters "
        "['doll', 'sheep']; to serve another, add it to 1/multi_lora.json and load the model again."]


def test_ray_runs_the_ranks_as_tritiums_processes(repo):
    """The vLLM backend's multi-LoRA CI model (ci/L0_multi_gpu_vllm/multi_lora/test.sh), its
    1/model.json and 1/multi_lora.json verbatim: "ray" loads, as Tritium's default executor for
    the ranks, with a log line; the adapters are served in multi_lora.json's order."""
    root, version = repo
    for d in ("backbone/gemma-2b", "loras/GemmaDoll", "loras/GemmaSheep"):
        os.makedirs(root / "weights" / d)
    (root / "weights" / "backbone" / "gemma-2b" / "config.json").write_text("{}", encoding="utf-8")
    (version / "model.json").write_text('''{
    "model":"./weights/backbone/gemma-2b",
    "gpu_memory_utilization": 0.7,
    "tensor_parallel_size": 2,
    "block_size": 16,
    "enforce_eager": true,
    "enable_lora": true,
    "max_lora_rank": 32,
    "distributed_executor_backend":"ray"
}
''', encoding="utf-8")
    (version / "multi_lora.json").write_text('''{
    "doll": "./weights/loras/GemmaDoll",
    "sheep": "./weights/loras/GemmaSheep"
}
''', encoding="utf-8")
    cfg = serving_config({}, "/nonexistent", str(version), cwd=str(root))
    args = cfg.engine_args
    assert (args.tensor_parallel_size, args.distributed_executor_backend) == (2, None)  # None: "mp" for 2
    assert cfg.notes == ["tritium: distributed_executor_backend=ray: the 2 tensor-parallel ranks run as "
                         "Tritium's own processes on this host ('mp'), not as Ray workers"]
    assert list(args.lora_modules) == ["doll", "sheep"]
    # One rank (the vLLM backend's CI adds "ray" only from 2; a user may at 1).
    _model_json(version, {"model": str(root / "m"), "distributed_executor_backend": "ray"})
    cfg = serving_config({}, str(root), str(version))
    assert cfg.engine_args.distributed_executor_backend is None and cfg.notes == [
        "tritium: distributed_executor_backend=ray: the one rank runs in Tritium's engine process ('uni'), "
        "not as a Ray worker"]
    # Tritium's own executors keep their checks; external_launcher is still refused.
    _model_json(version, {"model": str(root / "m"), "distributed_executor_backend": "external_launcher"})
    with pytest.raises(ValueError, match=r"^distributed_executor_backend='external_launcher' is not supported"):
        serving_config({}, str(root), str(version))


def test_multi_lora_json_relative_paths_from_the_working_directory(repo):
    """The vLLM backend's CI lists {"doll": "./weights/loras/GemmaDoll"} and starts the server
    where ./weights is."""
    root, version = repo
    os.makedirs(root / "weights" / "loras" / "GemmaDoll")
    _model_json(version, {"model": str(root / "m"), "enable_lora": True})
    (version / "multi_lora.json").write_text('{"doll": "./weights/loras/GemmaDoll"}', encoding="utf-8")
    cfg = serving_config({}, "/nonexistent", str(version), cwd=str(root))
    assert cfg.engine_args.lora_modules == {"doll": str(root / "weights" / "loras" / "GemmaDoll")}


def test_drain_timeout_is_a_serving_setting(repo):
    root, _ = repo
    base = {"model": str(root / "m")}
    assert serving_config(base, str(root)).drain_timeout_s == 30.0
    cfg = serving_config({**base, "drain_timeout_s": "2.5"}, str(root))
    assert cfg.drain_timeout_s == 2.5 and not hasattr(cfg.engine_args, "drain_timeout_s")
    for bad in ("-1", "soon", "inf"):
        with pytest.raises(ValueError, match=f"drain_timeout_s must be a number of seconds >= 0, got '{bad}'"):
            serving_config({**base, "drain_timeout_s": bad}, str(root))


def test_speculative_config_from_model_json_and_parameters(repo):
    """vLLM's speculative_config as an object in model.json, or as JSON text in a config.pbtxt
    parameter: the same engine argument (a draft model here; EAGLE heads alike)."""
    root, version = repo
    spec = {"method": "eagle3", "model": str(root / "m"), "num_speculative_tokens": 4}
    _model_json(version, {"model": str(root / "m"), "speculative_config": spec})
    assert serving_config({}, str(root), str(version)).engine_args.speculative_config == spec
    draft = {"model": str(root / "m"), "num_speculative_tokens": 3}
    args = serving_config({"model": str(root / "m"), "speculative_config": json.dumps(draft)}, str(root)).engine_args
    assert args.speculative_config == draft
