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
    top_k: int,
) -> torch.Tensor:
    """Sum over this rank's experts e of gate[t, e] * expert_e(x_t): [T, D] fp32.

    ``local_gates`` [T, E_local] are the gates of the experts held here ([E_local, F, D] up/gate,
    [E_local, D, F] down); a row has at most ``top_k`` non-zero gates. Without reading a device
    value (CUDA-graph safe, no host synchronisation): the (expert, row) pairs are listed
    expert-major into a static T * k slots (k = min(top_k, E_local); unused slots padded), the
    experts run as grouped GEMMs over their contiguous pair ranges, and each row adds its pairs in
    increasing expert order, so the sums do not depend on T or on what other rows routed to.
    """
    T, E = local_gates.shape
    k = min(top_k, E)
    routed = local_gates != 0  # [T, E]
    # Pair (e, t) as e * T + t, unrouted ones past the end; sorted, the first T * k are the routed
    # pairs expert-major, rows ascending, then padding (a sort: no host read, CUDA-graph safe).
    index = torch.arange(E * T, device=routed.device).view(E, T)
    pairs = torch.where(routed.t(), index, E * T).flatten().sort().values[: T * k]
    valid = pairs < E * T
    expert, row = (pairs // T).clamp_max(E - 1), torch.where(valid, pairs % T, 0)
    ends = routed.sum(dim=0, dtype=torch.int32).cumsum(0, dtype=torch.int32)  # each expert's last pair + 1
    x = layer_input[row]
    gate = torch._grouped_mm(x, w_gate.transpose(1, 2), offs=ends).float()
    up = torch._grouped_mm(x, w_up.transpose(1, 2), offs=ends).float()
    act = (F.silu(gate) * up).to(torch.bfloat16)
    y = torch._grouped_mm(act, w_down.transpose(1, 2), offs=ends).float()  # pad slots: undefined
    y = torch.where(valid.unsqueeze(1), y * local_gates[row, expert].unsqueeze(1), 0.0)
    # Slot j of row t holds its j-th routed expert (in expert order); pad slot i lands at T * k + i
    # (every destination distinct: the copy is deterministic).
    place = routed.cumsum(dim=1) - 1  # [T, E]
    slot = torch.arange(T * k, device=y.device)
    dest = torch.where(valid, row * k + place[row, expert], T * k + slot)
    parts = y.new_zeros(2 * T * k, y.shape[1]).index_copy_(0, dest, y)[: T * k].view(T, k, y.shape[1])
    out = parts[:, 0]
    for j in range(1, k):
        out = out + parts[:, j]
    return out
