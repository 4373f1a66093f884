"""Training at the hardware's speed, guarded on the CPU (issue #62) with tiny models:
- train.compile: the regions compiled (repeated blocks, or the whole model), the same losses as
  eager, and one compile per region through a loader-fed epoch whose last batch is short (recompiles
  made errors), channels_last image batches included;
- no host sync in a training step (the profiler's aten::_local_scalar_dense, which .item(), bool()
  and every read of a device value go through), against a budget per model;
- LoRA's frozen base in bf16: a step casts the adapters only, never a base weight, and computes the
  same losses as autocast over the fp32 base.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.test_loader import write_shards
from workflows.train.compile import compile_model, compile_regions, fixed_rows
from workflows.train.loop import make_optimizer, make_scheduler, train_epoch, validate

CPU = torch.device("cpu")
SYNCS = "aten::_local_scalar_dense"  # .item(), bool(tensor), tolist(): a device value read by the host


def tiny_bert():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def tiny_gpt2():
    from workflows.tasks.causal_lm.model import build_causal_lm

    torch.manual_seed(0)
    return build_causal_lm(SimpleNamespace(size="tiny", n_layer=None, n_embd=None, n_head=None, seq_len=16), 100)


def text_batches(rows: int, size: int, padded: bool = True, seed: int = 1):
    from workflows.tasks.text.model import collate

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 13, (rows,), generator=g) if padded else torch.full((rows,), 12)
    ids = [torch.randint(1, 50, (int(n),), generator=g).numpy() for n in lengths]
    labels = torch.randint(0, 3, (rows,), generator=g).numpy()
    for i in range(0, rows, size):
        # one width, as the text task's collate pads a compiled model's training batches
        yield collate({"input_ids": ids[i:i + size], "label_id": labels[i:i + size]}, width=12)


def losses(model, batches, pad_to=None, epochs=2, between=lambda: None):
    opt = make_optimizer(model, 1e-2, 0.0)
    sched = make_scheduler(opt, 100, 0.0)
    out = []
    for _ in range(epochs):
        out += train_epoch(model, batches(), opt, sched, CPU, 1.0, pad_to=pad_to)["step_losses"]
        between()
    return out


def test_regions_are_the_repeated_blocks_or_the_whole_model():
    bert = tiny_bert()
    assert compile_regions(bert) == list(bert.bert.encoder.layer)
    from transformers import AutoModelForImageClassification

    from workflows.tasks.image.models import ARCHITECTURES

    cnn = AutoModelForImageClassification.from_config(ARCHITECTURES["small_cnn"](16))
    assert compile_regions(cnn) == [cnn]  # its stages differ in shape: one graph for the whole model


def test_a_causal_lm_compiles_its_blocks_and_its_loss_and_trains_as_eager():
    """The head's loss (a vocabulary-wide cross-entropy) is compiled too, on the model that owns the head;
    a short last batch is padded (labels ignored), and the steps' losses are eager's."""
    import torch._dynamo

    from workflows.tasks.causal_lm.model import lm_collate

    g = torch.Generator().manual_seed(0)
    blocks = list(torch.randint(0, 100, (6, 16), generator=g).numpy())
    batches = lambda: (lm_collate(blocks[i:i + 4]) for i in range(0, 6, 4))  # noqa: E731  4, then 2 (padded)
    eager = losses(tiny_gpt2(), batches, epochs=1)
    torch._dynamo.reset()
    model = tiny_gpt2()
    regions = compile_model(model, "eager")
    assert regions == list(model.transformer.h) and hasattr(model.loss_function, "_torchdynamo_orig_callable")
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert losses(model, batches, pad_to=4, epochs=1) == pytest.approx(eager, abs=1e-4)


def test_a_short_batch_is_padded_with_ignored_labels_and_a_long_one_split():
    batch = {"input_ids": torch.arange(10).reshape(5, 2), "labels": torch.arange(5)}
    pieces = list(fixed_rows(batch, 4, -100))
    assert [real for _, real in pieces] == [4, 1]
    assert pieces[1][0]["labels"].tolist() == [4, -100, -100, -100]
    assert pieces[1][0]["input_ids"].shape == (4, 2)
    images = torch.zeros(3, 4, 4, 3).permute(0, 3, 1, 2)  # channels_last
    (piece, real), = fixed_rows({"pixel_values": images, "labels": torch.zeros(3, dtype=torch.long)}, 4, -100)
    assert real == 3 and piece["pixel_values"].is_contiguous(memory_format=torch.channels_last)
    regression = {"x": torch.zeros(3, 2), "labels": torch.zeros(3)}
    assert [real for _, real in fixed_rows(regression, 4, -100)] == [3]  # a real-valued target: as it is


def test_compiled_training_trains_as_eager_and_compiles_once():
    """aot_eager (dynamo's graphs and autograd's, no code generation): the step losses of eager training,
    over 2 epochs of 3 batches of which the last is short (padded), with validation between the epochs
    (eager), and not one recompile."""
    import torch._dynamo

    batches = lambda: text_batches(20, 8)  # noqa: E731  8, 8, 4
    eager = losses(tiny_bert(), batches)
    torch._dynamo.reset()
    model = tiny_bert()
    assert len(compile_model(model, "aot_eager")) == 2
    counters = torch._dynamo.utils.counters
    counters.clear()
    task = SimpleNamespace(metric_states=lambda m, b: {"loss": m(**b).loss.detach()},
                           compute_metrics=lambda states, data: dict(states))
    with torch._dynamo.config.patch(error_on_recompile=True):
        # validation after each epoch: another shape and eval mode, run eagerly
        compiled = losses(model, batches, pad_to=8,
                          between=lambda: validate(task, model, text_batches(5, 5), CPU, None))
    assert compiled == pytest.approx(eager, abs=1e-4)
    assert counters["stats"]["unique_graphs"] == 1  # two blocks, one graph


def count_ops(fn, name: str, stack: bool = False) -> list:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=not stack, with_stack=stack) as prof:
        fn()
    return [e for e in prof.events() if e.name == name]


def origin(event) -> str:
    """Where a sync came from: the nearest caller the profiler recorded that names its file."""
    chain, parent = [], event.cpu_parent
    while parent is not None:
        chain.append(parent.name)
        parent = parent.cpu_parent
    if any("_fused_adamw_" in name for name in chain):
        return "fused adamw (CPU)"
    return next((name for name in chain if ".py(" in name), "?")


def step_syncs(model, batch, steps: int = 2) -> list[str]:
    """The host syncs of `steps` training steps (forward, backward, clipping, fused AdamW, schedule, the
    loop's bookkeeping; its one read of the epoch's totals at the end is a tolist(), which the profiler
    does not see), by origin. Fused AdamW's CPU
    kernel reads its step counts on the host; on a GPU they are device tensors its kernel reads there, so
    those are left out."""
    opt = make_optimizer(model, 1e-3, 0.0, fused=True)
    sched = make_scheduler(opt, 100, 0.0)
    train_epoch(model, iter([dict(batch)]), opt, sched, CPU, 1.0)  # warm-up: lazy state
    epoch = lambda: train_epoch(model, iter([dict(batch) for _ in range(steps)]), opt, sched, CPU, 1.0)  # noqa: E731
    return [o for o in map(origin, count_ops(epoch, SYNCS, stack=True)) if o != "fused adamw (CPU)"]


def per_step(syncs: list[str], steps: int = 2) -> float:
    return len(syncs) / steps


def test_a_causal_lm_step_syncs_once_in_transformers_and_never_in_the_loop():
    """Budget 1 a step, and that one in transformers: the loss, label count and tokens add up on the
    device (the loop read each with .item() every step). transformers (5.x) asks the device once a
    forward while preparing a causal mask: mask.all() on a given mask, or a packed-sequence check of the
    position ids without one; the collate gives no mask (all ones, it would only add its transfer)."""
    from workflows.tasks.causal_lm.model import lm_collate

    g = torch.Generator().manual_seed(0)
    batch = lm_collate(list(torch.randint(0, 100, (4, 16), generator=g).numpy()))
    assert "attention_mask" not in batch
    syncs = step_syncs(tiny_gpt2(), batch)
    assert per_step(syncs) <= 1
    assert all("masking_utils" in s for s in syncs), syncs


def test_a_text_classifier_step_syncs_only_for_padding():
    """Budget 0 for a batch without padding (the collate leaves out its mask), 1 with padding:
    transformers asks the device whether a given mask is all ones (its bidirectional mask's check)."""
    full = next(text_batches(8, 8, padded=False))
    assert "attention_mask" not in full
    assert per_step(step_syncs(tiny_bert(), full)) == 0
    padded = step_syncs(tiny_bert(), next(text_batches(8, 8)))
    assert per_step(padded) <= 1 and all("masking_utils" in s for s in padded), padded


def test_a_compiled_image_model_trains_through_loader_epochs_without_a_recompile(tmp_path):
    """The platform's StreamLoader over JPEG shards hands channels_last batches, as the collate of stored
    pixels does (the GPU benchmark's synthetic batch was channels_last and the loader's contiguous: a
    recompile), and the epoch's short last batch is padded: a stored-pixels batch, then two loader epochs
    through one compiled CNN (backend eager: dynamo's guards, strides among them, without code
    generation), with recompiles made errors."""
    import torch._dynamo
    from transformers import AutoModelForImageClassification

    from workflows.loader import StreamLoader
    from workflows.preprocess.images import ImageTransform
    from workflows.storage.cache import ShardCache
    from workflows.storage.uri import StorageContext
    from workflows.tasks.image import model_input
    from workflows.tasks.image.models import ARCHITECTURES, _with_labels

    ctx, images = StorageContext(), 9  # batches of 4, 4 and 1 (padded)
    (tmp_path / "shards").mkdir()
    write_shards(lambda name, data: (tmp_path / "shards" / name).write_bytes(data), counts=[5, 4])
    loader = StreamLoader(str(tmp_path / "shards"), ctx, ShardCache(str(tmp_path / "cache"), ctx),
                          ImageTransform(16, seed=0), batch_size=4, num_workers=0, seed=0)
    first = next(iter(loader))["image"]
    assert first.is_contiguous(memory_format=torch.channels_last) and not first.is_contiguous()

    torch.manual_seed(0)
    labels = [str(i) for i in range(10)]
    model = AutoModelForImageClassification.from_config(_with_labels(ARCHITECTURES["small_cnn"](16), labels))
    torch._dynamo.reset()
    assert compile_model(model, "eager") == [model]

    def fed(epoch: int):
        loader.set_epoch(epoch)
        return ({"pixel_values": b["image"], "labels": b["label"]} for b in loader)

    opt = make_optimizer(model, 1e-3, 0.0)
    sched = make_scheduler(opt, 100, 0.0)
    loss = lambda m, b: m(**model_input(m, b)).loss  # noqa: E731
    # stored pixels as the task's collate hands them: uint8 [N, S, S, 3] permuted, a channels_last view
    pixels = torch.randint(0, 255, (4, 16, 16, 3), dtype=torch.uint8).permute(0, 3, 1, 2)
    stored = [{"pixel_values": pixels, "labels": torch.arange(4)}]
    with torch._dynamo.config.patch(error_on_recompile=True):
        train_epoch(model, stored, opt, sched, CPU, pad_to=4, loss_fn=loss)
        stats = [train_epoch(model, fed(e), opt, sched, CPU, pad_to=4, loss_fn=loss) for e in range(2)]
    loader.close()
    assert [s["samples"] for s in stats] == [images, images] and stats[0]["steps"] == 3  # padding is not counted


def tiny_lora(bf16_base: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    from workflows.tasks.chat import ChatOptions
    from workflows.tasks.chat.training.model import frozen_linears_to, with_lora

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    model = with_lora(base, ChatOptions(lora_r=4, lora_dropout=0.0))
    changed = frozen_linears_to(model, torch.bfloat16) if bf16_base else 0
    return model, changed


def weight_casts(model, batch) -> tuple[list[tuple], list[float]]:
    """The 2-D casts (weights; activations are 3-D) of two bf16-autocast training steps after a warm-up,
    by input shape, and the steps' losses."""
    opt = make_optimizer(model, 1e-2, 0.0)
    sched = make_scheduler(opt, 100, 0.0)
    train_epoch(model, [dict(batch)], opt, sched, CPU, amp=torch.bfloat16)
    out: dict = {}
    casts = count_ops(lambda: out.update(train_epoch(model, [dict(batch), dict(batch)], opt, sched, CPU,
                                                     amp=torch.bfloat16)), "aten::_to_copy")
    return [tuple(e.input_shapes[0]) for e in casts if e.input_shapes and len(e.input_shapes[0]) == 2], \
        out["step_losses"]


def test_lora_keeps_the_frozen_base_in_bf16_and_casts_only_the_adapters():
    """Budget: no cast of a base weight, at most two per adapter tensor a step (its bf16 copy for the
    forward, its gradient back to fp32); autocast over an fp32 base casts every base weight every step.
    The losses are autocast's over the fp32 base: it rounds those weights to bf16 for the same matmuls."""
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, 96, (3, 7), generator=g)}  # 21 rows: no weight's dimension
    batch["labels"] = batch["input_ids"].clone()
    fp32_model, _ = tiny_lora(bf16_base=False)
    model, changed = tiny_lora(bf16_base=True)
    base = {tuple(m.base_layer.weight.shape) for m in model.modules() if hasattr(m, "base_layer")}
    adapters = [p for n, p in model.named_parameters() if p.requires_grad]
    assert changed == 2 * 7 and all(p.dtype == torch.float32 for p in adapters)  # 7 linears a layer, the head tied
    assert model.get_output_embeddings().weight.dtype == torch.float32  # the tied head: the embedding, left fp32
    before, fp32_losses = weight_casts(fp32_model, batch)
    after, losses = weight_casts(model, batch)
    assert not [s for s in after if s in base]
    shapes = {tuple(p.shape) for p in adapters}
    assert len([s for s in after if s in shapes]) <= 2 * 2 * len(adapters)  # two steps
    assert len([s for s in before if s in base]) >= 2 * changed  # what bf16 storage saves: each base weight a step
    assert losses == pytest.approx(fp32_losses, abs=2e-3)
