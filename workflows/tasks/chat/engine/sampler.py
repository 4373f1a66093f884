"""The next token of every row of a step, chosen together on the model's device.

Per row, in this order (SamplingParams): logit_bias, presence and frequency penalties (over the row's
generated tokens), its TokenConstraint's mask, then greedy (argmax) below MIN_TEMPERATURE, else
temperature, top_p and the draw. Only the chosen ids (and the log probabilities a row asked for) come
back to the host, in one transfer.

The draw is by inverse CDF with one uniform number per row from the request's own seeded CPU generator,
so a seeded request gives the same tokens alone or beside others, on any device: the uniform does not
depend on the batch, and every other operation is per row. top_p takes the most probable tokens with
`topk`, 64 at first and 8 times more for a row whose 64 do not reach top_p (a sort of the whole
vocabulary only where the nucleus is that wide), rather than sorting every row's 49,152 logits.

Log probabilities come from the distribution the token was drawn from: log_softmax of the processed
logits for a greedy row; the temperature-scaled distribution, renormalized over top_p's nucleus, for a
sampled row. A row whose processing fails (the model's logits for it are not finite, its constraint
raised, or it allows no token) gets its exception instead of a token; the other rows are unaffected.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from workflows.tasks.chat.engine.params import SamplingParams, generator
from workflows.tasks.chat.engine.requests import TokenLogprob

TOP_K_FIRST = 64  # candidates top_p starts from; 8x more where they do not reach it


@dataclass
class RowSampling:
    """One request's sampling state: its settings, its generator, its logit bias on the device, and the
    slot its generated tokens are counted in (for penalties)."""

    params: SamplingParams
    slot: int
    rng: torch.Generator
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None


class Sampler:
    """Chooses tokens for the rows of a step: `row` when a request joins, `choose` at each step,
    `accepted` with the chosen tokens (penalty counts, constraints)."""

    def __init__(self, vocab_size: int, slots: int, device: torch.device):
        self.vocab_size, self.slots, self.device = vocab_size, slots, device
        self._counts: torch.Tensor | None = None  # [slots, vocab] generated-token counts, made on first use

    def row(self, params: SamplingParams, slot: int) -> RowSampling:
        row = RowSampling(params, slot, generator(params.seed))
        if params.logit_bias:
            ids = list(params.logit_bias)
            if max(ids) >= self.vocab_size:
                raise ValueError(f"logit_bias: token {max(ids)} is not in the vocabulary of {self.vocab_size}")
            row.bias_ids = torch.tensor(ids, device=self.device)
            row.bias_values = torch.tensor([float(params.logit_bias[i]) for i in ids], device=self.device)
        if params.penalized:
            if self._counts is None:
                self._counts = torch.zeros(self.slots, self.vocab_size, device=self.device)
            self._counts[slot].zero_()
        return row

    def choose(self, logits: torch.Tensor, rows: Sequence[RowSampling]) -> list[TokenChoiceOrError]:
        """The next token of each row (logits [rows, vocab], on the device; processed in place when they
        are float32): a (token, TokenLogprob or None) per row, or the exception that row's choice raised."""
        logits = logits.float()
        n = len(rows)
        # a NaN or +inf anywhere, or no finite logit, is a broken row (an adapter with NaN weights or a huge
        # scale): it fails alone; -inf alone is a model's own mask and is kept. One reduction finds all three:
        # a row's max is NaN if any logit is (amax propagates NaN), +inf if one is, -inf if all are
        broken = (~torch.isfinite(logits.amax(-1))).tolist()
        failed: dict[int, BaseException] = {i: NonFinite("the model's logits for this request are not finite (NaN "
                                                         "or inf): its adapter's weights or scale may be broken")
                                            for i, bad in enumerate(broken) if bad}
        biased = [i for i, r in enumerate(rows) if r.bias_ids is not None]
        if biased:
            r_idx = torch.cat([torch.full_like(rows[i].bias_ids, i) for i in biased])  # type: ignore[arg-type]
            t_idx = torch.cat([rows[i].bias_ids for i in biased])  # type: ignore[misc]
            logits.index_put_((r_idx, t_idx), torch.cat([rows[i].bias_values for i in biased]),  # type: ignore[misc]
                              accumulate=True)
        penalized = [i for i, r in enumerate(rows) if r.params.penalized]
        if penalized:
            assert self._counts is not None
            idx = torch.tensor(penalized, device=self.device)
            counts = self._counts.index_select(0, torch.tensor([rows[i].slot for i in penalized], device=self.device))
            freq = torch.tensor([rows[i].params.frequency_penalty for i in penalized], device=self.device)[:, None]
            pres = torch.tensor([rows[i].params.presence_penalty for i in penalized], device=self.device)[:, None]
            logits.index_copy_(0, idx, logits.index_select(0, idx) - counts * freq - (counts > 0).float() * pres)
        for i, r in enumerate(rows):
            if r.params.constraint is not None and i not in failed:
                try:
                    r.params.constraint.mask(logits[i])
                except Exception as e:  # that row's alone
                    failed[i] = e
        # a row that a bias or its constraint may have left without any token (-inf everywhere)
        masked = [i for i, r in enumerate(rows) if i not in failed and (r.bias_ids is not None
                                                                         or r.params.constraint is not None)]
        empty: list[int] = []
        if masked:
            m = torch.tensor(masked, device=self.device)
            empty = [i for i, ok in zip(masked, torch.isfinite(logits.index_select(0, m)).any(-1).tolist()) if not ok]
        if failed or empty:  # such a row's logits may be anything: sample a harmless row, answer its error
            logits[list(failed) + empty] = 0.0

        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        tokens = torch.zeros(n, dtype=torch.long, device=self.device)
        logprob_rows: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}  # row -> (log dist values, ids, k)
        if greedy:
            g = torch.tensor(greedy, device=self.device)
            tokens.index_copy_(0, g, logits.index_select(0, g).argmax(-1))
            asked = [i for i in greedy if rows[i].params.logprobs is not None]
            if asked:
                a = torch.tensor(asked, device=self.device)
                self._full_logprobs(torch.log_softmax(logits.index_select(0, a), -1), asked, rows, logprob_rows)
        if sampled:
            self._sample(logits, sampled, rows, tokens, logprob_rows)

        host = tokens.tolist()
        chosen_lp = self._gather_logprobs(logprob_rows, host, rows)
        out: list[TokenChoiceOrError] = []
        for i in range(n):
            if i in failed:
                out.append(failed[i])
            elif i in empty:
                out.append(RuntimeError("no token is allowed: every logit is -inf after logit_bias and the constraint"))
            else:
                out.append((host[i], chosen_lp.get(i)))
        return out

    def _sample(self, logits: torch.Tensor, sampled: list[int], rows: Sequence[RowSampling], tokens: torch.Tensor,
                logprob_rows: dict) -> None:
        dev = self.device
        s = torch.tensor(sampled, device=dev)
        temps = torch.tensor([rows[i].params.temperature for i in sampled], device=dev)[:, None]
        scaled = logits.index_select(0, s) / temps
        probs = torch.softmax(scaled, -1)
        # one uniform per row from its own generator, on the host: independent of the batch and the device
        u = torch.tensor([float(torch.rand((), generator=rows[i].rng, dtype=torch.float64)) for i in sampled],
                         dtype=torch.float64, device=dev)
        whole = [j for j, i in enumerate(sampled) if rows[i].params.top_p >= 1]
        nucleus = [j for j, i in enumerate(sampled) if rows[i].params.top_p < 1]
        if whole:
            w = torch.tensor(whole, device=dev)
            cdf = probs.index_select(0, w).cumsum(-1, dtype=torch.float64)
            pick = torch.searchsorted(cdf, (u[w] * cdf[:, -1])[:, None], right=True).clamp_(max=self.vocab_size - 1)
            tokens.index_copy_(0, s[w], pick[:, 0])
            asked = [j for j in whole if rows[sampled[j]].params.logprobs is not None]
            if asked:
                a = torch.tensor(asked, device=dev)
                self._full_logprobs(torch.log_softmax(scaled.index_select(0, a), -1), [sampled[j] for j in asked],
                                    rows, logprob_rows)
        if nucleus:
            self._sample_top_p(probs, nucleus, sampled, rows, u, tokens, logprob_rows)

    def _sample_top_p(self, probs: torch.Tensor, nucleus: list[int], sampled: list[int],
                      rows: Sequence[RowSampling], u: torch.Tensor, tokens: torch.Tensor, logprob_rows: dict) -> None:
        dev, vocab = self.device, probs.shape[-1]
        todo, k = nucleus, min(TOP_K_FIRST, vocab)
        while todo:
            t = torch.tensor(todo, device=dev)
            top_p = torch.tensor([rows[sampled[j]].params.top_p for j in todo], device=dev)[:, None]
            values, ids = probs.index_select(0, t).topk(k, -1)  # most probable first
            before = values.cumsum(-1) - values  # the mass of the more probable candidates
            done = [True] * len(todo) if k == vocab else (before[:, -1] + values[:, -1] >= top_p[:, 0]).tolist()
            keep = [j for j, d in zip(todo, done) if d]
            if keep:
                r = torch.tensor([todo.index(j) for j in keep], device=dev)
                values, ids, before = values[r], ids[r], before[r]
                # the nucleus: candidates with less than top_p before them (so the most probable stays)
                kept = torch.where(before < top_p[r], values, torch.zeros_like(values)).double()
                cdf = kept.cumsum(-1)  # k candidates only
                mass = cdf[:, -1:]
                pick = torch.searchsorted(cdf, u[torch.tensor(keep, device=dev)][:, None] * mass, right=True)
                pick = torch.minimum(pick, (kept > 0).sum(-1, keepdim=True) - 1)
                rows_idx = torch.tensor([sampled[j] for j in keep], device=dev)
                tokens.index_copy_(0, rows_idx, ids.gather(-1, pick)[:, 0])
                asked = [m for m, j in enumerate(keep) if rows[sampled[j]].params.logprobs is not None]
                if asked:
                    a = torch.tensor(asked, device=dev)
                    # renormalized over the nucleus
                    logs = (kept.index_select(0, a) / mass.index_select(0, a)).log().float()
                    for m, row_logs, row_ids in zip(asked, logs, ids.index_select(0, a)):
                        logprob_rows[sampled[keep[m]]] = (row_logs, row_ids, rows[sampled[keep[m]]].params.logprobs)
            todo = [j for j, d in zip(todo, done) if not d]
            k = min(vocab, k * 8)

    @staticmethod
    def _full_logprobs(logs: torch.Tensor, which: list[int], rows: Sequence[RowSampling], logprob_rows: dict) -> None:
        """Rows whose distribution is the whole vocabulary: keep their log-probabilities for the gather."""
        for row_logs, i in zip(logs, which):
            logprob_rows[i] = (row_logs, None, rows[i].params.logprobs)

    def _gather_logprobs(self, logprob_rows: dict, host_tokens: list[int],
                         rows: Sequence[RowSampling]) -> dict[int, TokenLogprob]:
        """The chosen token's log probability and the top alternatives of each row that asked, gathered on
        the device and brought to the host in one transfer."""
        if not logprob_rows:
            return {}
        order = list(logprob_rows)
        widest = max(logprob_rows[i][2] for i in order)
        chosen, top_values, top_ids = [], [], []
        for i in order:
            logs, ids, _ = logprob_rows[i]
            if ids is None:  # the whole vocabulary, indexed by token id
                chosen.append(logs[host_tokens[i]])
                values, which = logs.topk(min(widest, logs.shape[-1]))
            else:  # the nucleus' candidates `ids`, most probable first
                chosen.append(logs[(ids == host_tokens[i]).nonzero()[0, 0]])
                values, which = logs[:widest], ids[:widest]
            top_values.append(values)
            top_ids.append(which)
        width = min(v.shape[0] for v in top_values)
        tops = torch.stack([v[:width] for v in top_values])
        values_host = torch.cat([torch.stack(chosen)[:, None], tops], 1).tolist()
        ids_host = torch.stack([t[:width] for t in top_ids]).tolist()
        out = {}
        for row, i in enumerate(order):
            n = logprob_rows[i][2]
            top = [(int(t), float(v)) for t, v in zip(ids_host[row][:n], values_host[row][1:n + 1])
                   if v != float("-inf")]
            out[i] = TokenLogprob(host_tokens[i], float(values_host[row][0]), top)
        return out

    def accepted(self, rows: Sequence[RowSampling], tokens: Sequence[int]) -> list[BaseException | None]:
        """After the tokens were chosen: count them for penalties, pass them to constraints. Per row, the
        exception its constraint raised, or None."""
        penalized = [(r.slot, t) for r, t in zip(rows, tokens) if r.params.penalized]
        if penalized and self._counts is not None:
            slots, toks = zip(*penalized)
            self._counts.index_put_((torch.tensor(slots, device=self.device), torch.tensor(toks, device=self.device)),
                                    torch.ones(len(slots), device=self.device), accumulate=True)
        out: list[BaseException | None] = []
        for r, t in zip(rows, tokens):
            err = None
            if r.params.constraint is not None:
                try:
                    r.params.constraint.accept(t)
                except Exception as e:  # that row's alone
                    err = e
            out.append(err)
        return out


class NonFinite(RuntimeError):
    """A row's logits hold NaN or +inf (or nothing finite): that request fails, the others go on."""


TokenChoiceOrError = tuple[int, TokenLogprob | None] | BaseException
