"""Routed experts of the MoE FFN, expert parallel: each TP rank holds a contiguous block of experts
and returns only their contribution; the shared expert (the TP-sharded dense FFN) adds its shard, and
the sum over ranks happens in the same boundary op as a dense FFN's partial (all-reduce in TP mode,
reduce-scatter in SP mode, where every rank sees all gathered tokens).

Gate: the router scores every expert (fp32, replicated); the top k each weigh in with their margin
over the first expert left out, divided by (sum of the k margins + GATE_TAU). Unlike softmax-over-top-k
this is continuous where two experts swap places (the one leaving has weight zero), and GATE_TAU keeps
it well conditioned where every margin is small (a plain normalisation by the sum would amplify score
noise by 1 / sum): TP layouts whose layer inputs differ by bf16 rounding noise agree closely on the
output, so layouts can be compared by logits. (A GPU run without GATE_TAU differed from one process by
3x the check's tolerance on such a token.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GATE_TAU = 1.0  # router logits are ~N(0, 2^2): typical margins are O(1)


def gates(layer_input: torch.Tensor, router: torch.Tensor, top_k: int) -> torch.Tensor:
    """[T, D] bf16, [E, D] fp32 -> [T, E] fp32 expert weights, non-zero on at most top_k experts."""
    scores = layer_input.float() @ router.t()
    top = scores.topk(top_k + 1, dim=-1)
    margin = (top.values[:, :top_k] - top.values[:, top_k:]).clamp_min(0)
    weight = margin / (margin.sum(dim=-1, keepdim=True) + GATE_TAU)
    return torch.zeros_like(scores).scatter_(1, top.indices[:, :top_k], weight)


def routed_experts(
    layer_input: torch.Tensor,
    local_gates: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
) -> torch.Tensor:
    """Sum over this rank's experts e of gate[t, e] * expert_e(x_t): [T, D] fp32.

    ``local_gates`` [T, E_local] are the gates of the experts held here ([E_local, F, D] up/gate,
    [E_local, D, F] down). Eagerly each expert runs on its routed tokens only, found with one host
    read of the routed counts per layer; inside a CUDA graph capture (no host reads) every expert
    runs on every token, weighted by its gate. Both add each expert's rows in increasing row order,
    so they give the same sums (an unrouted row adds zeros).
    """
    T, E = local_gates.shape
    out = torch.zeros(layer_input.shape, dtype=torch.float32, device=layer_input.device)
    if layer_input.is_cuda and torch.cuda.is_current_stream_capturing():
        every = torch.arange(T, device=layer_input.device)
        rows_of = [every] * E
    else:
        routed = local_gates.t() != 0  # [E, T]
        counts = routed.sum(dim=1).tolist()  # the one host read
        pairs = torch.nonzero_static(routed, size=sum(counts))  # (expert, row), expert-major, rows ascending
        rows_of = torch.split(pairs[:, 1], counts)
    for e, rows in enumerate(rows_of):
        if rows.numel() == 0:
            continue
        x = layer_input[rows]
        act = (F.silu((x @ w_gate[e].t()).float()) * (x @ w_up[e].t()).float()).to(torch.bfloat16)
        y = (act @ w_down[e].t()).float() * local_gates[rows, e].unsqueeze(1)
        out.index_add_(0, rows, y)
    return out
