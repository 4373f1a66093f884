"""A tiny chat model for the serving tests, and the chat task with test hooks that serves it.

`build_tiny_chat(out)`: a random 2-layer LlamaForCausalLM (hidden 48) with a word-level tokenizer built
here, a ChatML chat template and eos = pad = <|im_end|>, saved with save_pretrained. `build_lora`: a
random LoRA adapter of it (peft, safetensors). `HookedChatTask`: the chat task with two test hooks
(model.options): each model step slowed down, and each generation's end recorded, so that a test can
watch a disconnect stop one generation. `served`: the chat task's predictor of a registered directory, as a
replica builds it, its forward eager (EAGER).
"""

from __future__ import annotations

import json
import time

from workflows.tasks.chat import ChatOptions, ChatServing, ChatTask

WORDS = "hello world the a cat dog sat on mat is big small red blue green one two three four five".split()
# The serving tests run the tiny model's forward eagerly: compiling it (serve.generate.forward auto, about 10 s of
# inductor per engine on 2 cores) is what tests/test_chat_compiled.py tests (tokens as eager, adapters, no
# recompiles), and the chat pipeline test serves the demo's path compiled (its replica, `workflows predict`).
EAGER = "serve.generate.forward=eager"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tiny_chat(out, seed: int = 0, hidden: int = 48, context: int = 256):
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate(dict.fromkeys(specials + WORDS + chars))}  # "a" is a word and a char
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<|im_start|>",
                                        eos_token="<|im_end|>", pad_token="<|im_end|>")
    tokenizer.chat_template = CHATML
    torch.manual_seed(seed)
    end = vocab["<|im_end|>"]
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=context, eos_token_id=end, pad_token_id=end,
                         bos_token_id=vocab["<|im_start|>"])
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return model, tokenizer


def build_lora(base_dir, out, seed: int):
    """A LoRA adapter of the tiny model with random (nonzero) weights: it changes what the model says."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    config = LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    model.save_pretrained(out)


class HookedOptions(ChatOptions):
    step_delay_s: float = 0.0  # sleep in each model call (a slow model: a stream lasts long enough to leave)
    finish_log: str | None = None  # append {"tokens", "finish_reason", "max_tokens"} per ended generation


class HookedServing(ChatServing):
    """The chat task's serving with two test hooks on its engine, set by model.options: a slow model and
    a log of each generation's end (so that a test can watch a disconnect stop one generation)."""

    def predictor(self, model_dir, card, threads=None, precision="fp32"):
        predictor = super().predictor(model_dir, card, threads=threads, precision=precision)
        opts, engine = self.options, predictor.engine
        if opts.step_delay_s:  # whichever forward a step runs: the model's (eager) or the compiled one
            for owner, name in ((engine.model, "forward"), (engine.compiled, "logits")):
                if owner is not None:
                    setattr(owner, name, _slowed(getattr(owner, name), opts.step_delay_s))
        if opts.finish_log:
            def record(gen):
                with open(opts.finish_log, "a") as f:
                    f.write(json.dumps({"tokens": gen.completion_tokens, "finish_reason": gen.finish_reason,
                                        "max_tokens": gen.params.max_tokens}) + "\n")

            engine.on_finish = record
        return predictor


def _slowed(fn, delay_s: float):
    def slow(*args, **kwargs):
        time.sleep(delay_s)
        return fn(*args, **kwargs)

    return slow


class HookedChatTask(ChatTask):
    Options = HookedOptions
    Serving = HookedServing


def served(model_dir: str, card=None, base: str | None = None, extra: tuple[str, ...] = (), **generate):
    """The chat task's predictor of a registered directory, by default a whole model registered as
    tiny:1 (nothing loaded yet), its forward eager (EAGER); `base`: the config's model.name_or_path; `extra`:
    config overrides."""
    from types import SimpleNamespace

    from tests.conftest import ROOT
    from workflows.config import load_config
    from workflows.tasks.chat.serving import ChatPredictor

    sets = [f"serve.generate.{k}={v}" for k, v in generate.items()] + ([f"model.name_or_path={base}"] if base else [])
    cfg = load_config(ROOT / "configs" / "chat.yaml", [EAGER, *sets, *extra])
    return ChatPredictor(ChatTask(cfg), model_dir, card or SimpleNamespace(name="tiny", version=1))


def register_chat_models(cfg, ctx, base, tmp, name: str, task: str) -> None:
    """The base model in `base` as `name`, the adapters `support` and `pirate` (folders under `tmp`) as the chat
    task's export registers them (export=adapter, the base by its name and the sha256 of its weights: a
    replica reads the card before it downloads a version), and `stranger`: support's files on another base."""
    from workflows import registry
    from workflows.tasks.chat.training.model import weights_sha256

    registry.register(cfg, ctx, str(base), name, {"task": task})
    same = {"name_or_path": f"registry:{name}:1", "sha256": weights_sha256(str(base))}
    for adapter in ("support", "pirate"):
        registry.register(cfg, ctx, str(tmp / adapter), adapter, {"task": task, "export": "adapter", "base": same})
    registry.register(cfg, ctx, str(tmp / "support"), "stranger",
                      {"task": task, "export": "adapter", "base": {**same, "sha256": "0" * 64}})


def deploy_chat(cfg, spec: str, app: str, port: int, token: str, timeout_s: float) -> str:
    """`spec` served by the generic app (workflows.serve.app.ModelServer) as application `app` on 127.0.0.1:port
    behind `token` (serve.auth_token_env names CHAT_TOKEN), once healthy; its URL."""
    from typing import Any

    from ray import serve

    from tests.helpers import wait_until
    from workflows.serve.app import ModelServer, deployment_options

    opts = deployment_options(cfg)
    opts["ray_actor_options"]["runtime_env"]["env_vars"]["CHAT_TOKEN"] = token
    deployment: Any = ModelServer
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(deployment.options(**opts).bind(cfg.model_dump(mode="json"), spec), name=app, route_prefix="/",
              blocking=False)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: healthy(url), timeout_s, f"{spec}'s replica")
    return url


def healthy(url: str) -> bool:
    import requests

    try:
        return requests.get(f"{url}/healthz", timeout=5).status_code == 200
    except requests.RequestException:
        return False
