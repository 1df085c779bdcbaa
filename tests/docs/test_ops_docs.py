"""docs/ stays true: every condition reason the code can emit is documented, the
reference is the generated one, and every TieredPrefixCache shown in docs renders."""

from __future__ import annotations

import re

import pytest
import yaml

from kvtier_operator.context import RenderContext
from kvtier_operator.docgen import reference
from kvtier_operator.render.objects import render_objects
from kvtier_operator.validation import parse_tpc
from tests.helpers import ROOT

OPERATOR = ROOT / "operator" / "kvtier_operator"
DOCS = ROOT / "docs"


def emitted_reasons() -> set[str]:
    found = set()
    for path in OPERATOR.rglob("*.py"):
        text = path.read_text()
        found |= set(re.findall(r'Cond\("(?:True|False|Unknown)",\s*"([A-Za-z]+)"', text))
        found |= set(re.findall(r'found\.append\(\("([A-Za-z]+)"', text))  # status._advice
        found |= set(re.findall(r'"([A-Z][A-Za-z]+)" if not notes else', text))
    found.add("BoundWithWarnings")  # chosen by an expression the pattern above cannot see
    return found


def test_every_condition_reason_is_in_the_troubleshooting_table():
    table = (DOCS / "operations.md").read_text()
    reasons = emitted_reasons()
    assert len(reasons) >= 20
    missing = sorted(r for r in reasons if f"`{r}`" not in table)
    assert missing == [], f"docs/operations.md does not explain: {missing}"


def test_reference_is_generated():
    assert (DOCS / "reference.md").read_text() == reference(), "run `make docs`"


def doc_examples() -> list[tuple[str, dict]]:
    out = []
    for path in [*sorted(DOCS.glob("*.md")), ROOT / "README.md"]:
        for block in re.findall(r"```yaml\n(.*?)```", path.read_text(), re.S):
            for doc in yaml.safe_load_all(block):
                if isinstance(doc, dict) and doc.get("kind") == "TieredPrefixCache":
                    out.append((path.name, doc))
    return out


EXAMPLES = doc_examples()


def test_docs_show_a_resource():
    assert EXAMPLES


def implied_objects(doc: dict) -> dict[str, str]:
    """The owned objects a shown resource asks for, kind -> name: a PVC where it asks for
    one (not an existing claim), the evictor's CronJob wherever it has a shared tier, the
    router's ConfigMap where the router is on."""
    name, spec = doc["metadata"]["name"], doc["spec"]
    storage = spec.get("storage") or {}
    implied = {}
    if "pvc" in storage:
        implied["PersistentVolumeClaim"] = f"{name}-kv-cache"
    if storage:
        implied["CronJob"] = f"{name}-evictor"
    if (spec.get("router") or {}).get("enabled"):
        implied["ConfigMap"] = f"{name}-router"
    return implied


@pytest.mark.parametrize(("where", "doc"), EXAMPLES, ids=[w for w, _ in EXAMPLES])
def test_every_doc_example_renders_the_objects_it_implies(where, doc):
    objects = render_objects(parse_tpc(doc), RenderContext())
    assert {o["kind"]: o["metadata"]["name"] for o in objects} == implied_objects(doc)
    namespace = doc["metadata"].get("namespace", "default")
    assert {o["metadata"].get("namespace", "default") for o in objects} <= {namespace}
    claim = (doc["spec"].get("storage") or {}).get("pvc")
    for o in objects:
        if o["kind"] == "PersistentVolumeClaim":
            assert o["spec"]["resources"]["requests"]["storage"] == claim["size"]
