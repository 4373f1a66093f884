"""One typed config for the whole workflow, loaded from YAML with `--set a.b=c` overrides.

Every model forbids unknown keys, so a typo is reported with its dotted path and the file.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from workflows.errors import UserError
from workflows.overrides import apply_overrides

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def check_name(value: str, what: str = "name") -> str:
    """Names that become parts of paths/URIs: no separators, no '..', no leading dot."""
    if not NAME_RE.match(value) or ".." in value:
        raise ValueError(
            f"invalid {what} {value!r}: use 1-64 letters, digits, '_', '-', '.', starting with a letter or digit"
        )
    return value


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


class EmbeddedS3Config(Strict):
    """moto's S3 server on this machine, persisted to `data_dir` between commands."""

    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535, description="0 picks a free port")
    data_dir: str = Field(".workflows/s3", description="local directory that persists the buckets")


class StorageConfig(Strict):
    root: str = Field("s3://workflows", description="URI under which processed data, runs and models live")
    endpoint_url: str | None = Field(
        None, description="S3-compatible endpoint (MinIO, ...); else AWS_ENDPOINT_URL or AWS"
    )
    region: str | None = Field(None, description="else AWS_REGION / AWS_DEFAULT_REGION")
    embedded: EmbeddedS3Config = EmbeddedS3Config()
    retries: int = Field(5, ge=0, description="S3 client retry attempts")


class CacheConfig(Strict):
    enabled: bool = Field(True, description="read shards through the per-node cache")
    dir: str = Field(
        "auto",
        description="per-node cache directory (shards/, models/); 'auto' = $WORKFLOWS_CACHE_DIR if the node "
        "sets it, else /mnt/nvme/workflows-cache if /mnt/nvme exists, else ~/.cache/workflows "
        "($XDG_CACHE_HOME/workflows when set)",
    )
    max_bytes: int | None = Field(
        None, ge=1, description="byte budget of the shard cache (LRU eviction); None = unbounded"
    )
    verify_checksums: bool = Field(
        False, description="re-hash a cached shard on every hit (slower; size is always checked)"
    )

    def resolved_dir(self) -> str:
        """Resolved on the node that uses it: WORKFLOWS_CACHE_DIR in the node's environment (e.g. a
        pod spec) wins over 'auto'."""
        if self.dir != "auto":
            return os.path.abspath(os.path.expanduser(self.dir))
        if os.environ.get("WORKFLOWS_CACHE_DIR"):
            return os.path.abspath(os.path.expanduser(os.environ["WORKFLOWS_CACHE_DIR"]))
        if os.path.isdir("/mnt/nvme"):
            return "/mnt/nvme/workflows-cache"
        return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "workflows")

    def shard_cache(self, ctx):
        """The shard cache of the node this runs on ('auto' is resolved here, on that node)."""
        from workflows.storage.cache import ShardCache

        return ShardCache(os.path.join(self.resolved_dir(), "shards"), ctx, self.max_bytes, self.verify_checksums)


class RayConfig(Strict):
    address: str | None = Field(
        None,
        description="Ray cluster to join ('auto', host:port, ray://...); 'local' starts a cluster of the command's "
        "own; None joins RAY_ADDRESS's cluster where it is set and not 'local' (`ray job submit` sets it), "
        "else starts a local one",
    )
    num_cpus: int | None = Field(None, ge=1, description="CPUs of a newly started local cluster")
    dashboard: bool = Field(
        True,
        description="start Ray's dashboard with a local cluster; false: fewer processes for a one-node "
        "`workflows serve` (train, tune and `bench serve` need it: Ray Train V2 and the state API use it)",
    )
    dashboard_port: int | None = Field(
        None, ge=0, le=65535,
        description="port of a local cluster's dashboard (a free one instead when it is taken; 0: any free port); "
        "None: $WORKFLOWS_DASHBOARD_PORT where set, else Ray's 8265",
    )


class DataConfig(Strict):
    source: str = Field(..., description="URI of a raw shard, a directory of shards or a glob")
    format: Literal["auto", "csv", "jsonl", "parquet", "tar", "image"] = "auto"
    text_columns: list[str] = Field(["text"], min_length=1, description="text tasks: the columns joined into the input")
    label_column: str = "label"
    image_column: str = Field(
        "image", description="image tasks, parquet shards: the column of encoded image bytes (tar shards and "
        "class-per-folder files carry their images themselves)")
    max_bad_records: int = Field(
        0, ge=0, description="records that cannot be decoded (an image that is truncated, empty, not an image, a "
        "decompression bomb) skipped and named in the preprocessing summary; one more fails preprocessing, "
        "naming the first bad key (0: the first bad record fails it)")
    builtin: Literal["quickstart", "digits"] | None = Field(
        None,
        description="build this dataset into `source` when no shard is there: in the embedded store only, "
        "unless write_builtin is set (anywhere else an empty source is an error)",
    )
    write_builtin: bool = Field(
        False, description="let `builtin` write its dataset into a source outside the embedded store "
        "(a real bucket or a local directory)"
    )
    builtin_rows_per_class: int = Field(900, ge=10)
    val_fraction: float = Field(0.1, ge=0.0, lt=0.5)
    test_fraction: float = Field(0.2, gt=0.0, lt=0.5)
    split_seed: int = 0
    max_rows: int | None = Field(None, ge=1, description="keep at most this many rows (a deterministic subset)")


class PreprocessConfig(Strict):
    tokenizer: str = Field("minilm", description="'minilm' (the packaged all-MiniLM-L6-v2) or a local HF directory")
    max_length: int = Field(128, ge=8, le=4096)
    image_size: int = Field(
        224, ge=8, le=1024, description="image tasks: images are decoded, resized (shorter side) and center-cropped "
        "to this square once, and stored as uint8 tensors; serving decodes requests the same way")
    max_image_pixels: int = Field(
        40_000_000, ge=1, description="image tasks: an image declaring more pixels is refused undecoded "
        "(decompression bombs), in preprocessing and serving alike")
    batch_size: int = Field(256, ge=1)
    concurrency: int = Field(2, ge=1, description="tokenizing or image-decoding Ray tasks at a time")
    rows_per_shard: int = Field(2000, ge=1)


class CausalLMConfig(Strict):
    """A GPT-2-style model built from a size preset, randomly initialized (model.task: causal_lm)."""

    size: Literal["tiny", "small", "gpt2-124m", "gpt2-350m", "gpt2-774m", "1b"] = "gpt2-124m"
    n_layer: int | None = Field(None, ge=1, description="overrides the preset's layers")
    n_embd: int | None = Field(None, ge=8, description="overrides the preset's hidden size")
    n_head: int | None = Field(None, ge=1, description="overrides the preset's attention heads")
    seq_len: int = Field(1024, ge=8, description="tokens per training block (rows are packed into blocks)")


class ModelConfig(Strict):
    task: str = Field(
        "classification",
        description="classification (fine-tune a text classifier), causal_lm (pretrain a causal LM from model.lm), "
        "image_classification, or a plug-in task by import path, module.path:ClassName (a workflows.tasks.base.Task)",
    )
    name_or_path: str = Field(
        "minilm",
        description="text: 'minilm' or a local Hugging Face model directory; images: an architecture by name "
        "(small_cnn, resnet18, resnet50, vit_small, convnext_tiny: new weights), or a directory or object-store "
        "URI in from_pretrained layout (safetensors) whose weights are fine-tuned on the dataset's labels",
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="a plug-in task's own settings (its Options model validates them)")
    trusted_tasks: list[str] = Field(
        default_factory=list, description="plug-in tasks (module.path:ClassName) that serve, evaluate and predict "
        "may import for a registered model whose card names them; model.task is always trusted. A card naming "
        "any other plug-in is refused: the card comes from the store, and must not choose the code that runs")
    dropout: float | None = Field(None, ge=0.0, lt=1.0)
    pooling: Literal["cls", "mean"] = Field(
        "cls",
        description="classification: 'cls' (the checkpoint's pooler on the first token, Hugging Face's classifier) "
        "or 'mean' (normalized mean of all tokens: how sentence-embedding checkpoints such as MiniLM were trained)",
    )
    lm: CausalLMConfig = CausalLMConfig()

    @field_validator("task")
    @classmethod
    def _known_task(cls, v: str) -> str:
        from workflows.tasks import check_task_name

        return check_task_name(v)

    @model_validator(mode="after")
    def _heads_divide_hidden(self):
        from workflows.train.lm import shape

        _, hidden, heads = shape(self.lm)
        if hidden % heads:
            raise ValueError(f"lm: hidden size {hidden} is not divisible by {heads} heads")
        return self


class AugmentConfig(Strict):
    """On-the-fly augmentation of training images, in the training workers (seeded per sample and
    epoch, so a resumed epoch sees the same crops)."""

    enabled: bool = True
    crop_scale: tuple[float, float] = Field(
        (0.08, 1.0), description="RandomResizedCrop: the range of the crop's area as a fraction of the image")
    crop_ratio: tuple[float, float] = Field((3 / 4, 4 / 3), description="RandomResizedCrop: aspect ratio range")
    flip: bool = Field(True, description="horizontal flip with probability 0.5 (off for digits, text, ...)")

    @model_validator(mode="after")
    def _ranges(self):
        for name in ("crop_scale", "crop_ratio"):
            lo, hi = getattr(self, name)
            if not 0 < lo <= hi or (name == "crop_scale" and hi > 1):
                raise ValueError(f"{name} must be 0 < low <= high{' <= 1' if name == 'crop_scale' else ''}")
        return self


class TrainConfig(Strict):
    num_workers: int | tuple[int, int] = Field(
        2,
        description="training workers: a number, or [min, max] for an elastic group (Ray Train resizes it within "
        "the range as workers are lost or resources come and go; needs train.loader=stream)",
    )
    cpus_per_worker: float = Field(1, gt=0)
    use_gpu: bool = False
    strategy: Literal["fsdp", "ddp"] = "fsdp"
    epochs: int = Field(3, ge=1)
    batch_size: int = Field(32, ge=1, description="per worker")
    lr: float = Field(1e-4, gt=0)
    head_lr: float | None = Field(
        None, gt=0, description="classification: learning rate of the new head (random weights); None: train.lr"
    )
    head_init: Literal["random", "linear_probe"] = Field(
        "random",
        description="classification: the new head's start: 'random', or 'linear_probe' "
        "(LP-FT: the head is first fitted "
        "on the frozen pretrained features, a logistic regression over all workers' training rows, then "
        "everything is fine-tuned, so early steps do not pull the pretrained features toward a random head)",
    )
    linear_probe_l2: float = Field(1e-3, ge=0, description="head_init=linear_probe: L2 penalty on the head's weights")
    weight_decay: float = Field(0.01, ge=0)
    warmup_fraction: float = Field(0.1, ge=0, lt=1)
    grad_clip: float | None = Field(1.0, gt=0)
    grad_accum_steps: int = Field(
        1, ge=1, description="micro-batches of batch_size per optimizer step (gradient accumulation)"
    )
    activation_checkpointing: bool = Field(
        False, description="recompute each block's activations in backward: less memory, ~1/3 more compute"
    )
    freeze_embeddings: bool = Field(
        False,
        description="classification fine-tuning: keep the pretrained input embeddings fixed (half of MiniLM's "
        "weights): less compute and communication; ignored by causal-LM pretraining (random embeddings, tied to "
        "the LM head)",
    )
    seed: int = 0
    max_train_rows: int | None = Field(None, ge=1, description="cap rows per epoch (tuning, tests)")
    max_val_rows: int | None = Field(None, ge=1, description="cap validation rows per epoch (tuning, tests)")
    checkpoint_select: Literal["best", "last"] = Field(
        "best",
        description="the epoch whose checkpoint is evaluated and registered: 'best' by the validation metric "
        "(val_f1; val_loss for a causal LM), or 'last', the end of the full learning-rate schedule "
        "(on a validation split of a few dozen rows, the best epoch is partly picked by noise)",
    )
    num_to_keep: int = Field(1, ge=1)
    max_failures: int = Field(1, ge=0)
    torch_threads: int | None = Field(None, ge=1, description="threads per worker; default = cpus_per_worker")
    augment: AugmentConfig = AugmentConfig()
    loader: Literal["ray_data", "stream"] = Field(
        "ray_data",
        description="training input: 'ray_data' (Ray Data shards, resumable at epoch ends), or 'stream' "
        "(workflows.loader: one global order per epoch whatever the worker count, every sample exactly once, "
        "resumable mid-epoch and on another number of workers)",
    )
    checkpoint_every_steps: int | None = Field(
        None, ge=1,
        description="a checkpoint every N optimizer steps besides the epoch ends (off: None); a restart or "
        "--resume continues mid-epoch from it. Needs loader=stream. Each costs one save + upload of the "
        "model and optimizer state (docs/guides/train.md measures it)",
    )
    loader_workers: int | None = Field(
        None, ge=0,
        description="loader=stream: decode processes per training worker (0: inline); None: the worker's CPUs "
        "minus the one it trains on, at least 1 (docs/guides/train.md measures it)",
    )
    image_input: Literal["raw", "pixels"] = Field(
        "pixels",
        description="loader=stream, image tasks: 'raw' trains from the source's tar shards, parquet rows (image "
        "bytes in data.image_column) or image files (decode, "
        "RandomResizedCrop of the original image and flip in the loader's processes; val/test stay the "
        "preprocessed pixels), 'pixels' from the preprocessed fixed-size pixels (cropped in the collate; "
        "small images such as digits). docs/guides/train.md compares them",
    )
    shuffle_window: int = Field(
        4, ge=1, description="loader=stream: shards whose samples are shuffled together (the shuffle buffer)"
    )

    @field_validator("num_workers")
    @classmethod
    def worker_range(cls, v: int | tuple[int, int]) -> int | tuple[int, int]:
        lo, hi = (v, v) if isinstance(v, int) else v
        if lo < 1 or lo > hi:
            raise ValueError(f"train.num_workers must be >= 1, or [min, max] with 1 <= min <= max; got {v}")
        return v

    @model_validator(mode="after")
    def stream_features(self) -> TrainConfig:
        wants = [name for name, on in (("checkpoint_every_steps", self.checkpoint_every_steps is not None),
                                       ("an elastic train.num_workers [min, max]", self.elastic)) if on]
        if wants and self.loader != "stream":
            raise ValueError(f"{' and '.join(wants)} need(s) train.loader=stream (Ray Data cannot resume mid-epoch "
                             "or keep the order across worker counts)")
        return self

    @property
    def decode_workers(self) -> int:
        """loader_workers, or its default from the worker's CPUs."""
        return self.loader_workers if self.loader_workers is not None else max(1, int(self.cpus_per_worker) - 1)

    @property
    def elastic(self) -> bool:
        return not isinstance(self.num_workers, int)

    @property
    def max_workers(self) -> int:
        """The most workers the run uses (all of them when num_workers is a number)."""
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers[1]

    @property
    def min_workers(self) -> int:
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers[0]


class SearchDim(Strict):
    uniform: tuple[float, float] | None = None
    loguniform: tuple[float, float] | None = None
    choice: list[Any] | None = None
    grid: list[Any] | None = None

    @model_validator(mode="after")
    def one_kind(self) -> SearchDim:
        kinds = [k for k in ("uniform", "loguniform", "choice", "grid") if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError("give exactly one of uniform, loguniform, choice, grid")
        return self


class TuneConfig(Strict):
    enabled: bool = True
    search: Literal["random", "optuna"] = Field(
        "random", description="random sampling (grid dims expand), or Optuna's TPE (`pip install optuna`; no grid dims)"
    )
    scheduler: Literal["asha", "fifo"] = Field(
        "asha", description="asha stops poor trials early; fifo runs every trial to max_epochs (a baseline)"
    )
    num_samples: int = Field(4, ge=1)
    metric: str | None = Field(
        None, description="the validation metric trials are ranked by; None: the task's checkpoint metric "
        "(val_f1 for a classifier, a plug-in task's `score`)")
    mode: Literal["max", "min"] | None = Field(
        None, description="None: the task's for its own metric, else max")
    max_epochs: int = Field(2, ge=1)
    grace_period: int = Field(1, ge=1)
    reduction_factor: float = Field(2, gt=1)
    num_workers: int = Field(
        1,
        ge=1,
        description="workers per trial: 1 runs the trial's loop in its Tune actor; more run a Ray Train run per trial",
    )
    checkpoint: bool = Field(
        True,
        description="one-worker trials: report a checkpoint every epoch (a failed or resumed trial continues from it)",
    )
    max_train_rows: int | None = Field(None, ge=1, description="cap rows per trial epoch")
    max_val_rows: int | None = Field(None, ge=1, description="cap validation rows per trial epoch")
    seed: int = 0
    space: dict[str, SearchDim] = Field(default_factory=dict, description="dotted train.* field -> distribution")

    @field_validator("space")
    @classmethod
    def train_fields_only(cls, space: dict[str, SearchDim]) -> dict[str, SearchDim]:
        for key in space:
            field = key.removeprefix("train.")
            if not key.startswith("train.") or field not in TrainConfig.model_fields:
                raise ValueError(f"search dimension {key!r} must name a train.* field")
        return space


class EvaluateConfig(Strict):
    batch_size: int = Field(64, ge=1)
    in_process_max_rows: int = Field(
        2000, ge=0, description="score a dataset of at most this many rows in the calling process, not in a "
        "Ray Data actor pool (an actor's start and model load cost more than scoring a few thousand rows); "
        "0: always the pool")


class RegistryConfig(Strict):
    name: str = Field("quickstart", description="the trained model is registered under this name")

    @field_validator("name")
    @classmethod
    def valid(cls, v: str) -> str:
        return check_name(v, "model name")


class AutoscalingConfig(Strict):
    """Ray Serve autoscaling of the model deployment (replaces serve.num_replicas when set)."""

    min_replicas: int = Field(1, ge=0, description="0 lets an idle deployment scale to zero")
    max_replicas: int = Field(4, ge=1)
    target_ongoing_requests: float = Field(8, gt=0, description="per replica; high enough for batches to fill")
    upscale_delay_s: float = Field(
        30.0, ge=0, description="load must stay above target this long before a replica is added"
    )
    downscale_delay_s: float = Field(
        600.0, ge=0, description="load must stay below target this long before a replica is removed"
    )

    @model_validator(mode="after")
    def _order(self):
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) is below min_replicas ({self.min_replicas})")
        return self


class ServeConfig(Strict):
    enabled: bool = True
    host: str = Field("127.0.0.1", description="bind address; 0.0.0.0 exposes the server beyond this machine")
    port: int = Field(8000, ge=1, le=65535)
    num_replicas: int = Field(1, ge=1, description="fixed replica count (when autoscaling is not set)")
    autoscaling: AutoscalingConfig | None = None
    cpus_per_replica: float = Field(1, gt=0)
    gpus_per_replica: float = Field(0, ge=0)
    precision: Literal["fp32", "bf16", "int8"] = Field(
        "fp32", description="fp32; bf16 (meant for GPU replicas); int8 dynamic quantization of Linear layers (CPU)"
    )
    auth_token_env: str | None = Field(
        None, description="name of an environment variable holding a bearer token that /predict and /v1/models require"
    )
    max_batch_size: int = Field(16, ge=1)
    batch_wait_timeout_s: float = Field(
        0.0,
        ge=0,
        description="how long a batch waits to fill once its first instance arrived; 0 batches what queued "
        "up while the model ran (no idle wait)",
    )
    model_in_thread: bool = Field(
        False,
        description="run the model in a thread of the replica, so that its event loop keeps reading and "
        "queueing requests while a batch runs; measured slower on 1-CPU replicas (the threads contend for the "
        "CPU and the GIL: docs/BENCHMARKS.md), hence off; for replicas with more cores or a GPU",
    )
    haproxy: bool | Literal["auto"] = Field(
        "auto",
        description="front the replicas with Ray Serve's HAProxy ingress instead of its Python proxy, on a "
        "cluster the command starts (a running cluster needs RAY_SERVE_ENABLE_HA_PROXY=1 in its environment): "
        "auto where the binary is installed (ray[serve] brings it on Linux), true to insist, false for the "
        "Python proxy; HAProxy measured as fast as a plain FastAPI server in docs/BENCHMARKS.md",
    )
    access_log: bool = Field(
        True,
        description="log a line per request in the proxy and the replica (Ray Serve's access log, in "
        "/tmp/ray/session_latest/logs/serve/); turning it off saved no measurable time (docs/BENCHMARKS.md)",
    )
    max_instances: int = Field(256, ge=1, description="largest `instances` list one request may carry")
    max_request_pixels: int = Field(
        100_000_000, ge=1,
        description="image models: the most pixels one request's images may declare in all (read from their "
        "headers, before any is decoded; each image also stays under preprocess.max_image_pixels): bounds the "
        "decoding one request costs, about 0.75 s for 100 Mpx of PNG on one core; a request over it is a 422",
    )
    demo_requests: int = Field(3, ge=0, description="requests the pipeline sends after deploying")


class TrackingConfig(Strict):
    """MLflow experiment tracking (workflows/tracking): a run per pipeline, stage and tune trial."""

    enabled: bool = True
    uri: str | None = Field(
        None, description="MLflow tracking URI (http://... for a team server); None: sqlite:///<output_dir>/mlflow.db"
    )
    experiment: str | None = Field(None, description="experiment name; None: the config's name")
    step_loss_every: int = Field(10, ge=1, description="log the training loss of every N-th optimizer step")
    retry_seconds: float = Field(
        300.0, gt=0, description="how long a failing tracking store is retried (with backoff, metrics buffered) "
        "before tracking turns off for the process and its runs are marked FAILED with the gap",
    )


class WorkflowConfig(Strict):
    name: str = Field("quickstart", description="run name: prefixes runs and summaries")
    seed: int = 0
    output_dir: str = Field(".workflows/runs", description="local directory for JSON summaries and plots")
    storage: StorageConfig = StorageConfig()
    cache: CacheConfig = CacheConfig()
    ray: RayConfig = RayConfig()
    data: DataConfig
    preprocess: PreprocessConfig = PreprocessConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    tune: TuneConfig = TuneConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    registry: RegistryConfig = RegistryConfig()
    serve: ServeConfig = ServeConfig()
    tracking: TrackingConfig = TrackingConfig()

    @field_validator("name")
    @classmethod
    def valid_name(cls, v: str) -> str:
        return check_name(v, "run name")

    # Where things live under the storage root.
    def uri(self, *parts: str) -> str:
        return "/".join([self.storage.root.rstrip("/"), *parts])


def _format_error(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "missing":
            msg = "required key is missing"
        else:
            msg = e["msg"]
            if "input" in e and not isinstance(e["input"], (dict, list)):
                msg += f" (got {e['input']!r})"
        lines.append(f"{source}: {key}: {msg}")
    return "invalid config: " + "; ".join(lines)


SHIPPED_CONFIGS = Path(__file__).resolve().parent / "configs"


def shipped_configs() -> list[str]:
    """Names of the configs shipped in the package (`--config quickstart`)."""
    return sorted(p.stem for p in SHIPPED_CONFIGS.glob("*.yaml"))


def resolve_config(path: str | os.PathLike) -> Path:
    """A config file: an existing path as given, else a bare name (no '/' or suffix) of a shipped
    config, so `--config quickstart` works from any directory."""
    p = Path(path)
    if p.is_file():
        return p
    name = str(path)
    if "/" not in name and not p.suffix and (SHIPPED_CONFIGS / f"{name}.yaml").is_file():
        return SHIPPED_CONFIGS / f"{name}.yaml"
    raise UserError(f"config file not found: {p} (shipped configs, by name: {', '.join(shipped_configs())})")


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> WorkflowConfig:
    """Read YAML at `path` (a file or a shipped config's name; None = defaults only), apply
    overrides, validate."""
    data: dict = {}
    source = "<defaults>"
    if path is not None:
        p = resolve_config(path)
        source = str(path) if p.parent == SHIPPED_CONFIGS else str(p)
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise UserError(f"{p}: not valid YAML: {e}".splitlines()[0]) from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise UserError(f"{p}: top level must be a mapping of sections, got {type(loaded).__name__}")
        data = loaded
    if overrides:
        source = f"{source} (with --set)"
        data = apply_overrides(data, overrides, source)
    try:
        return WorkflowConfig.model_validate(data)
    except ValidationError as e:
        raise UserError(_format_error(e, source)) from None


def dump_config(cfg: WorkflowConfig) -> dict:
    """A JSON-safe dict of the config (holds no credentials: they never enter the config)."""
    return cfg.model_dump(mode="json")
