"""A PyTorch DARTS search network and the MiLeNAS step of the FedNAS authors' code,
written from scratch as the same-run baseline of ``benchmarks/fednas_search.py``.

Benchmark-only: PyTorch is not a dependency of jaxfednas (``pip install torch`` to use it).

The network mirrors ``search_spaces/darts`` op for op (and the DARTS reference design the
FedNAS code builds on): the 8 primitives, ReLU -> conv -> BN blocks, BatchNorm without
affine parameters inside cells, pooling followed by BN(affine=False) on search edges,
FactorizedReduce for stride-2 skips and for ``s0`` after a reduction, 14-edge cells with
4 intermediate nodes all concatenated, a 3C stem (conv + affine BN), reductions at
``layers // 3`` and ``2 * layers // 3``, global average pooling and a linear classifier.
Layout is PyTorch's NCHW in float32. As in the authors' code the ``none`` op is
computed (``x * 0``) and the architecture parameters are plain tensors outside the
module's parameters.

:func:`milenas_step` is one minibatch of the authors' FedNAS local search:

1. α step (MiLeNAS, mixed level): ``∇_α L_train`` and ``∇_α L_val`` by
   ``torch.autograd.grad`` w.r.t. α only, summed (λ = 1), then
   ``Adam(3e-4, betas=(0.5, 0.999), weight_decay=1e-3)``;
2. w step at the new α: forward on the training batch, ``loss.backward()``,
   the gradient-norm clip applied to α's gradients (as the authors' code does; the
   weights are not clipped), then ``SGD(0.025, momentum=0.9, weight_decay=3e-4)``.

Three forward and three backward passes per step (the JAX default, Eq. 4 with both
gradients at the same point, needs two of each).

    python benchmarks/torch_darts.py            # parameter counts of the two benchmark configs
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

PRIMITIVES = (
    "none",
    "max_pool_3x3",
    "avg_pool_3x3",
    "skip_connect",
    "sep_conv_3x3",
    "sep_conv_5x5",
    "dil_conv_3x3",
    "dil_conv_5x5",
)


def bn(c: int, affine: bool) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(c, affine=affine)  # momentum 0.1, eps 1e-5 (PyTorch defaults)


class ReLUConvBN(nn.Module):
    def __init__(self, c_in: int, c_out: int, k: int, stride: int, pad: int, affine: bool):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, k, stride, pad, bias=False)
        self.bn = bn(c_out, affine)

    def forward(self, x):
        return self.bn(self.conv(F.relu(x)))


class DilConv(nn.Module):
    """ReLU -> depthwise k x k (stride, dilation) -> 1x1 -> BN."""

    def __init__(self, c_in: int, c_out: int, k: int, stride: int, pad: int, dil: int, affine: bool):
        super().__init__()
        self.dw = nn.Conv2d(c_in, c_in, k, stride, pad, dilation=dil, groups=c_in, bias=False)
        self.pw = nn.Conv2d(c_in, c_out, 1, bias=False)
        self.bn = bn(c_out, affine)

    def forward(self, x):
        return self.bn(self.pw(self.dw(F.relu(x))))


class SepConv(nn.Module):
    """Two separable blocks; only the first depthwise conv is strided."""

    def __init__(self, c_in: int, c_out: int, k: int, stride: int, pad: int, affine: bool):
        super().__init__()
        self.a = DilConv(c_in, c_in, k, stride, pad, 1, affine)
        self.b = DilConv(c_in, c_out, k, 1, pad, 1, affine)

    def forward(self, x):
        return self.b(self.a(x))


class FactorizedReduce(nn.Module):
    """ReLU, two stride-2 1x1 convs (x and x shifted by one pixel), concat -> BN."""

    def __init__(self, c_in: int, c_out: int, affine: bool):
        super().__init__()
        assert c_out % 2 == 0
        self.c1 = nn.Conv2d(c_in, c_out // 2, 1, 2, bias=False)
        self.c2 = nn.Conv2d(c_in, c_out // 2, 1, 2, bias=False)
        self.bn = bn(c_out, affine)

    def forward(self, x):
        x = F.relu(x)
        return self.bn(torch.cat([self.c1(x), self.c2(x[:, :, 1:, 1:])], dim=1))


class Zero(nn.Module):
    def __init__(self, stride: int):
        super().__init__()
        self.stride = stride

    def forward(self, x):
        s = self.stride
        return x.mul(0.0) if s == 1 else x[:, :, ::s, ::s].mul(0.0)


def make_op(name: str, c: int, stride: int) -> nn.Module:
    """Search-edge op (affine=False); pooling gets its BN(affine=False) here."""
    if name == "none":
        return Zero(stride)
    if name == "max_pool_3x3":
        return nn.Sequential(nn.MaxPool2d(3, stride, 1), bn(c, False))
    if name == "avg_pool_3x3":
        return nn.Sequential(nn.AvgPool2d(3, stride, 1, count_include_pad=False), bn(c, False))
    if name == "skip_connect":
        return nn.Identity() if stride == 1 else FactorizedReduce(c, c, False)
    if name == "sep_conv_3x3":
        return SepConv(c, c, 3, stride, 1, False)
    if name == "sep_conv_5x5":
        return SepConv(c, c, 5, stride, 2, False)
    if name == "dil_conv_3x3":
        return DilConv(c, c, 3, stride, 2, 2, False)
    if name == "dil_conv_5x5":
        return DilConv(c, c, 5, stride, 4, 2, False)
    raise ValueError(f"unknown op {name!r}")


class MixedOp(nn.Module):
    def __init__(self, c: int, stride: int, primitives=PRIMITIVES):
        super().__init__()
        self.ops = nn.ModuleList(make_op(p, c, stride) for p in primitives)

    def forward(self, x, weights):
        return sum(w * op(x) for w, op in zip(weights, self.ops))


class SearchCell(nn.Module):
    def __init__(self, steps: int, multiplier: int, c_pp: int, c_p: int, c: int, reduction: bool,
                 reduction_prev: bool, primitives=PRIMITIVES):
        super().__init__()
        self.reduction, self.steps, self.multiplier = reduction, steps, multiplier
        self.pre0 = FactorizedReduce(c_pp, c, False) if reduction_prev else ReLUConvBN(c_pp, c, 1, 1, 0, False)
        self.pre1 = ReLUConvBN(c_p, c, 1, 1, 0, False)
        self.edges = nn.ModuleList()
        for i in range(steps):
            for j in range(2 + i):
                self.edges.append(MixedOp(c, 2 if reduction and j < 2 else 1, primitives))

    def forward(self, s0, s1, weights):
        states = [self.pre0(s0), self.pre1(s1)]
        e = 0
        for _ in range(self.steps):
            node = sum(self.edges[e + j](h, weights[e + j]) for j, h in enumerate(states))
            e += len(states)
            states.append(node)
        return torch.cat(states[-self.multiplier:], dim=1)


class DartsSearchNetwork(nn.Module):
    def __init__(self, C: int = 16, num_classes: int = 10, layers: int = 8, steps: int = 4, multiplier: int = 4,
                 stem_multiplier: int = 3, primitives=PRIMITIVES):
        super().__init__()
        c_curr = stem_multiplier * C
        self.stem = nn.Sequential(nn.Conv2d(3, c_curr, 3, padding=1, bias=False), nn.BatchNorm2d(c_curr))
        c_pp, c_p, c_curr = c_curr, c_curr, C
        self.cells = nn.ModuleList()
        reduction_prev = False
        for i in range(layers):
            reduction = i in (layers // 3, 2 * layers // 3)
            if reduction:
                c_curr *= 2
            self.cells.append(SearchCell(steps, multiplier, c_pp, c_p, c_curr, reduction, reduction_prev, primitives))
            reduction_prev = reduction
            c_pp, c_p = c_p, multiplier * c_curr
        self.classifier = nn.Linear(c_p, num_classes)
        n_edges = sum(2 + i for i in range(steps))
        # Plain leaf tensors, not module parameters (as in the DARTS/FedNAS search code).
        self.alphas_normal = (1e-3 * torch.randn(n_edges, len(primitives))).requires_grad_(True)
        self.alphas_reduce = (1e-3 * torch.randn(n_edges, len(primitives))).requires_grad_(True)

    def arch_parameters(self) -> list[torch.Tensor]:
        return [self.alphas_normal, self.alphas_reduce]

    def forward(self, x):
        w_n = F.softmax(self.alphas_normal, dim=-1)
        w_r = F.softmax(self.alphas_reduce, dim=-1)
        s0 = s1 = self.stem(x)
        for cell in self.cells:
            s0, s1 = s1, cell(s0, s1, w_r if cell.reduction else w_n)
        return self.classifier(F.adaptive_avg_pool2d(s1, 1).flatten(1))


def count_weights(model: nn.Module) -> int:
    """Trainable weights (module parameters; the α tensors are not among them)."""
    return sum(p.numel() for p in model.parameters())


def make_optimizers(model: DartsSearchNetwork):
    w_opt = torch.optim.SGD(model.parameters(), lr=0.025, momentum=0.9, weight_decay=3e-4)
    a_opt = torch.optim.Adam(model.arch_parameters(), lr=3e-4, betas=(0.5, 0.999), weight_decay=1e-3)
    return w_opt, a_opt


def milenas_step(model: DartsSearchNetwork, w_opt, a_opt, x_tr, y_tr, x_val, y_val, lam: float = 1.0,
                 grad_clip: float = 5.0) -> float:
    """One minibatch of the authors' FedNAS local search (α step, then w step); returns L_train."""
    alphas = model.arch_parameters()
    # α step: ∇_α L_train + λ ∇_α L_val (two forward/backward passes, gradients w.r.t. α only)
    # (allow_unused: a one-cell network has no normal cell, its α gets a zero gradient)
    g_tr = torch.autograd.grad(F.cross_entropy(model(x_tr), y_tr), alphas, allow_unused=True, materialize_grads=True)
    g_val = torch.autograd.grad(F.cross_entropy(model(x_val), y_val), alphas, allow_unused=True,
                                materialize_grads=True)
    for a, gt, gv in zip(alphas, g_tr, g_val):
        a.grad = gv + lam * gt
    a_opt.step()
    # w step at the new α
    w_opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x_tr), y_tr)
    loss.backward()
    nn.utils.clip_grad_norm_(alphas, grad_clip)  # the authors' code clips α's gradients, not w's
    w_opt.step()
    return float(loss.detach())


if __name__ == "__main__":
    for C, layers in ((8, 5), (16, 8)):
        net = DartsSearchNetwork(C, 10, layers)
        print(f"C={C} layers={layers}: {count_weights(net):,} weights")
