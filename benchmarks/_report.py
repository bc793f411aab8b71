"""Shared output for the benchmark scripts: ``name: value unit`` lines, or one JSON object."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field


def base_parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the flags every benchmark accepts."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    parser.add_argument("--quick", action="store_true", help="a shorter run (under 30 s)")
    return parser


@dataclass
class Report:
    """Figures in the order they were measured; printed once at the end."""

    figures: list[tuple[str, float | int | str, str]] = field(default_factory=list)

    def add(self, name: str, value: float | int | str, unit: str = "") -> None:
        self.figures.append((name, value, unit))

    def emit(self, as_json: bool) -> None:
        if as_json:
            print(json.dumps({name: value for name, value, _ in self.figures}))
            return
        for name, value, unit in self.figures:
            shown = f"{value:.6g}" if isinstance(value, float) else str(value)
            print(f"{name}: {shown} {unit}".rstrip())
