"""`workflows bench train` on the quickstart for docs/BENCHMARKS.md's training section
(`python -m benchmarks.train`)."""

from __future__ import annotations

from workflows.bench.train import MIN_EPOCH_SECONDS
from workflows.bench.train import run as run


def _met(ok: bool) -> str:
    return "met" if ok else "**not met**"


def markdown(r: dict) -> str:
    p, f, d, a = r["runs"]["plain"], r["runs"]["ray_fsdp"], r["runs"]["ray_ddp"], r["runs"].get("ray_auto")

    def row(name: str, x: dict) -> str:
        epochs = " / ".join(f"{s:.1f}" for s in x["epoch_seconds"])
        return (
            f"| {name} | {epochs} s | {x['samples_per_s']:.1f} | {x['steps_per_epoch']} | {x['wall_seconds']:.0f} s "
            f"| {x['final_train_loss']:.4f} / {x['final_val_f1']:.4f} | {x['load_average_before_after'][0]:.1f} / "
            f"{x['load_average_before_after'][1]:.1f} |"
        )

    runner = a.get("runner", "Ray Train") if a else ""  # runs before auto's one actor trained under Ray Train
    versus = f"{runner}, num_workers auto" if a else "Ray FSDP2"  # results from before auto compared FSDP2
    plain_batch = r.get("global_batch", r["ray_workers"] * r["batch_per_worker"])
    auto = several = ""
    if a:
        auto = row(f"{runner}, num_workers auto ({r['auto_layout']}), batch {r['global_batch']}", a) + "\n"
        several = (f"| `auto_vs_several_workers_epoch_ratio` (auto's mean epoch ÷ the faster {r['ray_workers']}-worker "
                   f"one) | {r['auto_vs_several_workers_epoch_ratio']:.3f} | <= 1 ({_met(r['auto_is_fastest'])}) |\n")

    return f"""## Training: the layout on one node, Ray Train overhead, FSDP2 vs DDP

`{r["command"]}` ({r["measured_at"]}, {r["machine"]["cpus"]} CPUs, torch {r["machine"]["torch"]}).
Quickstart model and data, {r["train_rows"]} training rows per epoch, {r["epochs"]} epochs per run, each run a
fresh process. Epoch time = the training steps inside `train_epoch` (batches included; start-up and
evaluation excluded); wall = the whole process, start-up to exit.

| run | epoch times | samples/s | steps/epoch | wall | final loss / val F1 | load avg before / after |
| --- | --- | --- | --- | --- | --- | --- |
{row(f"plain PyTorch, 1 process, a thread per core, batch {plain_batch}, no Ray", p)}
{auto}{row(f"Ray Train FSDP2, {r['ray_workers']} workers x 1 CPU, batch {r['batch_per_worker']}/worker", f)}
{row(f"Ray Train DDP, {r['ray_workers']} workers x 1 CPU, batch {r['batch_per_worker']}/worker", d)}

| measure | value | goal |
| --- | --- | --- |
| `ray_vs_plain_epoch_ratio` ({versus} mean epoch ÷ plain mean epoch) | {r["ray_vs_plain_epoch_ratio"]:.3f} | <= {r["goal_ratio"]} ({_met(r["ray_vs_plain_meets_goal"])}) |
| same, wall time of the whole process | {r["ray_vs_plain_wall_ratio"]:.3f} | |
{several}| `fsdp_vs_ddp_ratio` (Ray FSDP2 mean epoch ÷ Ray DDP mean epoch) | {r["fsdp_vs_ddp_ratio"]:.3f} | <= {r["goal_ratio"]} ({_met(r["fsdp_vs_ddp_meets_goal"])}) |
| same, wall time of the whole process | {r["fsdp_vs_ddp_wall_ratio"]:.3f} | |
| every epoch >= {MIN_EPOCH_SECONDS} s | {r["epochs_at_least_20s"]} | |

The machine's CPUs are shared with other work while this runs: the load averages are the
1-minute load when each run started and ended (2 CPUs; above 2 means the runs competed for them).
"""  # noqa: E501 (markdown table rows: one line each)

if __name__ == "__main__":
    from benchmarks.record import main

    main("train")
