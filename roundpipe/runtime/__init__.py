"""The runtime: parameter store, workers, executor and the Pipeline engine."""

from roundpipe.runtime.engine import Pipeline, StepOutput

__all__ = ["Pipeline", "StepOutput"]
