"""Serve config files: what `workflows serve --emit-config FILE` writes.

The file is Ray Serve's own deploy schema, so `serve run FILE` / `serve deploy FILE` accept it and
a KubeRay RayService embeds it as `serveConfigV2`. Each model is one application built by
`workflows.serve.app:build_app` from the workflow config, so a replica on any node loads the
model from the registry exactly as `workflows serve` does. Deploying the file again with another
model version rolls the application over: Serve starts the new replicas before it stops the old.
"""

from __future__ import annotations

from pathlib import Path

from workflows import registry
from workflows.config import SHIPPED_CONFIGS, WorkflowConfig, resolve_config
from workflows.errors import UserError


def route_prefixes(specs: list[str]) -> dict[str, str]:
    """One model is served at /; several side by side at /NAME, or /NAME/vN for versions of one name
    (/NAME/ALIAS for its aliases)."""
    parsed = [registry.parse_spec(s) for s in specs]
    if len(specs) == 1:
        return {specs[0]: "/"}
    out = {}
    for spec, (name, version) in zip(specs, parsed):
        alias = registry.split_alias(spec)[1]
        out[spec] = f"/{name}" + (f"/v{version}" if version is not None else f"/{alias}" if alias else "")
    if len(set(out.values())) != len(out):
        raise UserError(f"models {specs} would share a route; name distinct versions (NAME:1 NAME:2)")
    return out


def app_name(spec: str) -> str:
    name, version = registry.parse_spec(spec)
    alias = registry.split_alias(spec)[1]
    return f"model-{name}" + (f"-v{version}" if version is not None else f"-{alias}" if alias else "")


def serve_config(cfg: WorkflowConfig, config_path: str, overrides: list[str], specs: list[str]) -> dict:
    """A Serve deploy config for these models, validated against Ray Serve's schema."""
    from ray.serve.schema import ServeDeploySchema

    from workflows.serve.app import deployment_options, logging_config
    from workflows.serve.guards import check_exposure

    check_exposure(cfg.serve)  # `serve run` of the file binds serve.host as `workflows serve` would

    # `serve run` builds the application in a Ray worker whose working directory is not this one
    if resolve_config(config_path).parent != SHIPPED_CONFIGS:
        config_path = str(Path(config_path).resolve())
    if cfg.storage.embedded.enabled:
        data_dir = Path(cfg.storage.embedded.data_dir).expanduser().resolve()
        overrides = [*overrides, f"storage.embedded.data_dir={data_dir}"]
    apps = []
    for spec, prefix in route_prefixes(specs).items():
        apps.append({
            "name": app_name(spec),
            "route_prefix": prefix,
            "import_path": "workflows.serve.app:build_app",
            "args": {"config": config_path, "model": spec, "set": list(overrides)},
            "deployments": [{"name": "ModelServer", **deployment_options(cfg)}],
        })
    doc = {"proxy_location": "EveryNode", "http_options": {"host": cfg.serve.host, "port": cfg.serve.port},
           "logging_config": logging_config(cfg.serve), "applications": apps}
    ServeDeploySchema.model_validate(doc)
    return doc
