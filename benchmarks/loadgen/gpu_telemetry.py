"""Clocks and power of the GPU during each benchmark phase, from the log that benchmarks/gpu.sh e2e
keeps with `nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active
--format=csv,noheader -lms 200`.

Workload A runs at the GPU's power cap with the SM clock well below its maximum, and machines
differ; so every run records, per phase, the SM clock and power while the GPU
worked, and how often the software power cap held the clock down.
"""
from __future__ import annotations

import csv
import statistics
import time
from dataclasses import dataclass
from typing import Any

# nvidia-smi's clocks_event_reasons bit for the software power cap (NVML's
# nvmlClocksEventReasonSwPowerCap).
SW_POWER_CAP = 0x4
# Samples below this power are the GPU idling between a phase's runs (start-up, warm-up, the
# server loading), not the workload.
BUSY_WATTS = 200.0


@dataclass
class Sample:
    epoch: float
    sm_mhz: float
    watts: float
    reasons: int


def _number(field: str) -> float:
    return float(field.strip().split()[0])


def parse_log(path: str) -> list[Sample]:
    """Rows `timestamp, clocks.sm [MHz], power.draw [W], reasons` with or without a header;
    rows that do not parse (a header, '[N/A]', a line cut off by kill) are skipped. Timestamps
    are the machine's local time, as `date +%s` in gpu_run.sh reads it."""
    samples = []
    try:
        with open(path, encoding="utf-8", newline="") as f:
            for row in csv.reader(f):
                if len(row) < 4:
                    continue
                try:
                    stamp = row[0].strip()
                    whole, _, frac = stamp.partition(".")
                    epoch = time.mktime(time.strptime(whole, "%Y/%m/%d %H:%M:%S"))
                    epoch += float("0." + frac) if frac.isdigit() else 0.0
                    samples.append(Sample(epoch, _number(row[1]), _number(row[2]),
                                          int(row[3].strip(), 16)))
                except ValueError:
                    continue
    except OSError:
        return []
    return samples


def summarize(samples: list[Sample], start: float, end: float) -> dict[str, Any] | None:
    """The samples in [start, end] while the GPU worked (power above BUSY_WATTS)."""
    busy = [s for s in samples if start <= s.epoch <= end and s.watts >= BUSY_WATTS]
    if not busy:
        return None
    clocks = [s.sm_mhz for s in busy]
    watts = [s.watts for s in busy]
    return {
        "busy_samples": len(busy),
        "sm_clock_mhz_median": statistics.median(clocks),
        "sm_clock_mhz_min": min(clocks),
        "sm_clock_mhz_max": max(clocks),
        "power_w_median": statistics.median(watts),
        "power_w_max": max(watts),
        "power_capped_fraction": sum(1 for s in busy if s.reasons & SW_POWER_CAP) / len(busy),
    }


def annotate_phases(phases: list[dict[str, Any]], samples: list[Sample]) -> None:
    """Adds "gpu" (summarize's dict, or None) to each phase that has start and end times."""
    for p in phases:
        if "start" in p and "end" in p:
            p["gpu"] = summarize(samples, float(p["start"]), float(p["end"]))


def describe(phase: dict[str, Any]) -> str | None:
    g = phase.get("gpu")
    if not g:
        return None
    return (f"GPU during {phase.get('model')}/{phase.get('phase')}: SM clock median "
            f"{g['sm_clock_mhz_median']:,.0f} MHz ({g['sm_clock_mhz_min']:,.0f}-{g['sm_clock_mhz_max']:,.0f}), "
            f"power median {g['power_w_median']:.0f} W (max {g['power_w_max']:.0f}), "
            f"power cap holding the clock in {g['power_capped_fraction']:.0%} of "
            f"{g['busy_samples']} busy samples")
