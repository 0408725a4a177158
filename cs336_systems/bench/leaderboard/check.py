"""The correctness check of a run, before its timings: at a scaled-down config with the same code paths, every
main provider and a float32 plain reference are given the same weights (rounded to the run's parameter dtype) and
tokens; each provider's loss and every gradient are compared with the reference's and must be within 2x the error
of the plain model run eagerly in the same dtype without checkpointing (what torch itself gets in that dtype), or
within the dtype's floor (`CHECK_FLOORS`). One row per provider, status check_ok or check_fail."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import replace

import torch

from cs336_systems.bench.leaderboard.config import CHECK_FLOORS, LeaderboardConfig
from cs336_systems.bench.leaderboard.provider import (Trainee, batch_mean, build, build_plain, forward_backward, fresh,
                                                      recipe_columns, share, tokens, rank_and_world)
from cs336_systems.bench.leaderboard.recipes import AUTO, CHECK_CHECKPOINT, PLAIN_SAC, recipe
from cs336_systems.model import TransformerLM
from cs336_systems.timing import DTYPES


def _relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    reference = reference.double()
    return ((value.double() - reference).norm() / reference.norm().clamp_min(1e-30)).item()



def _loss_and_gradients(trainee: Trainee, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[float, dict]:
    loss = forward_backward(trainee, inputs, targets)
    return batch_mean(loss).item(), trainee.gradients()


def _errors(result: tuple[float, dict], reference: tuple[float, dict]) -> dict:
    """Relative error of the loss, and the largest relative L2 error over the gradients (and whose)."""
    (loss, grads), (ref_loss, ref_grads) = result, reference
    missing = sorted(set(ref_grads) - {n for n, g in grads.items() if g is not None})
    if missing:
        raise RuntimeError(f"no gradient for {', '.join(missing)}")
    per_param = {name: _relative_error(grads[name], ref) for name, ref in ref_grads.items()}
    worst = max(per_param, key=per_param.get)
    return {"loss_err": abs(loss - ref_loss) / abs(ref_loss), "grad_err": per_param[worst], "worst_param": worst}


def run_check(config: LeaderboardConfig, device: torch.device) -> Iterator[dict]:
    """The check's rows, one per main provider (see the module docstring)."""
    model_config = config.check_config()
    dtype = DTYPES[config.param_dtype]
    torch.manual_seed(0)
    with device:
        source = TransformerLM(model_config)  # float32 weights, our initialisation
    weights = {name: t.to(dtype) for name, t in source.state_dict().items()}  # what every run starts from
    inputs, targets = tokens(model_config.vocab_size, config.check_batch, config.check_context, device, seed=2)

    def plain_eager(param_dtype: str) -> tuple[float, dict]:  # this process alone, on the whole batch
        eager = replace(config, compile="none", param_dtype=param_dtype, data_parallel="none")
        trainee = build_plain(replace(PLAIN_SAC, checkpoint="none"), model_config, eager, device, weights)
        return _loss_and_gradients(trainee, inputs, targets)

    reference = plain_eager("fp32")
    anchor = _errors(plain_eager(config.param_dtype), reference)  # torch's own error in this dtype
    floors = CHECK_FLOORS[config.param_dtype]
    tolerance = {"loss": max(2 * anchor["loss_err"], floors["loss"]), "grad": max(2 * anchor["grad_err"], floors["grad"])}
    world = rank_and_world()[1]  # under data parallelism each rank checks its averaged gradients against the reference
    for provider in config.providers:
        fresh(device)
        base = {**recipe_columns(provider, config, config.check_batch), "size": f"check:{config.check_size}",
                "world_size": world, "batch": config.check_batch, "context_length": config.check_context}
        trainee = build(provider, model_config, config, device, weights,
                        checkpoint=CHECK_CHECKPOINT if recipe(provider).checkpoint == AUTO else None)
        result = _loss_and_gradients(trainee, *share(inputs, targets))
        errors = _errors(result, reference)
        del trainee
        ok = errors["loss_err"] <= tolerance["loss"] and errors["grad_err"] <= tolerance["grad"]
        row = {**base, "status": "check_ok" if ok else "check_fail", "check_loss_err": errors["loss_err"],
               "check_loss_tol": tolerance["loss"], "check_grad_err": errors["grad_err"],
               "check_grad_tol": tolerance["grad"], "check_worst_param": errors["worst_param"],
               "loss": result[0], "check_loss_ref": reference[0]}
        if not ok:
            row["error"] = (f"{provider} differs from the float32 reference by {errors['loss_err']:.3g} (loss) and "
                            f"{errors['grad_err']:.3g} ({errors['worst_param']}); tolerances {tolerance['loss']:.3g} "
                            f"and {tolerance['grad']:.3g}")
        print(f"check {provider}: {row['status']} (loss error {errors['loss_err']:.2e}, worst gradient "
              f"{errors['worst_param']} {errors['grad_err']:.2e}; tolerances {tolerance['loss']:.2e}, "
              f"{tolerance['grad']:.2e})", file=sys.stderr, flush=True)
        yield row
    fresh(device)

