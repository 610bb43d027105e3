"""verify's batching: many programs of one world size in one torchrun launch
(``parcompile.runtime.distributed.batch``); a failing program is reported as its own and the programs
after it still run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parcompile.verification import run_batched

PROGRAM = '''
import json, sys
from pathlib import Path
import torch
import torch.distributed as dist

def main(argv):
    out = Path(argv[argv.index("--metrics-dir") + 1])
    if {fail!r}:
        raise RuntimeError("boom in job {name}")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{{dist.get_rank()}}.json").write_text(json.dumps({{"sum": t.item(), "job": {name!r}}}))
'''


@pytest.mark.torchrun
def test_a_failing_program_is_its_own_failure_and_the_rest_still_run(tmp_path):
    outs = []
    for name, fail in [("a", False), ("b", True), ("c", False)]:
        out = tmp_path / name
        out.mkdir()
        (out / "program.py").write_text(PROGRAM.format(fail=fail, name=name))
        outs.append(out)
    failures = run_batched(outs, world=2, steps=1, timeout_s=120, tmp=tmp_path)
    assert failures[0] is None and failures[2] is None
    assert isinstance(failures[1], RuntimeError) and "boom in job b" in str(failures[1])
    for name in "ac":   # both ranks ran the job and its all-reduce: 1 + 2
        recs = [json.loads((tmp_path / name / "metrics" / f"rank{r}.json").read_text()) for r in (0, 1)]
        assert [r["sum"] for r in recs] == [3.0, 3.0] and {r["job"] for r in recs} == {name}
    assert not (tmp_path / "b" / "metrics").exists()
    assert len(list(Path(tmp_path).glob("jobs_2_*.json"))) == 2   # a, b in the first launch; c in the second
