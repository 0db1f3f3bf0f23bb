"""deploy/kubernetes: each overlay rendered (Kustomize's JSON6902 `patches`, applied with jsonpatch)
and every object validated against Kubernetes' OpenAPI schemas (kubernetes-validate, strict: an
unknown field fails); the PodMonitor (a Prometheus Operator CRD, not in those schemas) and the
prometheus-adapter values are checked field by field. Probe paths and ports, the Service and the
PodMonitor are checked against the container's tritonserver flags, the flags against
`tritonserver --help`, and the probe paths against tritonserver serving the repository that the
init container builds from the ConfigMap."""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import subprocess

import jsonpatch
import kubernetes_validate
import pytest
import yaml

from triton_server import CONFIG_PBTXT, ROOT, http_request, start_server

DEPLOY = os.path.join(ROOT, "deploy", "kubernetes")
OVERLAYS = {1: "overlays/gpu-1", 2: "overlays/gpu-2", 4: "overlays/gpu-4"}
K8S_VERSION = "1.30"  # oldest Kubernetes the manifests target (HPA v2 behavior, PDB policy/v1)
DRAIN_GRACE_S = 30  # the drain's default grace period (engine argument)
_KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "patches", "labels"}


def _load(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def render(directory: str) -> list[dict]:
    """The objects `kustomize build directory` gives, for the subset of Kustomize used here."""
    directory = os.path.join(DEPLOY, directory)
    (kustomization,) = _load(os.path.join(directory, "kustomization.yaml"))
    unknown = set(kustomization) - _KUSTOMIZATION_FIELDS
    assert not unknown, f"{directory}: kustomization fields this renderer does not apply: {unknown}"
    objects: list[dict] = []
    for resource in kustomization.get("resources", []):
        path = os.path.normpath(os.path.join(directory, resource))
        objects += render(os.path.relpath(path, DEPLOY)) if os.path.isdir(path) else _load(path)
    for patch in kustomization.get("patches", []):
        target = patch["target"]
        matched = [i for i, o in enumerate(objects)
                   if o["kind"] == target["kind"] and o["metadata"]["name"] == target["name"]]
        assert len(matched) == 1, f"{directory}: patch target {target} matches {len(matched)} objects"
        # jsonpatch raises on a path that does not exist (a `replace` must replace something).
        objects[matched[0]] = jsonpatch.apply_patch(objects[matched[0]], yaml.safe_load(patch["patch"]))
    for label in kustomization.get("labels", []):
        for o in objects:
            o["metadata"].setdefault("labels", {}).update(label["pairs"])
    return copy.deepcopy(objects)


def one(objects: list[dict], kind: str) -> dict:
    (found,) = [o for o in objects if o["kind"] == kind]
    return found


def server_container(objects: list[dict]) -> dict:
    (c,) = [c for c in one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
            if c["name"] == "tritonserver"]
    return c


def flags(container: dict) -> dict[str, str]:
    assert container["command"] == ["tritonserver"]
    return dict(re.fullmatch(r"--([a-z-]+)=(.*)", a).groups() for a in container["args"])


def pbtxt_parameters(text: str) -> dict[str, str]:
    return dict(re.findall(r'parameters \{ key: "(\w+)" value \{ string_value: "([^"]*)" \} \}', text))


@pytest.mark.parametrize("overlay", sorted(OVERLAYS.values()) + ["monitoring"])
def test_every_object_validates_against_the_kubernetes_schemas(overlay):
    objects = render(overlay)
    assert objects
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: test_pod_monitor_scrapes_the_metrics_port
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_examples_validate_against_the_kubernetes_schemas():
    directory = os.path.join(DEPLOY, "examples")
    objects = [o for name in sorted(os.listdir(directory)) for o in _load(os.path.join(directory, name))]
    assert [o["kind"] for o in objects] == ["PersistentVolumeClaim"]
    volume = next(v for v in one(render(OVERLAYS[1]), "Deployment")["spec"]["template"]["spec"]["volumes"]
                  if v["name"] == "weights")
    assert volume["persistentVolumeClaim"]["claimName"] == objects[0]["metadata"]["name"]
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_the_validator_rejects_a_misspelt_field():
    objects = render(OVERLAYS[1])
    deployment = one(objects, "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/x"
    with pytest.raises(kubernetes_validate.ValidationError, match="paht"):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


@pytest.mark.parametrize("gpus", sorted(OVERLAYS))
def test_overlay_sets_the_gpu_limit_and_tensor_parallel_size(gpus, tiny_model):
    from tritium.config import EngineArgs
    from tritium.serving.triton_config import engine_args_from_model_config

    objects = render(OVERLAYS[gpus])
    assert server_container(objects)["resources"]["limits"]["nvidia.com/gpu"] == gpus
    volumes = {v["name"]: v for v in one(objects, "Deployment")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": f"{2 * gpus}Gi"}
    data = one(objects, "ConfigMap")["data"]
    params = pbtxt_parameters(data["config.pbtxt"] + data["tensor-parallel.pbtxt"])
    if gpus == 1:
        assert "tensor_parallel_size" not in params  # what today's engine loads
    else:
        assert params["tensor_parallel_size"] == str(gpus)
    if "tensor_parallel_size" not in {f.name for f in dataclasses.fields(EngineArgs)}:
        params.pop("tensor_parallel_size", None)  # the tensor-parallel engine has not landed
    assert params["model"] == "/data/model"  # the weights volume's mount
    params["model"] = "models/tiny-llama"  # a directory that exists here: the others are checked
    engine_args_from_model_config(params, ROOT)  # raises on an unknown or bad argument


def test_config_map_is_the_repository_model_config_but_its_parameters():
    def interface(text: str) -> str:
        text = re.sub(r"#.*", "", text)
        text = re.sub(r"^parameters \{.*\}$", "", text, flags=re.M)
        return " ".join(text.split())

    with open(CONFIG_PBTXT, encoding="utf-8") as f:
        repository = f.read()
    config = one(render(OVERLAYS[1]), "ConfigMap")["data"]["config.pbtxt"]
    assert interface(config) == interface(repository)


def test_probes_service_and_ports_agree_with_the_server_flags():
    objects = render(OVERLAYS[1])
    container = server_container(objects)
    f = flags(container)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": int(f["http-port"]), "grpc": int(f["grpc-port"]),
                     "metrics": int(f["metrics-port"])}
    assert f["model-repository"] == "/models" and f["allow-metrics"] == "true"
    # The init container builds /models/llm: the model's name in the probe paths.
    (init,) = one(objects, "Deployment")["spec"]["template"]["spec"]["initContainers"]
    assert "/models/llm/config.pbtxt" in init["command"][-1]
    assert "mkdir -p /models/llm/1" in init["command"][-1]
    probes = {k: container[k]["httpGet"] for k in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert probes["startupProbe"]["path"] == "/v2/models/llm/ready"
    assert probes["readinessProbe"]["path"] == "/v2/models/llm/ready"
    assert probes["livenessProbe"]["path"] == "/v2/health/live"
    for probe in probes.values():
        assert ports[probe["port"]] == int(f["http-port"])
    service = one(objects, "Service")
    assert {p["name"]: ports[p["targetPort"]] for p in service["spec"]["ports"]} == ports
    selector = service["spec"]["selector"]
    pod_labels = one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= pod_labels.items()
    assert one(objects, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


def test_server_flags_are_tritonservers():
    container = server_container(render(OVERLAYS[1]))
    # The bundled 2.51 (the image's 25.01 is 2.54: these flags are in both); usage is on stderr.
    done = subprocess.run([os.path.join(ROOT, "scripts", "tritonserver"), "--help"],
                          capture_output=True, text=True, timeout=120)
    help_text = done.stdout + done.stderr
    assert "--model-repository" in help_text, help_text[-2000:]
    for flag in flags(container):
        assert re.search(rf"^\s+--{flag} <", help_text, flags=re.M), f"tritonserver has no --{flag}"


def test_termination_grace_covers_prestop_and_drain():
    objects = render(OVERLAYS[1])
    spec = one(objects, "Deployment")["spec"]["template"]["spec"]
    container = server_container(objects)
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop_s = int(command[1])
    exit_timeout_s = int(flags(container)["exit-timeout-secs"])
    # Endpoints are removed while preStop sleeps, the drain runs within tritonserver's exit timeout.
    assert pre_stop_s >= 5
    assert exit_timeout_s >= DRAIN_GRACE_S + 10
    assert spec["terminationGracePeriodSeconds"] >= pre_stop_s + exit_timeout_s + 10


def test_hpa_scales_the_deployment_on_the_adapter_metric():
    from tritium.serving.triton_metrics import METRICS

    objects = render(OVERLAYS[1])
    hpa = one(objects, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": one(objects, "Deployment")["metadata"]["name"]}
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    (values,) = _load(os.path.join(DEPLOY, "monitoring", "prometheus-adapter-values.yaml"))
    (rule,) = values["rules"]["custom"]
    source = re.fullmatch(r"\^(.+)\$", rule["name"]["matches"]).group(1)
    assert source == "vllm:num_requests_waiting" in {m.name for m in METRICS}
    assert rule["seriesQuery"].startswith(source + "{")
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
    assert metric["pods"]["metric"]["name"] == rule["name"]["as"]
    # The model publishes it: vLLM's metrics are off unless REPORT_CUSTOM_METRICS is true.
    assert pbtxt_parameters(one(objects, "ConfigMap")["data"]["config.pbtxt"])["REPORT_CUSTOM_METRICS"] == "true"


def test_pod_monitor_scrapes_the_metrics_port():
    (monitor,) = render("monitoring")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["kind"] == "PodMonitor"
    assert set(monitor["spec"]) == {"selector", "podMetricsEndpoints"}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout"}
    deployment_objects = render(OVERLAYS[1])
    pod_labels = one(deployment_objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    container = server_container(deployment_objects)
    assert {p["name"]: p["containerPort"] for p in container["ports"]}[endpoint["port"]] == \
        int(flags(container)["metrics-port"])
    assert endpoint["path"] == "/metrics"


def test_the_init_container_builds_a_repository_that_serves_the_probes(tmp_path, tiny_model):
    """The init container's script (paths mapped into tmp_path) on the ConfigMap's files, then
    tritonserver with the container's flags (on free ports) on its result: the probes' paths."""
    objects = render(OVERLAYS[1])
    (init,) = one(objects, "Deployment")["spec"]["template"]["spec"]["initContainers"]
    config_dir, models = tmp_path / "config", tmp_path / "models"
    config_dir.mkdir()
    for name, text in one(objects, "ConfigMap")["data"].items():
        (config_dir / name).write_text(text.replace('"/data/model"', json.dumps(tiny_model)))
    script = (init["command"][-1].replace("/opt/tritium", ROOT).replace("/config/", f"{config_dir}/")
              .replace("/models", str(models)))
    subprocess.run(["bash", "-c", script], check=True, timeout=60)
    assert sorted(p.name for p in (models / "llm").iterdir()) == ["1", "config.pbtxt"]
    container = server_container(objects)
    ours = ("model-repository", "http-port", "grpc-port", "metrics-port")
    server_flags = [f"--{k}={v}" for k, v in flags(container).items() if k not in ours]
    server = start_server(str(models), str(tmp_path / "tritonserver.log"), *server_flags)
    try:
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            status, _ = http_request(server.http_url + container[probe]["httpGet"]["path"])
            assert status == 200, (probe, server.log_tail())
        assert "vllm:num_requests_waiting{" in server.metrics()
    finally:
        server.stop()
