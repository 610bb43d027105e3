"""plan.json's published JSON Schema: every example's plan.json validates against the
pydantic models (parcompile/plan_schema.py) and against docs/plan.schema.json (checked by
the small validator below: `jsonschema` is not a dependency), and the committed schema
equals the regenerated one (`pytest tests/test_plan_schema.py --update-goldens` rewrites it)."""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

import parcompile
from parcompile.cli import main
from parcompile.plan_schema import json_schema_text, validate_plan

REPO = Path(__file__).resolve().parent.parent
SCHEMA_FILE = REPO / "docs" / "plan.schema.json"
EXAMPLES = sorted((REPO / "examples").glob("*.par"))


def schema_errors(schema: dict, value, path: str = "$", root: dict | None = None) -> list[str]:
    """Errors of ``value`` against ``schema``, for the JSON Schema keywords pydantic's
    schemas use: $ref, anyOf, type, enum, const, properties, required,
    additionalProperties, items, minimum, pattern."""
    root = root if root is not None else schema
    if "$ref" in schema:
        ref = schema["$ref"]
        assert ref.startswith("#/$defs/"), ref
        return schema_errors(root["$defs"][ref.split("/")[-1]], value, path, root)
    if "anyOf" in schema:
        branches = [schema_errors(s, value, path, root) for s in schema["anyOf"]]
        return [] if any(not b for b in branches) else [f"{path}: matches no branch of anyOf: {branches}"]
    errs = []
    types = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    t = schema.get("type")
    if t == "integer":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif t == "number":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif t is not None:
        ok = isinstance(value, types[t])
    else:
        ok = True
    if not ok:
        return [f"{path}: {value!r:.60} is not of type {t}"]
    if "enum" in schema and value not in schema["enum"]:
        errs.append(f"{path}: {value!r} not in {schema['enum']}")
    if "const" in schema and value != schema["const"]:
        errs.append(f"{path}: {value!r} != {schema['const']!r}")
    if "minimum" in schema and value < schema["minimum"]:
        errs.append(f"{path}: {value} < {schema['minimum']}")
    if "pattern" in schema and not re.search(schema["pattern"], value):
        errs.append(f"{path}: {value!r} does not match {schema['pattern']}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        errs += [f"{path}: missing {k}" for k in schema.get("required", []) if k not in value]
        extra = schema.get("additionalProperties", True)
        for k, v in value.items():
            if k in props:
                errs += schema_errors(props[k], v, f"{path}.{k}", root)
            elif extra is False:
                errs.append(f"{path}: unexpected key {k}")
            elif isinstance(extra, dict):
                errs += schema_errors(extra, v, f"{path}.{k}", root)
    if isinstance(value, list) and "items" in schema:
        for i, v in enumerate(value):
            errs += schema_errors(schema["items"], v, f"{path}[{i}]", root)
    return errs


@pytest.fixture(scope="module")
def plan_jsons():
    import os

    old = os.getcwd()
    os.chdir(REPO)
    try:
        return {p.stem: json.loads(parcompile.compile(p.relative_to(REPO)).to_json()) for p in EXAMPLES}
    finally:
        os.chdir(old)


def test_schema_file_is_current(request):
    text = json_schema_text()
    if request.config.getoption("--update-goldens"):
        SCHEMA_FILE.write_text(text)
    assert SCHEMA_FILE.exists(), "docs/plan.schema.json is missing; run pytest --update-goldens"
    assert SCHEMA_FILE.read_text() == text, (
        "docs/plan.schema.json differs from parcompile/plan_schema.py; regenerate it with "
        "`python -m pytest tests/test_plan_schema.py --update-goldens` and review the diff")


@pytest.mark.parametrize("name", [p.stem for p in EXAMPLES])
def test_example_validates(name, plan_jsons):
    data = plan_jsons[name]
    model = validate_plan(data)
    assert model.model_dump(exclude_none=True, mode="json") == data   # the models cover every key
    assert (model.serve is not None) == (data["workload"] == "serve")
    schema = json.loads(SCHEMA_FILE.read_text())
    assert schema_errors(schema, data) == []


def test_searched_plan_validates():
    """A spec with `auto` layout keys: plan.json's `search` section is part of the schema."""
    text = (REPO / "examples" / "tiny.par").read_text()
    assert "    tp = 2\n" in text
    plan = parcompile.compile(text.replace("    tp = 2\n", "    tp = auto\n"), filename="tiny.par")
    data = json.loads(plan.to_json())
    assert set(data["search"]) == {"auto", "chosen", "enumerated", "valid", "fitting"}
    assert data["search"]["auto"] == sorted(plan.config.parallel.auto) and "tp" in data["search"]["auto"]
    assert data["search"]["valid"] <= data["search"]["enumerated"]
    assert validate_plan(data).search is not None
    assert schema_errors(json.loads(SCHEMA_FILE.read_text()), data) == []


@pytest.mark.parametrize("line,key,value", [("compile = true", "compile", True),
                                            ("stream_interval = 4", "stream_interval", 4)])
def test_serve_engine_keys_reach_the_plan_and_validate(line, key, value):
    """`serve { compile = true }` (a single-rank layout) puts `compile: true` in plan.json's
    serve section, `stream_interval = 4` puts 4, and that plan validates against the models
    and the schema file; a plan without the key has the default (the key is absent, not
    false or 1)."""
    text = (REPO / "examples" / "tiny_serve.par").read_text()
    for k in ("tp", "pp"):
        text = re.sub(rf"(\n\s*{k}\s*=\s*)\d+", r"\g<1>1", text)
    plain = json.loads(parcompile.compile(text, filename="tiny_serve.par").to_json())
    assert key not in plain["serve"]
    keyed = text.replace("    seed           = 1\n", f"    seed           = 1\n    {line}\n")
    assert keyed != text
    data = json.loads(parcompile.compile(keyed, filename="tiny_serve.par").to_json())
    assert data["serve"][key] == value
    model = validate_plan(data)
    assert getattr(model.serve, key) == value
    assert model.model_dump(exclude_none=True, mode="json") == data
    assert schema_errors(json.loads(SCHEMA_FILE.read_text()), data) == []


def test_plan_data_is_the_models_dump():
    """The driver builds plan.json through the models (parcompile.driver.plan_data): a key
    outside them fails there; its data round-trips through them unchanged, in order."""
    from parcompile.plan_schema import plan_dict

    plan = parcompile.compile(REPO / "examples" / "tiny.par")
    again = plan_dict(validate_plan(plan.data),
                      {("comm", "per_step"): list(plan.data["comm"]["per_step"]),
                       ("estimate", "breakdown"): list(plan.data["estimate"]["breakdown"])})
    assert again == plan.data and list(again) == list(plan.data)
    assert list(plan.data["comm"]["per_step"]) == ["tp", "cp", "ep", "dp", "pp"]   # the analysis's order
    assert "serve" not in plan.data and "search" not in plan.data   # unset sections are left out


def test_schema_rejects_wrong_plans(plan_jsons):
    schema = json.loads(SCHEMA_FILE.read_text())
    good = plan_jsons["tiny"]
    bad_cases = {
        "unknown key": lambda d: d.update(extra=1),
        "missing section": lambda d: d.pop("memory"),
        "wrong type": lambda d: d["degrees"].update(tp="2"),
        "bad schedule": lambda d: d["schedule"].update(name="pipedream"),
        "bad action": lambda d: d["schedule"]["actions"][0][0].update(op="jump"),
        "negative bytes": lambda d: d["comm"]["collectives"][0].update(bytes=-1),
        "bad format": lambda d: d.update(format="parcompile.plan/2"),
        "bad order": lambda d: d.update(order="tp-dp"),
    }
    for what, mutate in bad_cases.items():
        d = copy.deepcopy(good)
        mutate(d)
        with pytest.raises(ValidationError):
            validate_plan(d)
        assert schema_errors(schema, d), what


def test_schema_command(capsys, tmp_path):
    assert main(["schema"]) == 0
    assert capsys.readouterr().out == SCHEMA_FILE.read_text()
    out = tmp_path / "s.json"
    assert main(["schema", "-o", str(out)]) == 0
    assert out.read_text() == SCHEMA_FILE.read_text()


@pytest.mark.parametrize("output", ["", "  "])
def test_schema_to_an_empty_output_is_a_usage_error(output, capsys):
    """`schema -o ""` printed the schema to stdout as if -o were absent (`export -o ""` and
    `compile -o ""` are usage errors)."""
    assert main(["schema", "-o", output]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "-o needs a file name" in err


def test_schema_output_is_written_atomically(tmp_path, monkeypatch, capsys):
    """`schema -o FILE` wrote FILE in place (Path.write_text): a write that failed half-way
    (a full disk) left a truncated schema where the old file was. Now through a temporary
    file renamed into place, as every other -o: when that fails, the old file stays whole
    and no temporary is left."""
    out = tmp_path / "s.json"
    out.write_text("old")

    def no_rename(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "replace", no_rename)
    assert main(["schema", "-o", str(out)]) == 2
    assert "cannot write" in capsys.readouterr().err
    assert out.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json"]
