"""The causal LM's model moved to its task's wing, workflows.tasks.causal_lm.model; its names stay
importable from here for the benches (workflows/bench/lm.py), which import them by this path."""

from workflows.tasks.causal_lm.model import (  # noqa: F401
    PACK_ROWS,
    PEAK_BF16_FLOPS,
    SIZES,
    build_causal_lm,
    causal_lm_config,
    flops_per_token,
    lm_collate,
    mfu,
    model_shape,
    pack_batch,
    pack_blocks,
    peak_flops,
    peak_for_name,
    shape,
)
