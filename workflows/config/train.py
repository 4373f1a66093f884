"""The `train` section: the training run and its input."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from workflows.config.base import Strict


class TrainConfig(Strict):
    num_workers: int | tuple[int, int] | Literal["auto"] = Field(
        "auto",
        description="training workers: auto (chosen for the cluster when the run starts, printed: one worker per "
        "GPU; on CPUs one worker per node with the node's free CPUs, so one on a laptop, which trains in one actor "
        "without Ray Train's worker group), a number, or [min, max] "
        "for an elastic group (Ray Train resizes it within the range as workers are lost or resources come and "
        "go; needs train.loader=stream)",
    )
    cpus_per_worker: float = Field(1, gt=0, description="CPUs each worker holds (num_workers auto on CPUs: the "
                                    "node's free CPUs)")
    use_gpu: bool = False
    strategy: Literal["fsdp", "ddp"] = "fsdp"
    epochs: int = Field(3, ge=1)
    batch_size: int = Field(32, ge=1, description="per worker")
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    warmup_fraction: float = Field(0.1, ge=0, lt=1)
    grad_clip: float | None = Field(1.0, gt=0)
    grad_accum_steps: int = Field(
        1, ge=1, description="micro-batches of batch_size per optimizer step (gradient accumulation)"
    )
    activation_checkpointing: bool = Field(
        False, description="recompute each block's activations in backward: less memory, ~1/3 more compute"
    )
    compile: bool | None = Field(
        None,
        description="torch.compile the model for training: each repeated transformer block (or, for a model without "
        "identical blocks, the whole model) as its own region, and a task's loss where it pays (a causal LM's "
        "head and cross-entropy); validation runs uncompiled. None: on when train.use_gpu, off on CPU",
    )
    compile_backend: Literal["inductor", "aot_eager", "eager"] = Field(
        "inductor", description="train.compile's backend (aot_eager, eager: tracing without code generation, for "
        "checks on CPU)")
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
        description="loader=stream: decode processes per training worker (0: inline); None: inline when the "
        "loader reads the processed rows (the collate runs in the training process either way), else (raw "
        "images decoded in the loader) the worker's CPUs minus the one it trains on, at least 1 "
        "(docs/guides/train.md measures both)",
    )
    shuffle_window: int = Field(
        4, ge=1, description="loader=stream: shards whose samples are shuffled together (the shuffle buffer)"
    )

    @field_validator("num_workers")
    @classmethod
    def worker_range(cls, v: int | tuple[int, int] | str) -> int | tuple[int, int] | str:
        if isinstance(v, str):  # auto (the Literal): resolved when the run starts
            return v
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
    def compiled(self) -> bool:
        """Whether training compiles the model (train.compile, or its default: on GPU only)."""
        return self.use_gpu if self.compile is None else self.compile

    def decode_workers(self, decodes: bool) -> int:
        """loader_workers, or its default: inline for stored rows (a process beside the training one only
        slices parquet for it, and takes a core from the step), the worker's CPUs minus one for the
        loader's decoding (`decodes`: the task's stream_source has a per-sample transform)."""
        if self.loader_workers is not None:
            return self.loader_workers
        return max(1, int(self.cpus_per_worker) - 1) if decodes else 0

    @property
    def elastic(self) -> bool:
        return isinstance(self.num_workers, (tuple, list))

    @property
    def max_workers(self) -> int:
        """The most workers the run uses (all of them when num_workers is a number)."""
        return self._workers()[1]

    @property
    def min_workers(self) -> int:
        return self._workers()[0]

    def _workers(self) -> tuple[int, int]:
        if self.num_workers == "auto":  # a run resolves it for its cluster first (workflows.train.layout)
            raise ValueError("train.num_workers is auto: the number is chosen when the run starts")
        return (self.num_workers, self.num_workers) if isinstance(self.num_workers, int) else self.num_workers

