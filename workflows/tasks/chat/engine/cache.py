"""The KV cache the engine writes in place, and the attention that reads it.

Storage: per layer, keys and values of shape [slots, kv_heads, capacity, head_dim], allocated once
(zeros) and grown (doubling, up to `max_tokens` per slot) only when a longer row needs it. A request
holds one slot from its admission to its end; its token at position p lives at [slot, :, p]. A step
writes one position per decoding row and a chunk of positions per prefilling row (an index_put, no
copy of the rest); a request that joins writes its own slot only; one that leaves frees its slot and
copies nothing. The memory is bounded by slots x max_tokens x `bytes_per_token`, and admission
counts slots: the engine admits a request only into a free slot.

Attention: one forward per step carries every token of the step (decode tokens and prefill chunks of
several requests) as a batch of length-1 sequences, [tokens, 1] (see workflows.tasks.chat.engine.loop
for why). The model's attention modules compute q, k, v and rotary embeddings as usual and call the
attention function registered here with transformers' `AttentionInterface` (ATTENTION, set as the
model's attention implementation by `use`); it receives the step's `StepPlan` as the `slot_plan`
keyword the model forwards to every attention call, writes the step's keys and values into their
slots, then attends (torch's scaled_dot_product_attention; decode tokens in fp32, `decode_attention`):
- decode tokens together: with the engine's kernel (`SlotCache.kernel`: fp32 on a CPU,
  workflows.tasks.chat.engine.kernels), each token's query heads against its own slot's positions up to
  its own length, read where they lie, once; with torch's operators, their queries against the slots'
  first L positions (a view, no gather), masked to each row's own length; a slot without a decode token
  this step attends to position 0 only, and its output is dropped; a row more than twice as long as the
  median (plus 64) attends alone, over its own length, so that one long request does not make every row
  read its length;
- prefill chunks: each chunk's queries against its own slot up to the chunk's end, causal by
  position; chunks of several rows together in one call (their few positions gathered), a chunk
  much further along than the others alone.
Query heads are folded onto their key/value head (GQA without repeating keys), as transformers' own
SDPA path does for decoding. Without a `slot_plan` (e.g. `generate` on the same model) the function
is transformers' SDPA attention, and its mask is SDPA's.

Why not transformers' own caches (5.23): `StaticCache` writes every row at one shared position
(cache_position), so rows cannot have lengths of their own; the continuous-batching module's
`PagedAttentionCache` flattens the batch into one sequence (batch 1, which breaks peft's per-row
`adapter_names`) and, with SDPA, gathers every cached key of every request into that sequence at every
layer and step, with a mask over all of them (measured at half the tokens/s of static batching on
CPU, workflows/tasks/chat/engine/loop.py). Slots let SDPA read each row's keys where they lie.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workflows.tasks.chat.engine.kernels import decode_attention_kernel

ATTENTION = "workflows_slots"  # the attention implementation name registered with transformers


def attention_shape(config) -> tuple[int, int, int, int]:
    """(layers, attention heads, key/value heads, head dim) of a decoder's config."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, heads, kv_heads, head_dim


def check_full_attention(config) -> None:
    """The engine's cache holds full-attention layers only: refuse sliding windows and other layer kinds."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if kinds != {"full_attention"} or (window and not getattr(config, "layer_types", None)):
        raise NotImplementedError(f"{type(config).__name__}: layers {sorted(kinds)}, sliding_window {window}: the "
                                  "engine's cache serves full-attention layers only")


class SlotCache:
    """Keys and values of up to `slots` requests, `max_tokens` positions each at most, on `device`."""

    def __init__(self, config, slots: int, max_tokens: int, device: torch.device, dtype: torch.dtype,
                 attention_kernel: str = "auto"):
        self.layers, self.heads, self.kv_heads, self.head_dim = attention_shape(config)
        self.group = self.heads // self.kv_heads
        self.slots, self.max_tokens, self.device, self.dtype = slots, max_tokens, device, dtype
        self.capacity = 0
        # the decode attention kernel `attention_kernel` chooses (workflows.tasks.chat.engine.kernels); None:
        # torch's operators
        self.kernel: Callable[..., torch.Tensor] | None = decode_attention_kernel(attention_kernel, device, dtype)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._free = list(range(slots))  # lowest first: rows stay packed at the start, so views stay short

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_bound(self) -> int:
        """The most memory the cache can ever take: every slot at max_tokens."""
        return self.slots * self.max_tokens * self.bytes_per_token

    @property
    def allocated_bytes(self) -> int:
        return self.slots * self.capacity * self.bytes_per_token

    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        self._free.sort()
        return self._free.pop(0)

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def reserve(self, positions: int) -> None:
        """Room for `positions` positions per slot (growing the storage, copying it once, if needed)."""
        if positions <= self.capacity:
            return
        if positions > self.max_tokens:
            raise ValueError(f"{positions} positions in a slot: the cache holds {self.max_tokens}")
        capacity = min(self.max_tokens, max(positions, 2 * self.capacity, 128))
        shape = (self.slots, self.kv_heads, capacity, self.head_dim)
        for store in (self.keys, self.values):
            grown = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
            for old, new in zip(store, grown):
                new[:, :, :self.capacity] = old
            store[:] = grown
        self.capacity = capacity

    def plan(self, slots: list[int], positions: list[int], decode: list[int],
             prefills: list[tuple[int, int]]) -> StepPlan:
        """The attention plan of a step whose token i goes to (slots[i], positions[i]): `decode` lists the
        indices of decode tokens (one per row), `prefills` the (first index, count) of each prefill chunk
        (consecutive tokens of one row at consecutive positions)."""
        device = self.device
        self.reserve(max(positions) + 1)
        # each token's row of every key/value head in a layer's storage seen as [slots * kv_heads * capacity, dim]:
        # a step's writes one index_copy_ a layer, not an advanced-index assignment (a few times dearer, every layer)
        heads = torch.arange(self.kv_heads, device=device)
        slot_heads = torch.tensor(slots, device=device)[:, None] * self.kv_heads + heads
        at = slot_heads * self.capacity + torch.tensor(positions, device=device)[:, None]
        plan = StepPlan(self, at.reshape(-1))
        if decode and self.kernel is None:
            # a row much longer than the others attends alone, so that it does not widen what they all read
            ordered = sorted(positions[i] for i in decode)
            cut = 2 * ordered[len(ordered) // 2] + 64
            plan.alone = [(i, slots[i], positions[i] + 1) for i in decode if positions[i] >= cut]
            decode = [i for i in decode if positions[i] < cut]
        if decode:
            plan.decode_tokens = torch.tensor(decode, device=device)
            plan.decode_only = decode == list(range(len(slots)))  # every token of the step, in order
        if decode and self.kernel is not None:  # each token to its own length, its slot where it lies
            plan.kernel_slots = torch.tensor([slots[i] for i in decode], device=device)
            plan.kernel_lengths = torch.tensor([positions[i] + 1 for i in decode], device=device)
        elif decode:
            rows = max(slots[i] for i in decode) + 1
            length = max(positions[i] for i in decode) + 1
            lengths = [1] * rows  # a slot without a decode token attends to position 0 (its output is dropped)
            for i in decode:
                lengths[slots[i]] = positions[i] + 1
            dec_slots = [slots[i] for i in decode]
            plan.dense = dec_slots == list(range(rows))
            plan.decode_slots = None if plan.dense else torch.tensor(dec_slots, device=device)
            plan.decode_rows, plan.decode_len = rows, length
            if min(lengths) < length:  # rows of one length (a lone stream's) attend to every position: no mask
                span = torch.arange(length, device=device)
                plan.decode_mask = (span[None, :] < torch.tensor(lengths, device=device)[:, None])[:, None, None, :]
                if self.dtype == torch.float32:  # an additive mask, once a step, for every layer's scores
                    plan.decode_bias = torch.zeros(plan.decode_mask.shape, dtype=self.dtype, device=device)
                    plan.decode_bias.masked_fill_(~plan.decode_mask, float("-inf"))
        if prefills:
            # chunks of similar lengths attend together (their keys gathered, a few positions each); one
            # much longer than the others (a long prompt's later chunks) attends alone over its own slot
            ends = sorted(positions[start] + count for start, count in prefills)
            cut = 2 * ends[len(ends) // 2] + 64
            together = [(start, count) for start, count in prefills if positions[start] + count < cut]
            if len(together) < 2:
                together = []
            for start, count in prefills:
                if (start, count) not in together:
                    plan.prefills.append(self._chunk(start, count, slots[start], positions[start]))
            if together:
                plan.prefill_group = self._group(together, slots, positions)
        return plan

    def _chunk(self, start: int, count: int, slot: int, first: int) -> tuple:
        """One prefill chunk attending alone: (first index, count, slot, end, mask [1, 1, group*count, end])."""
        end = first + count
        span = torch.arange(end, device=self.device)
        causal = span[None, :] <= (first + torch.arange(count, device=self.device))[:, None]  # [count, end]
        return start, count, slot, end, causal.repeat(self.group, 1)[None, None]

    def _group(self, chunks: list[tuple[int, int]], slots: list[int], positions: list[int]) -> PrefillGroup:
        """Prefill chunks of several rows in one attention call: queries padded to the longest chunk (a
        padded query repeats its row's last one), keys gathered up to the longest end."""
        device, widest = self.device, max(count for _, count in chunks)
        length = max(positions[start] + count for start, count in chunks)
        q_index: list[int] = []
        last: list[int] = []
        valid: list[int] = []
        tokens: list[int] = []
        for r, (start, count) in enumerate(chunks):
            q_index += [start + min(t, count - 1) for t in range(widest)]
            last += [positions[start] + min(t, count - 1) for t in range(widest)]  # each query's position
            valid += [r * widest + t for t in range(count)]
            tokens += range(start, start + count)
        span = torch.arange(length, device=device)
        causal = span[None, None, :] <= torch.tensor(last, device=device).view(len(chunks), widest, 1)
        return PrefillGroup(torch.tensor(q_index, device=device),
                            torch.tensor([slots[start] for start, _ in chunks], device=device), widest, length,
                            causal.repeat(1, self.group, 1)[:, None], torch.tensor(valid, device=device),
                            torch.tensor(tokens, device=device))


@dataclass
class PrefillGroup:
    """Prefill chunks of several rows attending in one call (SlotCache._group)."""

    q_index: torch.Tensor  # [rows * widest]: the step's token whose query each padded query is
    slots: torch.Tensor  # [rows]
    widest: int  # the longest chunk
    length: int  # the positions read: the furthest chunk's end
    mask: torch.Tensor  # [rows, 1, group * widest, length]
    valid: torch.Tensor  # indices into rows * widest of the real queries
    tokens: torch.Tensor  # their tokens' indices in the step


@dataclass
class StepPlan:
    """Where a step's tokens write their keys and values, and what each attends to (SlotCache.plan)."""

    cache: SlotCache
    write_rows: torch.Tensor  # [tokens * kv_heads]: where each token's key (value) heads go in a layer's storage
    # flattened to rows of head_dim
    decode_tokens: torch.Tensor | None = None  # [n]: the decode tokens' indices in the step
    decode_slots: torch.Tensor | None = None  # [n]: their slots, None when they are slots 0..n-1 in order
    dense: bool = False
    decode_only: bool = False  # the decode tokens are all the step's tokens, in order
    decode_rows: int = 0  # slots 0..decode_rows-1 take part in the decode attention
    decode_len: int = 0  # positions 0..decode_len-1 are read
    decode_mask: torch.Tensor | None = None  # [decode_rows, 1, 1, decode_len], True where a row attends (None: all)
    decode_bias: torch.Tensor | None = None  # the same as 0 and -inf (fp32 caches: decode_attention's)
    kernel_slots: torch.Tensor | None = None  # [n]: with the cache's kernel, the decode tokens' slots
    kernel_lengths: torch.Tensor | None = None  # [n]: and the positions each reads (its own length)
    prefills: list = None  # type: ignore[assignment]  # (first index, count, slot, end, mask [1, 1, group*count, end])
    alone: list = None  # type: ignore[assignment]  # decode tokens attending alone: (index, slot, length)
    prefill_group: PrefillGroup | None = None  # prefill chunks attending together
    layers_seen: int = 0  # attention calls that used this plan: every layer's, or the model is not one we serve

    def __post_init__(self):
        self.prefills = self.prefills or []
        self.alone = self.alone or []


def slot_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, dropout=0.0,
                   scaling=None, slot_plan: StepPlan | None = None, **kwargs):
    """transformers' attention function signature: query [tokens, heads, 1, dim], key and value
    [tokens, kv_heads, 1, dim] of the step's tokens; returns ([tokens, 1, heads, dim], None)."""
    if slot_plan is None:  # any other caller of the model (generate): transformers' SDPA attention
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    for unsupported in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise NotImplementedError(f"attention with {unsupported}: the engine's cache serves full attention only")
    return attend(slot_plan, module.layer_idx, query, key, value, scaling), None


def attend(plan: StepPlan, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           scaling: float | None) -> torch.Tensor:
    """Layer `layer`'s slot attention of a step (the eager model's and the compiled forward's): writes
    the step's keys and values into their slots, returns [tokens, 1, heads, dim]."""
    plan.layers_seen += 1
    cache = plan.cache
    keys, values = cache.keys[layer], cache.values[layer]
    tokens, heads, _, dim = query.shape
    keys.view(-1, dim).index_copy_(0, plan.write_rows, key.reshape(-1, dim))
    values.view(-1, dim).index_copy_(0, plan.write_rows, value.reshape(-1, dim))
    kv_heads, group = cache.kv_heads, cache.group
    decoded = None
    if plan.decode_tokens is not None:
        n = plan.decode_tokens.shape[0]
        q = (query if plan.decode_only else query.index_select(0, plan.decode_tokens)).reshape(n, kv_heads, group, dim)
        if plan.kernel_lengths is not None and cache.kernel is not None:
            o = cache.kernel(q.contiguous(), keys, values, plan.kernel_slots, plan.kernel_lengths,
                             dim ** -0.5 if scaling is None else scaling)
        else:
            rows, length = plan.decode_rows, plan.decode_len
            if not plan.dense:
                q = q.new_zeros(rows, kv_heads, group, dim).index_copy_(0, plan.decode_slots, q)
            o = decode_attention(q, keys[:rows, :, :length], values[:rows, :, :length], plan.decode_mask,
                                 plan.decode_bias, scaling)
            if not plan.dense:
                o = o.index_select(0, plan.decode_slots)
        if plan.decode_only:  # nothing else attends this step: no `out` to copy into
            return o.reshape(n, 1, heads, dim)
        decoded = o.reshape(n, heads, dim)
    out = query.new_empty(tokens, heads, dim)
    if decoded is not None:
        out.index_copy_(0, plan.decode_tokens, decoded)
    for index, slot, length in plan.alone:
        q = query[index, :, 0].reshape(1, kv_heads, group, dim)
        o = decode_attention(q, keys[slot:slot + 1, :, :length], values[slot:slot + 1, :, :length], None, None,
                             scaling)
        out[index] = o.reshape(heads, dim)
    if (pg := plan.prefill_group) is not None:
        rows, widest = pg.slots.shape[0], pg.widest
        q = query.index_select(0, pg.q_index)[:, :, 0].view(rows, widest, kv_heads, group, dim)
        q = q.permute(0, 2, 3, 1, 4).reshape(rows, kv_heads, group * widest, dim)
        k = keys[:, :, :pg.length].index_select(0, pg.slots)
        v = values[:, :, :pg.length].index_select(0, pg.slots)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=pg.mask, scale=scaling)
        o = o.view(rows, kv_heads, group, widest, dim).permute(0, 3, 1, 2, 4).reshape(rows * widest, heads, dim)
        out.index_copy_(0, pg.tokens, o.index_select(0, pg.valid))
    for start, count, slot, end, mask in plan.prefills:
        q = query[start:start + count, :, 0].reshape(count, kv_heads, group, dim).permute(1, 2, 0, 3)
        o = F.scaled_dot_product_attention(q.reshape(1, kv_heads, group * count, dim), keys[slot:slot + 1, :, :end],
                                           values[slot:slot + 1, :, :end], attn_mask=mask, scale=scaling)
        out[start:start + count] = o.view(kv_heads, group, count, dim).permute(2, 0, 1, 3).reshape(count, heads, dim)
    return out.unsqueeze(1)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     bias: torch.Tensor | None, scaling: float | None) -> torch.Tensor:
    """Decode tokens' attention: q [rows, kv_heads, group, dim] over k, v [rows, kv_heads, length, dim] (views
    of the slots), `mask` [rows, 1, 1, length] (True: attended; `bias` the same as 0 and -inf) or None.

    In fp32, two batched matmuls and a softmax: a query row per head against a few hundred keys is too small
    for SDPA's CPU flash kernel, whose blocking and buffers cost more than the arithmetic (16 rows of
    SmolLM2's heads at 100 positions, 2 threads: 0.16 against 0.29 ms a layer; at one row the same). Other
    dtypes (bf16, fp16) keep SDPA, which accumulates its softmax in fp32."""
    if q.dtype != torch.float32 or (mask is not None and bias is None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    scores = torch.matmul(q, k.transpose(-1, -2))
    scores.mul_(q.shape[-1] ** -0.5 if scaling is None else scaling)
    if bias is not None:
        scores.add_(bias)
    return torch.matmul(torch.softmax(scores, -1), v)


def use_slot_attention(model) -> None:
    """Register the slot attention with transformers (once) and make it `model`'s attention (a peft
    model's base model's); other callers of the model get transformers' SDPA attention."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION, slot_attention)
        AttentionMaskInterface.register(ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(base.config, "_attn_implementation", None) != ATTENTION:
        base.set_attn_implementation(ATTENTION)
        if getattr(base.config, "_attn_implementation", None) != ATTENTION:
            raise NotImplementedError(f"{type(base).__name__} does not take an attention implementation of "
                                      "transformers' AttentionInterface: the engine cannot serve it")


def check_plan_used(plan: StepPlan) -> None:
    """After a forward: every attention layer ran the slot attention with the step's plan (a model whose
    layers drop the keyword would have attended each token to itself alone)."""
    if plan.layers_seen != plan.cache.layers:
        raise NotImplementedError(f"{plan.layers_seen} of the model's {plan.cache.layers} attention layers used the "
                                  "engine's cache: the model does not pass its keyword arguments to its attention "
                                  "functions, and the engine cannot serve it")
