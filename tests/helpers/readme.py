"""The README's workload-contract example, written out as the files a user would copy."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

README = Path(__file__).resolve().parents[2] / "README.md"
SECTION = "### Your own model code: the workload contract"


def readme_example(tmp_path: Path) -> tuple[Path, dict]:
    """The README's example: its ``my_model.py`` written into ``tmp_path`` and its sweep spec."""
    text = README.read_text(encoding="utf-8")
    section = text.split(SECTION, 1)[1].split("\n### ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    spec = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    (tmp_path / "my_model.py").write_text(code, encoding="utf-8")
    return tmp_path, yaml.safe_load(spec)
