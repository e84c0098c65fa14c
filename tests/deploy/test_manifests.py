"""Offline validation of the Kubernetes manifests in deploy/ (no cluster, no Ray started).

1. The RayService against the KubeRay CRD's `openAPIV3Schema` (the served version named by its
   apiVersion), with unknown fields rejected as `kubectl apply` (strict field validation) does.
   Broken copies must be rejected, so the check itself is tested.
2. `serveConfigV2` the way the Serve controller takes it: Ray's own schema, the builder imported
   from `import_path` and called with `args`, the app built, the per-deployment overrides applied
   with Serve's own override code.
3. Consistency between the layers: ports, GPUs/CPUs per pod vs. what the deployments request,
   health/shutdown timings, the model cache volume, the gRPC Service's selector.

The CRDs live beside the clone: ../shared/schemas/kuberay/ from the repo root (skipped if absent).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
CRD_DIR = REPO.parent / "shared" / "schemas" / "kuberay"
RAYSERVICE_CRD = CRD_DIR / "ray.io_rayservices.yaml"

APP_DEPLOYMENTS = {"Ingress", "Scheduler", "Drafter", "Verifier"}  # what cluster.serving.app.build_app binds (Drafter
# only with a draft model: `draft: ngram` drafts inside the scheduler)
SINGLETONS = ("Scheduler", "Drafter", "Verifier")  # hold the engine loop / a KV pool: exactly one replica
HEALTH_FIELDS = ("health_check_period_s", "health_check_timeout_s", "graceful_shutdown_wait_loop_s",
                 "graceful_shutdown_timeout_s")

Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRD is 18k lines: libyaml when present


def load_one(path: Path) -> dict[str, Any]:
    docs = [doc for doc in yaml.load_all(path.read_text(), Loader=Loader) if doc is not None]
    assert len(docs) == 1, f"{path}: expected one document, got {len(docs)}"
    return docs[0]


@pytest.fixture(scope="module")
def rayservice() -> dict[str, Any]:
    return load_one(DEPLOY / "rayservice.yaml")


@pytest.fixture(scope="module")
def grpc_service() -> dict[str, Any]:
    return load_one(DEPLOY / "service-grpc.yaml")


@pytest.fixture(scope="module")
def cache_pvc() -> dict[str, Any]:
    return load_one(DEPLOY / "model-cache-pvc.yaml")


# -- 1. the RayService against the KubeRay CRD -------------------------------------------------------


def structural_schema(node: Any) -> Any:
    """An OpenAPI v3 CRD schema as a JSON Schema (draft 4) with the API server's semantics.

    - objects with `properties` reject unknown fields unless `additionalProperties` or
      `x-kubernetes-preserve-unknown-fields` allows them (kubectl's default strict validation);
    - `nullable: true` admits null;
    - `x-kubernetes-int-or-string` admits an integer or a string (the CRD also spells it as anyOf).
    CEL rules (`x-kubernetes-validations`) are not evaluated: see test_no_cel_guarded_fields.
    """
    if isinstance(node, list):
        return [structural_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: structural_schema(value) for key, value in node.items()}
    if "properties" in node:
        out["properties"] = {name: structural_schema(sub) for name, sub in node["properties"].items()}
        if "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if node.get("nullable") and isinstance(node.get("type"), str):
        out["type"] = [node["type"], "null"]
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in node:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return out


def crd_version(crd: dict[str, Any], api_version: str) -> dict[str, Any]:
    group, _, version = api_version.partition("/")
    assert crd["spec"]["group"] == group, (crd["spec"]["group"], api_version)
    matches = [v for v in crd["spec"]["versions"] if v["name"] == version]
    assert matches, f"{api_version}: the CRD has no version {version!r}"
    return matches[0]


@pytest.fixture(scope="module")
def rayservice_crd() -> dict[str, Any]:
    if not RAYSERVICE_CRD.is_file():
        pytest.skip(f"KubeRay CRD not found at {RAYSERVICE_CRD} (CI checks out shared/ beside the repo)")
    crd = yaml.load(RAYSERVICE_CRD.read_text(), Loader=Loader)
    assert crd["kind"] == "CustomResourceDefinition"
    return crd


@pytest.fixture(scope="module")
def validator(rayservice_crd: dict[str, Any], rayservice: dict[str, Any]) -> Any:
    import jsonschema  # a dependency of ray (pinned in pyproject), not added by this test

    version = crd_version(rayservice_crd, rayservice["apiVersion"])
    schema = structural_schema(version["schema"]["openAPIV3Schema"])
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema)


def schema_errors(validator: Any, manifest: dict[str, Any]) -> list[str]:
    return sorted(f"{'.'.join(str(p) for p in err.absolute_path) or '<root>'}: {err.message}"
                  for err in validator.iter_errors(manifest))


def test_crd_version_is_served_and_current(rayservice_crd: dict[str, Any], rayservice: dict[str, Any]) -> None:
    assert rayservice["apiVersion"] == "ray.io/v1" and rayservice["kind"] == "RayService"
    assert rayservice_crd["spec"]["names"]["kind"] == "RayService"
    version = crd_version(rayservice_crd, rayservice["apiVersion"])
    assert version["served"] and version["storage"] and not version.get("deprecated")


def test_rayservice_matches_crd_schema(validator: Any, rayservice: dict[str, Any]) -> None:
    assert schema_errors(validator, rayservice) == []


def _head(manifest: dict[str, Any]) -> dict[str, Any]:
    return manifest["spec"]["rayClusterConfig"]["headGroupSpec"]


def _worker(manifest: dict[str, Any]) -> dict[str, Any]:
    return manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]


def _break_int_start_param(m: dict[str, Any]) -> None:
    _head(m)["rayStartParams"]["num-cpus"] = 0  # map[string]string: must be "0"


def _break_typo_field(m: dict[str, Any]) -> None:
    m["spec"]["rayClusterConfig"]["workerGroupSpec"] = m["spec"]["rayClusterConfig"].pop("workerGroupSpecs")


def _break_missing_group_name(m: dict[str, Any]) -> None:
    del _worker(m)["groupName"]


def _break_string_replicas(m: dict[str, Any]) -> None:
    _worker(m)["replicas"] = "one"


def _break_port_type(m: dict[str, Any]) -> None:
    _head(m)["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "6379"


def _break_serve_config_type(m: dict[str, Any]) -> None:
    m["spec"]["serveConfigV2"] = yaml.safe_load(m["spec"]["serveConfigV2"])  # an object, not a string


@pytest.mark.parametrize(("mutate", "where"), [
    (_break_int_start_param, "spec.rayClusterConfig.headGroupSpec.rayStartParams.num-cpus"),
    (_break_typo_field, "spec.rayClusterConfig"),
    (_break_missing_group_name, "spec.rayClusterConfig.workerGroupSpecs.0"),
    (_break_string_replicas, "spec.rayClusterConfig.workerGroupSpecs.0.replicas"),
    (_break_port_type, "spec.rayClusterConfig.headGroupSpec.template.spec.containers.0.ports.0.containerPort"),
    (_break_serve_config_type, "spec.serveConfigV2"),
])
def test_broken_copies_are_rejected(validator: Any, rayservice: dict[str, Any], mutate: Any, where: str) -> None:
    broken = copy.deepcopy(rayservice)
    mutate(broken)
    errors = schema_errors(validator, broken)
    assert any(error.startswith(f"{where}:") for error in errors), errors


def _cel_guarded(schema: dict[str, Any], value: Any, path: str) -> Iterator[str]:
    if "x-kubernetes-validations" in schema:
        yield path
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                yield from _cel_guarded(sub, value[key], f"{path}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            yield from _cel_guarded(schema["items"], item, f"{path}.{i}")


def test_no_cel_guarded_fields(rayservice_crd: dict[str, Any], rayservice: dict[str, Any]) -> None:
    """The schema check cannot run CEL rules, so the manifest sets none of the fields they guard."""
    schema = crd_version(rayservice_crd, rayservice["apiVersion"])["schema"]["openAPIV3Schema"]
    assert list(_cel_guarded(schema, rayservice, "")) == []


def test_metadata(rayservice: dict[str, Any], grpc_service: dict[str, Any], cache_pvc: dict[str, Any]) -> None:
    import re

    dns_label = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    for doc, kind in ((rayservice, "RayService"), (grpc_service, "Service"), (cache_pvc, "PersistentVolumeClaim")):
        assert doc["kind"] == kind
        assert dns_label.match(doc["metadata"]["name"]) and len(doc["metadata"]["name"]) <= 63
        assert "namespace" not in doc["metadata"]  # applied into the current namespace, like the operator's services
    assert grpc_service["apiVersion"] == "v1" and cache_pvc["apiVersion"] == "v1"


# -- 2. serveConfigV2 as the Serve controller takes it ------------------------------------------------


@pytest.fixture(scope="module")
def serve_config(rayservice: dict[str, Any]) -> dict[str, Any]:
    text = rayservice["spec"]["serveConfigV2"]
    assert isinstance(text, str)
    config = yaml.safe_load(text)
    assert isinstance(config, dict)
    return config


@pytest.fixture(scope="module")
def app_config(serve_config: dict[str, Any]) -> dict[str, Any]:
    (app,) = serve_config["applications"]
    return app


@pytest.fixture(scope="module")
def no_ray_autoinit() -> Iterator[None]:
    """Nothing here may start Ray: make any accidental `ray.*` call fail instead of auto-starting it."""
    import ray._private.auto_init_hook as hook

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hook, "enable_auto_connect", False)
        yield


def built_deployments(app_config: dict[str, Any]) -> dict[str, Any]:
    """Import, build and override the application exactly as the Serve controller does (offline).

    Mirrors ray.serve._private.application_state.build_serve_application (+ override_deployment_info)
    with Ray's private modules; ray is pinned (pyproject: ray[serve]==2.60.0): re-check on upgrades.
    """
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.application_state import override_deployment_info
    from ray.serve._private.build_app import build_app
    from ray.serve._private.config import DeploymentConfig, ReplicaConfig
    from ray.serve._private.deployment_info import DeploymentInfo
    from ray.serve.schema import ServeApplicationSchema

    schema = ServeApplicationSchema.model_validate(app_config)
    app = call_user_app_builder_with_args_if_necessary(import_attr(schema.import_path), schema.args)
    built = build_app(app, name=schema.name, default_runtime_env={})
    assert built.ingress_deployment_name == "Ingress"
    infos = {}
    for deployment in built.deployments:  # through the bytes the controller receives (as build_serve_application)
        config = DeploymentConfig.from_proto_bytes(deployment._deployment_config.to_proto_bytes())
        replica = ReplicaConfig.from_proto_bytes(deployment._replica_config.to_proto_bytes(), config.needs_pickle())
        infos[deployment.name] = DeploymentInfo(config, replica, start_time_ms=0, deployer_job_id="offline")
    return override_deployment_info(infos, schema)


@pytest.fixture(scope="module")
def deployments(app_config: dict[str, Any], no_ray_autoinit: None) -> dict[str, Any]:
    return built_deployments(app_config)


@pytest.fixture(scope="module")
def cluster_config(app_config: dict[str, Any]) -> Any:
    from deploy.serve_app import cluster_config

    return cluster_config(app_config["args"])


def _known_keys(model: Any) -> set[str]:
    return set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}


def test_serve_config_matches_ray_schema(serve_config: dict[str, Any]) -> None:
    from ray.serve.schema import DeploymentSchema, ServeApplicationSchema, ServeDeploySchema

    ServeDeploySchema.model_validate(serve_config)
    # Ray's models ignore unknown keys; a misspelt option would silently do nothing.
    assert set(serve_config) <= _known_keys(ServeDeploySchema)
    for app in serve_config["applications"]:
        assert set(app) <= _known_keys(ServeApplicationSchema)
        for deployment in app["deployments"]:
            assert set(deployment) <= _known_keys(DeploymentSchema), deployment["name"]


def test_import_path_names_a_serve_builder(app_config: dict[str, Any]) -> None:
    from ray._common.utils import import_attr

    assert ":" in app_config["import_path"], "import_path must be 'module:attribute'"
    builder = import_attr(app_config["import_path"])
    # Serve calls a builder with exactly one argument, the `args` mapping.
    assert inspect.isfunction(builder) and len(inspect.signature(builder).parameters) == 1


def test_grpc_servicer_is_the_apps(serve_config: dict[str, Any]) -> None:
    from ray._common.utils import import_attr

    from cluster.serving.app import GRPC_SERVICER

    assert serve_config["grpc_options"]["grpc_servicer_functions"] == [GRPC_SERVICER]
    assert callable(import_attr(GRPC_SERVICER))


def expected_deployments(cluster_config: Any) -> set[str]:
    return APP_DEPLOYMENTS if cluster_config.uses_draft_model else APP_DEPLOYMENTS - {"Drafter"}


def test_deployment_names_match_the_app(app_config: dict[str, Any], deployments: dict[str, Any],
                                        cluster_config: Any) -> None:
    assert set(deployments) == expected_deployments(cluster_config)  # built by the app from these args
    assert {d["name"] for d in app_config["deployments"]} == set(deployments)  # every one configured


def test_deployment_options_after_override(deployments: dict[str, Any], cluster_config: Any) -> None:
    for name in set(SINGLETONS) & set(deployments):
        config = deployments[name].deployment_config
        assert config.num_replicas == 1 and config.autoscaling_config is None, name
    ingress = deployments["Ingress"].deployment_config.autoscaling_config
    assert ingress is not None and 1 <= ingress.min_replicas <= ingress.max_replicas
    for name, info in deployments.items():
        for field in HEALTH_FIELDS:  # Serve's values == the app's own (the scheduler probes with the args)
            assert getattr(info.deployment_config, field) == getattr(cluster_config, field), (name, field)
    if "Drafter" in deployments:
        drafter = deployments["Drafter"].replica_config
        assert drafter.resource_dict.get("GPU", 0) == (1 if cluster_config.device.startswith("cuda") else 0)
    verifier = deployments["Verifier"].replica_config
    tp = cluster_config.tensor_parallel_size
    if tp == 1:
        assert verifier.placement_group_bundles is None
    else:
        bundles = verifier.placement_group_bundles
        assert len(bundles) == 1 + tp and not bundles[0].get("GPU")
        rank_gpus = 1 if cluster_config.device.startswith("cuda") else 0
        assert all(bundle.get("GPU", 0) == rank_gpus for bundle in bundles[1:]), bundles
        assert verifier.placement_group_strategy in ("PACK", "STRICT_PACK")
        assert verifier.resource_dict.get("CPU", 0) <= bundles[0]["CPU"]  # the replica fits bundle 0


def _deployment(app: dict[str, Any], name: str) -> dict[str, Any]:
    (entry,) = [d for d in app["deployments"] if d["name"] == name]
    return entry


@pytest.mark.parametrize(("mutate", "error"), [
    pytest.param(lambda app: _deployment(app, "Ingress").update(name="Ingres"), "'Ingres' does not exist",
                 id="unknown-deployment"),
    pytest.param(lambda app: app["args"].update(tensor_parallel_size="two"), "tensor_parallel_size",
                 id="bad-arg-type"),
    pytest.param(lambda app: app["args"].update(grpc_port=9001), "grpc_options.port", id="proxy-field-in-args"),
    pytest.param(lambda app: app.update(import_path="cluster.serving.app:build_app"), "exactly one parameter",
                 id="two-parameter-builder"),
    pytest.param(lambda app: _deployment(app, "Verifier")["ray_actor_options"].update(num_cpus=1), "first bundle",
                 id="replica-outgrows-bundle-0"),
    pytest.param(lambda app: _deployment(app, "Ingress").update(num_replicas=2), "num_replicas",
                 id="replicas-and-autoscaling"),
])
def test_broken_serve_configs_are_rejected(app_config: dict[str, Any], no_ray_autoinit: None, mutate: Any,
                                           error: str) -> None:
    broken = copy.deepcopy(app_config)
    mutate(broken)
    with pytest.raises((ValueError, TypeError), match=error):
        built_deployments(broken)


# -- 3. consistency between Serve, the pods and the Services ---------------------------------------


def _containers(group: dict[str, Any]) -> list[dict[str, Any]]:
    return group["template"]["spec"]["containers"]


def _ports(container: dict[str, Any]) -> dict[str, int]:
    return {port["name"]: port["containerPort"] for port in container.get("ports", [])}


def _cpus(quantity: str | int | float) -> float:
    text = str(quantity)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def test_ports(rayservice: dict[str, Any], serve_config: dict[str, Any], grpc_service: dict[str, Any]) -> None:
    head_group = _head(rayservice)
    head = _ports(_containers(head_group)[0])
    grpc_port = serve_config["grpc_options"]["port"]
    assert head["serve"] == serve_config["http_options"]["port"]  # KubeRay's serve Service uses this name
    assert head["grpc"] == grpc_port
    assert head["dashboard"] == int(head_group["rayStartParams"].get("dashboard-port", 8265))
    assert serve_config["http_options"]["host"] == "0.0.0.0"  # reachable from the Services
    (port,) = grpc_service["spec"]["ports"]
    assert port["port"] == port["targetPort"] == grpc_port


def test_grpc_service_selects_serving_ray_pods(rayservice: dict[str, Any], grpc_service: dict[str, Any]) -> None:
    selector = grpc_service["spec"]["selector"]
    assert selector.get("ray.io/serve") == "true"  # only pods whose Serve proxy KubeRay reports healthy
    own = {key: value for key, value in selector.items() if not key.startswith("ray.io/")}
    assert own, "the selector must also name this RayService's pods"
    for group in (_head(rayservice), *rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]):
        labels = group["template"].get("metadata", {}).get("labels", {})
        assert own.items() <= labels.items(), labels


def test_gpus_and_cpus_cover_the_deployments(rayservice: dict[str, Any], deployments: dict[str, Any],
                                             cluster_config: Any) -> None:
    head_group = _head(rayservice)
    assert "nvidia.com/gpu" not in _containers(head_group)[0]["resources"].get("limits", {})
    assert head_group["rayStartParams"].get("num-gpus", "0") == "0"
    (worker_group,) = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    resources = _containers(worker_group)[0]["resources"]
    assert resources["limits"] == resources["requests"]  # Guaranteed QoS; GPUs must be equal anyway
    pod_gpus = int(resources["limits"].get("nvidia.com/gpu", 0))
    pod_cpus = _cpus(worker_group["rayStartParams"].get("num-cpus", resources["limits"]["cpu"]))
    assert worker_group["minReplicas"] <= worker_group["replicas"] <= worker_group["maxReplicas"]

    verifier = deployments["Verifier"].replica_config
    bundles = verifier.placement_group_bundles or [verifier.resource_dict]
    verifier_gpus = sum(bundle.get("GPU", 0) for bundle in bundles)
    verifier_cpus = sum(bundle.get("CPU", 0) for bundle in bundles)
    if verifier.placement_group_strategy == "STRICT_PACK" or verifier.placement_group_bundles is None:
        assert verifier_gpus <= pod_gpus and verifier_cpus <= pod_cpus  # the whole group on one pod
    others = [info.replica_config.resource_dict for name, info in deployments.items() if name != "Verifier"]
    need_gpus = verifier_gpus + sum(resources.get("GPU", 0) for resources in others)
    need_cpus = verifier_cpus + sum(resources.get("CPU", 0) for resources in others)
    if cluster_config.device.startswith("cuda"):  # one per verifier rank + the drafter's
        assert need_gpus == cluster_config.tensor_parallel_size + int(cluster_config.uses_draft_model)
    assert need_gpus <= pod_gpus * worker_group["replicas"]
    assert need_cpus <= pod_cpus * worker_group["replicas"]
    assert worker_group["replicas"] == 1  # one app = one drafter + one verifier group: nothing to spread


def test_pod_lifecycle_covers_serve_shutdown(rayservice: dict[str, Any], cluster_config: Any) -> None:
    for group in (_head(rayservice), _worker(rayservice)):
        grace = group["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > cluster_config.graceful_shutdown_timeout_s + cluster_config.graceful_shutdown_wait_loop_s
    probe = _containers(_worker(rayservice))[0]["readinessProbe"]["httpGet"]
    assert probe["path"] == "/-/healthz" and probe["port"] == _ports(_containers(_head(rayservice))[0])["serve"]


def test_model_cache_and_import_path_in_every_pod(rayservice: dict[str, Any], cache_pvc: dict[str, Any],
                                                  app_config: dict[str, Any], cluster_config: Any) -> None:
    models = {cluster_config.model} | ({cluster_config.draft} if cluster_config.uses_draft_model else set())
    for group in (_head(rayservice), _worker(rayservice)):
        spec = group["template"]["spec"]
        volumes = {volume["name"]: volume for volume in spec["volumes"]}
        assert volumes["model-cache"]["persistentVolumeClaim"]["claimName"] == cache_pvc["metadata"]["name"]
        (prepare,) = spec["initContainers"]
        assert prepare["command"][:3] == ["specserve", "models", "prepare"]
        assert models <= set(prepare["command"][3:]), prepare["command"]  # the cache is filled before Ray starts
        for container in (prepare, *spec["containers"]):
            env = {item["name"]: item.get("value") for item in container.get("env", [])}
            mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
            assert env["SPECSERVE_CACHE"] == mounts["model-cache"], container["name"]
            assert container["image"] == _containers(_head(rayservice))[0]["image"]
        ray_env = {item["name"]: item.get("value") for item in spec["containers"][0]["env"]}
        if app_config["import_path"].startswith("deploy."):  # not an installed package: found through PYTHONPATH
            assert ray_env.get("PYTHONPATH"), group.get("groupName", "head")
    assert "ReadWriteMany" in cache_pvc["spec"]["accessModes"]  # head and workers mount it at once


# -- the builder itself ----------------------------------------------------------------------------


def test_builder_refuses_fields_kuberay_sets_elsewhere() -> None:
    from cluster.serving.config import ClusterConfig, ConfigError
    from deploy.serve_app import NOT_APP_ARGS, cluster_config

    assert set(NOT_APP_ARGS) <= set(ClusterConfig.model_fields)
    with pytest.raises(ConfigError, match="grpc_options.port"):
        cluster_config({"grpc_port": 9000})
    with pytest.raises(ConfigError, match="kv_blok"):
        cluster_config({"kv_blok": 64})
    assert cluster_config({"draft": "ngram"}).uses_draft_model is False
