"""The bookkeeping half of beam search (search.py runs the model and ranks the candidates): which candidates
become the next beams, which close a hypothesis, when an input's search is over, and the final choice.

A finished hypothesis with L generated tokens (its eos included) and summed log-probability S scores
S / L**length_penalty. The next beams are built as Python lists and made into tensors once: an element write
into a tensor costs a few microseconds, and one step does B0 * K * 3 of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from qkv.generate.config import GenerationConfig

NEG_INF = float("-inf")


@dataclass
class NextBeams:
    """The K beams of every input after one step: score, token and the row of the previous step it extends."""

    scores: Tensor  # (B0, K)
    tokens: Tensor  # (B0, K) long
    sources: Tensor  # (B0, K) long, the beam (0..Kc-1) of the same input that each beam continues


@dataclass
class BeamBook:
    """The finished hypotheses of each of B0 inputs (the K best, best first) and which inputs are done."""

    inputs: int
    cfg: GenerationConfig
    max_new: int
    eos: set[int]
    pad: int
    finished: list[list[tuple[float, Tensor]]] = field(init=False)
    done: list[bool] = field(init=False)

    def __post_init__(self) -> None:
        self.finished = [[] for _ in range(self.inputs)]
        self.done = [False] * self.inputs

    def advance(self, top: list[list[float]], src: list[list[int]], tok: list[list[int]], beams: int,
                generated: Tensor, length: int) -> NextBeams:
        """The next beams from each input's candidates (best first; `beams` = Kc beams per input this step).
        An eos among the K best candidates closes a hypothesis (its tokens: `generated`'s row of the beam it
        extends, then the eos); the next K non-eos candidates become the beams. `length` = L of this step."""
        K = self.cfg.num_beams
        next_s = [[NEG_INF] * K for _ in range(self.inputs)]
        next_tok = [[self.pad] * K for _ in range(self.inputs)]
        next_src = [[k if k < beams else 0 for k in range(K)] for _ in range(self.inputs)]
        for b in range(self.inputs):
            if self.done[b]:
                continue
            j = 0
            ns, nt, nsrc = next_s[b], next_tok[b], next_src[b]
            for r, (sc, s, t) in enumerate(zip(top[b], src[b], tok[b])):
                if sc == NEG_INF:
                    break
                if t in self.eos:
                    if r < K:
                        row = generated[b * beams + s]
                        toks = torch.cat([row, torch.tensor([t], device=row.device)])
                        self.finished[b].append((sc / length**self.cfg.length_penalty, toks))
                    continue
                ns[j], nt[j], nsrc[j] = sc, t, s
                j += 1
                if j == K:
                    break
            if j < K:  # empty slots (score -inf) copy beam 0: any valid source does for a -inf hypothesis
                nsrc[j:] = [0] * (K - j)
            self.finished[b] = sorted(self.finished[b], key=lambda h: -h[0])[:K]
            self.done[b] = self._over(b, ns[0], length)
        dev = generated.device
        return NextBeams(torch.tensor(next_s, device=dev),
                         torch.tensor(next_tok, dtype=torch.long, device=dev),
                         torch.tensor(next_src, dtype=torch.long, device=dev))

    def _over(self, b: int, best_open: float, length: int) -> bool:
        """Whether input b's search is over, given its best open beam's summed log-probability."""
        cfg, lp = self.cfg, self.cfg.length_penalty
        if best_open == NEG_INF:
            return True
        if len(self.finished[b]) < cfg.num_beams:
            return False
        if cfg.early_stopping is True:
            return True
        if cfg.early_stopping is False:  # HF's heuristic: the open beam at its current length
            bound = best_open / length**lp
        else:
            # the best score any open beam can still reach: sum only decreases, so for lp > 0 the
            # longest length is the best one, for lp <= 0 the shortest (the next step)
            bound = best_open / (self.max_new**lp if lp > 0 else (length + 1) ** lp)
        return self.finished[b][-1][0] >= bound

    def close(self, scores: Tensor, generated: Tensor) -> None:
        """At the end: the open beams (`scores` (B0, Kc), their tokens `generated` (B0*Kc, n)) compete with
        the finished hypotheses at their current length."""
        n_gen = generated.shape[1]
        Kc = scores.shape[1]
        for b in range(self.inputs):
            if self.done[b]:
                continue
            for k in range(Kc):
                sc = float(scores[b, k])
                if sc != NEG_INF and n_gen > 0:
                    self.finished[b].append(
                        (sc / n_gen**self.cfg.length_penalty, generated[b * Kc + k].clone())
                    )
            self.finished[b] = sorted(self.finished[b], key=lambda h: -h[0])[:self.cfg.num_beams]

    def best(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """(tokens (B0 * n, longest) right-padded with pad, scores (B0 * n,)) of each input's n =
        num_return_sequences best hypotheses; an input without any gets empty ones scored -inf."""
        n = self.cfg.num_return_sequences
        empty = (NEG_INF, torch.zeros(0, dtype=torch.long, device=device))
        picked = [h for b in range(self.inputs) for h in (self.finished[b][:n] or [empty] * n)]
        width = max((len(t) for _, t in picked), default=0)
        gen = torch.full((len(picked), width), self.pad, dtype=torch.long, device=device)
        for i, (_, t) in enumerate(picked):
            gen[i, : len(t)] = t
        return gen, torch.tensor([sc for sc, _ in picked], device=device)
