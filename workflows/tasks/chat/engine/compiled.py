"""A compiled forward of a step's tokens: the decoder's layers as one inductor graph, its weights frozen.

Why: transformers' eager Llama runs some 37 small operators a layer (RMSNorm, rotary, seven projections,
residual adds), each dispatched from Python: at a decode step of a 135M model on a CPU that is a third
of the step beside the matmuls (docs/BENCHMARKS.md, "The engine's step, profiled"). Compiled with
inductor, with the weights frozen (constants of the graph), the elementwise work is fused into a few C++
loops, the q, k and v projections are one matmul and so are the gate and up projections (the weights
concatenated, folded once as constants), and every matmul computes with its weight packed for oneDNN
(inductor's freezing packs them as `engine.linear` does for the eager model). The attention is the
engine's slot attention (workflows.tasks.chat.engine.cache) as a `torch.library` custom op: opaque to
the compiler, so the graph does not break around it, and it reads the step's plan (which slots, which
positions) from the step that runs it, not from the graph's inputs.

The token count is dynamic, a single token's included (size-oblivious: the token count is not specialized at
1): one graph with LoRA adapters' deltas and one without (workflows.tasks.chat.engine.lora: the step's
adapters are inputs of the graph, so their rows, mixed per row with base rows, run in it too; vLLM turns its
compile off whenever LoRA is on). A third graph, optional (`one_token`), is static at one token without adapters,
the output head in it: a lone stream's decode step, which reads every weight for one row, so its speed is the rate
its matmuls read weights at. There inductor autotunes each matmul between its C++ GEMM template (a micro-kernel
over the frozen weight, blocked for it) and ATen's, and the template reads them faster than oneDNN's packed op
(on SmolLM2-135M on 2 cores: a lone stream's step in 0.52x the time, docs/BENCHMARKS.md); it is not the dynamic
graphs' choice, since at 16 rows the template with a dynamic row count was 3x slower than oneDNN (and static at
16 rows, no faster). All are compiled when the engine is built (`warm_up`), never per request: after warm-up a
call that would recompile raises instead (torch.compiler's "fail_on_recompile" stance) and that step
runs eagerly, counted (`refused`), as do steps with an adapter the graph cannot compute (DoRA) and steps
after the model's weights changed in place (the graph holds them as constants).

The layers it knows: transformers' Llama layout (q/k/v/o and gate/up/down projections, RMSNorm before
attention and MLP, rotary embeddings from the model's own rotary module, so its scaling kind is the
model's), which Llama, Mistral and Qwen2 share (`ARCHITECTURES`). Another model runs eagerly.
"""

from __future__ import annotations

import logging
import threading
import time
import types

import torch
import torch.nn.functional as F

from workflows.tasks.chat.engine.cache import StepPlan, attend, attention_shape
from workflows.tasks.chat.engine.device import model_device, model_dtype
from workflows.tasks.chat.engine.linear import source
from workflows.tasks.chat.engine.lora import Adapters, AdapterStep, delta, warm_up_step

log = logging.getLogger(__name__)

ARCHITECTURES = ("llama", "mistral", "qwen2")  # model_type values laid out as transformers' Llama
AUTOTUNED = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}  # one-token graph
_step = threading.local()  # the plan of the step running in this thread, read by the attention op


@torch.library.custom_op("workflows_chat::slot_attention", mutates_args=())
def slot_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int,
                      scaling: float) -> torch.Tensor:
    """query [tokens, heads, dim], key and value [tokens, kv_heads, dim] -> [tokens, heads * dim]. It writes
    the cache of the running step's plan (state the compiler does not see: the op is opaque, and a layer's
    cache is read and written by that layer's call alone, which its output depends on)."""
    out = attend(_step.plan, layer, query[:, :, None], key[:, :, None], value[:, :, None], scaling)
    return out.reshape(query.shape[0], -1)


@slot_attention_op.register_fake
def _(query, key, value, layer, scaling):
    return query.new_empty(query.shape[0], query.shape[1] * query.shape[2])


def unsupported(model) -> str | None:
    """Why the compiled forward cannot run `model` (None where it can)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    if getattr(config, "model_type", None) not in ARCHITECTURES:
        return f"model_type {getattr(config, 'model_type', None)!r} (compiled: {', '.join(ARCHITECTURES)})"
    inner = getattr(base, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return f"{type(base).__name__} is not laid out as transformers' Llama"
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if any(hasattr(attn, a) for a in ("q_norm", "k_norm")) or not all(
                hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return f"{type(layer).__name__} has layers the compiled forward does not know"
    if model_device(model).type != "cpu":
        return f"weights on {model_device(model).type} (the compiled forward is measured on CPUs only)"
    return None


def _linear(module) -> torch.nn.Linear:
    """A projection's own Linear (a peft LoRA layer's base layer: the compiled forward runs base rows)."""
    return getattr(module, "base_layer", module)


class Decoder(torch.nn.Module):
    """The decoder's layers over a step's tokens (a batch of one-token rows): ids [tokens], positions
    [tokens] -> the final norm's hidden states [tokens, hidden]. It holds the model's own weights (no copy)."""

    def __init__(self, model, positions: int):
        super().__init__()
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        inner = base.model
        self.register_buffer("embed", inner.embed_tokens.weight.detach(), persistent=False)
        self.register_buffer("norm_w", inner.norm.weight.detach(), persistent=False)
        self.norm_eps = inner.norm.variance_epsilon
        self.layers_ = []
        for i, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            q, k, v, o = (_linear(getattr(attn, n)) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
            gate, up, down = (_linear(getattr(mlp, n)) for n in ("gate_proj", "up_proj", "down_proj"))
            weights = {"q": q.weight, "k": k.weight, "v": v.weight, "o": o.weight, "gate": gate.weight,
                       "up": up.weight, "down": down.weight, "ln1": layer.input_layernorm.weight,
                       "ln2": layer.post_attention_layernorm.weight}
            for name, b in (("qb", q.bias), ("kb", k.bias), ("vb", v.bias), ("ob", o.bias), ("gateb", gate.bias),
                            ("upb", up.bias), ("downb", down.bias)):
                weights[name] = b
            for name, w in weights.items():  # detached: the storage and version the model's, not its grad flag
                if w is not None:
                    self.register_buffer(f"l{i}_{name}", w.detach(), persistent=False)
            self.layers_.append((i, weights["qb"] is not None, weights["ob"] is not None,
                                 weights["gateb"] is not None, layer.input_layernorm.variance_epsilon,
                                 layer.post_attention_layernorm.variance_epsilon, attn.scaling, mlp.act_fn))
        _, self.heads, self.kv_heads, self.head_dim = attention_shape(base.config)  # the cache's own reading
        with torch.no_grad():  # the model's own rotary embedding (its scaling kind) at every position
            probe = torch.zeros(1, dtype=self.embed.dtype, device=self.embed.device)
            cos, sin = inner.rotary_emb(probe, torch.arange(positions, device=self.embed.device)[None])
        self.register_buffer("cos", cos[0], persistent=False)
        self.register_buffer("sin", sin[0], persistent=False)
        head = _linear(model.get_output_embeddings())  # (the one-token graph's: `logits`)
        self.register_buffer("head_w", head.weight.detach(), persistent=False)
        self.register_buffer("head_b", None if head.bias is None else head.bias.detach(), persistent=False)

    def _p(self, i: int, name: str) -> torch.Tensor:
        return getattr(self, f"l{i}_{name}")

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, lora: tuple | None) -> torch.Tensor:
        """`lora`: the step's LoRA adapters' inputs (lora.AdapterStep.inputs), their deltas added to each
        projection group; None: base tokens only."""
        h = F.embedding(ids, self.embed)
        n, hd = ids.shape[0], self.head_dim
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        if lora is not None:  # per group: A, B (its bias in its last columns), the tokens' masks
            rows = lora[12]
            la, lb, masks = lora[0:4], lora[4:8], [m[rows] for m in lora[8:12]]
        for i, qkv_bias, o_bias, mlp_bias, eps1, eps2, scaling, act in self.layers_:
            p = self._p
            x = _rms(h, p(i, "ln1"), eps1)
            # one matmul for q, k and v: the concatenation of constants is folded once by the compiler
            qkv = F.linear(x, torch.cat([p(i, "q"), p(i, "k"), p(i, "v")]),
                           torch.cat([p(i, "qb"), p(i, "kb"), p(i, "vb")]) if qkv_bias else None)
            if lora is not None:
                qkv = qkv + delta(x, la[0][i], lb[0][i], masks[0])
            # split after the view: a view of a column slice would guard the token count against 1
            qkv = qkv.view(n, self.heads + 2 * self.kv_heads, hd)
            q = _rotate(qkv[:, :self.heads], cos, sin)
            k = _rotate(qkv[:, self.heads:self.heads + self.kv_heads], cos, sin)
            v = qkv[:, self.heads + self.kv_heads:]
            a = slot_attention_op(q, k, v, i, scaling)
            o = F.linear(a, p(i, "o"), p(i, "ob") if o_bias else None)
            if lora is not None:
                o = o + delta(a, la[1][i], lb[1][i], masks[1])
            h = h + o
            x = _rms(h, p(i, "ln2"), eps2)
            gu = F.linear(x, torch.cat([p(i, "gate"), p(i, "up")]),
                          torch.cat([p(i, "gateb"), p(i, "upb")]) if mlp_bias else None)
            if lora is not None:
                gu = gu + delta(x, la[2][i], lb[2][i], masks[2])
            width = gu.shape[-1] // 2
            m = act(gu[:, :width]) * gu[:, width:]
            d = F.linear(m, p(i, "down"), p(i, "downb") if mlp_bias else None)
            if lora is not None:
                d = d + delta(m, la[3][i], lb[3][i], masks[3])
            h = h + d
        return _rms(h, self.norm_w, self.norm_eps)

    def logits(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The output head over `forward`'s hidden states of base tokens: [tokens, vocab]."""
        return F.linear(self.forward(ids, positions, None), self.head_w, self.head_b)


def _own_code(fn):
    """`fn` with a code object of its own (torch.compile keeps its graphs per code object)."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, as it computes (in fp32, then back to the input's dtype)."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [tokens, heads, dim] (transformers' rotate_half layout)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


class CompiledForward:
    """The compiled decoder of a model, its output head, and the tables of its LoRA adapters (`adapters`)."""

    def __init__(self, model, positions: int, one_token: bool = False):
        self.decoder = Decoder(model, positions)
        self.head = model.get_output_embeddings()
        self._frozen = [t for name, t in self.decoder.named_buffers() if name not in ("cos", "sin")]
        self._sources = self._weights_now()
        # dynamic: one graph for every token count (warm_up: size-oblivious); the forward's code an
        # object of its own, so that its graphs and their guards (and their count's limit) are this engine's alone
        self._fn = torch.compile(_own_code(Decoder.forward), dynamic=True)
        # static: one token without adapters, a lone stream's decode step, its output head included (a fifth of
        # SmolLM2-135M's weights: its matmul at one row autotuned too)
        self._one = torch.compile(_own_code(Decoder.logits), dynamic=False) if one_token else None
        self.one_token = one_token  # steps of one token run it (set between steps: the dynamic graph runs them)
        self.one_token_steps, self.one_token_compile_s = 0, 0.0  # steps it ran; its warm-up's seconds
        self.adapters = Adapters()
        self.warm = False
        self.refused = 0  # steps that would have recompiled after warm-up, run eagerly instead

    def _weights_now(self) -> list[tuple]:
        return [source(t) for t in self._frozen]

    def current(self) -> bool:
        """The frozen weights are still the model's (none replaced or changed in place since)."""
        return self._weights_now() == self._sources

    def warm_up(self, cache) -> None:
        """Compile the graphs (with LoRA adapters' deltas or without, any token count; the one-token graph) on
        the cache's first slots, before any request holds one (a request writes a position's keys before it
        reads them)."""
        device = cache.device
        # freezing: the weights are constants of the graphs, so inductor folds the concatenations and packs every
        # matmul's weight once. A global setting (read outside torch.compile's options), so set while compiling
        # only: no other compile in the process (a training step's) sees it. No duck shapes: a size of the LoRA
        # inputs equal to another (a model width) while compiling is not made the same symbol, which would tie
        # the graph to that size. Size-oblivious: the token count is not specialized at 1, so a lone stream's
        # step runs the same graph, its matmuls oneDNN's packed ones (a graph of 1 token, static, would run MKL's)
        with torch._inductor.config.patch(freezing=True), \
                torch.fx.experimental._config.patch(use_duck_shape=False, backed_size_oblivious=True), \
                torch.compiler.set_stance("default"):
            self._warm_up(cache, device)
        if self._one is not None:  # each matmul's kernel measured: inductor's C++ GEMM template or ATen's
            started = time.perf_counter()
            with torch._inductor.config.patch(**AUTOTUNED), torch.compiler.set_stance("default"), \
                    torch.inference_mode():
                ids, positions = (torch.zeros(1, dtype=torch.long, device=device) for _ in range(2))
                keep = torch.zeros(1, dtype=torch.long, device=device)
                self._call(ids, positions, cache.plan([0], [0], [0], []), keep, None)
            self.one_token_compile_s = time.perf_counter() - started
        self.warm, self.one_token_steps = True, 0

    def _warm_up(self, cache, device) -> None:
        for n, lora in ((2, False), (2, True)):
            with torch.inference_mode():  # inputs made as a step makes them (inference tensors: a guard)
                plan = cache.plan([0] * n, list(range(n)), [], [(0, n)])  # slot 0's first n positions: a cache
                # of one slot warms up too (the graphs do not depend on what the attention op is planned to do)
                ids, positions = (torch.zeros(n, dtype=torch.long, device=device) for _ in range(2))  # not one
                # tensor twice: aliasing is a guard
                keep = torch.tensor([n - 1], device=device)  # a step's last token (the head runs eagerly)
                self._call(ids, positions, plan, keep, warm_up_step(self.decoder, n) if lora else None)

    def _call(self, ids: torch.Tensor, positions: torch.Tensor, plan: StepPlan, keep: torch.Tensor,
              adapters: AdapterStep | None) -> torch.Tensor:
        """The logits of the step's tokens at `keep`: from the one-token graph (its head in it) for one base
        token, else the output head over the dynamic graph's hidden states."""
        one = self._one if self.one_token and adapters is None and ids.shape[0] == 1 else None
        _step.plan = plan
        try:
            with torch.inference_mode():  # as every step runs (grad mode is one of the graphs' guards)
                if one is not None:
                    self.one_token_steps += 1
                    return one(self.decoder, ids, positions)[keep]
                hidden = self._fn(self.decoder, ids, positions, None if adapters is None else adapters.inputs())
        finally:
            _step.plan = None
        return self.head(hidden[keep])

    def logits(self, ids: torch.Tensor, positions: torch.Tensor, plan: StepPlan, keep: torch.Tensor,
               adapters: AdapterStep | None = None) -> torch.Tensor | None:
        """The logits of a step's tokens at `keep` (`adapters`: its rows' LoRA adapters, None for base rows
        only), or None where the graph would recompile (the step then runs eagerly)."""
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                return self._call(ids, positions, plan, keep, adapters)
        except RuntimeError as e:  # torch raises a plain RuntimeError for the stance, before running anything
            if "fail_on_recompile" not in str(e):
                raise
            self.refused += 1
            log.warning("the compiled forward would recompile for a step of %d tokens: the step runs eagerly (%s)",
                        ids.shape[0], " ".join(str(e).split("guard failure(s):", 1)[-1].split())[:300])
            plan.layers_seen = 0
            return None


FORWARDS = ("auto", "compiled", "eager")
ONE_TOKEN = ("auto", "on", "off")
ONE_TOKEN_AUTO_BYTES = 64 << 20  # layers' weights well beyond a CPU's caches: a one-token step bound by reading them


def build(model, forward: str, cache, one_token: str = "auto") -> CompiledForward | None:
    """The compiled forward `forward` asks for (serve.generate.forward), warmed up on `cache`: "eager",
    none; "compiled", one or a clear error; "auto", one where the model, its dtype and its device are those
    it is measured on (an fp32 Llama-laid decoder on a CPU), else none (on a GPU until measured there).
    `one_token` (serve.generate.one_token_graph): its one-token graph "on", "off", or "auto": on where the
    layers' weights exceed ONE_TOKEN_AUTO_BYTES (SmolLM2-135M's are 425 MB, a tiny test model's some KB)."""
    if forward not in FORWARDS:
        raise ValueError(f"forward {forward!r}: one of {', '.join(FORWARDS)}")
    if one_token not in ONE_TOKEN:
        raise ValueError(f"one_token {one_token!r}: one of {', '.join(ONE_TOKEN)}")
    if forward == "eager":
        return None
    why = unsupported(model)
    if why is None and forward == "auto" and model_dtype(model) != torch.float32:
        why = f"{model_dtype(model)} weights (auto compiles fp32, where it is measured)"
    if why is not None:
        if forward == "compiled":
            raise NotImplementedError(f"serve.generate.forward=compiled: {why}; set it to eager or auto")
        log.info("the engine's forward runs eagerly: %s", why)
        return None
    started = time.perf_counter()
    made = CompiledForward(model, cache.max_tokens, one_token_graph(model, one_token))
    made.warm_up(cache)
    log.info("the engine's forward compiled in %.1f s (its one-token graph in %.1f s)", time.perf_counter() - started,
             made.one_token_compile_s)
    return made


def one_token_graph(model, one_token: str) -> bool:
    """Whether a compiled forward of `model` has its one-token graph (`one_token`: "on", "off" or "auto")."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    # the decoder layers' weights (not the embeddings, of which a step gathers a row a token)
    layers = sum(p.numel() * p.element_size() for p in base.model.layers.parameters())
    return one_token == "on" or (one_token == "auto" and layers > ONE_TOKEN_AUTO_BYTES)
