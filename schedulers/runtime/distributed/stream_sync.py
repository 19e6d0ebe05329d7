"""A weight sync streamed into vLLM engines unit by unit, without a full copy of the generate node's instance.

A generate node whose instance only its vLLM engines read
(:class:`~rlflow.schedulers.runtime.distributed.replicas.Replicas`) holds no parameters between syncs. A
planned reallocation into it (:class:`~rlflow.schedulers.runtime.distributed.weight_sync.Route` with a plan)
then runs *unit by unit* — the embedding, each decoder layer, the final norm, the head
(:func:`weight_units`) — so that a device holds one unit of that instance at a time, not the whole model
(NeMo RL streams its refit the same way, in buckets of ``refit_buffer_size_gb``; verl in buckets of
``update_weights_bucket_megabytes``). Per unit, in the same order on every rank of the route:

1. a source rank takes its shards of the unit's parameters (an FSDP2 source re-gathers them over ``dp``:
   per unit, not the whole model);
2. a target rank allocates the unit's parameters;
3. the reallocation's transfers of those parameters run (the sub-plan of ``plan.transfers``) and are
   verified region by region (``verify_reallocation``, one ``all_gather_object`` per unit);
4. a target rank loads the unit into its engines as one bucket (at tp > 1 gathered to full tensors over the
   tp group, the leader loading).

The engines' weights are still checked by the probe (teacher-forced log-probs of a fixed batch compared
with the engine's): on the target ranks the units are driven by the probe's own forward. Forward pre-hooks
(:class:`UnitStream`) fill a unit just before its module runs and free its parameters once every module
that uses them has run (a tied head keeps the embedding until the head), so the probe's log-probs come from
the same forward that fed the engines. Source ranks outside the target mesh walk the same units in order.
A unit no module called (the forward did not use it) is filled after the forward, so every parameter is
loaded.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["UnitStream", "move_params", "unit_of", "weight_units"]

_INDEX = re.compile(r"^\d+$")


def unit_of(name: str) -> str:
    """The unit of parameter ``name``: the path up to its first numeric component (a layer of a
    ``ModuleList``: ``model.layers.3.mlp.up_proj.weight`` -> ``model.layers.3``), else its module's path
    (``model.embed_tokens.weight`` -> ``model.embed_tokens``; ``""`` for a parameter of the root module)."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if _INDEX.match(part):
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1])


def weight_units(names: Iterable[str]) -> list[tuple[str, tuple[str, ...]]]:
    """``names`` (a model's parameters, ``named_parameters`` order) grouped by :func:`unit_of`, units in
    order of first appearance: ``[(unit path, its parameter names)]``. For a Hugging Face causal LM this is
    forward order: embedding, layers 0..L-1, final norm, head."""
    units: dict[str, list[str]] = {}
    for name in names:
        units.setdefault(unit_of(name), []).append(name)
    return [(path, tuple(group)) for path, group in units.items()]


def move_params(params: Iterable[nn.Parameter], device: torch.device) -> None:
    """Give each parameter new, uninitialised storage on ``device`` (``meta``: none), in place:
    ``torch.utils.swap_tensors`` keeps each ``Parameter`` object, so tied weights stay tied and references
    to them stay valid (``param.data =`` refuses a change between meta and a real device). A DTensor
    parameter (tensor parallel) keeps its mesh, placements and global shape; only its local shard moves
    (as FSDP2's meta-device initialisation holds DTensors over meta shards). Pass a tied parameter once."""
    from torch.distributed.tensor import DTensor
    from torch.utils import swap_tensors

    for p in params:
        if isinstance(p, DTensor):
            local = torch.empty_like(p.to_local(), device=device)
            value: torch.Tensor = DTensor.from_local(
                local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )
        else:
            value = torch.empty_like(p, device=device)
        new = nn.Parameter(value, requires_grad=p.requires_grad)
        swap_tensors(p, new)
        del new  # holds the old storage, freed here


def local_bytes(p: torch.Tensor) -> int:
    """Bytes of ``p``'s storage on this rank (a DTensor's local shard; 0 on ``meta``)."""
    from torch.distributed.tensor import DTensor

    t = p.to_local() if isinstance(p, DTensor) else p
    return 0 if t.is_meta else t.untyped_storage().nbytes()


class UnitStream:
    """The target side of a streamed sync: forward hooks on ``module`` that fill its parameters unit by unit.

    Args:
        module: the target instance (its parameters on ``meta``, or allocated: they are freed as the
            stream goes).
        units: :func:`weight_units` of ``module``'s parameter names (the plan's names), the order every
            rank of the route walks.
        fill: called with ``(unit index, {name: parameter})`` once the unit's parameters are allocated on
            ``device``; it writes them (the reallocation) and loads them into the engines.
        device: where the parameters are allocated.

    Use as a context manager around the probe's forward, then :meth:`finish`. A module's pre-hook fills, in
    order, every unit up to the last one holding a parameter it uses (so the units are filled in ``units``
    order whatever order the forward calls them in); a parameter is freed once every module path using it
    (its tied aliases' included) has run. :attr:`peak_bytes`: the most bytes of this instance held at once
    on this rank.
    """

    def __init__(
        self,
        module: nn.Module,
        units: Sequence[tuple[str, tuple[str, ...]]],
        fill: Callable[[int, dict[str, nn.Parameter]], None],
        device: torch.device,
    ) -> None:
        self.module = module
        self.units = list(units)
        self.fill = fill
        self.device = device
        canon = dict(module.named_parameters())
        self.params = [{n: canon[n] for n in names} for _, names in self.units]
        unit_index = {id(p): k for k, group in enumerate(self.params) for p in group.values()}
        # every module path a parameter is used under (a tied head's alias too), in first-appearance order
        self.users: dict[int, set[str]] = defaultdict(set)
        self.of_path: dict[str, list[nn.Parameter]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            path = unit_of(name)
            self.users[id(p)].add(path)
            self.of_path.setdefault(path, []).append(p)
        self.needs = {path: max(unit_index[id(p)] for p in ps) for path, ps in self.of_path.items()}
        self.filled = 0  # units filled so far, in order
        self.done: set[str] = set()
        self.live: dict[int, nn.Parameter] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self._handles: list[Any] = []

    def __enter__(self) -> UnitStream:
        for path in self.of_path:
            sub = self.module.get_submodule(path)
            self._handles.append(sub.register_forward_pre_hook(self._pre_hook(path), prepend=True))
            self._handles.append(sub.register_forward_hook(self._post_hook(path), always_call=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre_hook(self, path: str) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: Any) -> None:
            self._fill_to(self.needs[path])

        return hook

    def _post_hook(self, path: str) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: Any, _out: Any) -> None:
            self.done.add(path)
            for p in self.of_path[path]:
                if id(p) in self.live and self.users[id(p)] <= self.done:
                    self._free([p])

        return hook

    def _fill_to(self, last: int) -> None:
        while self.filled <= last:
            group = self.params[self.filled]
            fresh = [p for p in group.values() if id(p) not in self.live]
            move_params(fresh, self.device)
            for p in fresh:
                self.live[id(p)] = p
                self.live_bytes += local_bytes(p)
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            self.fill(self.filled, group)
            self.filled += 1

    def _free(self, params: Sequence[nn.Parameter]) -> None:
        for p in params:
            self.live_bytes -= local_bytes(p)
            del self.live[id(p)]
        move_params(params, torch.device("meta"))

    def finish(self) -> None:
        """Fill the units the forward did not reach, then free every parameter still held."""
        self._fill_to(len(self.units) - 1)
        self._free(list(self.live.values()))
