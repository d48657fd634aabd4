"""The Mamba2 mixer (state space duality, SSD) over the engine's recurrent state pool.

Per token: in_proj gives a gate z, the conv input xBC and a time step dt per head. A causal
depthwise conv (d_conv taps, SiLU) mixes xBC over the last d_conv positions, then splits it into
x [heads, head_dim], B and C [groups, d_state] (each group serves heads / groups heads). With
A = -exp(A_log) and dt = softplus(dt + dt_bias), each head's state h [head_dim, d_state] evolves

    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,      y_t = h_t C_t + D x_t

and the output is out_proj(RMSNorm_grouped(y * silu(z))). A sequence's conv state (its last
d_conv - 1 inputs) and h live in its slot of the StateCache (kvserve/model/state_cache.py), so a
prompt split over several steps (chunked prefill) continues where the last chunk stopped, and a
decode step updates them one token at a time.

Prefill chunks use the chunked (parallel) form of the same recurrence: within a block of L
positions, y = (C B^T o decay) (dt x) + decay_in (C h_0), with decay[t, s] = exp(a_{s+1} + ... +
a_t) (a = dt A) built from masked cumulative sums, and the state after the block is
exp(a_1 + ... + a_L) h_0 + sum_s exp(a_{s+1} + ... + a_L) dt_s x_s B_s^T.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels import ssm_decode as ssm_decode_kernel
from kvserve.model.config import ModelConfig
from kvserve.model.state_cache import RecurrentMetadata, SeqState


class GatedRMSNorm(nn.Module):
    """RMSNorm of y * silu(z) over groups of channels (one group per B/C group), in fp32, then the
    gain in the input's dtype (Mamba2's norm_before_gate=False)."""

    def __init__(self, dim: int, groups: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.groups, self.eps = groups, eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = y.dtype
        g = (y.float() * F.silu(z.float())).unflatten(-1, (self.groups, -1))
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.flatten(-2).to(dtype)


class Mamba2Mixer(nn.Module):
    """HF Bamba's `mamba` submodule (parameter names and shapes as its checkpoints hold them)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.head_dim = cfg.mamba_n_heads, cfg.mamba_head_dim
        self.n_groups, self.d_state = cfg.mamba_n_groups, cfg.mamba_d_state
        self.d_conv, self.chunk_size = cfg.mamba_d_conv, cfg.mamba_chunk_size
        self.intermediate, self.conv_dim = cfg.mamba_intermediate, cfg.mamba_conv_dim
        self.in_proj = nn.Linear(cfg.hidden_size, self.intermediate + self.conv_dim + self.num_heads,
                                 bias=cfg.mamba_proj_bias)
        # Depthwise: one d_conv-tap filter per channel, weight [conv_dim, 1, d_conv].
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.d_conv, groups=self.conv_dim,
                                bias=cfg.mamba_conv_bias, padding=self.d_conv - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False)
        self.D = nn.Parameter(torch.ones(self.num_heads), requires_grad=False)
        self.norm = GatedRMSNorm(self.intermediate, self.n_groups, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.intermediate, cfg.hidden_size, bias=cfg.mamba_proj_bias)

    def forward(self, x: torch.Tensor, rec: RecurrentMetadata) -> torch.Tensor:
        """x [T, hidden] (the flat batch) -> [T, hidden]; updates each sequence's states in its slot."""
        z, xbc, dt = self.in_proj(x).split([self.intermediate, self.conv_dim, self.num_heads], dim=-1)
        conv_pool, ssm_pool = rec.cache.layer(self.layer)
        y = x.new_empty(x.shape[0], self.intermediate)
        if rec.decode_rows is not None:
            r = rec.decode_rows
            y[r] = self._decode(xbc[r], dt[r], conv_pool, ssm_pool, rec.decode_slots, rec.decode_has_state)
        for s in rec.seqs:
            rows = slice(s.q_start, s.q_start + s.q_len)
            y[rows] = self._prefill(xbc[rows], dt[rows], conv_pool, ssm_pool, s)
        return self.out_proj(self.norm(y, z))

    # ------------------------------------------------------------ pieces
    def _conv_weight(self) -> torch.Tensor:
        return self.conv1d.weight[:, 0, :]  # [conv_dim, d_conv]

    def _split(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output [T, conv_dim] -> x [T, H, P], B and C [T, H, N] (each group's B, C shared
        by its heads), in fp32."""
        T, gn = xbc.shape[0], self.n_groups * self.d_state
        x, B, C = xbc.float().split([self.intermediate, gn, gn], dim=-1)
        per = self.num_heads // self.n_groups
        B = B.view(T, self.n_groups, self.d_state).repeat_interleave(per, dim=1)
        C = C.view(T, self.n_groups, self.d_state).repeat_interleave(per, dim=1)
        return x.view(T, self.num_heads, self.head_dim), B, C

    def _dt(self, dt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw dt [T, H] -> (softplus(dt + dt_bias), A) in fp32."""
        return F.softplus(dt.float() + self.dt_bias.float()), -torch.exp(self.A_log.float())

    # ------------------------------------------------------------ decode: one token per sequence
    def _decode(self, xbc: torch.Tensor, dt: torch.Tensor, conv_pool: torch.Tensor, ssm_pool: torch.Tensor,
                slots: torch.Tensor, has_state: torch.Tensor) -> torch.Tensor:
        """xbc [B, conv_dim], dt [B, H] of B sequences' one new token each -> y [B, intermediate]."""
        past = torch.where(has_state[:, None, None], conv_pool.index_select(0, slots), 0.0)
        window = torch.cat((past, xbc[:, :, None].to(conv_pool.dtype)), dim=-1)
        conv_pool.index_copy_(0, slots, window[:, :, 1:])  # the last d_conv - 1 inputs
        out = (window * self._conv_weight()).sum(-1)
        if self.conv1d.bias is not None:
            out = out + self.conv1d.bias
        x, B, C = self._split(F.silu(out))
        dt, A = self._dt(dt)  # [B, H], [H]
        # fp32 CPU states: one C pass over each state (kernels/ssm_decode.c), else the torch ops.
        y = ssm_decode_kernel(ssm_pool, slots, has_state, x, dt, A, B, C, self.D.float())
        if y is None:
            y = self._decode_ssm(ssm_pool, slots, has_state, x, dt, A, B, C)
        return y.flatten(1).to(xbc.dtype)

    def _decode_ssm(self, ssm_pool: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor, x: torch.Tensor,
                    dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
        """The SSM's one-token update in torch: x [B, H, P], dt [B, H], B and C [B, H, N] ->
        y [B, H, P]; the states at `slots` advanced (from zeros where has_state is False)."""
        h = ssm_pool.index_select(0, slots).float()
        h = torch.where(has_state[:, None, None, None], h, 0.0)
        h = h * torch.exp(dt * A)[:, :, None, None] + (dt[:, :, None] * x)[..., None] * B[:, :, None, :]
        ssm_pool.index_copy_(0, slots, h.to(ssm_pool.dtype))
        return (h * C[:, :, None, :]).sum(-1) + self.D.float()[:, None] * x

    # ------------------------------------------------------------ prefill: a chunk of one sequence
    def _prefill(self, xbc: torch.Tensor, dt: torch.Tensor, conv_pool: torch.Tensor, ssm_pool: torch.Tensor,
                 s: SeqState) -> torch.Tensor:
        """xbc [L, conv_dim], dt [L, H] of one sequence's chunk -> y [L, intermediate]."""
        L = xbc.shape[0]
        past = conv_pool[s.slot] if s.has_state else conv_pool.new_zeros(conv_pool.shape[1:])
        u = torch.cat((past, xbc.t().to(conv_pool.dtype)), dim=-1)  # [conv_dim, d_conv - 1 + L]
        conv_pool[s.slot] = u[:, L:]
        out = F.conv1d(u[None], self._conv_weight()[:, None, :], self.conv1d.bias, groups=self.conv_dim)[0]
        x, B, C = self._split(F.silu(out.t()))  # [L, H, P], [L, H, N], [L, H, N]
        dt, A = self._dt(dt)
        h = ssm_pool[s.slot].float() if s.has_state else x.new_zeros(self.num_heads, self.head_dim, self.d_state)
        y = torch.empty_like(x)
        for a in range(0, L, self.chunk_size):
            b = min(L, a + self.chunk_size)
            y[a:b], h = self._scan_block(x[a:b], dt[a:b], A, B[a:b], C[a:b], h)
        ssm_pool[s.slot] = h.to(ssm_pool.dtype)
        return (y + self.D.float()[:, None] * x).flatten(1).to(xbc.dtype)

    @staticmethod
    def _scan_block(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                    h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The recurrence over L positions at once: x [L, H, P], dt [L, H], A [H], B and C
        [L, H, N], h0 [H, P, N] -> (y [L, H, P] without the D skip, the state after the block)."""
        L = x.shape[0]
        a = dt * A  # [L, H] log-decay per position
        later = torch.arange(L, device=x.device)
        # seg[t, s] = a_{s+1} + ... + a_t for s <= t: a cumulative sum over t of a_i masked to i > s,
        # so no difference of two large cumulative sums loses precision.
        masked = torch.where((later[:, None] > later[None, :])[..., None], a[:, None, :], 0.0)  # [i, s, H]
        seg = masked.cumsum(0)
        decay = torch.exp(seg.masked_fill((later[:, None] < later[None, :])[..., None], float("-inf")))
        xdt = x * dt[..., None]
        scores = torch.einsum("thn,shn->tsh", C, B) * decay
        y = torch.einsum("tsh,shp->thp", scores, xdt)
        into = torch.exp(a.cumsum(0))  # [L, H]: decay from before the block to t (a_1 + ... + a_t)
        y = y + torch.einsum("thn,hpn->thp", C, h0) * into[..., None]
        to_end = torch.exp(seg[-1])  # [L(s), H]: a_{s+1} + ... + a_L
        h = h0 * into[-1][:, None, None] + torch.einsum("sh,shp,shn->hpn", to_end, xdt, B)
        return y, h
