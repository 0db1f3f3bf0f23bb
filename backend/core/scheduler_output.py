"""The step contract, under the scheduler's name for it (the records live in backend/step.py, which
the worker imports too)."""
from ..step import (CachedSequenceData, Fork, NewSequenceData, PromptSpan, SampleRow,  # noqa: F401
                    ScheduledSequence, SchedulerOutput, SpecRun)
