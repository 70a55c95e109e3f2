"""Data that ships with mirrorsd: the text ``mirrorsd eval`` and the export-time check score models on
(written for this project; docs/quality.md)."""
from pathlib import Path

EVAL_TEXT = Path(__file__).parent / "eval_text.txt"
CALIBRATION_TEXT = Path(__file__).parent / "calibration_text.txt"  # the data-aware scale search's (export/rounding.py)
