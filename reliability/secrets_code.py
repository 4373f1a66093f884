"""secrets_hygiene, parts 2 and 3 (reliability.secrets runs them): what the code itself refuses.
Static: no unsafe loading (torch.load without weights_only, pickle, joblib, allow_pickle) in
workflows/, weights loaded with use_safetensors, found by parsing the source. Names: registry specs
and config names that would become unsafe paths are rejected before they do."""

from __future__ import annotations

import ast
from pathlib import Path

from reliability import ROOT


# -- 2. static --------------------------------------------------------------------------------
def static_checks(package: Path) -> dict:
    """Parse every module; flag unsafe deserialization and weights not loaded via safetensors."""
    violations, notes, checked, files = [], [], 0, 0
    for path in sorted(package.rglob("*.py")):
        files += 1
        rel = path.relative_to(package.parent)
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = _dotted(node.func)
            kw = {k.arg: k.value for k in node.keywords if k.arg}
            where = f"{rel}:{node.lineno}"
            if name.endswith("torch.load") or name == "load" and _imported_from(tree, "load", "torch"):
                checked += 1
                if not _is_true(kw.get("weights_only")):
                    violations.append(f"torch.load without weights_only=True at {where}")
            elif name in (
                "pickle.load",
                "pickle.loads",
                "cPickle.load",
                "joblib.load",
                "dill.load",
                "dill.loads",
                "cloudpickle.load",
                "cloudpickle.loads",
            ):
                checked += 1
                violations.append(f"{name} at {where}")
            elif name.endswith(("np.load", "numpy.load")):
                checked += 1
                if _is_true(kw.get("allow_pickle")):
                    violations.append(f"{name}(allow_pickle=True) at {where}")
            elif name.endswith(("dcp.load", "_load_state_dict", "dcp_to_torch_save")):
                checked += 1  # DCP's own reader unpickles .metadata: only with checkpoint.py's
                reader = kw.get("storage_reader")
                if not (isinstance(reader, ast.Call) and _dotted(reader.func) == "_Reader"):
                    violations.append(f"{name} without checkpoint._Reader at {where}")
            elif name.endswith(".from_pretrained") and "Model" in name.rsplit(".", 1)[0]:
                checked += 1  # model weights (tokenizers and configs hold none); a GGUF file is read by the
                # gguf package (tensors from a memory map, no pickle), so gguf_file= counts as safe
                if not (_is_true(kw.get("use_safetensors")) or "gguf_file" in kw):
                    violations.append(f"{name} without use_safetensors=True at {where}")
    # torch.distributed.checkpoint's own reader unpickles a checkpoint's `.metadata` (and
    # torch.load(weights_only=False)s its non-tensor entries): workflows/train/checkpoint.py reads
    # both with restricted loaders (_Reader, its planners), which every DCP load above must use.
    notes.append(
        "note: DCP checkpoints are read with workflows/train/checkpoint.py's _Reader (.metadata by a "
        "restricted unpickler, non-tensor values with torch.load(weights_only=True))"
    )
    return {"violations": violations, "notes": notes, "checked": checked, "files": files}


def _dotted(node) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _is_true(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _imported_from(tree, name: str, module: str) -> bool:
    return any(
        isinstance(n, ast.ImportFrom) and n.module == module and any(a.name == name for a in n.names)
        for n in ast.walk(tree)
    )


# -- 3. names ---------------------------------------------------------------------------------
HOSTILE_NAMES = [
    "..",
    "../etc",
    "../../etc/passwd",
    "a/../../b",
    "a/b",
    "/abs",
    ".hidden",
    "...",
    "a..b",
    "..%2F..%2Fetc",
    "%2e%2e",
    "a\\b",
    "..\\..\\win",
    "a\x00b",
    "a\nb",
    "a b",
    "",
    " ",
    "-rf",
    "x" * 65,
    "ünïcode",
    "a:b:c",
    "s3://bucket/key",
    "~root",
    "$HOME",
    "a;rm -rf /",
]


def name_checks() -> dict:
    from workflows import registry
    from workflows.config import check_name, load_config
    from workflows.errors import UserError

    accepted, errors, checked = [], [], 0
    for bad in HOSTILE_NAMES:
        checked += 1
        try:
            name, _ = registry.parse_spec(bad)
            accepted.append(f"parse_spec({bad!r}) -> {name!r}")
        except UserError:
            pass
        except Exception as e:  # noqa: BLE001
            errors.append(f"parse_spec({bad!r}): {type(e).__name__}")
        checked += 1
        try:
            check_name(bad)
            accepted.append(f"check_name({bad!r})")
        except ValueError:
            pass
        for key in ("name", "registry.name"):
            checked += 1
            try:
                load_config(ROOT / "configs" / "quickstart.yaml", [f"{key}={bad}"])
                accepted.append(f"load_config({key}={bad!r})")
            except UserError:
                pass
            except Exception as e:  # noqa: BLE001
                errors.append(f"load_config({key}={bad!r}): {type(e).__name__}")
    # register() validates again before writing anything (it has no store here: must fail first)
    from workflows.config import load_config as _load
    from workflows.storage.uri import StorageContext

    cfg = _load(
        ROOT / "configs" / "quickstart.yaml",
        ["storage.embedded.enabled=false", "storage.root=/nonexistent-reliability"],
    )
    for bad in ("../evil", "a/b", ".."):
        checked += 1
        try:
            registry.register(cfg, StorageContext(), "/nonexistent-reliability-src", bad, {})
            accepted.append(f"register({bad!r})")
        except (ValueError, UserError):
            pass
        except Exception as e:  # noqa: BLE001 - e.g. it touched the filesystem before checking
            errors.append(f"register({bad!r}): {type(e).__name__}: {e}")
    return {"checked": checked, "accepted": accepted, "errors": errors}
