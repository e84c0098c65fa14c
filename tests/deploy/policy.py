"""A small policy check over rendered manifests: the rules an admission policy (Pod Security "restricted",
checkov's Kubernetes checks) would hold these pods to, for the pods inside a RayService.

checkov (3.3.30) was measured and left out: it cannot share the virtualenv (it pins networkx 2.6.3, packaging
23.2 and pydantic 2.14.4 against this project's 3.6.1, 26.4 and 2.14.3), and it does not look inside a
RayService: on the rendered gpu overlay it ran one check, on the ConfigMap (deploy/README.md, "Validation").
The rules here are the ones that matter for these pods, each a few lines:

  resources      every container (init containers too) sets cpu and memory limits, requests equal to limits
                 (Guaranteed QoS, which the manifests claim)
  non-root       runAsNonRoot (pod or container), no uid 0
  escalation     allowPrivilegeEscalation: false on every container, not privileged, capabilities drop ALL and
                 add none, a seccomp profile (RuntimeDefault or Localhost)
  host           no hostNetwork / hostPID / hostIPC, no hostPath volumes, no service account token mounted
  image          a tag that is not `latest`, an explicit imagePullPolicy
  ray auth       every RayService enables Ray token authentication: KubeRay `authOptions.mode: token`, or (older
                 KubeRay) RAY_AUTH_MODE=token and RAY_AUTH_TOKEN from a Secret on every Ray container
  network        a NetworkPolicy selects the RayService's pods for Ingress; a rule open to anyone (no `from`, an
                 ipBlock, an empty namespaceSelector) names ports, all of them serve ports (the containers' ports
                 named `serve` / `serve-*`); a rule for every port admits only the RayService's own pods; a rule
                 for another namespace names its ports
"""

from __future__ import annotations

from typing import Any

from tests.deploy.rendering import ray_groups

__all__ = ["pod_templates", "violations"]

SECCOMP_TYPES = ("RuntimeDefault", "Localhost")


def pod_templates(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(where, pod template) of every pod the documents define (the RayService's groups here)."""
    templates = []
    for doc in docs:
        if doc["kind"] == "RayService":
            name = doc["metadata"]["name"]
            templates += [(f"{name}/{group_name}", group["template"]) for group_name, group in ray_groups(doc)]
        elif doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            templates.append((f"{doc['kind']}/{doc['metadata']['name']}", doc["spec"]["template"]))
        elif doc["kind"] == "Pod":
            templates.append((f"Pod/{doc['metadata']['name']}", {"spec": doc["spec"]}))
    return templates


def _container_violations(where: str, container: dict[str, Any], pod: dict[str, Any]) -> list[str]:
    problems = []
    resources = container.get("resources", {})
    limits, requests = resources.get("limits", {}), resources.get("requests", {})
    for resource in ("cpu", "memory"):
        if resource not in limits:
            problems.append(f"{where}: no {resource} limit")
        elif str(requests.get(resource, limits[resource])) != str(limits[resource]):
            problems.append(f"{where}: {resource} request {requests[resource]} != limit {limits[resource]} "
                            "(not Guaranteed QoS)")
    pod_security = pod.get("securityContext", {})
    security = container.get("securityContext", {})
    if not security.get("runAsNonRoot", pod_security.get("runAsNonRoot", False)):
        problems.append(f"{where}: runAsNonRoot not set")
    if security.get("runAsUser", pod_security.get("runAsUser")) == 0:
        problems.append(f"{where}: runs as uid 0")
    if security.get("allowPrivilegeEscalation") is not False:
        problems.append(f"{where}: allowPrivilegeEscalation is not false")
    if security.get("privileged"):
        problems.append(f"{where}: privileged")
    capabilities = security.get("capabilities", {})
    if "ALL" not in capabilities.get("drop", []):
        problems.append(f"{where}: capabilities do not drop ALL")
    if capabilities.get("add"):
        problems.append(f"{where}: adds capabilities {capabilities['add']}")
    seccomp = security.get("seccompProfile", pod_security.get("seccompProfile", {}))
    if seccomp.get("type") not in SECCOMP_TYPES:
        problems.append(f"{where}: no seccomp profile ({' or '.join(SECCOMP_TYPES)})")
    image = container.get("image", "")
    tag = image.rsplit("/", 1)[-1].partition("@")[0].partition(":")[2]
    if not tag and "@" not in image or tag == "latest":
        problems.append(f"{where}: image {image!r} has no pinned tag")
    if "imagePullPolicy" not in container:
        problems.append(f"{where}: no imagePullPolicy")
    return problems


def _ray_auth_violations(rayservice: dict[str, Any]) -> list[str]:
    name = rayservice["metadata"]["name"]
    if rayservice["spec"]["rayClusterConfig"].get("authOptions", {}).get("mode") == "token":
        return []
    problems = []
    for group_name, group in ray_groups(rayservice):
        for container in group["template"]["spec"]["containers"]:
            env = {item["name"]: item for item in container.get("env", [])}
            mode = env.get("RAY_AUTH_MODE", {}).get("value")
            token = env.get("RAY_AUTH_TOKEN", {}).get("valueFrom", {}).get("secretKeyRef")
            if mode != "token" or not token:
                problems.append(f"{name}/{group_name}/{container['name']}: Ray token auth not enabled "
                                "(authOptions.mode: token, or RAY_AUTH_MODE=token and RAY_AUTH_TOKEN from a Secret)")
    return problems


def serve_ports(rayservice: dict[str, Any]) -> set[int | str]:
    """The ports KubeRay's serve Service carries: the Ray containers' ports named `serve` and `serve-*`."""
    ports: set[int | str] = set()
    for _, group in ray_groups(rayservice):
        for container in group["template"]["spec"]["containers"]:
            for port in container.get("ports", []):
                if port.get("name") == "serve" or port.get("name", "").startswith("serve-"):
                    ports |= {port["containerPort"], port["name"]}
    return ports


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector (matchLabels only here; matchExpressions are not used for pods) matches `labels`."""
    if selector.get("matchExpressions"):
        return False
    return all(labels.get(key) == value for key, value in selector.get("matchLabels", {}).items())


def _network_violations(rayservice: dict[str, Any], policies: list[dict[str, Any]]) -> list[str]:
    name = rayservice["metadata"]["name"]
    pod_labels = [group["template"].get("metadata", {}).get("labels", {}) for _, group in ray_groups(rayservice)]
    governing = [policy for policy in policies if "Ingress" in policy["spec"].get("policyTypes", ["Ingress"])
                 and all(_selects(policy["spec"].get("podSelector", {}), labels) for labels in pod_labels)]
    if not governing:
        return [f"{name}: no NetworkPolicy selects its pods for Ingress (every port open to every pod)"]
    allowed = serve_ports(rayservice)
    problems = []
    for policy in governing:
        where = f"NetworkPolicy/{policy['metadata']['name']}"
        for index, rule in enumerate(policy["spec"].get("ingress", [])):
            peers = rule.get("from", [])
            ports = [port.get("port") for port in rule.get("ports", [])]
            anyone = not peers or any("ipBlock" in peer or peer.get("namespaceSelector") == {} for peer in peers)
            own_pods_only = bool(peers) and all(set(peer) == {"podSelector"} and all(
                _selects(peer["podSelector"], labels) for labels in pod_labels) for peer in peers)
            if anyone and (not ports or not set(ports) <= allowed):
                problems.append(f"{where} rule {index}: open to anyone on {ports or 'every port'}, not only the "
                                f"serve ports {sorted(p for p in allowed if isinstance(p, int))}")
            elif not ports and not own_pods_only:
                problems.append(f"{where} rule {index}: every port, to peers other than the RayService's own pods")
    return problems


def violations(docs: list[dict[str, Any]]) -> list[str]:
    problems = []
    policies = [doc for doc in docs if doc["kind"] == "NetworkPolicy"]
    for doc in docs:
        if doc["kind"] == "RayService":
            problems += _ray_auth_violations(doc) + _network_violations(doc, policies)
    for where, template in pod_templates(docs):
        pod = template["spec"]
        for field in ("hostNetwork", "hostPID", "hostIPC"):
            if pod.get(field):
                problems.append(f"{where}: {field}")
        for volume in pod.get("volumes", []):
            if "hostPath" in volume:
                problems.append(f"{where}: hostPath volume {volume['name']}")
        if pod.get("automountServiceAccountToken", True):
            problems.append(f"{where}: mounts a service account token (automountServiceAccountToken)")
        for container in (*pod.get("initContainers", []), *pod.get("containers", [])):
            problems += _container_violations(f"{where}/{container['name']}", container, pod)
    return problems
