#!/usr/bin/env python3
"""Helpers for .ci/deploy-checks.sh: policy checks of the assembled deploy files.

Subcommands (run from the repository root, with PyYAML importable):

  check MANIFESTS       the policy checks that a schema cannot express, over
                        `kubectl kustomize deploy/k8s` (the example app plus the
                        llm-sidecar component) and the files kept outside the
                        kustomization (Secret template, PodMonitor, NetworkPolicy)
                        and the Dockerfile
  component INPUT OUT   the llm-sidecar component on a Deployment it did not write:
                        INPUT holds the Deployments as written, OUT the kustomize
                        output with the component; the labelled ones must have the
                        sidecar and nothing else changed, the others no change
  context OUTDIR        copy the Docker build context (the files .dockerignore lets
                        through) into OUTDIR, to build the wheel as the image does
  same A B              exit 1 unless two multi-document YAML files hold the same objects

Assembling is kustomize's job (`kubectl kustomize`, pinned in .ci/deploy-checks.sh):
the sidecar's ConfigMap comes from a configMapGenerator over deploy/k8s/sidecar.toml,
its one source.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tomllib
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped,unused-ignore]

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
TOML_PATH = K8S / "sidecar.toml"
SECRET_PATH = K8S / "secret.example.yaml"
PODMONITOR_PATH = K8S / "podmonitor.yaml"
NETWORKPOLICY_PATH = K8S / "networkpolicy.yaml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
LOCK_NAME = "requirements.lock"

CONFIG_DIR = "/etc/sidecar"
CONFIG_FILE = f"{CONFIG_DIR}/sidecar.toml"
CONFIGMAP_NAME = "sidecar-config"
CONFIGMAP_KEY = "sidecar.toml"
UID = 10001
ADMIN_PORT = 9090
PROXY_PORT = 8080
SIDECAR_NAME = "llm-sidecar"
SECRET_NAME = "llm-provider-keys"
# The component's contract (deploy/k8s/components/llm-sidecar): the Deployment label
# that asks for the sidecar, and the pod label it puts on the pods it changed.
INJECT_LABEL = "llm-circuit-sidecar/inject"
INJECTED_LABEL = "llm-circuit-sidecar/injected"
SIDECAR_VOLUMES = ("sidecar-config", "sidecar-tmp")
# CPU: a request and no limit (CFS throttling; docs/kubernetes.md, "CPU").
SIDECAR_RESOURCES = {"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}}


class Failures:
    def __init__(self) -> None:
        self.items: list[str] = []
        self.passed = 0

    def check(self, ok: bool, what: str) -> bool:
        if ok:
            self.passed += 1
        else:
            self.items.append(what)
        return ok


def load_docs(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def key_of(doc: dict[str, Any]) -> tuple[str, str, str]:
    meta = doc.get("metadata") or {}
    return (str(doc.get("apiVersion")), str(doc.get("kind")), str(meta.get("name")))


# --------------------------------------------------------------------------- policy


def host_port(value: Any) -> tuple[str, int] | None:
    if not isinstance(value, str) or ":" not in value:
        return None
    host, _, port = value.rpartition(":")
    return (host.strip("[]"), int(port)) if port.isdigit() else None


def container_sc_ok(f: Failures, where: str, c: dict[str, Any], pod_sc: dict[str, Any]) -> None:
    sc = c.get("securityContext") or {}

    def eff(key: str) -> Any:
        return sc.get(key, pod_sc.get(key))

    f.check(eff("runAsNonRoot") is True, f"{where}: runAsNonRoot must be true")
    f.check(eff("runAsUser") == UID, f"{where}: runAsUser must be {UID}")
    f.check(sc.get("readOnlyRootFilesystem") is True, f"{where}: readOnlyRootFilesystem")
    f.check(sc.get("allowPrivilegeEscalation") is False, f"{where}: allowPrivilegeEscalation")
    f.check(sc.get("privileged") in (None, False), f"{where}: privileged")
    f.check(
        (sc.get("capabilities") or {}).get("drop") == ["ALL"],
        f"{where}: capabilities.drop must be [ALL]",
    )
    f.check(not (sc.get("capabilities") or {}).get("add"), f"{where}: capabilities.add")
    seccomp = (eff("seccompProfile") or {}).get("type")
    f.check(seccomp == "RuntimeDefault", f"{where}: seccompProfile RuntimeDefault")


def probe_ok(f: Failures, where: str, probe: Any, path: str, port_names: dict[str, int]) -> None:
    get = (probe or {}).get("httpGet") or {}
    port = get.get("port")
    port = port_names.get(port, port) if isinstance(port, str) else port
    f.check(
        get.get("path") == path and port == ADMIN_PORT,
        f"{where}: must be httpGet {path} on the admin port {ADMIN_PORT} (got {get})",
    )


def check_toml(f: Failures) -> dict[str, Any]:
    cfg = tomllib.loads(TOML_PATH.read_text(encoding="utf-8"))
    server = cfg.get("server") or {}
    f.check(
        host_port(server.get("listen")) == ("127.0.0.1", PROXY_PORT),
        f'sidecar.toml: server.listen must be "127.0.0.1:{PROXY_PORT}" (loopback only)',
    )
    admin = host_port(server.get("admin_listen"))
    f.check(
        admin is not None and admin[1] == ADMIN_PORT and admin[0] in ("0.0.0.0", "::", ""),
        f"sidecar.toml: server.admin_listen must listen on all interfaces, port {ADMIN_PORT}",
    )
    ups = cfg.get("upstreams") or {}
    for name in ("openai", "anthropic"):
        up = ups.get(name) or {}
        f.check(bool(up.get("api_key_env")), f"sidecar.toml: upstreams.{name}.api_key_env")
        f.check("circuit_breaker" in up, f"sidecar.toml: upstreams.{name}.circuit_breaker")
        f.check("retry" in up, f"sidecar.toml: upstreams.{name}.retry")
    routes = {r.get("path_prefix"): r for r in cfg.get("routes") or [] if not r.get("models")}
    msgs = routes.get("/v1/messages") or {}
    f.check(
        [c.get("upstream") for c in msgs.get("candidates") or []][:1] == ["anthropic"],
        "sidecar.toml: /v1/messages must route to anthropic",
    )
    f.check(
        [c.get("upstream") for c in (routes.get("/v1/") or {}).get("candidates") or []][:1]
        == ["openai"],
        "sidecar.toml: /v1/ must route to openai",
    )
    f.check(
        any(
            r.get("path_prefix") == "/v1/"
            and len(r.get("candidates") or []) > 1
            and (r["candidates"][0] or {}).get("upstream") == "openai"
            for r in cfg.get("routes") or []
        ),
        "sidecar.toml: a /v1/ route to openai must have a fallback candidate",
    )
    secret_like = re.compile(r"(sk-[A-Za-z0-9_-]{10,}|sk-ant-)")
    f.check(
        not secret_like.search(TOML_PATH.read_text(encoding="utf-8")),
        "sidecar.toml: looks like it holds an API key",
    )
    return cfg


def check_dockerfile(f: Failures) -> None:
    text = DOCKERFILE.read_text(encoding="utf-8")
    joined = re.sub(r"\\\n", " ", text)
    instrs = [
        ln.strip() for ln in joined.splitlines() if ln.strip() and not ln.lstrip().startswith("#")
    ]
    froms = [i for i in instrs if i.upper().startswith("FROM ")]
    f.check(len(froms) >= 2, "Dockerfile: must be multi-stage")
    for fr in froms:
        image = fr.split()[1]
        f.check(
            re.fullmatch(r"python:3\.11\.\d+-slim-[a-z]+(@sha256:[0-9a-f]{64})?", image)
            is not None,
            f"Dockerfile: base image must be a pinned python:3.11.X-slim-<distro> tag: {image}",
        )
    final = instrs[instrs.index(froms[-1]) :]
    users = [i.split(None, 1)[1] for i in final if i.upper().startswith("USER ")]
    f.check(
        bool(users) and users[-1].split(":")[0] == str(UID),
        f"Dockerfile: the final stage must end as numeric USER {UID}",
    )
    f.check(
        'ENTRYPOINT ["sidecar"]' in final,
        'Dockerfile: ENTRYPOINT ["sidecar"] in the final stage',
    )
    f.check(
        f'CMD ["serve", "--config", "{CONFIG_FILE}"]' in final,
        "Dockerfile: CMD serve --config " + CONFIG_FILE,
    )
    exposed = {
        p.split("/")[0] for i in final if i.upper().startswith("EXPOSE ") for p in i.split()[1:]
    }
    f.check({str(PROXY_PORT), str(ADMIN_PORT)} <= exposed, "Dockerfile: EXPOSE 8080 9090")
    final_text = "\n".join(final)
    f.check(
        re.search(r"\b(gcc|g\+\+|build-essential|clang)\b", final_text) is None,
        "Dockerfile: no compilers in the final stage",
    )
    f.check(
        re.search(r"(?i)\b(ENV|ARG)\s+\S*(API_KEY|TOKEN|SECRET|PASSWORD)", text) is None,
        "Dockerfile: no secrets in ENV/ARG",
    )
    # The dependencies from the lock, hashes required; the project wheel without its own
    # resolution; pip check ties the two together (requirements.lock, docs/kubernetes.md).
    builder = "\n".join(instrs[: instrs.index(froms[-1])])
    f.check(
        re.search(r"pip install [^&]*--require-hashes [^&]*-r requirements\.lock", builder)
        is not None,
        "Dockerfile: the builder installs `--require-hashes -r requirements.lock`",
    )
    f.check(
        re.search(r"pip install [^&]*--no-deps [^&]*\.whl", builder) is not None,
        "Dockerfile: the project wheel is installed with --no-deps (the lock has the rest)",
    )
    f.check("pip check" in builder, "Dockerfile: `pip check` after the installs")
    lock = ROOT / LOCK_NAME
    f.check(
        lock.is_file() and "--hash=sha256:" in lock.read_text(encoding="utf-8"),
        f"{LOCK_NAME}: present, with hashes",
    )


def find_sidecar(f: Failures, where: str, pod: dict[str, Any]) -> dict[str, Any] | None:
    """The one native sidecar (an initContainer with restartPolicy Always) of a pod spec."""
    sidecars = [c for c in pod.get("initContainers") or [] if c.get("restartPolicy") == "Always"]
    if not f.check(
        len(sidecars) == 1 and sidecars[0].get("name") == SIDECAR_NAME,
        f"{where}: one native sidecar {SIDECAR_NAME} (initContainer, restartPolicy Always)",
    ):
        return None
    f.check(
        not any("sidecar" in str(c.get("image")) for c in pod.get("containers") or []),
        f"{where}: the sidecar must not run as a regular container",
    )
    return sidecars[0]


def check_sidecar_container(
    f: Failures, pod: dict[str, Any], sc: dict[str, Any], volumes: dict[str, Any]
) -> dict[str, int]:
    """Checks of the sidecar container as the component writes it; returns its port names.

    ``volumes`` maps the pod's volume names to their specs. The container must hold its
    own security settings: the component never touches the pod's securityContext.
    """
    where = f"sidecar container {sc.get('name')}"
    ports = sc.get("ports") or []
    port_names = {p.get("name"): p.get("containerPort") for p in ports if p.get("name")}
    f.check(port_names.get("admin") == ADMIN_PORT, f"{where}: containerPort {ADMIN_PORT} 'admin'")
    f.check(
        all(
            p.get("containerPort") != PROXY_PORT
            for c in [*(pod.get("containers") or []), sc]
            for p in c.get("ports") or []
        ),
        f"{where}: the proxy port {PROXY_PORT} stays undeclared (loopback only)",
    )
    f.check(all(not p.get("hostPort") for p in ports), f"{where}: no hostPort")

    probe_ok(f, f"{where}: startupProbe", sc.get("startupProbe"), "/readyz", port_names)
    probe_ok(f, f"{where}: readinessProbe", sc.get("readinessProbe"), "/readyz", port_names)
    probe_ok(f, f"{where}: livenessProbe", sc.get("livenessProbe"), "/healthz", port_names)

    res = sc.get("resources") or {}
    normal = {k: {n: str(v) for n, v in (res.get(k) or {}).items()} for k in res}
    f.check(
        normal == SIDECAR_RESOURCES,
        f"{where}: resources must be {SIDECAR_RESOURCES} (a CPU request, no CPU limit: "
        f"docs/kubernetes.md) (got {res})",
    )

    # On the container itself: the pod's securityContext belongs to the app.
    container_sc_ok(f, where, sc, {})

    env = {e.get("name"): e for e in sc.get("env") or []}
    f.check(
        (env.get("SIDECAR_CONFIG") or {}).get("value") == CONFIG_FILE,
        f"{where}: env SIDECAR_CONFIG={CONFIG_FILE}",
    )
    args = sc.get("args")
    f.check(
        args is None or args == ["serve", "--config", CONFIG_FILE],
        f"{where}: args must be the image CMD (serve --config {CONFIG_FILE})",
    )
    mounts = [m for m in sc.get("volumeMounts") or [] if m.get("mountPath") == CONFIG_DIR]
    if f.check(len(mounts) == 1, f"{where}: a volumeMount at {CONFIG_DIR}"):
        m = mounts[0]
        f.check(
            "subPath" not in m and "subPathExpr" not in m,
            f"{where}: mount {CONFIG_DIR} as a directory, never subPath (live reload)",
        )
        f.check(m.get("readOnly") is True, f"{where}: config mount readOnly")
        cm = (volumes.get(m.get("name")) or {}).get("configMap") or {}
        f.check(
            str(cm.get("name", "")).startswith(CONFIGMAP_NAME),
            f"{where}: {CONFIG_DIR} must mount the ConfigMap {CONFIGMAP_NAME}",
        )
        items = cm.get("items")
        f.check(
            items is None
            or any(i.get("key") == CONFIGMAP_KEY and i.get("path") == CONFIGMAP_KEY for i in items),
            f"{where}: the ConfigMap must project {CONFIGMAP_KEY} as {CONFIGMAP_KEY}",
        )
    return port_names


def check_keys(f: Failures, sc: dict[str, Any], cfg: dict[str, Any]) -> None:
    """Every api_key_env of sidecar.toml reaches the sidecar from the Secret template."""
    where = f"sidecar container {sc.get('name')}"
    env = {e.get("name"): e for e in sc.get("env") or []}
    secret_docs = load_docs(SECRET_PATH)
    f.check(
        len(secret_docs) == 1 and secret_docs[0].get("kind") == "Secret",
        "secret.example.yaml: one Secret",
    )
    secret = secret_docs[0] if secret_docs else {}
    secret_name = (secret.get("metadata") or {}).get("name")
    f.check(secret_name == SECRET_NAME, f"secret.example.yaml: the Secret is {SECRET_NAME}")
    secret_keys = set((secret.get("stringData") or {}) | (secret.get("data") or {}))
    for value in (secret.get("stringData") or {}).values():
        f.check(
            str(value).startswith("REPLACE_"),
            "secret.example.yaml: values must be REPLACE_* placeholders, never real keys",
        )
    env_from_secret = {
        (ef.get("secretRef") or {}).get("name") for ef in sc.get("envFrom") or []
    } - {None}
    for up_name, up in (cfg.get("upstreams") or {}).items():
        var = up.get("api_key_env")
        if not var:
            continue
        ref = ((env.get(var) or {}).get("valueFrom") or {}).get("secretKeyRef") or {}
        ok = (ref.get("name") == secret_name and ref.get("key") in secret_keys) or (
            secret_name in env_from_secret and var in secret_keys
        )
        f.check(
            ok,
            f"{where}: upstreams.{up_name}.api_key_env {var} must come from the "
            f"Secret {secret_name} (secretKeyRef or envFrom) and be in the template",
        )
        f.check(var in secret_keys, f"secret.example.yaml: key {var}")


def check_manifests(f: Failures, docs: list[dict[str, Any]], cfg: dict[str, Any]) -> None:
    """The example (`kubectl kustomize deploy/k8s`): one app Deployment plus the component."""
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        by_kind.setdefault(str(d.get("kind")), []).append(d)
    names = [key_of(d) for d in docs]
    f.check(len(names) == len(set(names)), f"manifests: duplicate objects {names}")
    f.check("Secret" not in by_kind, "manifests: the Secret template must stay out of -k")
    f.check("Service" not in by_kind, "manifests: no Service (the proxy is pod-local)")

    # The ConfigMap comes from the generator over sidecar.toml, its one source.
    cms = [d for d in by_kind.get("ConfigMap", []) if key_of(d)[2] == CONFIGMAP_NAME]
    if f.check(len(cms) == 1, f"manifests: one ConfigMap {CONFIGMAP_NAME} (fixed name)"):
        f.check(
            (cms[0].get("data") or {}).get(CONFIGMAP_KEY) == TOML_PATH.read_text(encoding="utf-8"),
            f"ConfigMap {CONFIGMAP_NAME}: data.{CONFIGMAP_KEY} must be deploy/k8s/sidecar.toml "
            "(kustomization.yaml's configMapGenerator)",
        )

    deps = by_kind.get("Deployment", [])
    if not f.check(len(deps) == 1, "manifests: exactly one Deployment"):
        return
    dep = deps[0]
    f.check(
        ((dep.get("metadata") or {}).get("labels") or {}).get(INJECT_LABEL) == "true",
        f"Deployment: label {INJECT_LABEL}: 'true' (what the component selects)",
    )
    tmpl = dep["spec"]["template"]
    pod = tmpl["spec"]
    pod_labels = (tmpl.get("metadata") or {}).get("labels") or {}
    f.check(
        dep["spec"]["selector"].get("matchLabels", {}).items() <= pod_labels.items(),
        "Deployment: selector must match the pod labels",
    )
    f.check(pod_labels.get(INJECTED_LABEL) == "true", f"Deployment: pod label {INJECTED_LABEL}")
    sc = find_sidecar(f, "Deployment", pod)
    if sc is None:
        return
    volumes = {v.get("name"): v for v in pod.get("volumes") or []}
    port_names = check_sidecar_container(f, pod, sc, volumes)
    cm_ref = ((volumes.get("sidecar-config") or {}).get("configMap") or {}).get("name")
    f.check(cm_ref == CONFIGMAP_NAME, f"Deployment: volume sidecar-config -> {CONFIGMAP_NAME}")

    # Grace period vs drain
    drain_ms = int((cfg.get("server") or {}).get("drain_timeout_ms", 25000))
    grace = pod.get("terminationGracePeriodSeconds", 30)
    f.check(
        isinstance(grace, int) and grace * 1000 > drain_ms + 5000,
        f"Deployment: terminationGracePeriodSeconds ({grace}) must exceed "
        f"server.drain_timeout_ms ({drain_ms} ms) with a margin of > 5 s",
    )

    # Security of the whole example pod
    pod_sc = pod.get("securityContext") or {}
    f.check(pod.get("hostNetwork") in (None, False), "Deployment: no hostNetwork")
    for c in [*(pod.get("initContainers") or []), *(pod.get("containers") or [])]:
        container_sc_ok(f, f"container {c.get('name')}", c, pod_sc)
    f.check(
        pod.get("automountServiceAccountToken") is False,
        "Deployment: automountServiceAccountToken false (the pod needs no API access)",
    )

    check_keys(f, sc, cfg)

    # Prometheus annotations
    ann = (tmpl.get("metadata") or {}).get("annotations") or {}
    f.check(
        ann.get("prometheus.io/scrape") == "true"
        and ann.get("prometheus.io/port") == str(ADMIN_PORT)
        and ann.get("prometheus.io/path") == "/metrics",
        "Deployment: prometheus.io/scrape|port|path annotations on the pod template",
    )

    check_podmonitor(f, pod_labels, port_names)
    check_networkpolicy(f, pod_labels, port_names)


def check_networkpolicy(
    f: Failures, pod_labels: dict[str, str], port_names: dict[str, int]
) -> None:
    """The example NetworkPolicy: the admin port, to Prometheus only, on the sidecar's pods."""
    docs = load_docs(NETWORKPOLICY_PATH)
    if not f.check(
        len(docs) == 1 and docs[0].get("kind") == "NetworkPolicy",
        "networkpolicy.yaml: one NetworkPolicy",
    ):
        return
    spec = docs[0].get("spec") or {}
    match = (spec.get("podSelector") or {}).get("matchLabels") or {}
    f.check(
        match == {INJECTED_LABEL: "true"} and match.items() <= pod_labels.items(),
        f"NetworkPolicy: podSelector must be {INJECTED_LABEL}: 'true' (the component's pods)",
    )
    f.check(spec.get("policyTypes") == ["Ingress"], "NetworkPolicy: policyTypes [Ingress]")
    rules = spec.get("ingress") or []
    if not f.check(len(rules) >= 1, "NetworkPolicy: an ingress rule for Prometheus"):
        return
    for i, rule in enumerate(rules):
        w = f"NetworkPolicy: ingress[{i}]"
        peers = rule.get("from") or []
        # An empty or missing `from` admits every source: the example must not.
        f.check(bool(peers), f"{w}: `from` must name its sources")
        for peer in peers:
            f.check(
                "ipBlock" not in peer
                and bool(peer.get("namespaceSelector"))
                and bool(peer.get("podSelector")),
                f"{w}: each source must name a namespace AND pods (got {peer})",
            )
        ports = rule.get("ports") or []
        f.check(
            bool(ports)
            and all(
                p.get("protocol", "TCP") == "TCP"
                and port_names.get(p.get("port"), p.get("port")) == ADMIN_PORT
                for p in ports
            ),
            f"{w}: only the admin port {ADMIN_PORT}/TCP",
        )


def strip_component(dep: dict[str, Any]) -> dict[str, Any]:
    """A Deployment without what the llm-sidecar component adds (a deep copy)."""
    out: dict[str, Any] = yaml.safe_load(yaml.safe_dump(dep))
    tmpl = out["spec"]["template"]
    labels = (tmpl.get("metadata") or {}).get("labels") or {}
    labels.pop(INJECTED_LABEL, None)
    pod = tmpl["spec"]
    inits = [c for c in pod.get("initContainers") or [] if c.get("name") != SIDECAR_NAME]
    if inits:
        pod["initContainers"] = inits
    else:
        pod.pop("initContainers", None)
    vols = [v for v in pod.get("volumes") or [] if v.get("name") not in SIDECAR_VOLUMES]
    if vols:
        pod["volumes"] = vols
    else:
        pod.pop("volumes", None)
    return out


def check_component(
    f: Failures, written: list[dict[str, Any]], built: list[dict[str, Any]]
) -> None:
    """The component on Deployments it did not write (``written``: as in the user's files).

    A Deployment labelled ``INJECT_LABEL: "true"`` must come out with the sidecar first in
    its initContainers, the two volumes, the pod label ``INJECTED_LABEL`` and nothing else
    of it changed; any other Deployment must come out unchanged.
    """
    out = {key_of(d): d for d in built}
    cms = {key_of(d)[2] for d in built if d.get("kind") == "ConfigMap"}
    deps = [d for d in written if d.get("kind") == "Deployment"]
    f.check(
        any(
            ((d.get("metadata") or {}).get("labels") or {}).get(INJECT_LABEL) == "true"
            for d in deps
        )
        and any(
            ((d.get("metadata") or {}).get("labels") or {}).get(INJECT_LABEL) != "true"
            for d in deps
        ),
        "component fixture: needs a labelled and an unlabelled Deployment",
    )
    for dep in deps:
        name = key_of(dep)[2]
        got = out.get(key_of(dep))
        if not f.check(got is not None, f"component: Deployment {name} missing from the output"):
            continue
        assert got is not None
        labelled = ((dep.get("metadata") or {}).get("labels") or {}).get(INJECT_LABEL) == "true"
        if not labelled:
            f.check(got == dep, f"component: unlabelled Deployment {name} must not change")
            continue
        where = f"component: Deployment {name}"
        pod = got["spec"]["template"]["spec"]
        sc = find_sidecar(f, where, pod)
        if sc is None:
            continue
        f.check(
            (pod.get("initContainers") or [{}])[0].get("name") == SIDECAR_NAME,
            f"{where}: the sidecar must be the first initContainer (your own init "
            "containers then find the proxy up)",
        )
        volumes = {v.get("name"): v for v in pod.get("volumes") or []}
        f.check(all(v in volumes for v in SIDECAR_VOLUMES), f"{where}: volumes {SIDECAR_VOLUMES}")
        check_sidecar_container(f, pod, sc, volumes)
        cm_ref = ((volumes.get("sidecar-config") or {}).get("configMap") or {}).get("name")
        f.check(
            cm_ref in cms,
            f"{where}: volume sidecar-config names ConfigMap {cm_ref}, not in the output "
            f"({sorted(cms)}): the configMapGenerator is missing or misnamed",
        )
        labels = ((got["spec"]["template"].get("metadata") or {}).get("labels")) or {}
        f.check(labels.get(INJECTED_LABEL) == "true", f"{where}: pod label {INJECTED_LABEL}")
        f.check(
            strip_component(got) == dep,
            f"{where}: the component changed more than its sidecar, volumes and pod label",
        )


def run_component(written: Path, built: Path) -> int:
    f = Failures()
    check_component(f, load_docs(written), load_docs(built))
    for item in f.items:
        print(f"FAIL: {item}")
    print(f"component: {f.passed} passed, {len(f.items)} failed")
    return 1 if f.items else 0


PODMONITOR_SPEC_KEYS = {
    "selector",
    "podMetricsEndpoints",
    "namespaceSelector",
    "jobLabel",
    "podTargetLabels",
    "sampleLimit",
    "targetLimit",
    "labelLimit",
    "labelNameLengthLimit",
    "labelValueLengthLimit",
    "attachMetadata",
    "scrapeProtocols",
    "scrapeClass",
    "keepDroppedTargets",
    "bodySizeLimit",
    "selectorMechanism",
}
PODMONITOR_EP_KEYS = {
    "port",
    "portNumber",
    "targetPort",
    "path",
    "scheme",
    "params",
    "interval",
    "scrapeTimeout",
    "honorLabels",
    "honorTimestamps",
    "trackTimestampsStaleness",
    "metricRelabelings",
    "relabelings",
    "basicAuth",
    "bearerTokenSecret",
    "authorization",
    "oauth2",
    "tlsConfig",
    "proxyUrl",
    "followRedirects",
    "enableHttp2",
    "filterRunning",
}
PROM_DURATION = re.compile(
    r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
)


def check_podmonitor(f: Failures, pod_labels: dict[str, str], port_names: dict[str, int]) -> None:
    """Structural check: kubernetes-validate has no schema for monitoring.coreos.com."""
    docs = load_docs(PODMONITOR_PATH)
    if not f.check(len(docs) == 1, "podmonitor.yaml: one document"):
        return
    pm = docs[0]
    f.check(pm.get("apiVersion") == "monitoring.coreos.com/v1", "PodMonitor: apiVersion")
    f.check(pm.get("kind") == "PodMonitor", "PodMonitor: kind")
    f.check(set(pm) <= {"apiVersion", "kind", "metadata", "spec"}, "PodMonitor: top-level keys")
    name = (pm.get("metadata") or {}).get("name", "")
    f.check(
        re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", str(name)) is not None,
        "PodMonitor: metadata.name must be a DNS label",
    )
    spec = pm.get("spec") or {}
    f.check(
        set(spec) <= PODMONITOR_SPEC_KEYS,
        f"PodMonitor: unknown spec keys {sorted(set(spec) - PODMONITOR_SPEC_KEYS)}",
    )
    match = (spec.get("selector") or {}).get("matchLabels") or {}
    f.check(
        bool(match) and match.items() <= pod_labels.items(),
        "PodMonitor: spec.selector.matchLabels must select the Deployment's pods",
    )
    eps = spec.get("podMetricsEndpoints")
    if not isinstance(eps, list) or not f.check(len(eps) > 0, "PodMonitor: podMetricsEndpoints"):
        f.check(isinstance(eps, list), "PodMonitor: podMetricsEndpoints must be a list")
        return
    for i, ep in enumerate(eps):
        w = f"PodMonitor: podMetricsEndpoints[{i}]"
        f.check(
            set(ep) <= PODMONITOR_EP_KEYS,
            f"{w}: unknown keys {sorted(set(ep) - PODMONITOR_EP_KEYS)}",
        )
        f.check(
            port_names.get(ep.get("port")) == ADMIN_PORT,
            f"{w}: port must name the sidecar's admin containerPort",
        )
        f.check(ep.get("path", "/metrics") == "/metrics", f"{w}: path /metrics")
        for k in ("interval", "scrapeTimeout"):
            if k in ep:
                f.check(PROM_DURATION.match(str(ep[k])) is not None, f"{w}: {k} duration")


def run_check(manifests: Path) -> int:
    f = Failures()
    cfg = check_toml(f)
    check_dockerfile(f)
    check_manifests(f, load_docs(manifests), cfg)
    for item in f.items:
        print(f"FAIL: {item}")
    print(f"policy: {f.passed} passed, {len(f.items)} failed")
    return 1 if f.items else 0


# --------------------------------------------------------------------------- build context


def dockerignore_rules() -> list[tuple[bool, str, re.Pattern[str]]]:
    rules = []
    for raw in DOCKERIGNORE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pat = (line[1:].strip() if negate else line).strip("/")
        rx = ""
        i = 0
        while i < len(pat):
            if pat.startswith("**/", i):
                rx += "(?:.*/)?"
                i += 3
            elif pat.startswith("**", i):
                rx += ".*"
                i += 2
            elif pat[i] == "*":
                rx += "[^/]*"
                i += 1
            elif pat[i] == "?":
                rx += "[^/]"
                i += 1
            else:
                rx += re.escape(pat[i])
                i += 1
        rules.append((negate, pat, re.compile(rx + r"\Z")))
    return rules


def ignored(rel: str, rules: list[tuple[bool, str, re.Pattern[str]]]) -> bool:
    """Docker's rule: the last matching pattern wins; a pattern matching a parent matches."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    result = False
    for negate, _, rx in rules:
        if any(rx.match(p) for p in prefixes):
            result = not negate
    return result


def may_hold_included(rel_dir: str, rules: list[tuple[bool, str, re.Pattern[str]]]) -> bool:
    """Whether an ignored directory could still hold a file that a `!` pattern lets in."""
    for negate, pat, _ in rules:
        if not negate:
            continue
        literal = re.split(r"[*?\[]", pat, maxsplit=1)[0]
        if literal == "" or literal.startswith(rel_dir + "/") or rel_dir.startswith(literal):
            return True
    return False


def copy_context(out: Path) -> None:
    rules = dockerignore_rules()
    count = 0
    for dirpath, dirnames, filenames in os.walk(ROOT):
        here = Path(dirpath)
        keep = []
        for d in sorted(dirnames):
            rel = (here / d).relative_to(ROOT).as_posix()
            if rel == ".git" or (ignored(rel, rules) and not may_hold_included(rel, rules)):
                continue
            keep.append(d)
        dirnames[:] = keep
        for name in sorted(filenames):
            path = here / name
            rel = path.relative_to(ROOT).as_posix()
            if ignored(rel, rules):
                continue
            dest = out / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest)
            count += 1
    print(f"build context: {count} files -> {out}")


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check")
    c.add_argument("manifests", type=Path)
    k = sub.add_parser("component")
    k.add_argument("written", type=Path)
    k.add_argument("built", type=Path)
    x = sub.add_parser("context")
    x.add_argument("out", type=Path)
    s = sub.add_parser("same")
    s.add_argument("a", type=Path)
    s.add_argument("b", type=Path)
    args = p.parse_args(argv)

    if args.cmd == "check":
        return run_check(args.manifests)
    if args.cmd == "component":
        return run_component(args.written, args.built)
    if args.cmd == "context":
        copy_context(args.out)
        return 0
    if args.cmd == "same":
        da = sorted(load_docs(args.a), key=key_of)
        db = sorted(load_docs(args.b), key=key_of)
        if da != db:
            print(
                f"{args.a} and {args.b} differ: {[key_of(d) for d in da]} vs "
                f"{[key_of(d) for d in db]}"
            )
            return 1
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
