"""deploy/kuberay/rayservice.yaml: a well-formed RayService whose Serve config names our application builder with
valid arguments, for the Ray version that the ``ray`` extra pins, on workers that have the GPUs it asks for."""

from __future__ import annotations

import importlib
import math
import re

import pytest
import yaml

from tests.deploy.conftest import REPO_ROOT

MANIFEST = REPO_ROOT / "deploy" / "kuberay" / "rayservice.yaml"


@pytest.fixture(scope="module")
def manifest() -> dict:
    return yaml.safe_load(MANIFEST.read_text())


@pytest.fixture(scope="module")
def application(manifest) -> dict:
    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    (app,) = serve_config["applications"]
    return app


def _pinned_ray_version() -> str:
    m = re.search(r'^ray\s*=\s*\["ray\[serve\]==([\w.]+)"\]', (REPO_ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert m, "pyproject.toml's optional extra `ray` pins ray[serve]"
    return m.group(1)


def test_rayservice_shape(manifest):
    assert manifest["apiVersion"] == "ray.io/v1"
    assert manifest["kind"] == "RayService"
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == _pinned_ray_version()
    assert cluster["enableInTreeAutoscaling"] is True
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert all(isinstance(v, str) for g in [head, *cluster["workerGroupSpecs"]] for v in g["rayStartParams"].values())


def test_serve_application_uses_our_builder(application):
    assert application["import_path"] == "service.ray_serve:app_builder"
    assert application["route_prefix"] == "/"


def test_workers_have_the_gpus_a_replica_asks_for(manifest, application):
    per_replica = float(application["args"]["num_gpus"])
    (workers,) = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    (container,) = workers["template"]["spec"]["containers"]
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus >= math.ceil(per_replica) > 0
    # Enough GPU workers for the most replicas Serve may ask for.
    assert workers["maxReplicas"] * gpus >= application["args"]["max_replicas"] * per_replica
    assert container["image"] == manifest["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"][
        "containers"][0]["image"]


def test_serve_arguments_are_valid(application):
    pytest.importorskip("ray.serve", reason="Ray Serve is the optional extra deconv[ray]")
    module_name, _, attr = application["import_path"].partition(":")
    module = importlib.import_module(module_name)
    config = module.RayServeConfig(**application["args"])  # unknown names or settings fail here
    assert config.num_gpus == 1
    assert getattr(module, attr)(application["args"]) is not None  # the builder accepts them


def test_installed_ray_is_the_pinned_one():
    ray = pytest.importorskip("ray")
    assert ray.__version__ == _pinned_ray_version()
