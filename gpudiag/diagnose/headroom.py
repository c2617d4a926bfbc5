"""How much of the device a profiled step uses and the largest batch that would fit: the first
thing an engineer checks when a small step leaves the GPU idle (issue 57). From one profiled
step's owners (gpudiag/model/facts.py, MemoryOwners): what scales with the batch (activations
saved for backward, the batch, temporaries: the peak less the rest) and what does not
(parameters, gradients, optimizer state, what the script keeps)."""

from __future__ import annotations

from dataclasses import dataclass

from gpudiag.model.results import StageResult

USABLE = 0.9  # of the device a batch may fill: the allocator's cache and CUDA's context need room


@dataclass(frozen=True)
class Headroom:
    peak: int  # bytes at the step's peak
    total: int  # the device's
    fixed: int  # what does not scale with the batch
    scaled: int  # what does
    batch: int | None  # samples a step now (None: not known)
    capped: bool = False  # `total` is the process's cap (set_per_process_memory_fraction)

    @property
    def times(self) -> float | None:
        """How many times the step's batch would fit: its scaled part filling USABLE of the
        device beside the fixed part."""
        room = USABLE * self.total - self.fixed
        return room / self.scaled if self.scaled > 0 and room > 0 else None

    def peak_at(self, times: float) -> int:
        """The step's peak, bytes, at `times` its batch: the scaled part scaled."""
        return int(self.fixed + self.scaled * times)

    @property
    def largest_batch(self) -> int | None:
        times = self.times
        return int(self.batch * times) if self.batch and times is not None else None

    def says(self) -> str:
        gib = 2**30
        of = "the process's cap of" if self.capped else "the device's"
        now = (f"{self.peak / gib:,.2f} of {of} {self.total / gib:,.0f} GiB "
               f"({self.peak / self.total:.0%})")
        text = (f"The step uses {now} at its peak: {self.scaled / gib:,.2f} GiB scale with the "
                f"batch (activations, the batch, temporaries), {self.fixed / gib:,.2f} GiB do "
                "not (weights, gradients, optimizer state)")
        largest, times = self.largest_batch, self.times
        fits = (f"a batch of up to ~{largest:,} (now {self.batch:,})" if largest is not None
                and self.batch else f"~{times:,.0f} times this step's batch"
                if times is not None else None)
        if fits is not None:
            text += (f"; {fits} would fit in {USABLE:.0%} of it (an estimate from one profiled "
                     "step's owners; a larger batch changes the recipe: scale the learning "
                     "rate with it)")
        return text + "."


def headroom(stage: StageResult) -> Headroom | None:
    """The step's headroom on a CUDA device, where its owners were counted: against what the
    process may use (its cap where the script set one, else the device's memory)."""
    script = stage.facts.script
    owners = script.owners if script is not None else None
    memory = script.memory if script is not None else None
    capacity = memory.device_capacity_mib if memory is not None else None
    if owners is None or owners.device != "cuda" or not owners.peak or not capacity:
        return None
    fixed = owners.parameters + owners.gradients + owners.optimizer_state + (owners.kept or 0)
    return Headroom(peak=owners.peak, total=int(capacity * 2**20), fixed=fixed,
                    scaled=max(0, owners.peak - fixed), batch=stage.samples_per_step,
                    capped=bool(memory and memory.cap_mib))
