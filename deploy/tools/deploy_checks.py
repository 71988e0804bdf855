#!/usr/bin/env python3
"""Helpers for .ci/deploy-checks.sh: assemble, cross-check and sync the deploy files.

Subcommands (run from the repository root, with PyYAML importable):

  assemble DIR          print the kustomization in DIR as one multi-document YAML
                        stream (a stand-in for `kubectl kustomize` where kubectl is
                        missing; supports `resources:` (files, directories) and `images:`)
  check MANIFESTS       the policy checks that a schema cannot express, over the
                        assembled manifests plus the files kept outside the
                        kustomization (Secret template, PodMonitor) and the Dockerfile
  sync-configmap        rewrite the sidecar.toml embedded in deploy/k8s/configmap.yaml
                        from deploy/k8s/sidecar.toml (the checked-in copy)
  context OUTDIR        copy the Docker build context (the files .dockerignore lets
                        through) into OUTDIR, to build the wheel as the image does
  same A B              exit 1 unless two multi-document YAML files hold the same objects
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
CONFIGMAP_PATH = K8S / "configmap.yaml"
SECRET_PATH = K8S / "secret.example.yaml"
PODMONITOR_PATH = K8S / "podmonitor.yaml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"

CONFIG_DIR = "/etc/sidecar"
CONFIG_FILE = f"{CONFIG_DIR}/sidecar.toml"
CONFIGMAP_NAME = "sidecar-config"
CONFIGMAP_KEY = "sidecar.toml"
UID = 10001
ADMIN_PORT = 9090
PROXY_PORT = 8080
EMBED_MARKER = f"  {CONFIGMAP_KEY}: |"
EMBED_INDENT = "    "


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


# --------------------------------------------------------------------------- assemble


def assemble(directory: Path) -> list[dict[str, Any]]:
    kfile = directory / "kustomization.yaml"
    kust = yaml.safe_load(kfile.read_text(encoding="utf-8"))
    allowed = {"apiVersion", "kind", "resources", "images"}
    unknown = sorted(set(kust) - allowed)
    if unknown:
        raise SystemExit(
            f"{kfile}: the fallback assembler supports only {sorted(allowed)}; found {unknown}. "
            "Install kubectl (kustomize) or keep the kustomization to resources and images."
        )
    docs: list[dict[str, Any]] = []
    for entry in kust.get("resources") or []:
        target = (directory / entry).resolve()
        if target.is_dir():
            docs.extend(assemble(target))
        elif target.is_file():
            docs.extend(load_docs(target))
        else:
            raise SystemExit(f"{kfile}: resource {entry!r} not found (remote bases unsupported)")
    for rule in kust.get("images") or []:
        for doc in docs:
            set_image(doc, rule)
    return docs


def set_image(doc: dict[str, Any], rule: dict[str, str]) -> None:
    """kustomize's `images:` transformer, for the pod templates of workloads."""
    spec = (doc.get("spec") or {}).get("template", {}).get("spec") or {}
    for c in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        image = str(c.get("image", ""))
        name, digest = image.split("@", 1) if "@" in image else (image, "")
        tag = ""
        if ":" in name.rsplit("/", 1)[-1]:
            name, tag = name.rsplit(":", 1)
        if name != rule.get("name"):
            continue
        new = rule.get("newName", name)
        if rule.get("digest"):
            c["image"] = f"{new}@{rule['digest']}"
        elif rule.get("newTag"):
            c["image"] = f"{new}:{rule['newTag']}"
        else:
            c["image"] = new + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")


def dump_docs(docs: list[dict[str, Any]]) -> str:
    return str(yaml.safe_dump_all(docs, sort_keys=True, default_flow_style=False))


def key_of(doc: dict[str, Any]) -> tuple[str, str, str]:
    meta = doc.get("metadata") or {}
    return (str(doc.get("apiVersion")), str(doc.get("kind")), str(meta.get("name")))


# --------------------------------------------------------------------------- configmap


def embedded_toml(configmap_text: str) -> str:
    """The sidecar.toml block of configmap.yaml, as YAML itself reads it."""
    docs = [d for d in yaml.safe_load_all(configmap_text) if d]
    if len(docs) != 1 or docs[0].get("kind") != "ConfigMap":
        raise SystemExit(f"{CONFIGMAP_PATH}: expected exactly one ConfigMap document")
    value = (docs[0].get("data") or {}).get(CONFIGMAP_KEY)
    if not isinstance(value, str):
        raise SystemExit(f"{CONFIGMAP_PATH}: data.{CONFIGMAP_KEY} missing")
    return value


def sync_configmap() -> None:
    text = CONFIGMAP_PATH.read_text(encoding="utf-8")
    lines = text.splitlines()
    try:
        at = lines.index(EMBED_MARKER)
    except ValueError:
        raise SystemExit(f"{CONFIGMAP_PATH}: no line {EMBED_MARKER!r}") from None
    toml_lines = TOML_PATH.read_text(encoding="utf-8").splitlines()
    body = [EMBED_INDENT + ln if ln.strip() else "" for ln in toml_lines]
    CONFIGMAP_PATH.write_text("\n".join([*lines[: at + 1], *body]) + "\n", encoding="utf-8")
    if embedded_toml(CONFIGMAP_PATH.read_text(encoding="utf-8")) != TOML_PATH.read_text(
        encoding="utf-8"
    ):
        raise SystemExit("sync-configmap: the embedded copy still differs (trailing spaces?)")
    print(f"{CONFIGMAP_PATH.relative_to(ROOT)}: embedded {TOML_PATH.relative_to(ROOT)}")


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


def check_manifests(f: Failures, docs: list[dict[str, Any]], cfg: dict[str, Any]) -> None:
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        by_kind.setdefault(str(d.get("kind")), []).append(d)
    names = [key_of(d) for d in docs]
    f.check(len(names) == len(set(names)), f"manifests: duplicate objects {names}")
    f.check("Secret" not in by_kind, "manifests: the Secret template must stay out of -k")
    f.check("Service" not in by_kind, "manifests: no Service (the proxy is pod-local)")

    # ConfigMap == sidecar.toml
    cms = [d for d in by_kind.get("ConfigMap", []) if key_of(d)[2] == CONFIGMAP_NAME]
    if f.check(len(cms) == 1, f"manifests: one ConfigMap {CONFIGMAP_NAME}"):
        embedded = (cms[0].get("data") or {}).get(CONFIGMAP_KEY)
        f.check(
            embedded == TOML_PATH.read_text(encoding="utf-8"),
            f"ConfigMap {CONFIGMAP_NAME}: data.{CONFIGMAP_KEY} differs from "
            "deploy/k8s/sidecar.toml (run: .ci/.venv-deploy/bin/python "
            "deploy/tools/deploy_checks.py sync-configmap)",
        )
    f.check(
        embedded_toml(CONFIGMAP_PATH.read_text(encoding="utf-8"))
        == TOML_PATH.read_text(encoding="utf-8"),
        "configmap.yaml: embedded sidecar.toml differs from deploy/k8s/sidecar.toml",
    )

    deps = by_kind.get("Deployment", [])
    if not f.check(len(deps) == 1, "manifests: exactly one Deployment"):
        return
    dep = deps[0]
    tmpl = dep["spec"]["template"]
    pod = tmpl["spec"]
    pod_labels = (tmpl.get("metadata") or {}).get("labels") or {}
    f.check(
        dep["spec"]["selector"].get("matchLabels", {}).items() <= pod_labels.items(),
        "Deployment: selector must match the pod labels",
    )
    sidecars = [c for c in pod.get("initContainers") or [] if c.get("restartPolicy") == "Always"]
    if not f.check(
        len(sidecars) == 1, "Deployment: one native sidecar (initContainer, restartPolicy Always)"
    ):
        return
    sc = sidecars[0]
    where = f"sidecar container {sc.get('name')}"
    f.check(
        not any("sidecar" in str(c.get("image")) for c in pod.get("containers") or []),
        "Deployment: the sidecar must not run as a regular container",
    )

    # Ports: only admin 9090 declared
    ports = sc.get("ports") or []
    port_names = {p.get("name"): p.get("containerPort") for p in ports if p.get("name")}
    f.check(port_names.get("admin") == ADMIN_PORT, f"{where}: containerPort {ADMIN_PORT} 'admin'")
    f.check(
        all(
            p.get("containerPort") != PROXY_PORT
            for c in [*pod.get("containers", []), sc]
            for p in c.get("ports") or []
        ),
        f"{where}: the proxy port {PROXY_PORT} stays undeclared (loopback only)",
    )
    f.check(
        all(not p.get("hostPort") for p in ports),
        f"{where}: no hostPort",
    )

    # Probes
    probe_ok(f, f"{where}: startupProbe", sc.get("startupProbe"), "/readyz", port_names)
    probe_ok(f, f"{where}: readinessProbe", sc.get("readinessProbe"), "/readyz", port_names)
    probe_ok(f, f"{where}: livenessProbe", sc.get("livenessProbe"), "/healthz", port_names)

    # Grace period vs drain
    drain_ms = int((cfg.get("server") or {}).get("drain_timeout_ms", 25000))
    grace = pod.get("terminationGracePeriodSeconds", 30)
    f.check(
        isinstance(grace, int) and grace * 1000 > drain_ms + 5000,
        f"Deployment: terminationGracePeriodSeconds ({grace}) must exceed "
        f"server.drain_timeout_ms ({drain_ms} ms) with a margin of > 5 s",
    )

    # Resources
    res = sc.get("resources") or {}
    f.check(
        res.get("requests") == {"cpu": "100m", "memory": "64Mi"}
        and {k: str(v) for k, v in (res.get("limits") or {}).items()}
        == {"cpu": "1", "memory": "256Mi"},
        f"{where}: resources requests 100m/64Mi, limits 1/256Mi (got {res})",
    )

    # Security
    pod_sc = pod.get("securityContext") or {}
    f.check(pod.get("hostNetwork") in (None, False), "Deployment: no hostNetwork")
    for c in [*(pod.get("initContainers") or []), *(pod.get("containers") or [])]:
        container_sc_ok(f, f"container {c.get('name')}", c, pod_sc)
    f.check(
        pod.get("automountServiceAccountToken") is False,
        "Deployment: automountServiceAccountToken false (the pod needs no API access)",
    )

    # Config mount, env, args
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
        vols = {v.get("name"): v for v in pod.get("volumes") or []}
        cm_ref = ((vols.get(m.get("name")) or {}).get("configMap") or {}).get("name")
        f.check(
            cm_ref == CONFIGMAP_NAME, f"{where}: {CONFIG_DIR} must mount ConfigMap {CONFIGMAP_NAME}"
        )
        items = ((vols.get(m.get("name")) or {}).get("configMap") or {}).get("items")
        f.check(
            items is None
            or any(i.get("key") == CONFIGMAP_KEY and i.get("path") == CONFIGMAP_KEY for i in items),
            f"{where}: the ConfigMap must project {CONFIGMAP_KEY} as {CONFIGMAP_KEY}",
        )

    # Keys: every api_key_env is set from the Secret template
    secret_docs = load_docs(SECRET_PATH)
    f.check(
        len(secret_docs) == 1 and secret_docs[0].get("kind") == "Secret",
        "secret.example.yaml: one Secret",
    )
    secret = secret_docs[0] if secret_docs else {}
    secret_name = (secret.get("metadata") or {}).get("name")
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

    # Prometheus annotations
    ann = (tmpl.get("metadata") or {}).get("annotations") or {}
    f.check(
        ann.get("prometheus.io/scrape") == "true"
        and ann.get("prometheus.io/port") == str(ADMIN_PORT)
        and ann.get("prometheus.io/path") == "/metrics",
        "Deployment: prometheus.io/scrape|port|path annotations on the pod template",
    )

    check_podmonitor(f, pod_labels, port_names)


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
    a = sub.add_parser("assemble")
    a.add_argument("directory", type=Path)
    c = sub.add_parser("check")
    c.add_argument("manifests", type=Path)
    sub.add_parser("sync-configmap")
    x = sub.add_parser("context")
    x.add_argument("out", type=Path)
    s = sub.add_parser("same")
    s.add_argument("a", type=Path)
    s.add_argument("b", type=Path)
    args = p.parse_args(argv)

    if args.cmd == "assemble":
        sys.stdout.write(dump_docs(assemble(args.directory)))
        return 0
    if args.cmd == "check":
        return run_check(args.manifests)
    if args.cmd == "sync-configmap":
        sync_configmap()
        return 0
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
