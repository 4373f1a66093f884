"""What every command shares: the --config/--set/--verbose options, one-line user errors, and
the runtime (object store, Ray) a command body runs in."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import typer

from workflows import console, stop
from workflows.errors import find_user_error

DEFAULT_CONFIG = "quickstart"
ConfigOpt = typer.Option(DEFAULT_CONFIG, "--config", "-c",
                         help="a workflow YAML file, or a shipped config by name: quickstart, madewithml")
SetOpt = typer.Option(None, "--set", help="override a config value: --set train.lr=3e-5 (repeatable)")
VerboseOpt = typer.Option(False, "--verbose", "-v", envvar="WORKFLOWS_VERBOSE",
                          help="show Ray's logs and progress here instead of only in the run's log file")


def _run(fn: Callable[[], object]) -> None:
    """User errors in one line (exit 2). Once Ray's output goes to a log file, any failure also
    shows the log's last lines, and an unexpected exception's traceback goes into the log (exit 1).
    SIGTERM/SIGINT: what was started is shut down, one line, exit 143/130 (workflows.stop)."""
    stop.install()
    try:
        fn()
    except KeyboardInterrupt as e:
        log = console.active_log()
        console.echo(f"stopped by {stop.signal_name(e)}" + (f"; Ray's output is in {log.path}" if log else ""))
        raise typer.Exit(stop.exit_code(e)) from None
    except typer.Exit:
        raise
    except Exception as e:
        ue, log = find_user_error(e), console.active_log()
        if ue is None:
            if log is None:
                raise
            log.log_exception()
        console.echo(f"error: {ue if ue is not None else _one_line(e)}")
        console.show_log_tail()
        raise typer.Exit(2 if ue is not None else 1) from e
    finally:
        if (log := console.active_log()) is not None:
            log.finish()


def _one_line(e: BaseException) -> str:
    first = next((ln for ln in console.strip_ansi(str(e)).splitlines() if ln.strip()), "")
    return f"{type(e).__name__}: {first[:300]}" if first else type(e).__name__


def _in_runtime(command: str, config: str, overrides: list[str] | None, body: Callable, ray_needed: bool = True,
                before_ray: Callable | None = None, verbose: bool = False,
                on_load: Callable | None = None) -> None:
    """Load the config, start the runtime (object store, Ray), run `body(rt)`; user errors in one line.
    `on_load(cfg)` checks the config before anything starts; `before_ray(cfg, storage)` checks
    what needs only the object store before Ray starts. Unless
    `verbose`, everything written to fds 1/2 from Ray's start on goes to
    `<output_dir>/<name>/logs/<command>-<time>.log` (workflows.console)."""
    def go():
        from workflows.runtime import runtime

        cfg = _load(config, overrides)
        if on_load is not None:
            on_load(cfg)

        def check(storage):
            if before_ray is not None:
                before_ray(cfg, storage)
            if ray_needed and not verbose:
                console.capture(Path(cfg.output_dir) / cfg.name / "logs", command)

        with runtime(cfg, ray_needed=ray_needed, before_ray=check) as rt:
            body(rt)
    _run(go)


def _registered(*specs: str) -> Callable:
    """A before_ray check: every model spec names a registered version whose task may be imported."""
    def check(cfg, storage):
        from workflows import registry
        from workflows.tasks import check_card_task

        for spec in specs:
            check_card_task(cfg, registry.model_card(cfg, storage, spec))
    return check


def _task_ready(cfg) -> None:
    """An on_load check: the config's task imports and takes its model.options (before the store starts)."""
    from workflows.tasks import get_task

    get_task(cfg).check_config()


def _load(config: str, overrides: list[str] | None):
    """The config, its task checked (a plug-in imported, its class's methods) before anything starts."""
    from workflows.config import load_config
    from workflows.tasks import check_task

    return check_task(load_config(config, overrides or []))
