"""Mixture of experts: a feed-forward layer that sends each token to k of E expert FFNs (Shazeer et al. 2017;
Switch Transformer, Fedus et al. 2021; Mixtral, Jiang et al. 2024; DeepSeekMoE / DeepSeek-V3, 2024).

  s      = score(W_r x)                     softmax (Mixtral, Qwen-MoE) or sigmoid (DeepSeek-V3), E values
  chosen = top-k(s + b)  [in the topk_group best of n_group expert groups]
           b: a per-expert bias used for the choice only (DeepSeek-V3's auxiliary-loss-free balancing), never
           trained: after each update it moves by +-rate towards the experts that received fewer tokens
  w      = s[chosen]  (/ sum s[chosen] when renormalised)  * routed_scaling
  y      = sum_i w_i FFN_{chosen_i}(x)  +  [sigmoid(g . x)] * FFN_shared(x)

Every expert is a FeedForward of ffn.py (the same activation table). Dispatch sorts the (token, expert)
assignments by expert and runs one batched product per expert: a Python loop over experts, never over tokens.

The load-balancing loss (Switch eq. 4-6, as transformers' Mixtral computes it): E * sum_e f_e * P_e, with f_e
the share of tokens that chose expert e (the shares sum to k) and P_e the mean router probability of e, both
pooled over every MoE layer of the forward. A training forward leaves each layer's counts in `stats`; the
model turns them into the loss (moe_aux_loss) and adds aux_loss_coef times it to the LM loss.

How balanced the routing is (logged as `moe_maxvio` by the trainer): MaxVio = max_e c_e / mean_e c_e - 1 over
a layer's per-expert token counts c (Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing"; DeepSeek-V3
§2.1.2), 0 for a perfectly even router, E - 1 when one expert gets every assignment; averaged over the MoE
layers, from the counts the training forwards record since the last reading (eval forwards record none).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.nn.ffn import FeedForward

SCORES = ("softmax", "sigmoid")


@dataclass
class MoEConfig:
    n_experts: int = 0  # routed experts per MoE layer; 0 = a dense model
    n_experts_per_tok: int = 2  # k: experts each token goes to
    ffn_dim: int | None = None  # an expert's hidden size; None = the model's d_ff
    layers: list[int] | None = None  # which blocks are MoE; None = every block from first_k_dense on
    first_k_dense: int = 0  # the first blocks keep a dense FFN (DeepSeek-V3: 3)
    n_shared_experts: int = 0  # experts every token goes through (DeepSeekMoE); one wider FFN
    shared_ffn_dim: int | None = None  # the shared FFN's hidden size; None = n_shared_experts * ffn_dim
    shared_expert_gate: bool = False  # scale the shared output by sigmoid(g . x) (Qwen2-MoE)
    score: str = "softmax"  # softmax | sigmoid: how router logits become scores
    norm_topk: bool = True  # divide the chosen scores by their sum (Mixtral always; Qwen: norm_topk_prob)
    n_group: int = 1  # expert groups for group-limited routing (DeepSeek-V3: 8)
    topk_group: int = 1  # groups a token may choose from (DeepSeek-V3: 4)
    routed_scaling: float = 1.0  # multiplies the routed experts' weights (DeepSeek-V3: 2.5)
    # DeepSeek-V3's selection bias, updated from the load after each optimizer step
    bias_balance: bool = False
    bias_rate: float = 0.001  # that bias's step per update (DeepSeek-V3's gamma)
    # load-balancing loss weight in the training loss (Mixtral's router_aux_loss_coef)
    aux_loss_coef: float = 0.02

    def is_moe(self, layer: int) -> bool:
        """Whether block `layer` has the MoE FFN."""
        if not self.n_experts:
            return False
        return layer in self.layers if self.layers is not None else layer >= self.first_k_dense


class Routing(NamedTuple):
    weights: Tensor  # (N, k) fp32 (fp64 for fp64 x): what each chosen expert's output is multiplied by
    experts: Tensor  # (N, k) long: the chosen experts
    probs: Tensor  # (N, E) fp32 (or fp64): scores normalised to sum 1 per token (the P of the balancing loss)


class RouterStats(NamedTuple):
    counts: Tensor  # (E,) tokens that chose each expert
    prob_sum: Tensor  # (E,) router probabilities summed over tokens (carries the gradient)
    rows: int | Tensor  # tokens routed (real ones: a tensor when a keep-mask counted them)


def limit_to_groups(choice: Tensor, n_group: int, topk_group: int) -> Tensor:
    """DeepSeek-V3's group-limited routing: the experts form n_group equal groups, a group's score is the sum
    of its two best choice scores, and everything outside the token's topk_group best groups is masked to -inf
    (so the top-k below cannot pick it)."""
    N, E = choice.shape
    grouped = choice.view(N, n_group, E // n_group)
    group_score = grouped.topk(min(2, E // n_group), dim=-1).values.sum(-1)  # (N, n_group)
    keep = torch.zeros_like(group_score, dtype=torch.bool)
    keep.scatter_(1, group_score.topk(topk_group, dim=-1).indices, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(N, E)


class Router(nn.Module):
    """x (N, d) -> Routing. `weight` is transformers' `gate.weight` (E, d)."""

    def __init__(self, d_model: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_experts, d_model))
        nn.init.normal_(self.weight, std=0.02)
        if cfg.bias_balance:
            # persistent (a checkpoint keeps the balance reached), never trained (no Parameter)
            self.register_buffer("score_bias", torch.zeros(cfg.n_experts))
            # tokens per expert since the last update: integers, which a model.to(bf16) leaves exact
            self.register_buffer("load", torch.zeros(cfg.n_experts, dtype=torch.long), persistent=False)

    def forward(self, x: Tensor) -> Routing:
        c = self.cfg
        logits = F.linear(x, self.weight)  # in x's dtype, scored in at least fp32 (as transformers' routers)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        scores = logits.softmax(-1) if c.score == "softmax" else logits.sigmoid()
        choice = scores + self.score_bias if c.bias_balance else scores
        if c.n_group > 1:
            choice = limit_to_groups(choice, c.n_group, c.topk_group)
        experts = choice.topk(c.n_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, experts)  # the bias chooses, the scores weigh
        if c.norm_topk:
            weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if c.score == "sigmoid" else 0.0))
        if c.routed_scaling != 1.0:
            weights = weights * c.routed_scaling
        probs = scores if c.score == "softmax" else scores / scores.sum(-1, keepdim=True)
        return Routing(weights, experts, probs)

    @torch.no_grad()
    def update_bias(self) -> None:
        """After an optimizer update: score_bias += rate * sign(mean load - load), so an overloaded expert is
        chosen less. Under torch.distributed the load is summed over ranks first (the biases stay equal)."""
        if not self.cfg.bias_balance:
            return
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(self.load)
        load = self.load.double()
        if load.sum() > 0:
            self.score_bias += self.cfg.bias_rate * torch.sign(load.mean() - load).to(self.score_bias.dtype)
        self.load.zero_()


def dispatch(x: Tensor, routing: Routing, counts: list[int], experts: nn.ModuleList) -> Tensor:
    """sum_i w_i expert_{e_i}(x) for every row of x (N, d): the N * k assignments sorted by expert, one
    batched call per expert on its rows, the weighted outputs added back to their tokens (index_add_)."""
    k = routing.experts.shape[1]
    order = routing.experts.reshape(-1).argsort(stable=True)
    token = order // k  # the row of x behind each sorted assignment
    # backward: one index_add_ (x[token]: a slower index_put_)
    chunks = x.index_select(0, token).split(counts)
    ys = torch.cat([experts[e](chunk) for e, chunk in enumerate(chunks) if chunk.shape[0]]) if len(order) \
        else x.new_zeros(0, x.shape[-1])
    ys = ys * routing.weights.reshape(-1)[order].unsqueeze(-1)  # fp32 weights: the sum is formed in fp32
    return torch.zeros(x.shape, dtype=ys.dtype, device=x.device).index_add_(0, token, ys).to(x.dtype)


class MoEFeedForward(nn.Module):
    """The MoE layer in a Block's `ffn` place: routed experts, optional shared expert (and its gate)."""

    def __init__(self, d_model: int, cfg: MoEConfig, d_ff: int, activation: str = "swiglu",
                 bias: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = Router(d_model, cfg)
        width = cfg.ffn_dim or d_ff
        self.experts = nn.ModuleList(FeedForward(d_model, width, activation, bias)
                                         for _ in range(cfg.n_experts))
        shared = cfg.shared_ffn_dim or cfg.n_shared_experts * width
        self.shared = FeedForward(d_model, shared, activation, bias) if shared else None
        self.shared_gate = nn.Linear(d_model, 1, bias=False) if cfg.shared_expert_gate else None
        self.stats: RouterStats | None = None  # the last training forward's, until moe_aux_loss takes it
        self.tally: Tensor | None = None  # tokens per expert since moe_max_violation last read them

    def forward(self, x: Tensor, keep: Tensor | None = None) -> Tensor:
        """x (..., d). keep: the real-token mask of x's positions (Block passes it): padded tokens are routed
        like the others (their output is never read) but left out of the balancing statistics."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        routing = self.router(x)
        counts = torch.bincount(routing.experts.reshape(-1), minlength=self.cfg.n_experts)
        y = dispatch(x, routing, counts.tolist(), self.experts)
        if self.shared is not None:
            s = self.shared(x)
            y = y + (torch.sigmoid(self.shared_gate(x)) * s if self.shared_gate is not None else s)
        if self.training:
            self._record(routing, counts, keep)
        return y.view(shape)

    def _record(self, routing: Routing, counts: Tensor, keep: Tensor | None) -> None:
        """The training forward's statistics: for the balancing loss (stats) and the selection bias (load)."""
        probs = routing.probs
        if keep is not None:
            real = keep.reshape(-1).to(probs.dtype)
            k = routing.experts.shape[1]
            counts = torch.bincount(routing.experts.reshape(-1), weights=real.repeat_interleave(k),
                                    minlength=self.cfg.n_experts).round().long()
            probs, rows = probs * real.unsqueeze(-1), real.sum()
        else:
            rows = probs.shape[0]
        self.stats = RouterStats(counts.to(probs.dtype), probs.sum(0), rows)
        self.tally = counts if self.tally is None else self.tally + counts
        if self.cfg.bias_balance:
            self.router.load += counts

    def step(self, x: Tensor) -> Tensor:
        """The decoding step is the same function on the step's rows."""
        return self.forward(x)


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def moe_aux_loss(model: nn.Module) -> Tensor | None:
    """The load-balancing loss of the last training forward, pooled over the MoE layers (the stats are taken,
    so a second call returns None); None when no layer routed anything."""
    stats = []
    for layer in moe_layers(model):
        if layer.stats is not None:
            stats.append(layer.stats)
            layer.stats = None
    if not stats:
        return None
    return load_balancing_loss(stats)


def load_balancing_loss(stats: list[RouterStats]) -> Tensor:
    """E * sum_e f_e P_e over the pooled counts of `stats` (f_e = chosen / tokens, P_e = mean probability)."""
    rows = sum(s.rows for s in stats)
    counts = torch.stack([s.counts for s in stats]).sum(0)
    probs = torch.stack([s.prob_sum for s in stats]).sum(0)
    return counts.numel() * (counts / rows * probs / rows).sum()


def max_violation(counts: Tensor) -> Tensor:
    """MaxVio = max_e c_e / mean_e c_e - 1 of per-expert token counts (..., E): 0 when every expert has the
    mean load, E - 1 when one has them all."""
    counts = counts.double()
    return counts.amax(-1) / counts.mean(-1) - 1


def moe_max_violation(model: nn.Module) -> float | None:
    """MaxVio of the training forwards since the last call, averaged over the MoE layers that routed tokens
    (the tallies are taken: a second call returns None); None for a model without one (a dense model). Under
    torch.distributed: this rank's tokens."""
    vios = []
    for layer in moe_layers(model):
        if layer.tally is not None and int(layer.tally.sum()) > 0:
            vios.append(max_violation(layer.tally))
        layer.tally = None
    return float(torch.stack(vios).mean()) if vios else None


def update_router_biases(model: nn.Module) -> None:
    """Move every bias-balanced router's selection bias once (call after each optimizer update). A frozen
    router (LoRA fine-tuning freezes every base weight) keeps its bias too: its routing is part of the
    base."""
    for router in (layer.router for layer in moe_layers(model)):
        if router.weight.requires_grad:
            router.update_bias()
        elif router.cfg.bias_balance:
            router.load.zero_()  # the counts are spent unused
