"""The step contract, under the engine's name for it (the records live in backend/step.py, which
the worker imports too)."""
from ..step import (Fork, PromptSpan, SampleRow, ScheduledSequence, SchedulerOutput,  # noqa: F401
                    SpecRun)
