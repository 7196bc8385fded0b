"""Muon for the hidden matrices, AdamW for the rest, in one optimizer (one set of parameter
groups, so Composer's schedulers scale both learning rates together and checkpoints hold both).

Muon (Keller Jordan et al., 2024, "Muon: an optimizer for hidden layers in neural networks";
modded-nanogpt's ``Muon``/``MuonWithAuxAdam``) keeps SGD momentum per matrix and steps along the
momentum's nearest semi-orthogonal matrix, found by five Newton-Schulz iterations of a quintic
tuned to push every singular value into about [0.7, 1.2] fast (:func:`orthogonalize`). It suits
the 2-D weights inside the blocks; embeddings, the output layer, norms and biases take AdamW
(:func:`muon_groups`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

#: The quintic's coefficients (modded-nanogpt's ``zeropower_via_newtonschulz5``): they maximize
#: the slope at zero, so small singular values grow fast, at the cost of not converging to 1.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def orthogonalize(matrix: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """``matrix``'s nearest semi-orthogonal matrix ``U V^T``, approximately: ``steps`` Newton-Schulz
    iterations ``X <- a X + (b X X^T + c (X X^T)^2) X`` from ``X = matrix / ||matrix||_F``.

    The result's singular values lie in about [0.7, 1.2] (not exactly 1: see
    :data:`NS_COEFFICIENTS`). Computed in float32 (bfloat16 on a GPU, as modded-nanogpt: the
    iteration is robust to it), on the shorter side (``X X^T`` of the smaller dimension).

    Args:
        matrix: (rows, cols) float.

    Returns:
        (rows, cols), in ``matrix``'s dtype.
    """
    x = matrix.to(torch.bfloat16 if matrix.is_cuda else torch.float32)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / (x.norm() + 1e-7)
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return (x.T if tall else x).to(matrix.dtype)


def muon_groups(model: nn.Module, *, lr: float, adamw_lr: float, weight_decay: float) -> list[dict]:
    """Parameter groups for :class:`Muon`: the 2-D weights of every block (attention and
    feed-forward projections; a fused query-key-value weight orthogonalized per part) with Muon
    at ``lr``; the other parameters with AdamW at ``adamw_lr``. ``weight_decay`` applies to every
    matrix (the embeddings and output layer too), not to norms and biases.

    Raises:
        ValueError: if ``model`` has no transformer blocks (nothing for Muon).
    """
    from llm.layers.blocks import MosaicGPTBlock

    hidden: dict[nn.Parameter, list[int] | None] = {}
    for module in model.modules():
        if isinstance(module, MosaicGPTBlock):
            for param in module.parameters():
                if param.requires_grad and param.dim() == 2:
                    hidden[param] = None
            attn = module.attn
            wqkv = getattr(attn.Wqkv, "weight", None)
            if wqkv in hidden:
                hidden[wqkv] = [attn.n_heads * attn.head_dim, attn.kv_n_heads * attn.head_dim,
                                attn.kv_n_heads * attn.head_dim]
    if not hidden:
        raise ValueError("optimizer muon: the model has no transformer blocks whose matrices Muon could train")
    rest = [p for p in model.parameters() if p.requires_grad and p not in hidden]
    groups = [{"params": [p for p, s in hidden.items() if s is None], "use_muon": True, "lr": lr,
               "weight_decay": weight_decay},
              {"params": [p for p, s in hidden.items() if s is not None], "use_muon": True, "lr": lr,
               "weight_decay": weight_decay, "sections": next((s for s in hidden.values() if s), None)},
              {"params": [p for p in rest if p.dim() >= 2], "use_muon": False, "lr": adamw_lr,
               "weight_decay": weight_decay},
              {"params": [p for p in rest if p.dim() < 2], "use_muon": False, "lr": adamw_lr, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


class Muon(torch.optim.Optimizer):
    """Muon on the groups with ``use_muon`` True, AdamW (torch's, decoupled weight decay
    ``p *= 1 - lr * weight_decay``) on the others; build the groups with :func:`muon_groups`.

    A Muon step per matrix ``W`` with gradient ``G``: ``M <- momentum M + (1 - momentum) G``;
    ``U = G + momentum (M - G)`` (Nesterov) or ``M``; ``W <- W (1 - lr wd) - lr sqrt(max(1, rows /
    cols)) orthogonalize(U)``, per row section when the group has ``sections`` (a fused
    query-key-value weight: each of the three orthogonalized on its own, as separate matrices
    would be). Deterministic for the same inputs; the state (momentum buffers, AdamW moments and
    step) is in ``state_dict``, so a run resumes exactly. Under DDP every rank computes the same
    update from the all-reduced gradients.

    Args:
        lr: Muon's learning rate (modded-nanogpt: 0.02-0.05); a group's own ``lr`` wins.
        momentum, nesterov, ns_steps: Muon's momentum, Nesterov or plain, Newton-Schulz steps.
        betas, eps: AdamW's.
        weight_decay: default of the groups (decoupled, as above).

    Raises:
        ValueError: for a learning rate, momentum, beta or eps out of range, or ns_steps < 1.
    """

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0):
        if not lr > 0 or not 0 <= momentum < 1 or ns_steps < 1 or not all(0 <= b < 1 for b in betas) or not eps > 0:
            raise ValueError(f"Muon: need lr > 0, 0 <= momentum < 1, ns_steps >= 1, betas in [0, 1), eps > 0; got "
                             f"lr={lr}, momentum={momentum}, ns_steps={ns_steps}, betas={betas}, eps={eps}")
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, use_muon=True, sections=None)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group["use_muon"]:
                    self._muon(p, group)
                else:
                    self._adamw(p, group)
        return loss

    def _muon(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buffer, grad, beta = state["momentum_buffer"], p.grad, group["momentum"]
        buffer.lerp_(grad, 1 - beta)
        update = grad.lerp(buffer, beta) if group["nesterov"] else buffer
        parts = update.split(group["sections"], dim=0) if group["sections"] else (update,)
        direction = torch.cat([orthogonalize(u, group["ns_steps"]) * math.sqrt(max(1.0, u.size(0) / u.size(1)))
                               for u in parts])
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(direction, alpha=-group["lr"])

    def _adamw(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
        step, (beta1, beta2), grad = int(state["step"]), group["betas"], p.grad
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denominator = (state["exp_avg_sq"] / (1 - beta2 ** step)).sqrt_().add_(group["eps"])
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.addcdiv_(state["exp_avg"], denominator, value=-group["lr"] / (1 - beta1 ** step))
