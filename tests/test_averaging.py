"""K-step model averaging on two real Horovod ranks, against synchronous training and a plain simulation.

Run as a script (``horovodrun ... python tests/test_averaging.py OUT``) this file is the worker: each
variant trains a tiny TSM (sub-batch BN on) on fixed batches, rank r taking its half of every global
batch, and saves every rank's parameters, BN buffers and optimizer state after every step. The same
launch also measures the gradient noise terms (trainer.schedules.batch_growth) under Horovod's optimizer.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from trainer.config import Data, Model, Recipe, Schedules, TrainConfig
from trainer.engine import Engine
from trainer.model.tsm import ModelConfig, build
from trainer.schedules import recipe
from trainer.schedules.batch_growth import LocalGradNorm, grad_sq_norm
from trainer.schedules.model_averaging import KStepAveraging, is_sync_step
from trainer.schedules.regime import Regime

HOROVODRUN = str(Path(sys.executable).parent / "horovodrun")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
GLOBAL_BATCH, STEPS, FRAMES, SIZE, CLASSES = 8, 8, 2, 64, 3
HPARAMS = {"sgd": {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3, "nesterov": True},
           "adam": {"lr": 3e-3, "weight_decay": 1e-3}, "adamw": {"lr": 3e-3, "weight_decay": 0.05}}
# name -> (optimizer, every, local_after); every 0: Horovod's synchronous DistributedOptimizer
SYNCHRONOUS = ("sgd", "adam")  # AdamW differs from Adam only in its decay: simulated below, not repeated here
VARIANTS = {f"sync-{o}": (o, 0, 0) for o in SYNCHRONOUS} | {f"k1-{o}": (o, 1, 0) for o in SYNCHRONOUS} | {
    "k2-sgd": ("sgd", 2, 0), "k4-sgd": ("sgd", 4, 0), "k2-adam": ("adam", 2, 0), "k3-adamw": ("adamw", 3, 0),
    "postlocal-sgd": ("sgd", 3, 2)}


def batches():
    data = torch.Generator().manual_seed(123)
    return [(torch.randint(0, 256, (GLOBAL_BATCH, FRAMES, 3, SIZE, SIZE), generator=data, dtype=torch.uint8),
             torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=data)) for _ in range(STEPS)]


def tiny_model():
    torch.manual_seed(0)
    return build(ModelConfig(num_classes=CLASSES, segments=FRAMES, depth=10, width=4), bn_group=2).train()


def optimizer_for(model, name: str):
    return recipe.build_optimizer(model, name=name, **HPARAMS[name])


def snapshot(model, optimizer) -> dict:
    """Parameters, BN running statistics and optimizer state, flattened."""
    state = [t for p in model.parameters() for k, t in sorted(optimizer.state.get(p, {}).items())
             if k != "step" and torch.is_tensor(t)]
    return {"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone(),
            "buffers": torch.cat([b.reshape(-1).float() for n, b in model.named_buffers()
                                  if "running" in n]).clone(),
            "state": torch.cat([t.reshape(-1) for t in state]).clone() if state else torch.zeros(0)}


def loss_of(model, clips, labels):
    return F.cross_entropy(model(clips), labels)


def count_allreduces() -> dict:
    """Count the values this rank hands to Horovod's allreduce while ``counter["on"]``: both entry
    points of ``horovod.torch.mpi_ops`` that every allreduce goes through (``hvd.allreduce``, the
    DistributedOptimizer's per-gradient ``allreduce_async_``, the grouped variants) are wrapped."""
    from horovod.torch import mpi_ops

    counter = {"on": False, "values": 0}

    def wrap(name, numel):
        original = getattr(mpi_ops, name)

        def counting(tensors, *args, **kwargs):
            if counter["on"]:
                counter["values"] += numel(tensors)
            return original(tensors, *args, **kwargs)

        setattr(mpi_ops, name, counting)

    wrap("_allreduce_async", lambda t: t.numel())
    wrap("_grouped_allreduce_async", lambda ts: sum(t.numel() for t in ts))
    return counter


def worker(out: str) -> None:
    import horovod.torch as hvd

    from trainer.distributed import backends as distributed
    sent = count_allreduces()
    backend = distributed.init("horovod")
    share = GLOBAL_BATCH // backend.size
    mine = slice(backend.rank * share, (backend.rank + 1) * share)
    data = batches()
    for name, (opt, every, local_after) in VARIANTS.items():
        model = tiny_model()
        optimizer = optimizer_for(model, opt)
        if every == 0:
            optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
            averaging = norms = None
        else:
            averaging = KStepAveraging(model, optimizer, backend.all_sum, backend.size, every, local_after)
        if name == "sync-sgd":  # the gradient noise terms under Horovod's own allreduce
            norms = LocalGradNorm(model.parameters())
        steps, measured = [], []
        for step, (clips, labels) in enumerate(data):
            optimizer.zero_grad()
            loss_of(model, clips[mine], labels[mine]).backward()
            if averaging is None:
                optimizer.synchronize()
                if norms is not None:
                    local = backend.all_sum(torch.tensor([norms.pop()],
                                                         dtype=torch.float64)).item() / backend.size
                    measured.append((local, grad_sq_norm(model.parameters())))
                with optimizer.skip_synchronize():
                    optimizer.step()
            else:
                averaging.synchronize(step)
                optimizer.step()
            steps.append(snapshot(model, optimizer))
        torch.save({"steps": steps, "collectives": averaging.collectives if averaging else None,
                    "measured": measured}, os.path.join(out, f"{name}-rank{backend.rank}.pt"))
    for opt in SYNCHRONOUS:  # the trainer's own step, synchronised as trainer train does it
        for every in (None, 1, 2):
            cfg = TrainConfig(data=Data(data="-", batch_size=share),
                              model=Model(segments=FRAMES, depth=10, width=4),
                              recipe=Recipe(epochs=1, warmup_epochs=0,
                                            lr_per_8=HPARAMS[opt]["lr"], optimizer=opt),
                              schedules=Schedules(average_every=every))
            torch.manual_seed(0)
            regime = Regime(cfg, backend.size, STEPS * GLOBAL_BATCH)
            engine = Engine(regime.backend(backend), CLASSES, STEPS * GLOBAL_BATCH, model=cfg.model,
                            recipe=cfg.recipe, system=cfg.system, batch_size=share)
            regime.attach(engine, lambda: None)  # (no loader: the steps are fed by hand)
            backend.broadcast_state(engine.model, engine.optimizer)
            engine.model.train()
            steps, sent["values"], sent["on"] = [], 0, True
            for clips, labels in data:
                engine.train_step(clips[mine], labels[mine])
                steps.append(snapshot(engine.model, engine.optimizer))
            sent["on"] = False
            sizes = {"params": sum(p.numel() for p in engine.model.parameters()),
                     "bn": sum(b.numel() for n, b in engine.model.named_buffers() if "running" in n)}
            torch.save({"steps": steps, "floats": regime.allreduced_floats(STEPS), "sent": sent["values"],
                        "sizes": sizes},
                       os.path.join(out, f"engine-{opt}-{every or 'sync'}-rank{backend.rank}.pt"))
    backend.shutdown()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("averaging")
    hvd = subprocess.run([HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
                          __file__, str(out)],
                         env=ENV, capture_output=True, text=True, timeout=300)
    assert hvd.returncode == 0, hvd.stdout[-3000:] + hvd.stderr[-3000:]
    return {p.stem: torch.load(p) for p in out.glob("*.pt")}


def same(a: dict, b: dict, atol: float = 0.0) -> bool:
    return all(torch.allclose(a[k], b[k], rtol=0, atol=atol) if atol else torch.equal(a[k], b[k]) for k in a)


def simulate(opt: str, every: int, local_after: int) -> list[dict]:
    """Two ranks in one process, written out plainly: for SGD the textbook K-step averaging (local
    steps, then the models and momenta averaged); for Adam the documented rule (at a synchronising
    step, gradients, parameters, buffers and moments averaged, then one step). Rank 0's snapshots."""
    models = [tiny_model() for _ in range(2)]
    opts = [optimizer_for(m, opt) for m in models]
    halves = (slice(0, GLOBAL_BATCH // 2), slice(GLOBAL_BATCH // 2, GLOBAL_BATCH))
    out = []

    def average(tensors_of):  # tensors_of(rank) -> list of tensors, replaced by their mean
        for a, b in zip(tensors_of(0), tensors_of(1)):
            mean = (a.detach() + b.detach()) / 2
            a.detach().copy_(mean)
            b.detach().copy_(mean)

    def model_and_state(r):
        state = [t for p in models[r].parameters() for k, t in sorted(opts[r].state.get(p, {}).items())
                 if k != "step"]
        return list(models[r].parameters()) + [b for n, b in models[r].named_buffers()
                                               if "running" in n] + state

    for step, (clips, labels) in enumerate(batches()):
        for r in range(2):
            opts[r].zero_grad()
            loss_of(models[r], clips[halves[r]], labels[halves[r]]).backward()
        sync = is_sync_step(step, every, local_after)
        if opt == "sgd":
            for o in opts:
                o.step()
            if sync:
                average(model_and_state)
        else:
            if sync:
                average(lambda r: [p.grad for p in models[r].parameters()] + model_and_state(r))
            for o in opts:
                o.step()
        out.append(snapshot(models[0], opts[0]))
    return out


def test_one_step_averaging_is_synchronous_training(runs):
    for opt in SYNCHRONOUS:
        sync, k1 = runs[f"sync-{opt}-rank0"]["steps"], runs[f"k1-{opt}-rank0"]["steps"]
        moved = (sync[-1]["params"] - tiny_params()).abs().max().item()
        assert moved > 1e-2, opt  # training really moved the weights
        for a, b in zip(sync, k1):
            assert torch.allclose(a["params"], b["params"], rtol=1e-4, atol=1e-6), opt
            assert torch.allclose(a["state"], b["state"], rtol=1e-4, atol=1e-7), opt
        assert runs[f"k1-{opt}-rank0"]["collectives"] == STEPS  # one allreduce per step, like synchronous


def test_the_trainers_step_with_one_step_averaging_is_its_synchronous_step(runs):
    """``trainer train --average-every 1`` (the regime's K-step backend under the engine's step)
    against the default, Horovod's synchronous optimizer: the same weights and state at every step."""
    for opt in SYNCHRONOUS:
        sync, k1 = runs[f"engine-{opt}-sync-rank0"]["steps"], runs[f"engine-{opt}-1-rank1"]["steps"]
        assert (sync[-1]["params"] - sync[0]["params"]).abs().max().item() > 1e-3, opt  # it trained
        for a, b in zip(sync, k1):
            assert torch.allclose(a["params"], b["params"], rtol=1e-4, atol=1e-6), opt
            assert torch.allclose(a["state"], b["state"], rtol=1e-4, atol=1e-7), opt


def test_the_regime_counts_the_values_each_rank_allreduces(runs):
    """The regime's figure against the values each rank really handed to Horovod's allreduce during
    the steps (counted inside Horovod's entry points): synchronous training sends every gradient at
    every step; one-step averaging also the BN statistics; two-step averaging, after each drift,
    the parameters and optimizer state as well."""
    for opt in SYNCHRONOUS:
        for every in ("sync", 1, 2):
            for rank in (0, 1):
                run = runs[f"engine-{opt}-{every}-rank{rank}"]
                assert (run["sent"] > 0
                        and run["floats"] == run["sent"]), (opt, every, rank, run["floats"], run["sent"])
        sync, k1 = runs[f"engine-{opt}-sync-rank0"], runs[f"engine-{opt}-1-rank0"]
        assert sync["sent"] == STEPS * sync["sizes"]["params"], opt
        assert k1["sent"] == STEPS * (k1["sizes"]["params"] + k1["sizes"]["bn"]), opt


def tiny_params() -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in tiny_model().parameters()])


@pytest.mark.parametrize("name", ["k2-sgd", "k4-sgd", "k2-adam", "k3-adamw", "postlocal-sgd"])
def test_ranks_are_identical_after_every_averaging_step_and_apart_between(name, runs):
    opt, every, local_after = VARIANTS[name]
    r0, r1 = runs[f"{name}-rank0"], runs[f"{name}-rank1"]
    syncs = [s for s in range(STEPS) if is_sync_step(s, every, local_after)]
    for step, (a, b) in enumerate(zip(r0["steps"], r1["steps"])):
        if step in syncs:
            assert same(a, b), (name, step)
        else:  # local steps on different batches: the ranks drift
            assert not torch.allclose(a["params"], b["params"]), (name, step)
    # one allreduce per synchronising step: K times fewer than synchronous training
    assert r0["collectives"] == r1["collectives"] == len(syncs)
    if not local_after:
        assert len(syncs) == STEPS // every


@pytest.mark.parametrize("name", ["k2-sgd", "k4-sgd", "k2-adam", "k3-adamw", "postlocal-sgd"])
def test_two_horovod_ranks_follow_the_plain_two_rank_simulation(name, runs):
    expected = simulate(*VARIANTS[name])
    for step, (got, want) in enumerate(zip(runs[f"{name}-rank0"]["steps"], expected)):
        for key in want:
            assert torch.allclose(got[key], want[key], rtol=1e-4, atol=1e-5), (name, step, key)


def test_gradient_noise_terms_are_measured_before_and_after_horovods_allreduce(runs):
    """LocalGradNorm's hooks see each rank's own gradient although Horovod's optimizer replaces it by
    the average during the same backward pass; checked at the first step, where both ranks start
    from the same weights, against gradients computed here."""
    clips, labels = batches()[0]
    grads = []
    for half in (slice(0, GLOBAL_BATCH // 2), slice(GLOBAL_BATCH // 2, GLOBAL_BATCH)):
        model = tiny_model()
        loss_of(model, clips[half], labels[half]).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    local = (grads[0].square().sum() + grads[1].square().sum()).item() / 2
    averaged = ((grads[0] + grads[1]) / 2).square().sum().item()
    for rank in (0, 1):
        got_local, got_averaged = runs[f"sync-sgd-rank{rank}"]["measured"][0]
        assert got_local == pytest.approx(local, rel=1e-4)
        assert got_averaged == pytest.approx(averaged, rel=1e-4)
    assert local > 1.2 * averaged  # two half batches are noisier than their average


@pytest.mark.parametrize("step,every,local_after,expected", [
    (0, 1, 0, True), (0, 4, 0, False), (3, 4, 0, True), (7, 4, 0, True), (5, 4, 0, False),
    (0, 4, 3, True), (2, 4, 3, True), (3, 4, 3, False), (6, 4, 3, True), (10, 4, 3, True), (9, 4, 3, False)])
def test_which_steps_synchronise(step, every, local_after, expected):
    assert is_sync_step(step, every, local_after) is expected


def test_single_process_averaging_sends_nothing():
    model = tiny_model()
    opt = optimizer_for(model, "sgd")
    averaging = KStepAveraging(model, opt, lambda t: pytest.fail("no allreduce in one process"), 1, every=2)
    clips, labels = batches()[0]
    for step in range(4):
        opt.zero_grad()
        loss_of(model, clips, labels).backward()
        averaging.synchronize(step)
        opt.step()
    averaging.average_now()
    assert averaging.collectives == 0
    with pytest.raises(ValueError, match="at least 1"):
        KStepAveraging(model, opt, None, 2, every=0)


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_adam_and_adamw_decay_weights_but_never_bn_or_biases(name):
    model = tiny_model()
    opt = recipe.build_optimizer(model, lr=0.1, weight_decay=0.5, name=name)
    before = copy.deepcopy(model.state_dict())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    after = model.state_dict()
    for key, value in before.items():
        if key.endswith("running_mean") or key.endswith("running_var") or "num_batches" in key:
            continue
        moved = not torch.equal(value, after[key])
        decayed = key.endswith("weight") and after[key].dim() > 1  # conv and linear weights
        assert moved is decayed, key
    assert type(opt).__name__.lower() == name
    with pytest.raises(ValueError, match="not one of"):
        recipe.build_optimizer(model, lr=0.1, name="lamb")


if __name__ == "__main__":
    worker(sys.argv[1])
