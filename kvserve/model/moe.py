"""Mixture-of-experts feed-forward blocks (Mixtral, Qwen2-MoE, DeepSeek-V2/V3).

A router scores every routed expert per token; each token runs through its top-k experts and
their outputs are summed with the routing weights, plus (Qwen2-MoE, DeepSeek) shared experts
every token runs through. The batch is dispatched by expert: the T x k (token, expert) pairs are
grouped by expert and each expert used by the step runs once on exactly its rows (index_select,
its gated MLP, index_add back), so a step reads the weights of the experts it uses and no others.

Routing variants, as MoEConfig spells them (HF names):

* scoring "softmax" (Mixtral, Qwen2-MoE, DeepSeek-V2) or "sigmoid" (DeepSeek-V3) of the router
  logits, in fp32;
* topk_method "greedy": the top_k scores; "group_limited_greedy" (DeepSeek-V2): the experts form
  n_group groups, a group scores its best expert, the top_k come from the best topk_group groups;
  "noaux_tc" (DeepSeek-V3): a per-expert bias (e_score_correction_bias) is added for the choice
  only, a group scores the sum of its best two, the weights are the unbiased scores;
* norm_topk_prob: the top_k weights renormalised to sum to 1; routed_scaling_factor multiplies them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model.config import ModelConfig, MoEConfig
from kvserve.model.layers import GatedMLP


class Router(nn.Module):
    """The gate: weight [num_experts, hidden] (a plain parameter, not an nn.Linear, so weight
    quantizers and packers leave the routing decision alone), and DeepSeek-V3's selection bias."""

    def __init__(self, hidden: int, moe: MoEConfig):
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden), requires_grad=False)
        if moe.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(moe.num_experts), requires_grad=False)
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, top_k] fp32, expert ids [T, top_k] int64)."""
        moe = self.moe
        if moe.router_fp32:  # DeepSeek computes the router logits in fp32 whatever the model dtype
            logits = F.linear(x.float(), self.weight.float())
        else:
            logits = F.linear(x, self.weight).float()
        scores = logits.softmax(dim=-1) if moe.scoring == "softmax" else logits.sigmoid()
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias.float()
        if moe.topk_method != "greedy":
            choice = self._limit_groups(choice)
        ids = torch.topk(choice, moe.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if moe.routed_scaling_factor != 1.0:
            weights = weights * moe.routed_scaling_factor
        return weights, ids

    def _limit_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """choice [T, E] with the experts outside each token's topk_group best groups at -inf."""
        moe = self.moe
        grouped = choice.view(choice.shape[0], moe.n_group, moe.num_experts // moe.n_group)
        if moe.topk_method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        best = torch.topk(group_scores, moe.topk_group, dim=-1).indices  # [T, topk_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ shared experts, gated by a sigmoid in Qwen2-MoE).

    Parameter names follow HF's per-expert checkpoints: gate.weight, experts.{e}.gate_proj /
    up_proj / down_proj, shared_experts.* (Qwen2-MoE's shared_expert.* is renamed on load),
    shared_expert_gate.weight."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        self.moe = moe
        self.gate = Router(cfg.hidden_size, moe)
        self.experts = nn.ModuleList(GatedMLP(cfg.hidden_size, moe.intermediate_size, cfg.hidden_act)
                                     for _ in range(moe.num_experts))
        self.shared_experts = (GatedMLP(cfg.hidden_size, moe.shared_intermediate_size, cfg.hidden_act)
                               if moe.shared_intermediate_size else None)
        self.shared_expert_gate = (nn.Linear(cfg.hidden_size, 1, bias=False)
                                   if moe.shared_expert_gate else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        weights, ids = self.gate(x)
        out = self.dispatch(x, weights, ids)
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out

    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for every token t, each used expert run
        once on the rows routed to it. x [T, hidden], weights [T, k] fp32, ids [T, k]."""
        k = ids.shape[1]
        if x.shape[0] == 1:  # a batch-1 decode step: k experts on the one row, no grouping to do
            return self._one_row(x, weights[0], ids[0])
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)  # the (token, slot) pairs grouped by expert
        rows = order // k  # the token of each pair, in that order
        pair_weights = weights.flatten().index_select(0, order)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            idx = rows[start:start + n]
            y = self.experts[e](x.index_select(0, idx))
            out.index_add_(0, idx, (y * pair_weights[start:start + n, None]).to(out.dtype))
            start += n
        return out

    def _one_row(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [1, hidden] through its k experts, summed in expert order (as the grouped path adds)."""
        out = torch.zeros_like(x)
        for w, e in sorted(zip(weights.tolist(), ids.tolist()), key=lambda p: p[1]):
            out += (self.experts[e](x).float() * w).to(out.dtype)  # (fp32 weighting, as the grouped path)
        return out


def feed_forward(cfg: ModelConfig, layer: int, bias: bool = False) -> nn.Module:
    """Layer `layer`'s feed-forward block: the MoE block on the config's sparse layers, else a
    dense gated MLP of cfg.intermediate_size."""
    if cfg.moe is not None and layer in cfg.moe.layers:
        return SparseMoeBlock(cfg)
    return GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=bias)
