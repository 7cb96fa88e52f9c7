"""docker-compose.yml, its GPU override, Prometheus and Grafana files: each deployment rule, asserted.

No Docker engine here: the files are parsed with PyYAML and checked against the rules of issue 9.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
REPLICAS = ("chatserve-1", "chatserve-2")


def _load(name: str) -> dict:
    return yaml.safe_load((ROOT / name).read_text())


@pytest.fixture(scope="module")
def compose() -> dict:
    return _load("docker-compose.yml")


@pytest.fixture(scope="module")
def svc(compose) -> dict:
    return compose["services"]


def _seconds(v: str | int) -> float:
    m = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", str(v))
    assert m and any(m.groups()), v
    return int(m.group(1) or 0) * 60 + int(m.group(2) or 0)


def _env(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(e.split("=", 1) for e in env)
    return {k: str(v) for k, v in env.items()}


def _internal(compose: dict, nets: list[str]) -> bool:
    return all((compose["networks"].get(n) or {}).get("internal") is True for n in nets)


def test_redis_internal_password_and_persistence(compose, svc):
    r = svc["redis"]
    assert "ports" not in r, "redis must not publish a port"
    assert r["networks"] and _internal(compose, r["networks"])
    cmd = " ".join(r["command"]) if isinstance(r["command"], list) else r["command"]
    assert "--requirepass" in cmd and "--appendonly yes" in cmd
    assert "$$REDIS_PASSWORD" in cmd  # expanded in the container, not written in the file
    assert _env(r)["REDIS_PASSWORD"].startswith("${REDIS_PASSWORD:?")
    vol, _, target = r["volumes"][0].partition(":")
    assert target == "/data" and vol in compose["volumes"], "AOF on a named volume"
    assert "ping" in r["healthcheck"]["test"]


def test_replicas_depend_on_healthy_redis_and_drain(compose, svc):
    chatserves = [n for n in svc if n.startswith("chatserve")]
    assert len(chatserves) >= 2 or svc["chatserve"]["deploy"]["replicas"] >= 2
    for name in REPLICAS:
        s = svc[name]
        assert s["depends_on"]["redis"]["condition"] == "service_healthy"
        assert "/ready" in " ".join(s["healthcheck"]["test"])
        drain = float(_env(s).get("CHATSERVE_DRAIN_TIMEOUT", 30))
        assert _seconds(s["stop_grace_period"]) > drain
        assert s["init"] is True and s.get("stop_signal", "SIGTERM") == "SIGTERM"
        assert "ports" not in s, "replicas are reached through the proxy only"
        assert "redis" in s["networks"] or "data" in s["networks"]
        url = _env(s)["CHATSERVE_REDIS_URL"]
        assert re.fullmatch(r"redis://:\$\{REDIS_PASSWORD:\?[^}]*\}@redis:6379/\d+", url), url
        assert _env(s)["CHATSERVE_SESSION_SECRET"].startswith("${"), "one secret shared by the replicas"
        assert (ROOT / s["build"]["dockerfile"]).is_file()
    # the replicas share one network with redis and nothing else shares it
    data_nets = set(svc["redis"]["networks"])
    for name, s in svc.items():
        if set(s.get("networks", [])) & data_nets:
            assert name == "redis" or name in REPLICAS, name


def test_config_env_names_exist():
    """Every CHATSERVE_* variable the compose files set is a real config field."""
    from dataclasses import fields

    from chatserve.config import CacheConfig, ModelConfig, SchedulerConfig, ServerConfig

    known = {f"CHATSERVE_{f.name.upper()}" for c in (CacheConfig, ModelConfig, SchedulerConfig, ServerConfig)
             for f in fields(c)}
    for name in ("docker-compose.yml", "docker-compose.gpu.yml"):
        for sname, s in _load(name)["services"].items():
            if not sname.startswith("chatserve"):
                continue  # the proxy's CHATSERVE_* names belong to haproxy.cfg
            for k in _env(s):
                if k.startswith("CHATSERVE_"):
                    assert k in known, (name, k)


def test_proxy_affinity_config_matches_compose(compose, svc):
    p = svc["proxy"]
    assert p["ports"], "the proxy is the published entry point"
    assert not _internal(compose, [n for n in p["networks"] if n != "backend"])
    src, _, dst = p["volumes"][0].partition(":")
    cfg_path = ROOT / src
    cfg = cfg_path.read_text()
    assert dst.startswith("/usr/local/etc/haproxy/haproxy.cfg")
    used = set(re.findall(r"\$\{(\w+)\}", cfg))
    env = _env(p)
    assert used <= set(env), f"haproxy.cfg needs {used - set(env)}"
    replicas = [v for k, v in env.items() if k.startswith("CHATSERVE_REPLICA_")]
    assert sorted(replicas) == [f"{n}:8000" for n in REPLICAS]
    for rule in ("balance hash var(txn.sid)", "hash-type consistent", "option httpchk GET /ready",
                 "http-check expect status 200", "option redispatch", "retries 2", "retry-on conn-failure empty-response 503",
                 "path,field(4,/)", "req.hdr(x-session-id)", "req.cook(chatserve_uid)"):
        assert rule in cfg, rule
    servers = re.findall(r"^\s*server\s+(\S+)\s+\"\$\{(\w+)\}\"", cfg, re.M)
    assert len(servers) == len(REPLICAS)
    assert re.search(r"default-server .*\bcheck\b", cfg)
    assert re.search(r"timeout server\s+\d+m", cfg), "SSE streams outlive the default timeouts"


def test_monitoring_profile(compose, svc):
    for name in ("prometheus", "grafana"):
        assert svc[name]["profiles"] == ["monitoring"]
        for port in svc[name].get("ports", []):
            assert str(port).startswith("127.0.0.1:"), "dashboards stay on localhost"
    prom = _load("docker/prometheus.yml")
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    targets = jobs["chatserve"]["static_configs"][0]["targets"]
    assert sorted(targets) == [f"{n}:8000" for n in REPLICAS] and jobs["chatserve"]["metrics_path"] == "/metrics"
    mounts = " ".join(svc["grafana"]["volumes"])
    assert "docker/grafana/provisioning" in mounts and "docker/grafana/dashboards" in mounts


def test_grafana_dashboard_panels_use_real_metrics():
    ds = _load("docker/grafana/provisioning/datasources/prometheus.yml")["datasources"][0]
    prov = _load("docker/grafana/provisioning/dashboards/chatserve.yml")["providers"][0]
    assert prov["options"]["path"] == "/var/lib/grafana/dashboards"
    dash = json.loads((ROOT / "docker/grafana/dashboards/chatserve.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert all(t["datasource"]["uid"] == ds["uid"] for p in dash["panels"] for t in p["targets"])
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for word in ("kv cache", "prefix", "first token", "tokens per second", "queue"):
        assert word in titles, word
    names = {n for e in exprs for n in re.findall(r"chatserve:[a-z_]+", e)}
    for need in ("chatserve:kv_cache_usage_perc", "chatserve:prefix_cache_hits_total",
                 "chatserve:time_to_first_token_seconds_bucket", "chatserve:generation_tokens_total",
                 "chatserve:num_requests_waiting"):
        assert need in names, need
    text = (ROOT / "chatserve/server/metrics.py").read_text()
    for n in names:  # each series the dashboard reads is one the server exports
        base = re.sub(r"_(total|bucket|sum|count)$", "", n).removeprefix("chatserve:")
        assert f'"{base}"' in text or f"chatserve:{base}" in text, n


def test_gpu_override():
    gpu = _load("docker-compose.gpu.yml")["services"]
    assert set(REPLICAS) <= set(gpu)
    for name in REPLICAS:
        s = gpu[name]
        assert s["build"]["dockerfile"] == "docker/Dockerfile.cuda" and (ROOT / s["build"]["dockerfile"]).is_file()
        dev = s["deploy"]["resources"]["reservations"]["devices"][0]
        assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"]
        assert _env(s)["CHATSERVE_DEVICE"] == "cuda"


def test_interpolation_only_known_forms():
    """${VAR}, ${VAR:-default}, ${VAR:?message} and $$ escapes only: nothing compose would misread."""
    for name in ("docker-compose.yml", "docker-compose.gpu.yml"):
        text = (ROOT / name).read_text()
        body = "\n".join(l for l in text.splitlines() if not l.lstrip().startswith("#"))
        body = body.replace("$$", "")
        for m in re.finditer(r"\$(\{[^}]*\}|\w+)?", body):
            assert re.fullmatch(r"\$\{\w+(:[-?][^}]*)?\}", m.group(0)), (name, m.group(0))


def test_redis_runs_as_its_own_user(svc):
    """The `sh -c` command bypasses the image's drop from root, so compose names the user."""
    assert svc["redis"].get("user") not in (None, "root", "0", "0:0")


def test_kernel_cache_on_a_named_volume(compose, svc):
    """A recreated replica finds its compiled kernels (C or Triton) instead of recompiling."""
    dockerfile = (ROOT / "docker/Dockerfile").read_text()
    cache = re.search(r"CHATSERVE_CACHE_DIR=(\S+)", dockerfile).group(1)
    for name in REPLICAS:
        mounts = [v.split(":") for v in svc[name].get("volumes", [])]
        assert any(src in compose["volumes"] and dst == cache for src, dst, *_ in mounts), name


def test_keyless_api_stays_on_loopback_and_grafana_password_from_env(svc):
    """Issue 14 items 3 and 8: the published API binds 127.0.0.1 unless the operator says otherwise,
    keys come from .env, and Grafana's admin password must be set there (no admin/admin)."""
    ports = [str(p) for p in svc["proxy"]["ports"]]
    assert ports and all(p.startswith("${CHATSERVE_BIND:-127.0.0.1}:") for p in ports), ports
    for name in REPLICAS:
        assert _env(svc[name])["CHATSERVE_API_KEYS"].startswith("${CHATSERVE_API_KEYS")
    pw = _env(svc["grafana"])["GF_SECURITY_ADMIN_PASSWORD"]
    assert pw.startswith("${GRAFANA_ADMIN_PASSWORD:?"), pw
