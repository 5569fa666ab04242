"""``--compile``: the temporal shift traced into the compiled graph (no graph break), and a
compiled training step equal to the eager one (CPU, tiny model: GPU figures still to be taken)."""
from __future__ import annotations

import torch
import torch._dynamo
from torch._dynamo.eval_frame import OptimizedModule

from trainer.config import Model, Recipe, System
from trainer.distributed.backends import Backend
from trainer.engine import Engine
from trainer.model import compiling
from trainer.model.temporal_shift import TemporalShift
from trainer.model.tsm import ModelConfig, build

SEGMENTS, SIZE, BATCH = 4, 16, 2


def clips(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (BATCH, SEGMENTS, 3, SIZE, SIZE), dtype=torch.uint8, generator=g),
            torch.randint(0, 3, (BATCH,), generator=g))


def test_the_shift_is_inside_one_graph_without_breaks():
    model = build(ModelConfig(num_classes=3, segments=SEGMENTS, depth=10, width=8)).train()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(clips()[0])
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    shifts = sum(isinstance(m, TemporalShift) for m in model.modules())
    assert (shifts == 4 and [str(op)
                             for op in explained.ops_per_graph[0]].count("autograd_function_apply") == shifts)


def engine(compile: str | None = None):
    torch.manual_seed(0)
    e = Engine(Backend(), 3, epoch_clips=4 * BATCH, model=Model(segments=SEGMENTS, depth=10, width=4),
               recipe=Recipe(epochs=1, warmup_epochs=0, lr_per_8=0.5), system=System(compile=compile),
               batch_size=BATCH)
    e.model.train()
    return e


def test_compiled_training_steps_equal_eager_ones():
    """``--compile`` wraps the training network; the graphs Dynamo and AOTAutograd capture from it
    (forward and backward, shift included) give the eager steps. Without Inductor's code
    generation, which takes minutes on 2 CPU cores."""
    torch._dynamo.reset()
    eager, compiled = engine(), engine("auto")
    assert isinstance(compiled.net, OptimizedModule) and compiled.net._orig_mod is compiled.model
    assert not isinstance(eager.net, OptimizedModule)
    compiled.net = compiling.compile_network(compiled.model, compiled.optimizer, compiled.device,
                                             backend="aot_eager")
    for step in range(3):
        x, y = clips(step)
        a, b = eager.train_step(x, y), compiled.train_step(x, y)
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(eager.model.state_dict().items(), compiled.model.state_dict().values()):
        torch.testing.assert_close(q, p, rtol=1e-3, atol=1e-5, msg=name)
