"""Offline validation of the kustomize overlays in deploy/overlays (no cluster, no Ray started).

Every overlay is rendered with `kubectl kustomize`, then:
1. each document against its schema: the RayService against KubeRay's CRD and the PodMonitor against the
   Prometheus operator's (unknown fields rejected, as `kubectl apply` does), built-in kinds and the pod templates
   against Kubernetes' own schemas (kubernetes-validate, strict). Broken copies must be rejected, so the checks
   themselves are tested, on the rendered documents and on broken copies of the kustomize tree;
2. `serveConfigV2` the way the Serve controller takes it: Ray's own schema, the builder imported from
   `import_path` and called with `args`, the app built, the per-deployment overrides applied with Serve's code;
3. consistency between the layers: ports, the gRPC route, GPUs/CPUs/custom resources per pod vs. what the
   deployments request, worker threads vs. the CPU limit, timings, the model cache, the parameters, metrics.
The policy check (limits, non-root, no privilege escalation) is tests/deploy/test_policy.py.
"""

from __future__ import annotations

import copy
import inspect
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.rendering import (
    DEPLOY,
    OVERLAYS,
    RenderError,
    cel_guarded,
    copy_deploy,
    crd_errors,
    crd_version,
    kubernetes_errors,
    one,
    pyproject,
    ray_groups,
    render,
    rendered,
)

APP_DEPLOYMENTS = {"Ingress", "Scheduler", "Drafter", "Verifier"}  # what cluster.serving.app.build_app binds
# (Drafter only with a draft model: `draft: ngram` drafts inside the scheduler)
SINGLETONS = ("Scheduler", "Drafter", "Verifier")  # hold the engine loop / a KV pool: exactly one replica
FRONTEND = "specserve-frontend"  # the Ray resource only worker pods advertise (deploy/base/rayservice.yaml)
ON_SERVE_PODS = ("Ingress", "Scheduler")  # Ingress: its gRPC server; Scheduler: serving without the head
HEALTH_FIELDS = ("health_check_period_s", "health_check_timeout_s", "graceful_shutdown_wait_loop_s",
                 "graceful_shutdown_timeout_s")
EXPECTED_KINDS = {  # kind -> how many
    "cpu-dev": {"PersistentVolumeClaim": 1, "RayService": 1, "NetworkPolicy": 1},
    "gpu": {"PersistentVolumeClaim": 1, "RayService": 1, "NetworkPolicy": 1, "PodMonitor": 2, "ConfigMap": 1},
    "gcs-ft": {"PersistentVolumeClaim": 1, "RayService": 1, "NetworkPolicy": 1, "PodMonitor": 2, "ConfigMap": 1},
}

@pytest.fixture(params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def docs(overlay: str) -> list[dict[str, Any]]:
    return rendered(overlay)


@pytest.fixture
def rayservice(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(docs, "RayService")


def params(overlay: str) -> dict[str, str]:
    """The overlay's params.env (what the parameters component writes into the base)."""
    lines = (DEPLOY / "overlays" / overlay / "params.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))


def serve_config_of(rayservice: dict[str, Any]) -> dict[str, Any]:
    text = rayservice["spec"]["serveConfigV2"]
    assert isinstance(text, str) and text.strip(), "serveConfigV2 must be a non-empty string"
    config = yaml.safe_load(text)
    assert isinstance(config, dict)
    return config


def app_of(rayservice: dict[str, Any]) -> dict[str, Any]:
    (app,) = serve_config_of(rayservice)["applications"]
    return app


def _head(manifest: dict[str, Any]) -> dict[str, Any]:
    return manifest["spec"]["rayClusterConfig"]["headGroupSpec"]


def _worker(manifest: dict[str, Any]) -> dict[str, Any]:
    (group,) = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    return group


def _ray_container(group: dict[str, Any]) -> dict[str, Any]:
    return group["template"]["spec"]["containers"][0]  # KubeRay's Ray container is the first


def _ports(container: dict[str, Any]) -> dict[str, int]:
    return {port["name"]: port["containerPort"] for port in container.get("ports", [])}


def _cpus(quantity: str | int | float) -> float:
    text = str(quantity)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


# -- 1. rendering and schemas ------------------------------------------------------------------------------


def test_overlay_renders_the_expected_documents(overlay: str, docs: list[dict[str, Any]]) -> None:
    kinds = [doc["kind"] for doc in docs]
    assert {kind: kinds.count(kind) for kind in kinds} == EXPECTED_KINDS[overlay]
    # The parameters are local-config: read by the replacements, never applied.
    assert not any(doc["metadata"].get("annotations", {}).get("config.kubernetes.io/local-config") for doc in docs)
    assert not (DEPLOY / "service-grpc.yaml").exists()  # the serve Service carries gRPC (test_grpc_route...)


def test_custom_resources_match_their_crds(docs: list[dict[str, Any]]) -> None:
    groups = [doc["apiVersion"].partition("/")[0] for doc in docs]  # built-in groups: "", apps, *.k8s.io
    custom = [doc for doc, group in zip(docs, groups, strict=True) if "." in group and not group.endswith(".k8s.io")]
    assert {doc["kind"] for doc in custom} <= {"RayService", "PodMonitor"}
    for doc in custom:
        version = crd_version(doc)
        assert version["served"] and version["storage"] and not version.get("deprecated"), doc["kind"]
        assert crd_errors(doc) == [], doc["kind"]


def test_kubernetes_objects_match_kubernetes_schemas(docs: list[dict[str, Any]]) -> None:
    for doc in docs:
        assert kubernetes_errors(doc) == [], doc["kind"]


def test_no_cel_guarded_fields(docs: list[dict[str, Any]]) -> None:
    """The schema check cannot run CEL rules, so the manifests set none of the fields they guard."""
    for doc in docs:
        if doc["kind"] in ("RayService", "PodMonitor"):
            schema = crd_version(doc)["schema"]["openAPIV3Schema"]
            assert list(cel_guarded(schema, doc)) == [], doc["kind"]


def test_metadata(docs: list[dict[str, Any]]) -> None:
    dns_label = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    for doc in docs:
        name = doc["metadata"]["name"]
        assert dns_label.match(name) and len(name) <= 63, name
        assert "namespace" not in doc["metadata"]  # applied into the current namespace (or kustomize's)
        assert doc["metadata"]["labels"]["app.kubernetes.io/name"] == "specserve"
    assert len(one(docs, "RayService")["metadata"]["name"]) <= 53  # KubeRay: + "-serve-svc" within 63


def _break_int_start_param(m: dict[str, Any]) -> None:
    _head(m)["rayStartParams"]["num-cpus"] = 0  # map[string]string: must be "0"


def _break_typo_field(m: dict[str, Any]) -> None:
    m["spec"]["rayClusterConfig"]["workerGroupSpec"] = m["spec"]["rayClusterConfig"].pop("workerGroupSpecs")


def _break_missing_group_name(m: dict[str, Any]) -> None:
    del _worker(m)["groupName"]


def _break_string_replicas(m: dict[str, Any]) -> None:
    _worker(m)["replicas"] = "one"


def _break_port_type(m: dict[str, Any]) -> None:
    _ray_container(_head(m))["ports"][0]["containerPort"] = "6379"


def _break_serve_config_type(m: dict[str, Any]) -> None:
    m["spec"]["serveConfigV2"] = yaml.safe_load(m["spec"]["serveConfigV2"])  # an object, not a string


def _break_quantity(m: dict[str, Any]) -> None:
    _ray_container(_worker(m))["resources"]["limits"]["cpu"] = "eight"


def _break_group_resource_type(m: dict[str, Any]) -> None:
    _worker(m)["resources"][FRONTEND] = 100  # map[string]string


@pytest.mark.parametrize(("mutate", "where"), [
    (_break_int_start_param, "spec.rayClusterConfig.headGroupSpec.rayStartParams.num-cpus"),
    (_break_typo_field, "spec.rayClusterConfig"),
    (_break_missing_group_name, "spec.rayClusterConfig.workerGroupSpecs.0"),
    (_break_string_replicas, "spec.rayClusterConfig.workerGroupSpecs.0.replicas"),
    (_break_port_type, "spec.rayClusterConfig.headGroupSpec.template.spec.containers.0.ports.0.containerPort"),
    (_break_serve_config_type, "spec.serveConfigV2"),
    (_break_quantity, "spec.rayClusterConfig.workerGroupSpecs.0.template.spec.containers.0.resources.limits.cpu"),
    (_break_group_resource_type, f"spec.rayClusterConfig.workerGroupSpecs.0.resources.{FRONTEND}"),
])
def test_broken_rayservices_are_rejected(mutate: Callable[[dict[str, Any]], None], where: str) -> None:
    broken = one(rendered("gpu"), "RayService")
    mutate(broken)
    errors = crd_errors(broken)
    assert any(error.startswith(f"{where}:") for error in errors), errors


def _pod_spec(m: dict[str, Any], group: str) -> dict[str, Any]:
    return (_head(m) if group == "head" else _worker(m))["template"]["spec"]


@pytest.mark.parametrize(("mutate", "expected"), [
    pytest.param(lambda m: _pod_spec(m, "worker")["containers"][0]["securityContext"].update(allowPrivEsc=False),
                 "workers pod template (Kubernetes 1.29.0) template.spec.containers.0.securityContext:",
                 id="unknown-container-field"),
    pytest.param(lambda m: _pod_spec(m, "head").update(tolerations={"key": "nvidia.com/gpu"}),
                 "head pod template (Kubernetes 1.29.0) template.spec.tolerations:", id="list-as-object"),
    pytest.param(lambda m: _pod_spec(m, "worker")["volumes"][0].update(persistentVolume={"claimName": "x"}),
                 "workers pod template (Kubernetes 1.37.0) template.spec.volumes.0:", id="unknown-volume-source"),
])
def test_broken_pod_templates_fail_the_kubernetes_schema(mutate: Callable[[dict[str, Any]], None],
                                                         expected: str) -> None:
    broken = one(rendered("gpu"), "RayService")
    mutate(broken)
    errors = kubernetes_errors(broken)
    assert any(error.startswith(expected) for error in errors), errors


def test_broken_pvc_and_podmonitor_are_rejected() -> None:
    docs = rendered("gpu")
    pvc = one(docs, "PersistentVolumeClaim")
    pvc["spec"]["storageClasName"] = pvc["spec"].pop("storageClassName")
    assert any("storageClasName" in error for error in kubernetes_errors(pvc))
    monitor = [doc for doc in docs if doc["kind"] == "PodMonitor"][0]
    monitor["spec"]["podMetricsEndpoints"][0]["path"] = 8080
    monitor["spec"]["selector"]["matchLabel"] = monitor["spec"]["selector"].pop("matchLabels")
    errors = crd_errors(monitor)
    assert any(error.startswith("spec.podMetricsEndpoints.0.path:") for error in errors), errors
    assert any(error.startswith("spec.selector:") and "matchLabel" in error for error in errors), errors


def test_broken_kustomize_trees_fail(tmp_path: Path) -> None:
    """Broken copies of the kustomize tree: a missing parameter stops the render; a misspelt field in the base
    renders but fails the CRD schema; a misspelt patch path fails both schemas, also in an overlay built on it."""
    tree = copy_deploy(tmp_path)
    params_file = tree / "overlays" / "gpu" / "params.env"
    params_file.write_text("\n".join(line for line in params_file.read_text().splitlines()
                                     if not line.startswith("workerMemory=")) + "\n")
    with pytest.raises(RenderError, match="workerMemory"):
        render(tree / "overlays" / "gpu")

    tree = copy_deploy(tmp_path / "typo")
    base = tree / "base" / "rayservice.yaml"
    base.write_text(base.read_text().replace("enableInTreeAutoscaling:", "enableInTreeAutoScaling:"))
    rayservice = one(render(tree / "overlays" / "cpu-dev"), "RayService")
    assert any(error.startswith("spec.rayClusterConfig:") and "enableInTreeAutoScaling" in error
               for error in crd_errors(rayservice))

    tree = copy_deploy(tmp_path / "patch")
    patch = tree / "overlays" / "gpu" / "gpu-worker.yaml"
    patch.write_text(patch.read_text().replace("/nodeSelector", "/nodeSelecter"))
    rayservice = one(render(tree / "overlays" / "gcs-ft"), "RayService")  # the overlay built on gpu
    assert any("nodeSelecter" in error for error in kubernetes_errors(rayservice))
    assert any("nodeSelecter" in error for error in crd_errors(rayservice))


def test_storage_class_is_a_parameter(tmp_path: Path) -> None:
    for overlay in OVERLAYS:
        pvc = one(rendered(overlay), "PersistentVolumeClaim")
        values = params(overlay if overlay != "gcs-ft" else "gpu")
        assert pvc["spec"]["storageClassName"] == values["storageClassName"]
        assert pvc["spec"]["accessModes"] == [values["accessMode"]]
        assert values["accessMode"] in ("ReadWriteOnce", "ReadWriteMany", "ReadWriteOncePod", "ReadOnlyMany")
        assert pvc["spec"]["resources"]["requests"]["storage"] == values["cacheSize"]
    tree = copy_deploy(tmp_path)
    params_file = tree / "overlays" / "gpu" / "params.env"
    params_file.write_text(params_file.read_text().replace("storageClassName=standard-rwx", "storageClassName=nfs-csi"))
    assert one(render(tree / "overlays" / "gpu"), "PersistentVolumeClaim")["spec"]["storageClassName"] == "nfs-csi"


# -- 2. serveConfigV2 as the Serve controller takes it -------------------------------------------------------


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


_BUILT: dict[str, dict[str, Any]] = {}


@pytest.fixture
def deployments(overlay: str, rayservice: dict[str, Any], no_ray_autoinit: None) -> dict[str, Any]:
    if overlay not in _BUILT:
        _BUILT[overlay] = built_deployments(app_of(rayservice))
    return _BUILT[overlay]


@pytest.fixture
def cluster_config(rayservice: dict[str, Any]) -> Any:
    from deploy.serve_app import cluster_config

    return cluster_config(app_of(rayservice)["args"])


def _known_keys(model: Any) -> set[str]:
    return set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}


def test_serve_config_matches_ray_schema(rayservice: dict[str, Any]) -> None:
    from ray.serve.schema import DeploymentSchema, ServeApplicationSchema, ServeDeploySchema

    serve_config = serve_config_of(rayservice)
    ServeDeploySchema.model_validate(serve_config)
    # Ray's models ignore unknown keys; a misspelt option would silently do nothing.
    assert set(serve_config) <= _known_keys(ServeDeploySchema)
    for app in serve_config["applications"]:
        assert set(app) <= _known_keys(ServeApplicationSchema)
        for deployment in app["deployments"]:
            assert set(deployment) <= _known_keys(DeploymentSchema), deployment["name"]


def test_serve_config_is_the_overlays_file(overlay: str, rayservice: dict[str, Any]) -> None:
    source = overlay if overlay != "gcs-ft" else "gpu"
    assert rayservice["spec"]["serveConfigV2"] == (DEPLOY / "overlays" / source / "serve-config.yaml").read_text()


def test_import_path_names_a_serve_builder(rayservice: dict[str, Any]) -> None:
    from ray._common.utils import import_attr

    app = app_of(rayservice)
    assert ":" in app["import_path"], "import_path must be 'module:attribute'"
    builder = import_attr(app["import_path"])
    # Serve calls a builder with exactly one argument, the `args` mapping.
    assert inspect.isfunction(builder) and len(inspect.signature(builder).parameters) == 1


def expected_deployments(cluster_config: Any) -> set[str]:
    return APP_DEPLOYMENTS if cluster_config.uses_draft_model else APP_DEPLOYMENTS - {"Drafter"}


def test_deployment_names_match_the_app(rayservice: dict[str, Any], deployments: dict[str, Any],
                                        cluster_config: Any) -> None:
    assert set(deployments) == expected_deployments(cluster_config)  # built by the app from these args
    assert {d["name"] for d in app_of(rayservice)["deployments"]} == set(deployments)  # every one configured


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
        assert drafter.resource_dict.get("GPU", 0) == (1 if cluster_config.uses_gpu else 0)
    verifier = deployments["Verifier"].replica_config
    tp = cluster_config.tensor_parallel_size
    if tp == 1:
        assert verifier.placement_group_bundles is None
        assert verifier.resource_dict.get("GPU", 0) == (1 if cluster_config.uses_gpu else 0)
    else:
        bundles = verifier.placement_group_bundles
        assert len(bundles) == 1 + tp and not bundles[0].get("GPU")
        rank_gpus = 1 if cluster_config.uses_gpu else 0
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
    pytest.param(lambda app: app["args"].update(http_port=8001), "http_options.port", id="proxy-field-in-args"),
    pytest.param(lambda app: app["args"].update(host="127.0.0.1"), "loopback", id="loopback-grpc-host"),
    pytest.param(lambda app: app.update(import_path="cluster.serving.app:build_app"), "exactly one parameter",
                 id="two-parameter-builder"),
    pytest.param(lambda app: _deployment(app, "Verifier")["ray_actor_options"].update(num_cpus=1), "first bundle",
                 id="replica-outgrows-bundle-0"),
    pytest.param(lambda app: _deployment(app, "Ingress").update(num_replicas=2), "num_replicas",
                 id="replicas-and-autoscaling"),
])
def test_broken_serve_configs_are_rejected(no_ray_autoinit: None, mutate: Callable[[dict[str, Any]], None],
                                           error: str) -> None:
    broken = copy.deepcopy(app_of(one(rendered("gpu"), "RayService")))
    mutate(broken)
    with pytest.raises((ValueError, TypeError), match=error):
        built_deployments(broken)


# -- 3. consistency between Serve, the pods and the Services -------------------------------------------------


def test_ports_and_grpc_settings(rayservice: dict[str, Any], cluster_config: Any) -> None:
    serve_config = serve_config_of(rayservice)
    head_group = _head(rayservice)
    head = _ports(_ray_container(head_group))
    assert head["serve"] == serve_config["http_options"]["port"]  # KubeRay's serve Service: HTTP
    assert serve_config["http_options"]["host"] == "0.0.0.0"  # reachable from the Service
    assert head["dashboard"] == int(head_group["rayStartParams"].get("dashboard-port", 8265))
    # gRPC: the Ingress replicas' own servers on host:grpc_port; Serve's gRPC proxy off (it would take the port).
    assert not serve_config.get("grpc_options", {}).get("grpc_servicer_functions")
    assert cluster_config.host == "0.0.0.0"
    for _, group in ray_groups(rayservice):
        ports = _ports(_ray_container(group))
        assert ports["serve-grpc"] == cluster_config.grpc_port, group.get("groupName", "head")
        assert ports["serve"] == serve_config["http_options"]["port"]
        assert ports["metrics"] == 8080  # Ray's metrics agent (KubeRay's default metrics-export-port)


def grpc_route_problems(docs: list[dict[str, Any]], deployments: dict[str, Any]) -> list[str]:
    """Why gRPC would not reach the active cluster's gRPC servers only (empty: it does).

    gRPC goes through KubeRay's serve Service, which selects only the active cluster's pods (ray.io/cluster =
    the active RayCluster, ray.io/serve=true) and carries the head container's ports named `serve` and
    `serve-*`. A Service of our own selecting Ray pods by an instance label reached the pending cluster during a
    NewCluster upgrade. The gRPC servers live in the Ingress replicas, so every pod that Service selects must
    run one: the replicas ask for a resource only worker pods advertise, and the head is kept out."""
    problems = []
    rayservice = one(docs, "RayService")
    spec = rayservice["spec"]
    problems += [f"Service {d['metadata']['name']} of our own" for d in docs if d["kind"] == "Service"]
    if spec.get("excludeHeadPodFromServeSvc") is not True:
        problems.append("the head (no Ingress replica, no gRPC server) is in the serve Service")
    if "serveService" in spec:
        problems.append("spec.serveService set: check its ports and that KubeRay still selects the active cluster")
    serving = sorted(n for n in _ports(_ray_container(_head(rayservice))) if n == "serve" or n.startswith("serve-"))
    if serving != ["serve", "serve-grpc"]:
        problems.append(f"the head container's serving ports are {serving}, not serve + serve-grpc")
    if FRONTEND in _head(rayservice).get("resources", {}) or "resources" in _head(rayservice)["rayStartParams"]:
        problems.append(f"the head advertises {FRONTEND} or other custom resources")
    workers = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    advertised = sum(float(g.get("resources", {}).get(FRONTEND, 0)) * g["replicas"] for g in workers)
    if len(workers) != 1 or workers[0]["replicas"] != 1:
        problems.append("more than one worker pod: Serve may leave one without an Ingress replica")
    needed = 0.0
    for name in ON_SERVE_PODS:
        info = deployments[name]
        custom = info.replica_config.resource_dict.get(FRONTEND, 0)
        if custom <= 0:
            problems.append(f"{name} does not ask for {FRONTEND}: it may run on the head")
        config = info.deployment_config
        replicas = config.autoscaling_config.max_replicas if config.autoscaling_config else config.num_replicas
        needed += custom * replicas
    if needed > advertised:
        problems.append(f"{FRONTEND}: the deployments need {needed}, the workers advertise {advertised}")
    return problems


def test_grpc_route_selects_the_active_clusters_serving_pods(docs: list[dict[str, Any]],
                                                            deployments: dict[str, Any]) -> None:
    assert grpc_route_problems(docs, deployments) == []


def _route_via_own_service(docs: list[dict[str, Any]], deployments: dict[str, Any]) -> None:
    docs.append({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "specserve-grpc"},
                 "spec": {"selector": {"app.kubernetes.io/instance": "specserve", "ray.io/serve": "true"}}})


def _ingress_anywhere(docs: list[dict[str, Any]], deployments: dict[str, Any]) -> None:
    replica = deployments["Ingress"].replica_config
    replica.resource_dict.pop(FRONTEND)


@pytest.mark.parametrize(("mutate", "problem"), [
    pytest.param(_route_via_own_service, "Service specserve-grpc of our own", id="own-grpc-service"),
    pytest.param(lambda docs, _: one(docs, "RayService")["spec"].update(excludeHeadPodFromServeSvc=False),
                 "the head", id="head-in-serve-service"),
    pytest.param(lambda docs, _: _ray_container(_head(one(docs, "RayService")))["ports"][4].update(name="grpc"),
                 "serving ports are ['serve']", id="grpc-port-not-serve-prefixed"),
    pytest.param(_ingress_anywhere, "Ingress does not ask", id="ingress-not-pinned"),
    pytest.param(lambda docs, _: _worker(one(docs, "RayService"))["resources"].update({FRONTEND: "2"}),
                 "the workers advertise 2.0", id="too-few-frontend-units"),
])
def test_broken_grpc_routes_are_found(no_ray_autoinit: None, mutate: Callable[[list[dict[str, Any]], Any], None],
                                      problem: str) -> None:
    docs = rendered("gpu")
    deployments = copy.deepcopy(_BUILT.get("gpu") or built_deployments(app_of(one(docs, "RayService"))))
    mutate(docs, deployments)
    problems = grpc_route_problems(docs, deployments)
    assert any(problem in p for p in problems), problems


def test_gpus_and_cpus_cover_the_deployments(rayservice: dict[str, Any], deployments: dict[str, Any],
                                             cluster_config: Any) -> None:
    head_group = _head(rayservice)
    assert "nvidia.com/gpu" not in _ray_container(head_group)["resources"].get("limits", {})
    assert head_group["rayStartParams"].get("num-gpus", "0") == "0"
    assert head_group["rayStartParams"]["num-cpus"] == "0"  # nothing that asks for a CPU lands on the head
    worker_group = _worker(rayservice)
    resources = _ray_container(worker_group)["resources"]
    pod_gpus = int(resources["limits"].get("nvidia.com/gpu", 0))
    assert int(resources["requests"].get("nvidia.com/gpu", 0)) == pod_gpus
    pod_cpus = _cpus(worker_group["rayStartParams"].get("num-cpus", resources["limits"]["cpu"]))
    assert worker_group["minReplicas"] <= worker_group["replicas"] <= worker_group["maxReplicas"]

    verifier = deployments["Verifier"].replica_config
    bundles = verifier.placement_group_bundles or [verifier.resource_dict]
    verifier_gpus = sum(bundle.get("GPU", 0) for bundle in bundles)
    verifier_cpus = sum(bundle.get("CPU", 0) for bundle in bundles)
    if verifier.placement_group_strategy == "STRICT_PACK" or verifier.placement_group_bundles is None:
        assert verifier_gpus <= pod_gpus and verifier_cpus <= pod_cpus  # the whole group on one pod
    others = [info.replica_config.resource_dict for name, info in deployments.items() if name != "Verifier"]
    need_gpus = verifier_gpus + sum(r.get("GPU", 0) for r in others)
    need_cpus = verifier_cpus + sum(r.get("CPU", 0) for r in others)
    if cluster_config.uses_gpu:  # one per verifier rank + the drafter's: distinct GPUs
        assert need_gpus == cluster_config.tensor_parallel_size + int(cluster_config.uses_draft_model) == pod_gpus
    else:
        assert need_gpus == pod_gpus == 0
    assert need_cpus <= pod_cpus * worker_group["replicas"]
    assert worker_group["replicas"] == 1  # one app = one drafter + one verifier group: nothing to spread
    if pod_gpus:
        spec = worker_group["template"]["spec"]
        assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]


def test_worker_threads_follow_the_worker_cpu_limit(rayservice: dict[str, Any], cluster_config: Any) -> None:
    """serveConfigV2 sets worker_threads explicitly: the builder runs in a Ray task on whichever pod Serve picks
    (often the head, with other CPU limits), so the cgroup quota it would read is not the worker's."""
    assert cluster_config.worker_threads > 0
    overlap = cluster_config.overlap_decision(in_process=False).enabled  # auto: the gpu overlay's own GPUs say on
    concurrent = cluster_config.tensor_parallel_size + int(cluster_config.uses_draft_model and overlap)
    limit = _cpus(_ray_container(_worker(rayservice))["resources"]["limits"]["cpu"])
    assert cluster_config.worker_threads * concurrent <= limit
    if not cluster_config.uses_gpu:  # CPU compute: use the pod's CPUs, not fewer
        assert (cluster_config.worker_threads + 1) * concurrent > limit


def test_pod_lifecycle_is_kuberays(rayservice: dict[str, Any], cluster_config: Any) -> None:
    """KubeRay's own probes (raylet + Serve proxy, every 5 s) and its /dev/shm (sized to the memory limit)."""
    for _, group in ray_groups(rayservice):
        spec = group["template"]["spec"]
        assert spec["terminationGracePeriodSeconds"] > (cluster_config.graceful_shutdown_timeout_s
                                                        + cluster_config.graceful_shutdown_wait_loop_s)
        for container in spec["containers"]:
            assert not {"readinessProbe", "livenessProbe", "startupProbe"} & set(container), container["name"]
            assert all(mount["mountPath"] != "/dev/shm" for mount in container.get("volumeMounts", []))
        assert "plasma-directory" not in group["rayStartParams"]


def test_model_cache_and_image(overlay: str, docs: list[dict[str, Any]], rayservice: dict[str, Any],
                               cluster_config: Any) -> None:
    pvc = one(docs, "PersistentVolumeClaim")
    models = {cluster_config.model} | ({cluster_config.draft} if cluster_config.uses_draft_model else set())
    spec = _worker(rayservice)["template"]["spec"]
    volumes = {volume["name"]: volume for volume in spec["volumes"]}
    assert volumes["model-cache"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    (prepare,) = spec["initContainers"]
    assert prepare["command"][:3] == ["python", "-m", "deploy.prepare_models"]
    env = {item["name"]: item.get("value") for item in prepare["env"]}
    assert models <= set(env["SPECSERVE_MODELS"].split()), env  # the cache is filled before Ray starts
    version = pyproject()["project"]["version"]
    image = _ray_container(_head(rayservice))["image"]
    assert image.endswith(f"specserve:{version}")
    for container in (prepare, *spec["containers"]):
        env = {item["name"]: item.get("value") for item in container.get("env", [])}
        mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
        assert env["SPECSERVE_CACHE"] == mounts["model-cache"], container["name"]
        assert container["image"] == image and container["imagePullPolicy"] == "IfNotPresent"
    for _, group in ray_groups(rayservice):  # the builder module is not part of the installed package
        env = {item["name"]: item.get("value") for item in _ray_container(group).get("env", [])}
        assert env.get("PYTHONPATH") == "/opt/specserve"
    if rayservice["spec"]["upgradeStrategy"]["type"] == "NewCluster" and overlay != "cpu-dev":
        # the new cluster's worker mounts the cache while the old one runs, maybe on another node
        assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def test_parameters_reach_the_pods(overlay: str, rayservice: dict[str, Any]) -> None:
    values = params(overlay if overlay != "gcs-ft" else "gpu")
    head = _ray_container(_head(rayservice))["resources"]
    assert head["limits"]["cpu"] == values["headCPU"] and head["limits"]["memory"] == values["headMemory"]
    spec = _worker(rayservice)["template"]["spec"]
    for container in (*spec["initContainers"], *spec["containers"]):  # init = worker: Guaranteed, nothing extra
        limits = container["resources"]["limits"]
        assert limits["cpu"] == values["workerCPU"] and limits["memory"] == values["workerMemory"], container["name"]


def test_access_parameters_reach_the_manifests(overlay: str, docs: list[dict[str, Any]],
                                               rayservice: dict[str, Any]) -> None:
    """The Ray token's Secret, the API keys' Secret mounted where serveConfigV2's api_key_file reads, and the
    namespaces the NetworkPolicy admits: all from params.env (docs/security.md)."""
    values = params(overlay if overlay != "gcs-ft" else "gpu")
    assert rayservice["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token",
                                                                     "secretName": values["rayAuthSecret"]}
    spec = _worker(rayservice)["template"]["spec"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "api-keys"]
    assert volume["secret"]["secretName"] == values["apiKeySecret"]
    (mount,) = [m for m in _ray_container(_worker(rayservice))["volumeMounts"] if m["name"] == "api-keys"]
    assert mount["readOnly"] is True
    key_file = Path(app_of(rayservice)["args"]["api_key_file"])
    assert key_file.parent == Path(mount["mountPath"]) and key_file.name == "keys"
    rules = one(docs, "NetworkPolicy")["spec"]["ingress"]
    admitted = [rule["from"][0]["namespaceSelector"]["matchExpressions"][0]["values"][0] for rule in rules[2:]]
    assert admitted == [values["monitoringNamespace"], values["kuberayNamespace"]]


def test_upgrade_settings(rayservice: dict[str, Any], cluster_config: Any) -> None:
    spec = rayservice["spec"]
    assert spec["upgradeStrategy"]["type"] == "NewCluster"
    assert spec["rayClusterDeletionDelaySeconds"] >= cluster_config.graceful_shutdown_timeout_s
    assert spec["rayClusterConfig"]["rayVersion"] == "2.60.0"
    assert spec["rayClusterConfig"]["enableInTreeAutoscaling"] is False


def test_gcs_fault_tolerance_overlay() -> None:
    spec = one(rendered("gcs-ft"), "RayService")["spec"]["rayClusterConfig"]
    options = spec["gcsFaultToleranceOptions"]
    values = dict(line.split("=", 1) for line in (DEPLOY / "overlays" / "gcs-ft" / "params.env").read_text()
                  .splitlines() if line.strip() and not line.startswith("#"))
    assert options["redisAddress"] == values["redisAddress"]
    assert options["redisPassword"]["valueFrom"]["secretKeyRef"] == {"name": values["redisPasswordSecret"],
                                                                     "key": "password"}
    assert "gcsFaultToleranceOptions" not in one(rendered("gpu"), "RayService")["spec"]["rayClusterConfig"]


def pod_labels(group_name: str, group: dict[str, Any]) -> dict[str, str]:
    """The labels a group's pods carry: the template's, plus the ones KubeRay adds (ray.io/node-type, ...)."""
    return {**group["template"]["metadata"]["labels"],
            "ray.io/node-type": "head" if group_name == "head" else "worker", "ray.io/group": group_name}


def selected(monitor: dict[str, Any], rayservice: dict[str, Any]) -> list[str]:
    labels = monitor["spec"]["selector"]["matchLabels"]
    return [name for name, group in ray_groups(rayservice) if labels.items() <= pod_labels(name, group).items()]


def test_podmonitors_scrape_the_app_once_and_ray_everywhere(overlay: str, docs: list[dict[str, Any]],
                                                            rayservice: dict[str, Any]) -> None:
    if overlay == "cpu-dev":
        pytest.skip("cpu-dev leaves out components/monitoring (kind/minikube usually lack the Prometheus CRDs)")
    monitors = {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == "PodMonitor"}
    assert set(monitors) == {"specserve", "specserve-ray"}
    # The application's /metrics: one target per cluster (the worker), since every proxy answers the same registry.
    app = monitors["specserve"]
    assert selected(app, rayservice) == ["workers"]
    (app_endpoint,) = app["spec"]["podMetricsEndpoints"]
    assert app_endpoint["path"] == "/metrics"
    assert app_endpoint["port"] in _ports(_ray_container(_worker(rayservice)))
    assert serve_config_of(rayservice)["http_options"]["port"] == _ports(_ray_container(_worker(rayservice)))["serve"]
    # Ray's metrics agent on every Ray pod.
    ray_monitor = monitors["specserve-ray"]
    assert selected(ray_monitor, rayservice) == ["head", "workers"]
    (ray_endpoint,) = ray_monitor["spec"]["podMetricsEndpoints"]
    assert all(ray_endpoint["port"] in _ports(_ray_container(group)) for _, group in ray_groups(rayservice))
    for endpoint in (app_endpoint, ray_endpoint):
        targets = {r["targetLabel"] for r in endpoint["relabelings"]}
        assert "ray_io_cluster" in targets  # two clusters run during an upgrade
        assert "kv_namespace" in {r.get("targetLabel") for r in endpoint["metricRelabelings"]}
    dashboard = one(docs, "ConfigMap")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    (text,) = dashboard["data"].values()
    assert json.loads(text) == json.loads((DEPLOY / "components" / "monitoring" / "grafana-dashboard.json").read_text())


def test_broken_podmonitor_selection_is_found(no_ray_autoinit: None) -> None:
    docs = rendered("gpu")
    rayservice = one(docs, "RayService")
    app = [doc for doc in docs if doc["kind"] == "PodMonitor" and doc["metadata"]["name"] == "specserve"][0]
    del app["spec"]["selector"]["matchLabels"]["ray.io/node-type"]
    assert selected(app, rayservice) == ["head", "workers"]  # the head's proxy too: every sum doubled
    app["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"] = "other"
    assert selected(app, rayservice) == []
