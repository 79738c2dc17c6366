"""docs/torch_ao_names.md accounts for every public torch.ao quantization name, and every lowbit equivalent
it lists imports."""

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "torch_ao_names.md"


def _tool():
    spec = importlib.util.spec_from_file_location("torch_ao_names_tool", ROOT / "tools" / "torch_ao_names.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows():
    """``{(section, torch.ao short name): lowbit name or None}`` parsed from the file."""
    rows, section = {}, None
    for line in DOC.read_text().splitlines():
        if m := re.match(r"## `(.+)`$", line):
            section = m.group(1)
        elif (m := re.match(r"\| `([^`]+)` \| (?:`([^`]+)`|—) \| (.*) \|$", line)) and section:
            rows[(section, m.group(1))] = m.group(2)
            assert m.group(2) or m.group(3).strip(), f"{section}.{m.group(1)}: no equivalent and no reason"
    return rows


def _resolve(dotted):
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def test_every_torch_ao_public_name_is_accounted_for():
    rows = _rows()
    sections = _tool().torch_ao_names()
    assert len(sections["torch.ao.quantization"]) > 100  # the enumeration itself works
    missing = [full for section, names in sections.items() for full in names
               if (section, full.removeprefix(section + ".")) not in rows]
    assert not missing, f"not in docs/torch_ao_names.md (rerun tools/torch_ao_names.py): {missing}"


@pytest.mark.parametrize("name", sorted({v for v in _rows().values() if v}))
def test_listed_lowbit_equivalent_imports(name):
    assert _resolve(name) is not None


def test_the_file_is_what_the_generator_writes():
    assert _tool().render() == DOC.read_text(), "docs/torch_ao_names.md is stale: run tools/torch_ao_names.py"
