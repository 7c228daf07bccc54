"""The optimizer step on a CUDA stream of its own, overlapped with the next forward
(`[optim] overlap_step`).

MasterAdamW's pass is bound by memory bandwidth (about 20 bytes a parameter), a forward by the
tensor cores; on one stream they take turns, and the step's few hundred launches each end in a
partly idle GPU. With a `StepStream` the step's kernels are queued on a second stream, one weight
unit at a time in the order the next forward uses them (the embedding, each block, the final norm
and untied head), with a CUDA event after each unit; the forward's stream waits for a unit's
event just before it uses that unit (`CausalLM.await_weights`). So block k's forward can start as
soon as block k is updated, while the updates of the blocks after it run beside it. At the Qwen3-1.7B
shape on H100s (docs/benchmarks.md, twenty-fifth session) a step is 0.4–1.7 % shorter (means of
three calls: 341.0 → 338.1 ms), so the setting is on by default; tests/gpu/test_models_cuda.py
`test_overlapped_optimizer_step_trains_as_the_inline_step` checks the steps are the in-line ones.

Invariants (nothing reads a weight or optimizer state that the step still writes, and the step
reads nothing that has been freed):
- the model's forward (training, the held-out evaluation) waits unit by unit (`wait`);
- everything else that reads the weights or the optimizer's state waits for the whole step first
  (`settle`): the optimizer's state_dict, load_state_dict and `master`, the model's state_dict (a
  hook), and whatever reads `weight_stream.persistent_tensors` or a checkpoint's state (the weight
  publisher, the Hugging Face export, checkpoints and their resume);
- the gradients and clipping's coefficient, which the trainer drops after `step()`, are marked
  as used by the step's stream (`record_stream`), so the allocator does not hand their memory to
  the next forward before the step has read them.
"""

import torch
from torch import nn


class StepStream:
    """A side stream and one event per weight unit of the last step queued on it."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)
        self._events: list[torch.cuda.Event] = []

    def begin(self) -> None:
        """Before queueing a step: the side stream waits for the work queued so far (the backward,
        clipping) on the current stream."""
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        self._events = []

    def unit_done(self) -> None:
        """After the kernels of one unit were queued on the side stream."""
        event = torch.cuda.Event()
        event.record(self.stream)
        self._events.append(event)

    def keep(self, tensor: torch.Tensor) -> None:
        """`tensor` (made on the current stream, dropped after `step()`) is read by the queued step."""
        tensor.record_stream(self.stream)

    def wait(self, unit: int) -> None:
        """The current stream waits until unit `unit` of the last step is updated."""
        if self._events:
            torch.cuda.current_stream(self.stream.device).wait_event(self._events[unit])

    def barrier(self, unit: int | None) -> None:
        """`wait(unit)`, or `settle()` for None (CausalLM.weights_barrier)."""
        if unit is None:
            self.settle()
        else:
            self.wait(unit)

    def settle(self) -> None:
        """The current stream waits for the whole of the last step."""
        if self._events:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)


def settle_weights(model: nn.Module) -> None:
    """Before reading `model`'s weights (or its optimizer's state) outside a forward: wait for a
    step still running on a stream of its own (CausalLM.await_weights); nothing for other models."""
    await_weights = getattr(model, "await_weights", None)
    if await_weights is not None:
        await_weights()
