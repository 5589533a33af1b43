"""Temporal-transformer layers kept in host memory and streamed to the device ahead of their use.

`LayerStreamer(transformer, layers, device)` takes the chosen layers' weights out of device
memory: each keeps a host copy (pinned on CUDA, so copies are asynchronous DMA), and its
parameters are bound, once and for good, to one of `staging` sets of device buffers shared by
every streamed layer (layer of rank k uses set k % staging). Each forward of the transformer
(a tick or a prefill chunk) then, per streamed layer:
- before it runs: its host copy has been copied into its set (the compute waits for that copy);
- after it runs: the set is free, and the copy of the streamed layer `staging` ranks later
  starts at once, while the layers in between compute.
On CUDA the copies run on a stream of their own, ordered by events (a copy into a set waits
for the compute that last read it; a layer waits for its own copy): every address is fixed, so
the whole tick can still be captured as one CUDA graph. On the CPU the same steps copy
synchronously, which is what the golden test runs (`tests/test_offload.py`): the weights of
every streamed layer really come from the host copy every step.

The layers are not replaced: their `forward` is wrapped on the instance (the transformer calls
`layer.forward(...)`), so module paths, state keys and checkpoints do not change.
What to stream is the engine's choice (engine/offload_plan.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from personaplex_voice.model.lm import LMModel


def _tensor_slots(layer: nn.Module) -> list[tuple[nn.Module, str, bool]]:
    """(module, name, is_parameter) for every parameter and buffer a layer holds, in a fixed order."""
    slots = []
    for module in layer.modules():
        for name, value in module._parameters.items():
            if value is not None:
                slots.append((module, name, True))
        for name, value in module._buffers.items():
            if value is not None:
                slots.append((module, name, False))
    return slots


class LayerStreamer:
    def __init__(
        self,
        transformer: nn.Module,
        layers: Sequence[int],
        device: str | torch.device,
        *,
        staging: int = 2,
    ):
        if not layers:
            raise ValueError("stream at least one layer")
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.order = sorted(set(layers))
        self.rank = {index: k for k, index in enumerate(self.order)}
        self.staging = max(1, min(staging, len(self.order)))
        self.copies = 0  # layer copies made so far (tests, benchmarks)
        modules = list(transformer.layers)  # type: ignore[attr-defined]
        slot_lists = [_tensor_slots(modules[i]) for i in self.order]
        shapes = [[(tuple(_get(m, n).shape), _get(m, n).dtype) for m, n, _ in slots] for slots in slot_lists]
        if any(s != shapes[0] for s in shapes):
            raise ValueError("streamed layers must all have the same tensors")
        pin = self.cuda and torch.cuda.is_available()
        self.hosts: list[list[torch.Tensor]] = []
        for slots in slot_lists:
            copies = []
            for module, name, _ in slots:
                value = _get(module, name).detach().to("cpu").contiguous()
                copies.append(value.pin_memory() if pin else value.clone())
            self.hosts.append(copies)
        self.buffers = [
            [torch.empty(host.shape, dtype=host.dtype, device=self.device) for host in self.hosts[0]]
            for _ in range(self.staging)
        ]
        for k, slots in enumerate(slot_lists):  # bind each streamed layer to its set, for good
            for (module, name, is_parameter), buffer in zip(
                slots, self.buffers[k % self.staging], strict=True
            ):
                if is_parameter:
                    module._parameters[name] = nn.Parameter(buffer, requires_grad=False)
                else:
                    module._buffers[name] = buffer
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(self.device)
            self.loaded = [torch.cuda.Event() for _ in self.order]
            self.consumed = [torch.cuda.Event() for _ in range(self.staging)]
        self.first = 0
        for index in sorted({self.first, *self.order}):
            self._wrap(index, modules[index])

    @property
    def layer_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.hosts[0])

    def _wrap(self, index: int, layer: nn.Module) -> None:
        inner = layer.forward

        def forward(*args, **kwargs):
            self.before(index)
            out = inner(*args, **kwargs)
            self.after(index)
            return out

        layer.forward = forward  # an instance attribute: the transformer's `layer.forward` finds it

    # -- one forward pass ---------------------------------------------------------------------

    def before(self, index: int) -> None:
        if index == self.first:  # a pass begins: the first `staging` streamed layers load now
            if self.cuda:
                self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            for k in range(self.staging):
                self._load(k, first=True)
        k = self.rank.get(index)
        if k is not None and self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.loaded[k])

    def after(self, index: int) -> None:
        k = self.rank.get(index)
        if k is None:
            return
        if self.cuda:
            self.consumed[k % self.staging].record(torch.cuda.current_stream(self.device))
        if k + self.staging < len(self.order):
            self._load(k + self.staging)

    def _load(self, k: int, first: bool = False) -> None:
        buffers, host = self.buffers[k % self.staging], self.hosts[k]
        if self.cuda:
            with torch.cuda.stream(self.copy_stream):
                if not first:
                    self.copy_stream.wait_event(self.consumed[k % self.staging])
                for dst, src in zip(buffers, host, strict=True):
                    dst.copy_(src, non_blocking=True)
                self.loaded[k].record(self.copy_stream)
        else:
            for dst, src in zip(buffers, host, strict=True):
                dst.copy_(src)
        self.copies += 1

    def copy_all_ms(self, repeats: int = 3) -> float:
        """The time of copying every streamed layer once (CUDA; the link's share of a tick)."""
        if not self.cuda:
            return 0.0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        best = float("inf")
        for _ in range(repeats):
            torch.cuda.synchronize(self.device)
            start.record(self.copy_stream)
            with torch.cuda.stream(self.copy_stream):
                for k in range(len(self.order)):
                    for dst, src in zip(self.buffers[k % self.staging], self.hosts[k], strict=True):
                        dst.copy_(src, non_blocking=True)
            end.record(self.copy_stream)
            end.synchronize()
            best = min(best, start.elapsed_time(end))
        # the buffers now hold other layers' weights: the next pass loads them again anyway
        return best


def _get(module: nn.Module, name: str) -> torch.Tensor:
    value = module._parameters.get(name)
    return value if value is not None else module._buffers[name]  # type: ignore[return-value]


def offload_layers(
    lm: LMModel, layers: Sequence[int], device: str | torch.device, *, staging: int = 2
) -> LayerStreamer:
    """Stream `layers` of the LM's temporal transformer from host memory; everything else of the
    LM moves to `device` (the streamed layers' own tensors are the staging buffers, already there)."""
    streamer = LayerStreamer(lm.transformer, layers, device, staging=staging)
    lm.to(device)
    return streamer
