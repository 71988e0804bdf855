"""The llm-sidecar kustomize Component, the example built on it, and the image's lock.

The component is built with a real ``kubectl kustomize``: the pinned one that
``.ci/deploy-checks.sh`` installs into ``.ci/.venv-deploy`` (CI runs that before the
tests), else one on PATH; the tests that need it skip without one. The checks are
``deploy/tools/deploy_checks.py``'s, the ones CI runs; each is also shown to fail on a
component or a manifest that breaks its rule.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped,unused-ignore]
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.deploy_tools import load_tool

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "k8s" / "existing-app"
COMPONENT = ROOT / "deploy" / "k8s" / "components" / "llm-sidecar"
checks = load_tool("deploy_checks")


def kubectl_path() -> str | None:
    """The pinned kubectl of the deploy checks' venv, else one on PATH, else None."""
    pinned = ROOT / ".ci" / ".venv-deploy" / "bin" / "kubectl"
    return str(pinned) if pinned.is_file() else shutil.which("kubectl")


needs_kubectl = pytest.mark.skipif(
    kubectl_path() is None,
    reason="no kubectl (bash .ci/deploy-checks.sh installs one into .ci/.venv-deploy)",
)


def kustomize(directory: Path) -> list[dict[str, Any]]:
    kubectl = kubectl_path()
    assert kubectl is not None
    out = subprocess.run(
        [kubectl, "kustomize", str(directory)],
        check=True,
        capture_output=True,
        text=True,
        timeout=20,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def by_name(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d.get("kind") == kind}


def failures_of(run: Any) -> list[str]:
    f = checks.Failures()
    run(f)
    return list(f.items)


def written_deployments() -> list[dict[str, Any]]:
    return [d for d in checks.load_docs(FIXTURE / "deployment.yaml") if d]


def copy_fixture_with_component(tmp_path: Path, edit: Any) -> Path:
    """The fixture, pointing at a copy of the component whose patch text ``edit`` changes."""
    comp = tmp_path / "component"
    shutil.copytree(COMPONENT, comp)
    patch = comp / "sidecar-patch.yaml"
    patch.write_text(edit(patch.read_text(encoding="utf-8")), encoding="utf-8")
    fx = tmp_path / "fixture"
    shutil.copytree(FIXTURE, fx)
    kust = fx / "kustomization.yaml"
    kust.write_text(
        kust.read_text(encoding="utf-8").replace(
            "../../../deploy/k8s/components/llm-sidecar", "../component"
        ),
        encoding="utf-8",
    )
    return fx


@needs_kubectl
def test_component_adds_the_sidecar_to_the_labelled_deployment_only() -> None:
    built = kustomize(FIXTURE)
    deps = by_name(built, "Deployment")
    web = deps["web"]["spec"]["template"]
    pod = web["spec"]
    # First, so the app's own init container (a migration) finds the proxy up.
    assert [c["name"] for c in pod["initContainers"]] == ["llm-sidecar", "migrate"]
    sidecar = pod["initContainers"][0]
    assert sidecar["restartPolicy"] == "Always"
    assert sidecar["image"] == "registry.example.com/llm-circuit-sidecar:0.1.0"
    assert sidecar["resources"] == {
        "requests": {"cpu": "100m", "memory": "64Mi"},
        "limits": {"memory": "256Mi"},
    }
    assert sidecar["envFrom"] == [{"secretRef": {"name": "llm-provider-keys"}}]
    # The app's pod settings are the app's: user 2000, 90 s grace, its annotations.
    assert pod["securityContext"]["runAsUser"] == 2000
    assert pod["terminationGracePeriodSeconds"] == 90
    assert web["metadata"]["annotations"]["prometheus.io/port"] == "8000"
    assert web["metadata"]["labels"]["llm-circuit-sidecar/injected"] == "true"
    # The generated ConfigMap keeps kustomize's hash here; the volume follows it.
    (cm_name,) = by_name(built, "ConfigMap")
    assert re.fullmatch(r"sidecar-config-[a-z0-9]{10}", cm_name)
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert set(volumes) == {"cache", "sidecar-config", "sidecar-tmp"}
    assert volumes["sidecar-config"]["configMap"]["name"] == cm_name
    # The unlabelled Deployment is exactly as written.
    assert deps["worker"] == by_name(written_deployments(), "Deployment")["worker"]
    assert failures_of(lambda f: checks.check_component(f, written_deployments(), built)) == []


@needs_kubectl
def test_component_check_fails_a_patch_that_touches_the_pod_or_sets_a_cpu_limit(
    tmp_path: Path,
) -> None:
    def edit(text: str) -> str:
        text = text.replace(
            "    spec:\n      initContainers:",
            "    spec:\n      terminationGracePeriodSeconds: 35\n      initContainers:",
            1,
        )
        return text.replace(
            "            limits:\n              memory: 256Mi",
            '            limits:\n              cpu: "1"\n              memory: 256Mi',
        )

    built = kustomize(copy_fixture_with_component(tmp_path, edit))
    items = failures_of(lambda f: checks.check_component(f, written_deployments(), built))
    assert any("no CPU limit" in i for i in items), items
    assert any("changed more than its sidecar" in i for i in items), items
    assert len(items) == 2, items


@needs_kubectl
def test_component_check_fails_without_the_configmap(tmp_path: Path) -> None:
    fx = copy_fixture_with_component(tmp_path, lambda text: text)
    kust = fx / "kustomization.yaml"
    text = kust.read_text(encoding="utf-8")
    kust.write_text(text[: text.index("configMapGenerator:")], encoding="utf-8")
    built = kustomize(fx)
    items = failures_of(lambda f: checks.check_component(f, written_deployments(), built))
    assert len(items) == 1 and "configMapGenerator is missing" in items[0], items


@needs_kubectl
def test_example_is_the_app_plus_the_component_with_one_config_source() -> None:
    built = kustomize(ROOT / "deploy" / "k8s")
    (cm,) = by_name(built, "ConfigMap").values()
    assert cm["metadata"]["name"] == "sidecar-config"  # fixed name: reloaded in place
    assert cm["data"]["sidecar.toml"] == checks.TOML_PATH.read_text(encoding="utf-8")
    assert not (ROOT / "deploy" / "k8s" / "configmap.yaml").exists()
    cfg = checks.check_toml(checks.Failures())
    assert failures_of(lambda f: checks.check_manifests(f, built, cfg)) == []

    # The same check fails once the sidecar gets a CPU limit.
    (dep,) = by_name(built, "Deployment").values()
    dep["spec"]["template"]["spec"]["initContainers"][0]["resources"]["limits"]["cpu"] = "1"
    items = failures_of(lambda f: checks.check_manifests(f, built, cfg))
    assert len(items) == 1 and "no CPU limit" in items[0], items


def test_networkpolicy_check_fails_a_rule_open_to_every_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    labels = {"llm-circuit-sidecar/injected": "true"}
    ports = {"admin": 9090}
    assert failures_of(lambda f: checks.check_networkpolicy(f, labels, ports)) == []

    policy = checks.load_docs(checks.NETWORKPOLICY_PATH)[0]
    policy["spec"]["ingress"][0].pop("from")
    path = tmp_path / "networkpolicy.yaml"
    path.write_text(yaml.safe_dump(policy), encoding="utf-8")
    monkeypatch.setattr(checks, "NETWORKPOLICY_PATH", path)
    items = failures_of(lambda f: checks.check_networkpolicy(f, labels, ports))
    assert items == ["NetworkPolicy: ingress[0]: `from` must name its sources"]


def test_lock_pins_every_runtime_dependency_within_pyproject_ranges() -> None:
    """requirements.lock (the image's and CI's dependency versions) matches pyproject.toml."""
    lock_text = (ROOT / "requirements.lock").read_text(encoding="utf-8")
    pins: dict[str, tuple[str, int]] = {}
    for m in re.finditer(
        r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)((?:\s*\\\n\s+--hash=\S+)*)", lock_text, re.M
    ):
        pins[canonicalize_name(m.group(1))] = (m.group(2), m.group(3).count("--hash=sha256:"))
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"][
        "dependencies"
    ]
    assert deps
    for dep in deps:
        req = Requirement(dep)
        name = canonicalize_name(req.name)
        assert name in pins, f"requirements.lock has no pin for {req.name}: refresh it"
        version, hashes = pins[name]
        assert req.specifier.contains(version), f"{req.name}=={version} is outside {req.specifier}"
        assert hashes >= 1, f"{req.name}: no --hash in requirements.lock"
    # Every pin is hashed: pip's --require-hashes (the Dockerfile) accepts nothing less.
    assert all(h >= 1 for _, h in pins.values()), pins
