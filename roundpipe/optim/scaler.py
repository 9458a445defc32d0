"""Dynamic loss scaling for fp16 compute (the semantics of ``torch.amp.GradScaler``)."""

from __future__ import annotations


class DynamicLossScaler:
    """Multiply the loss by ``scale``; on overflow skip the step and back off; grow after a calm run."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ):
        self.scale = init_scale
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self._calm_steps = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff_factor
            self._calm_steps = 0
        else:
            self._calm_steps += 1
            if self._calm_steps >= self.growth_interval:
                self.scale *= self.growth_factor
                self._calm_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "calm_steps": self._calm_steps}

    def load_state_dict(self, sd: dict) -> None:
        self.scale = sd["scale"]
        self._calm_steps = sd["calm_steps"]
