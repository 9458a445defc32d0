"""Plain-PyTorch baselines the pipeline is compared against, and the matching pipeline loop."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

import roundpipe

# Adam divides each element's update by that element's own gradient scale, so an element whose
# gradient is a near-cancelling sum moves by up to lr whatever its summation-order round-off says.
# eps=1e-4 (above these tiny models' smallest gradients) keeps every update a smooth function of the
# gradient, so equal gradients give equal weights to WEIGHT_ATOL (0.1% of the LR).
# test_gradients_equal_plain_backward_before_any_step checks the gradients themselves at rtol 1e-4.
LR, EPS = 1e-3, 1e-4
WEIGHT_ATOL = 1e-6
EXACT_ATOL = 1e-4  # the exactness rule's elementwise allowance against plain fp32 (assert_exact)


@dataclass
class RunResult:
    losses: list[float]
    weights: dict[str, torch.Tensor]  # trainable parameters by name, after the last step


def trainable_weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def reference_train(
    model, batch: dict, steps: int, *, max_grad_norm=None, autocast_dtype=None, weight_decay=0.0
) -> RunResult:
    """Train a copy of ``model`` with HF's forward + loss and ``torch.optim.AdamW`` on one device;
    ``batch`` may be a list: step ``t`` trains on ``batch[t % len(batch)]``."""
    batches = batch if isinstance(batch, list) else [batch]
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=LR, eps=EPS, weight_decay=weight_decay
    )
    losses = []
    for t in range(steps):
        batch = batches[t % len(batches)]
        if autocast_dtype is None:
            loss = model(**batch, use_cache=False).loss
        else:
            with torch.autocast("cpu", dtype=autocast_dtype):
                loss = model(**batch, use_cache=False).loss
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_grad_norm)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return RunResult(losses, trainable_weights(model))


def pipeline_train(model, batch: dict, steps: int, *, max_grad_norm=None, **config) -> RunResult:
    """Train a copy of ``model`` with roundpipe and export the result back into the copy."""
    model = copy.deepcopy(model)
    with roundpipe.wrap(model, roundpipe.RunConfig(**config)) as pipe:
        pipe.configure_optimizer(lr=LR, eps=EPS, weight_decay=0.0, max_grad_norm=max_grad_norm)
        losses = []
        for _ in range(steps):
            out = pipe.forward_backward(
                batch["input_ids"],
                labels=batch["labels"],
                attention_mask=batch.get("attention_mask"),
                position_ids=batch.get("position_ids"),
            )
            pipe.step()
            losses.append(out.loss)
        pipe.export_to(model)
    return RunResult(losses, trainable_weights(model))


def assert_same_run(
    got: RunResult, want: RunResult, *, loss_rtol=1e-5, weight_rtol=1e-4, weight_atol=WEIGHT_ATOL
):
    torch.testing.assert_close(
        torch.tensor(got.losses, dtype=torch.float64),
        torch.tensor(want.losses, dtype=torch.float64),
        rtol=loss_rtol,
        atol=0.0,
    )
    assert got.weights.keys() == want.weights.keys()
    for name in want.weights:
        torch.testing.assert_close(
            got.weights[name],
            want.weights[name],
            rtol=weight_rtol,
            atol=weight_atol,
            msg=lambda m, n=name: f"{n}: {m}",
        )


def assert_exact(got: RunResult, plain: RunResult, exact: RunResult) -> None:
    """The project's exactness rule: losses equal plain fp32 PyTorch to rtol 1e-5, and every weight
    is no further from the float64 run (``exact``) than twice as far as plain fp32 PyTorch is, or
    within ``EXACT_ATOL`` of plain fp32 elementwise (where plain fp32 is itself a few ulps from
    float64, twice that distance is round-off noise, not a verdict)."""
    torch.testing.assert_close(
        torch.tensor(got.losses, dtype=torch.float64),
        torch.tensor(plain.losses, dtype=torch.float64),
        rtol=1e-5,
        atol=0.0,
    )
    assert got.weights.keys() == exact.weights.keys()
    for name, want in exact.weights.items():
        ours = (got.weights[name].double() - want).norm()
        theirs = (plain.weights[name].double() - want).norm()
        close = float((got.weights[name].double() - plain.weights[name].double()).abs().max()) <= EXACT_ATOL
        assert close or ours <= 2 * theirs + 1e-12 * want.norm(), (
            f"{name}: {ours:.3g} from float64, plain fp32 {theirs:.3g}"
        )


def reference_train_one_step_stale(model, batch: dict, steps: int) -> RunResult:
    """Plain PyTorch with the async optimizer's delay: iteration t computes its loss and gradients on
    the weights from before update t-1 (W_{t-1}; W_0 for the first two), and AdamW applies them to
    the latest weights W_t."""
    latest = copy.deepcopy(model)  # holds W_t, stepped by the optimizer
    runner = copy.deepcopy(model)  # computes on the stale weights
    params = [p for p in latest.parameters() if p.requires_grad]
    run_params = [p for p in runner.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, eps=EPS, weight_decay=0.0)
    stale = [p.detach().clone() for p in params]  # W_{t-1}
    losses = []
    for _ in range(steps):
        with torch.no_grad():
            for rp, w in zip(run_params, stale):
                rp.copy_(w)
        loss = runner(**batch, use_cache=False).loss
        loss.backward()
        for p, rp in zip(params, run_params):
            p.grad = rp.grad
            rp.grad = None
        stale = [p.detach().clone() for p in params]  # W_t, read by the next iteration
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return RunResult(losses, trainable_weights(latest))
