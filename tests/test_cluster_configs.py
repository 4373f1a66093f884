"""The cluster configs under cluster/ are checked without a cluster (and without starting Ray):

- every KubeRay manifest validates against the RayCluster / RayJob / RayService CRD schemas
  (KubeRay's openAPIV3Schema, made strict the way the API server's structural schemas are: an
  unknown field is an error, so a misspelt field name fails here rather than being dropped), the
  RayJob the retraining CronJob creates (held in its ConfigMap) included; the CronJob's pod
  template validates against the same CRDs' PodTemplateSpec, its own fields against batch/v1's;
- the RayService's serveConfigV2 is a valid Ray Serve config whose application args and the
  RayJobs' `python -m workflows ... --config ... --set ...` entrypoints are valid workflow configs;
- every Ray pod has the NVMe cache/spill mount, S3 credentials from a Secret, token auth and
  Prometheus annotations; no file holds credentials;
- the cluster-launcher YAML passes Ray's own schema (ray/autoscaler/ray-schema.json);
- cluster/runtime-env.yaml uploads the code and excludes data, venvs, caches and run outputs.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "cluster"
KUBERAY = CLUSTER / "kuberay"
CRD_DIR = ROOT.parent / "shared" / "schemas" / "kuberay"
CRD_FILES = {
    "RayCluster": "ray.io_rayclusters.yaml",
    "RayJob": "ray.io_rayjobs.yaml",
    "RayService": "ray.io_rayservices.yaml",
}
MANIFESTS = sorted(KUBERAY.glob("*.yaml"))
LAUNCHER = CLUSTER / "launcher" / "aws-gpu.yaml"
RUNTIME_ENV = CLUSTER / "runtime-env.yaml"
APP_DIR = "/app"  # where the project image holds the repository (cluster/README.md)

NVME = "/mnt/nvme"
CACHE_DIR = "/mnt/nvme/workflows-cache"
S3_SECRET_KEYS = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
SECRET_ENV_NAMES = S3_SECRET_KEYS | {"AWS_SESSION_TOKEN", "RAY_AUTH_TOKEN"}

Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.load_all(path.read_text(), Loader=Loader) if d is not None]


# --- CRD schema -> strict JSON schema ---------------------------------------------------------

# The CRDs leave `metadata` of the resource itself open ({"type": "object"}): the API server
# validates it as ObjectMeta. The part of ObjectMeta that manifests here use, strictly.
OBJECT_META = {
    "type": "object",
    "anyOf": [{"required": ["name"]}, {"required": ["generateName"]}],  # `kubectl create` takes either
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
        "generateName": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[-a-z0-9])?$", "maxLength": 58},
        "namespace": {"type": "string"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}


def strict_schema(node):
    """An OpenAPI v3 (Kubernetes structural) schema as a JSON schema that rejects unknown fields:
    `additionalProperties: false` wherever an object lists `properties` and neither allows extra
    keys (`additionalProperties`) nor sets `x-kubernetes-preserve-unknown-fields`; `nullable`
    becomes a null type; `x-kubernetes-int-or-string` an integer-or-string; other `x-kubernetes-*`
    keys (CEL validations, list/map types: see list_map_errors) are dropped."""
    if isinstance(node, list):
        return [strict_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: strict_schema(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if (
        "properties" in node
        and "additionalProperties" not in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    if out.pop("nullable", False) and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    return out


@functools.cache
def crd_schema(kind: str) -> tuple[dict, dict]:
    """(strict JSON schema, original openAPIV3Schema) of the served storage version of `kind`."""
    path = CRD_DIR / CRD_FILES[kind]
    if not path.is_file():
        pytest.skip(
            f"KubeRay CRD schemas not found at {CRD_DIR} (expected {', '.join(CRD_FILES.values())}): "
            "the manifests cannot be validated here"
        )
    crd = yaml.load(path.read_text(), Loader=Loader)
    assert crd["spec"]["names"]["kind"] == kind, path
    version = next(v for v in crd["spec"]["versions"] if v.get("storage"))
    raw = version["schema"]["openAPIV3Schema"]
    schema = strict_schema(raw)
    schema["required"] = ["apiVersion", "kind", "metadata", "spec"]
    schema["properties"]["apiVersion"] = {"const": f"{crd['spec']['group']}/{version['name']}"}
    schema["properties"]["kind"] = {"const": kind}
    schema["properties"]["metadata"] = OBJECT_META
    return schema, raw


def list_map_errors(schema: dict, instance, path: str = "") -> list[str]:
    """Duplicate keys in `x-kubernetes-list-type: map` lists (two env vars with one name, two
    ports with one containerPort/protocol), which the API server rejects."""
    errors: list[str] = []
    if isinstance(instance, dict) and isinstance(schema, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, value in instance.items():
            sub = props.get(key, extra if isinstance(extra, dict) else None)
            if sub:
                errors += list_map_errors(sub, value, f"{path}.{key}")
    elif isinstance(instance, list) and isinstance(schema, dict):
        items = schema.get("items") or {}
        if schema.get("x-kubernetes-list-type") == "map":
            keys = schema.get("x-kubernetes-list-map-keys", [])
            seen = set()
            for item in instance:
                if isinstance(item, dict):
                    ident = tuple(item.get(k, (items.get("properties") or {}).get(k, {}).get("default")) for k in keys)
                    if ident in seen:
                        errors.append(f"{path}: duplicate entry {dict(zip(keys, ident))}")
                    seen.add(ident)
        for i, item in enumerate(instance):
            errors += list_map_errors(items, item, f"{path}[{i}]")
    return errors


def crd_errors(doc: dict) -> list[str]:
    kind = doc.get("kind")
    if kind not in CRD_FILES:
        return [f"kind {kind!r} is not one of {sorted(CRD_FILES)}"]
    schema, raw = crd_schema(kind)
    validator = jsonschema.Draft4Validator(schema)
    errors = [
        f"{'.'.join(str(p) for p in e.absolute_path) or '(top level)'}: {e.message}"
        for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    ]
    return errors + list_map_errors(raw, doc)


@functools.cache
def manifest(name: str) -> list[dict]:
    return load_docs(KUBERAY / name)


RAY_KINDS = tuple(CRD_FILES)


def ray_docs(name: str) -> list[dict]:
    """The Ray resources of a manifest file: its RayCluster/RayJob/RayService documents, and those a
    ConfigMap of it holds for something else to create (the retraining CronJob's RayJob)."""
    out = []
    for doc in manifest(name):
        if doc["kind"] in RAY_KINDS:
            out.append(doc)
        elif doc["kind"] == "ConfigMap":
            out += [d for text in doc.get("data", {}).values() for d in yaml.safe_load_all(text)
                    if isinstance(d, dict) and d.get("kind") in RAY_KINDS]
    return out


def all_docs():
    return [(path.name, i, doc) for path in MANIFESTS for i, doc in enumerate(ray_docs(path.name))]


def cluster_spec(doc: dict) -> dict:
    return {
        "RayCluster": lambda s: s,
        "RayJob": lambda s: s["rayClusterSpec"],
        "RayService": lambda s: s["rayClusterConfig"],
    }[doc["kind"]](doc["spec"])


def groups(doc: dict) -> list[tuple[str, dict]]:
    spec = cluster_spec(doc)
    return [("head", spec["headGroupSpec"])] + [(g["groupName"], g) for g in spec.get("workerGroupSpecs", [])]


def test_the_manifests_exist():
    assert {p.name for p in MANIFESTS} >= {
        "raycluster.yaml",
        "rayjob-pipeline.yaml",
        "rayjob-train.yaml",
        "rayservice.yaml",
        "rayservice-vllm.yaml",
        "cronjob-retrain.yaml",
    }
    kinds = sorted(doc["kind"] for _, _, doc in all_docs())
    assert kinds == ["RayCluster", "RayJob", "RayJob", "RayJob", "RayService", "RayService"]


@pytest.mark.parametrize("name", [p.name for p in MANIFESTS])
def test_manifest_validates_against_the_kuberay_crd(name):
    for i, doc in enumerate(ray_docs(name)):
        errors = crd_errors(doc)
        assert not errors, f"{name} (document {i}) does not match the KubeRay CRD:\n  " + "\n  ".join(errors)


def _rename_key(d: dict, old: str, new: str) -> None:
    d[new] = d.pop(old)


@pytest.mark.parametrize(
    "mutate, where",
    [
        (lambda m: _rename_key(m["spec"], "rayVersion", "rayVerison"), "rayVerison"),
        (lambda m: _rename_key(m["spec"]["workerGroupSpecs"][0], "rayStartParams", "rayStartParam"), "rayStartParam"),
        (
            lambda m: _rename_key(
                m["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["volumeMounts"][0],
                "mountPath",
                "mountpath",
            ),
            "mountpath",
        ),
        (
            lambda m: _rename_key(
                m["spec"]["workerGroupSpecs"][0]["template"]["metadata"], "annotations", "anotations"
            ),
            "anotations",
        ),
        (lambda m: m["spec"]["authOptions"].update(mode="tokens"), "tokens"),
        (lambda m: m["spec"]["workerGroupSpecs"][0].update(replicas="two"), "two"),
        (
            lambda m: m["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"].append(
                {"name": "WORKFLOWS_CACHE_DIR", "value": "/tmp"}
            ),
            "duplicate entry",
        ),
    ],
    ids=["spec-field", "worker-group-field", "container-field", "pod-metadata-field", "enum", "type", "duplicate-env"],
)
def test_a_typo_in_a_manifest_is_caught(mutate, where):
    """The validation is strict: a misspelt field name deep in a pod template, a wrong enum
    value or type, a duplicated env var each fail (the real manifest passes, see above)."""
    doc = copy.deepcopy(manifest("raycluster.yaml")[0])
    assert not crd_errors(doc)
    mutate(doc)
    errors = crd_errors(doc)
    assert errors and any(where in e for e in errors), errors


def test_a_typo_inside_the_rayjob_cluster_spec_is_caught():
    doc = copy.deepcopy(manifest("rayjob-train.yaml")[0])
    _rename_key(doc["spec"]["rayClusterSpec"]["headGroupSpec"], "rayStartParams", "rayStartParms")
    _rename_key(doc["spec"], "shutdownAfterJobFinishes", "shutdownAfterJobFinished")
    errors = " ".join(crd_errors(doc))
    assert "rayStartParms" in errors and "shutdownAfterJobFinished" in errors


# --- what every Ray pod must have -------------------------------------------------------------


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


@pytest.mark.parametrize("name", [p.name for p in MANIFESTS])
def test_every_ray_pod_has_nvme_cache_spilling_secrets_auth_and_metrics(name):
    for doc in ray_docs(name):
        spec = cluster_spec(doc)
        assert spec.get("authOptions", {}).get("mode") == "token", f"{name}: Ray token authentication is off"
        assert spec.get("rayVersion") == "2.60.0", f"{name}: rayVersion must match the Ray the project pins"
        for group, g in groups(doc):
            where = f"{name} {group}"
            pod = g["template"]
            ann = pod.get("metadata", {}).get("annotations", {})
            assert ann.get("prometheus.io/scrape") == "true" and ann.get("prometheus.io/port") == "8080", where
            params = g.get("rayStartParams", {})
            assert params.get("metrics-export-port") == "8080", f"{where}: Ray metrics must be on :8080"
            spill = params.get("object-spilling-directory", "")
            ray_container = pod["spec"]["containers"][0]
            spill_env = env_of(ray_container).get("RAY_object_spilling_config", {}).get("value", "")
            assert spill.startswith(NVME + "/") or NVME in spill_env, f"{where}: object spilling is not on {NVME}"

            volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
            nvme_mounts = [m for m in ray_container.get("volumeMounts", []) if m["mountPath"] == NVME]
            assert nvme_mounts, f"{where}: {NVME} is not mounted"
            vol = volumes[nvme_mounts[0]["name"]]
            assert vol.get("hostPath", {}).get("path") or vol.get("persistentVolumeClaim") or vol.get("ephemeral"), (
                f"{where}: {NVME} must be the node's local disk (hostPath or a local PV)"
            )

            env = env_of(ray_container)
            assert env.get("WORKFLOWS_CACHE_DIR", {}).get("value") == CACHE_DIR, f"{where}: WORKFLOWS_CACHE_DIR"
            from_secret = {k for k, e in env.items() if e.get("valueFrom", {}).get("secretKeyRef")}
            env_from_secret = [s for s in ray_container.get("envFrom", []) if s.get("secretRef")]
            assert S3_SECRET_KEYS <= from_secret or env_from_secret, f"{where}: S3 credentials must come from a Secret"

            limits = ray_container.get("resources", {}).get("limits", {})
            if group == "head":
                assert "nvidia.com/gpu" not in limits and params.get("num-cpus") == "0", (
                    f"{where}: a CPU head without tasks"
                )
            assert (
                ray_container["image"]
                == manifest("raycluster.yaml")[0]["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]
            )


@pytest.mark.parametrize("name", ["raycluster.yaml", "rayjob-pipeline.yaml", "rayjob-train.yaml",
                                  "cronjob-retrain.yaml"])
def test_training_clusters_have_a_gpu_worker_group(name):
    doc = ray_docs(name)[0]
    gpu_groups = [
        g
        for _, g in groups(doc)[1:]
        if int(g["template"]["spec"]["containers"][0].get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
        > 0
    ]
    assert gpu_groups, f"{name}: no worker group with nvidia.com/gpu limits"


# --- the commands and configs the manifests run ------------------------------------------------


def parse_workflows_command(argv: list[str]) -> tuple[str, str, list[str]]:
    """`python -m workflows STAGE --config FILE --set K=V ...` -> (stage, config, overrides)."""
    assert argv[:3] == ["python", "-m", "workflows"], f"not a `python -m workflows` command: {argv}"
    stage, rest = argv[3], argv[4:]
    config, overrides = None, []
    it = iter(rest)
    for arg in it:
        if arg in ("--config", "-c"):
            config = next(it)
        elif arg == "--set":
            overrides.append(next(it))
        else:
            pytest.fail(f"unexpected argument {arg!r} in {argv}")
    assert config, f"no --config in {argv}"
    return stage, config, overrides


def repo_path(path_in_image: str) -> Path:
    assert path_in_image.startswith(APP_DIR + "/"), f"{path_in_image}: configs live in the image under {APP_DIR}"
    return ROOT / path_in_image[len(APP_DIR) + 1 :]


def check_cluster_config(config: str, overrides: list[str]):
    from workflows.config import load_config

    cfg = load_config(repo_path(config), overrides)  # raises on an unknown key or a bad value
    assert not cfg.storage.embedded.enabled, (
        "the embedded S3 endpoint lives on the driver's 127.0.0.1: off on a cluster"
    )
    assert cfg.storage.root.startswith("s3://") and cfg.cache.dir == "auto"
    return cfg


@pytest.mark.parametrize("name, stage", [("rayjob-pipeline.yaml", "pipeline"), ("rayjob-train.yaml", "train")])
def test_rayjob_entrypoint_runs_the_stage_with_a_valid_config(name, stage):
    doc = manifest(name)[0]
    got_stage, config, overrides = parse_workflows_command(shlex.split(doc["spec"]["entrypoint"]))
    assert got_stage == stage
    cfg = check_cluster_config(config, overrides)
    assert cfg.ray.address == "auto" and cfg.train.use_gpu
    if stage == "pipeline":
        assert not cfg.serve.enabled, "serving is the RayService's job, not the pipeline's"


# --- the scheduled retraining: a CronJob that creates the gated pipeline's RayJob ------------------

def _strict(properties: dict, required: tuple[str, ...] = ()) -> dict:
    return {"type": "object", "additionalProperties": False, "properties": properties, "required": list(required)}


_INT = {"type": "integer", "minimum": 0}
_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_SMALL_META = _strict({"labels": _LABELS, "annotations": _LABELS})


def cronjob_schema() -> dict:
    """batch/v1 CronJob, strict: its own fields and the Job's (as the Kubernetes API reference lists
    them), and the pod template as the KubeRay CRDs define a PodTemplateSpec (the RayJob's
    submitterPodTemplate: the core/v1 schema the API server uses, embedded in the CRD)."""
    pod_template = crd_schema("RayJob")[0]["properties"]["spec"]["properties"]["submitterPodTemplate"]
    job_spec = _strict({"backoffLimit": _INT, "activeDeadlineSeconds": _INT, "ttlSecondsAfterFinished": _INT,
                        "completions": _INT, "parallelism": _INT, "template": pod_template}, ("template",))
    spec = _strict({
        "schedule": {"type": "string"}, "timeZone": {"type": "string"},
        "concurrencyPolicy": {"enum": ["Allow", "Forbid", "Replace"]}, "startingDeadlineSeconds": _INT,
        "successfulJobsHistoryLimit": _INT, "failedJobsHistoryLimit": _INT, "suspend": {"type": "boolean"},
        "jobTemplate": _strict({"metadata": _SMALL_META, "spec": job_spec}, ("spec",)),
    }, ("schedule", "jobTemplate"))
    return _strict({"apiVersion": {"const": "batch/v1"}, "kind": {"const": "CronJob"}, "metadata": OBJECT_META,
                    "spec": spec}, ("apiVersion", "kind", "metadata", "spec"))


SIDE_SCHEMAS = {  # the other kinds the CronJob's file holds, strict in the fields they use
    "ServiceAccount": _strict({"apiVersion": {"const": "v1"}, "kind": {}, "metadata": OBJECT_META}),
    "ConfigMap": _strict({"apiVersion": {"const": "v1"}, "kind": {}, "metadata": OBJECT_META,
                          "data": {"type": "object", "additionalProperties": {"type": "string"}}}),
    "Role": _strict({"apiVersion": {"const": "rbac.authorization.k8s.io/v1"}, "kind": {}, "metadata": OBJECT_META,
                     "rules": {"type": "array", "items": _strict({
                         "apiGroups": {"type": "array", "items": {"type": "string"}},
                         "resources": {"type": "array", "items": {"type": "string"}},
                         "verbs": {"type": "array", "items": {"enum": ["get", "list", "watch", "create", "update",
                                                                        "patch", "delete", "deletecollection"]}}},
                         ("apiGroups", "resources", "verbs"))}}),
    "RoleBinding": _strict({"apiVersion": {"const": "rbac.authorization.k8s.io/v1"}, "kind": {},
                            "metadata": OBJECT_META,
                            "roleRef": _strict({"apiGroup": {"const": "rbac.authorization.k8s.io"},
                                                "kind": {"enum": ["Role", "ClusterRole"]},
                                                "name": {"type": "string"}}, ("apiGroup", "kind", "name")),
                            "subjects": {"type": "array", "items": _strict({
                                "kind": {"enum": ["ServiceAccount", "User", "Group"]}, "name": {"type": "string"},
                                "namespace": {"type": "string"}}, ("kind", "name"))}}, ("roleRef", "subjects")),
}

CRON_FIELD = re.compile(r"^(\*|\d+(-\d+)?)(/\d+)?(,(\*|\d+(-\d+)?)(/\d+)?)*$")


def retrain_docs() -> dict[str, dict]:
    docs = manifest("cronjob-retrain.yaml")
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs), "one document of each kind"
    return by_kind


def kind_errors(doc: dict) -> list[str]:
    schema = cronjob_schema() if doc["kind"] == "CronJob" else SIDE_SCHEMAS[doc["kind"]]
    return [f"{'.'.join(str(p) for p in e.absolute_path) or '(top level)'}: {e.message}"
            for e in jsonschema.Draft4Validator(schema).iter_errors(doc)]


def test_the_retrain_cronjobs_documents_validate():
    docs = retrain_docs()
    assert set(docs) == {"ServiceAccount", "Role", "RoleBinding", "ConfigMap", "CronJob"}
    for kind, doc in docs.items():
        assert not kind_errors(doc), f"{kind}: {kind_errors(doc)}"
    bad = copy.deepcopy(docs["CronJob"])
    bad["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    bad["spec"]["concurrencyPolicy"] = "Never"
    errors = " ".join(kind_errors(bad))
    assert "volumeMount" in errors and "Never" in errors  # strict: a typo or a wrong enum fails


def test_the_retrain_cronjob_creates_the_gated_pipeline_rayjob_on_its_schedule():
    docs = retrain_docs()
    cron = docs["CronJob"]["spec"]
    fields = cron["schedule"].split()
    assert len(fields) == 5 and all(CRON_FIELD.match(f) for f in fields), cron["schedule"]
    assert cron["concurrencyPolicy"] == "Forbid"  # never two retrains at once
    pod = cron["jobTemplate"]["spec"]["template"]["spec"]
    # the pod's identity may create RayJobs, and nothing else
    account = docs["ServiceAccount"]["metadata"]["name"]
    assert pod["serviceAccountName"] == account
    binding = docs["RoleBinding"]
    assert {"kind": "ServiceAccount", "name": account} in binding["subjects"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": docs["Role"]["metadata"]["name"]}
    assert docs["Role"]["rules"] == [{"apiGroups": ["ray.io"], "resources": ["rayjobs"],
                                      "verbs": ["create", "get", "list"]}]
    # its one command creates the RayJob that the ConfigMap it mounts holds
    (container,) = pod["containers"]
    (mount,) = container["volumeMounts"]
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == docs["ConfigMap"]["metadata"]["name"]
    assert container["command"][:3] == ["kubectl", "create", "-f"]
    key = container["command"][3].removeprefix(mount["mountPath"].rstrip("/") + "/")
    (job,) = list(yaml.safe_load_all(docs["ConfigMap"]["data"][key]))
    assert job["kind"] == "RayJob" and "generateName" in job["metadata"] and "name" not in job["metadata"]
    assert not crd_errors(job)
    stage, config, overrides = parse_workflows_command(shlex.split(job["spec"]["entrypoint"]))
    cfg = check_cluster_config(config, overrides)
    assert stage == "pipeline" and cfg.ray.address == "auto" and cfg.train.use_gpu and not cfg.serve.enabled
    assert cfg.registry.promote is not None and cfg.registry.promote.alias == "production"  # the gate is on
    assert not cfg.data.write_builtin, "a scheduled retrain reads the data that landed, never builds demo data"
    assert job["spec"]["shutdownAfterJobFinishes"] is True


def serve_config(name: str = "rayservice.yaml") -> dict:
    (doc,) = manifest(name)
    return yaml.safe_load(doc["spec"]["serveConfigV2"])


@pytest.mark.parametrize("name", ["rayservice.yaml", "rayservice-vllm.yaml"])
def test_rayservice_serve_config_is_a_valid_ray_serve_config(name):
    from ray.serve.schema import DeploymentSchema, HTTPOptionsSchema, ServeApplicationSchema, ServeDeploySchema

    raw = serve_config(name)
    ServeDeploySchema.model_validate(raw)
    # Serve's schemas ignore unknown keys: make a misspelt one an error here.
    assert set(raw) <= set(ServeDeploySchema.model_fields), set(raw) - set(ServeDeploySchema.model_fields)
    assert set(raw.get("http_options", {})) <= set(HTTPOptionsSchema.model_fields)
    assert raw["http_options"]["port"] == 8000 and raw["http_options"]["host"] == "0.0.0.0"
    (app,) = raw["applications"]
    assert set(app) <= set(ServeApplicationSchema.model_fields), set(app) - set(ServeApplicationSchema.model_fields)
    for dep in app.get("deployments", []):
        assert set(dep) <= set(DeploymentSchema.model_fields), set(dep) - set(DeploymentSchema.model_fields)
    assert app["import_path"] == "workflows.serve.app:build_app"
    assert set(app["args"]) <= {"config", "model", "set"}
    check_cluster_config(app["args"]["config"], app["args"].get("set", []))
    from workflows.config import check_name

    check_name(app["args"]["model"].split(":")[0], "model name")


def test_the_vllm_rayservice_spans_two_gpus_of_a_node_with_tensor_parallelism():
    """The 8B-class chat model's RayService: vLLM's engine, tensor-parallel over 2 GPUs, a replica per
    node of 2 GPUs (its vLLM worker's placement group holds them: the replica asks for none)."""
    from workflows.config import load_config
    from workflows.tasks.chat import ChatTask

    (app,) = serve_config("rayservice-vllm.yaml")["applications"]
    cfg = load_config(repo_path(app["args"]["config"]), app["args"]["set"])
    gen = cfg.serve.generate
    assert gen.engine == "vllm" and gen.tensor_parallel_size == 2 and cfg.serve.gpus_per_replica == 2
    assert gen.vllm_python == "/app/.venv-vllm/bin/python" and cfg.serve.auth_token_env
    assert ChatTask(cfg).serving.deployment_options()["ray_actor_options"] == {"num_gpus": 0}
    (doc,) = manifest("rayservice-vllm.yaml")
    (group,) = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    (container,) = group["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert {e["name"] for e in container["env"]} >= {cfg.serve.auth_token_env}


def test_rayservice_builder_builds_the_configured_deployments():
    """The builder named by import_path takes the manifest's args and returns an Application
    with the deployments the config names (binding only: no Ray, no model download)."""
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    import workflows.serve.app as serve_app

    (app_cfg,) = serve_config()["applications"]
    args = dict(app_cfg["args"], config=str(repo_path(app_cfg["args"]["config"])))
    app = call_user_app_builder_with_args_if_necessary(serve_app.build_app, args)
    assert {d["name"] for d in app_cfg.get("deployments", [])} <= {app._bound_deployment.name}


# --- credentials -------------------------------------------------------------------------------


def inline_secrets(node, path="") -> list[str]:
    found = []
    if isinstance(node, dict):
        if node.get("name") in SECRET_ENV_NAMES and "value" in node:
            found.append(f"{path}: {node['name']} has an inline value")
        for k, v in node.items():
            found += inline_secrets(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found += inline_secrets(v, f"{path}[{i}]")
    return found


CREDENTIAL_PATTERNS = [
    re.compile(r"AKIA[0-9A-Z]{16}"),  # an AWS access key id
    re.compile(r"(?i)(aws_secret_access_key|aws_session_token|ray_auth_token)\s*[=:]\s*['\"]?[A-Za-z0-9/+]{16,}"),
    re.compile(r"(?i)--from-literal=\w+=(?!\.\.\.)[A-Za-z0-9/+]{16,}"),
]


@pytest.mark.parametrize(
    "path", sorted(p for p in CLUSTER.rglob("*") if p.is_file()), ids=lambda p: str(p.relative_to(CLUSTER))
)
def test_no_inline_credentials(path):
    text = path.read_text()
    for pattern in CREDENTIAL_PATTERNS:
        assert not pattern.search(text), f"{path}: looks like a credential ({pattern.pattern})"
    if path.suffix in (".yaml", ".yml"):
        found = [f for doc in load_docs(path) for f in inline_secrets(doc)]
        assert not found, found
        if path.parent == KUBERAY:  # the embedded Serve config too
            for doc in load_docs(path):
                if doc.get("kind") == "RayService":
                    assert not inline_secrets(yaml.safe_load(doc["spec"]["serveConfigV2"]))


def test_an_inline_secret_would_be_caught():
    doc = copy.deepcopy(manifest("raycluster.yaml")[0])
    env = doc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    next(e for e in env if e["name"] == "AWS_SECRET_ACCESS_KEY").update(value="x", valueFrom=None)
    assert inline_secrets(doc)


# --- the cluster launcher -----------------------------------------------------------------------


def test_launcher_config_passes_rays_schema():
    import ray.autoscaler
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = yaml.safe_load(LAUNCHER.read_text())
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(cfg, schema)  # the file as written
    validate_config(prepare_config(copy.deepcopy(cfg)))  # as `ray up` sees it, with Ray's AWS defaults


def test_launcher_mounts_nvme_installs_the_project_and_enables_auth():
    cfg = yaml.safe_load(LAUNCHER.read_text())
    assert cfg["provider"]["type"] == "aws"
    types = cfg["available_node_types"]
    head = types[cfg["head_node_type"]]
    assert head["resources"].get("CPU") == 0 and not head["node_config"]["InstanceType"].startswith(("g", "p"))
    gpu_types = [
        t
        for n, t in types.items()
        if n != cfg["head_node_type"] and t["node_config"]["InstanceType"].startswith(("g5", "p4d", "p5"))
    ]
    assert gpu_types and any(t.get("max_workers", 0) > 0 for t in gpu_types)
    init = "\n".join(cfg["initialization_commands"])
    assert "mkfs" in init and f"mount -o noatime $dev {NVME}" in init and "Instance Storage" in init
    docker = cfg["docker"]
    assert docker["image"].startswith("rayproject/ray:2.60.0-")
    run_opts = " ".join(docker["run_options"])
    assert (
        f"{NVME}:{NVME}" in run_opts
        and f"WORKFLOWS_CACHE_DIR={CACHE_DIR}" in run_opts
        and "RAY_AUTH_MODE=token" in run_opts
    )
    assert "~/.ray/auth_token" in cfg["file_mounts"] and cfg["file_mounts"]["~/workflows"] == "."
    assert any("pip install" in c and "~/workflows" in c for c in cfg["setup_commands"])
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        assert f"--object-spilling-directory={NVME}/" in " ".join(cfg[key]), key
    assert not inline_secrets(cfg)


# --- ray job submit's runtime env ---------------------------------------------------------------


def test_runtime_env_uploads_code_and_excludes_data_venvs_caches():
    from ray._private.runtime_env.packaging import _get_excludes
    from ray.runtime_env import RuntimeEnv

    raw = yaml.safe_load(RUNTIME_ENV.read_text())
    RuntimeEnv(**raw)  # Ray's own validation of the fields
    assert raw["working_dir"] == "."
    excluded = _get_excludes(ROOT, raw["excludes"])
    for path in (
        ".git",
        ".git/HEAD",
        ".venv",
        ".venv/bin/python",
        "venv",
        ".workflows",
        ".workflows/s3/x",
        "data",
        "data/raw.csv",
        "benchmarks/results",
        "benchmarks/results/quickstart.json",
        "workflows/__pycache__",
        ".pytest_cache",
        "workflows.egg-info",
    ):
        assert excluded(ROOT / path), f"{path} would be uploaded"
    for path in (
        "workflows",
        "workflows/cli/__init__.py",
        "workflows/config/workflow.py",
        "configs/quickstart.yaml",
        "pyproject.toml",
        "docs/data",
        "docs/data/quickstart.md",
        "benchmarks",
    ):
        assert not excluded(ROOT / path), f"{path} would not be uploaded"


# --- the local multi-node scripts ---------------------------------------------------------------


@pytest.mark.parametrize("script", ["start.sh", "stop.sh"])
def test_local_cluster_scripts_are_valid_bash(script):
    path = CLUSTER / "local" / script
    assert os.access(path, os.X_OK), f"{path} is not executable"
    res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    text = path.read_text()
    assert "pkill" not in text and "killall" not in text and "ray stop" not in text.replace("`ray stop`", "")
    if script == "start.sh":
        for needle in (
            "WORKFLOWS_CACHE_DIR=",
            "--temp-dir=",
            "--object-spilling-directory=",
            "--node-manager-port=",
            "--object-manager-port=",
            "--dashboard-agent-listen-port=",
            "--num-cpus=",
        ):
            assert needle in text, needle
