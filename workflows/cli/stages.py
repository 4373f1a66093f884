"""The pipeline's stages as commands: preprocess, train, tune, and the whole pipeline."""

from __future__ import annotations

import typer

from workflows.cli.common import ConfigOpt, SetOpt, VerboseOpt, _in_runtime, _task_ready
from workflows.cli.serving import _ready_to_serve


def preprocess(config: str = ConfigOpt, set: list[str] | None = SetOpt, verbose: bool = VerboseOpt):
    """Read raw shards from object storage, tokenize on Ray Data, materialize processed shards."""
    from workflows.pipeline.stages import stage_preprocess

    _in_runtime("preprocess", config, set, stage_preprocess, verbose=verbose,
                on_load=_task_ready)


def train(config: str = ConfigOpt, set: list[str] | None = SetOpt,
          resume: bool = typer.Option(False, "--resume", help="continue from the latest checkpoint of the last run"),
          verbose: bool = VerboseOpt):
    """Fine-tune with Ray Train (FSDP2 or DDP), checkpoint to object storage, register the best model."""
    from workflows.pipeline.stages import stage_preprocess, stage_register, stage_train

    def body(rt):
        data = stage_preprocess(rt)
        stage_register(rt, data, stage_train(rt, data, resume=resume))

    _in_runtime("train", config, set, body, verbose=verbose, on_load=_task_ready)


def tune(config: str = ConfigOpt, set: list[str] | None = SetOpt,
         resume: bool = typer.Option(False, "--resume", help="restore an interrupted search"),
         verbose: bool = VerboseOpt):
    """Search hyperparameters with Ray Tune + ASHA; every trial is a Ray Train run."""
    from workflows.pipeline.stages import stage_preprocess, stage_tune

    _in_runtime("tune", config, set, lambda rt: stage_tune(rt, stage_preprocess(rt), resume=resume), verbose=verbose,
                on_load=_task_ready)


def pipeline(config: str = ConfigOpt, set: list[str] | None = SetOpt, verbose: bool = VerboseOpt):
    """Everything: preprocess -> tune -> train -> evaluate -> register -> serve (serve.enabled)."""
    from workflows.pipeline import run_pipeline

    def check(cfg, storage):
        if cfg.serve.enabled:  # what would refuse the serve stage, refused before the stages before it
            _ready_to_serve(cfg)

    _in_runtime("pipeline", config, set, run_pipeline, verbose=verbose, before_ray=check, on_load=_task_ready)

