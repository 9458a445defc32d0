"""The runtime: parameter store, planning, workers, executor and the Pipeline facade."""

from roundpipe.runtime.pipeline import Pipeline
from roundpipe.runtime.step import StepOutput

__all__ = ["Pipeline", "StepOutput"]
