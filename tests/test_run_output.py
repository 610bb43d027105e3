"""What a training run prints (issue 47): a step line an 80-column terminal holds on the CPU,
the accelerator's fields only where there is an allocator, and an end-of-run summary with the
outputs' paths and the TensorBoard command (parcompile/runtime/train/metrics.py RunLog)."""

from __future__ import annotations

import json

import pytest

from parcompile.runtime.train.metrics import RunLog

PLAN = {"compute": {"model_flops_per_step": 4e12}, "estimate": {"step_time": 0.109}, "world_size": 8}


def _log(tmp_path, enabled=True) -> RunLog:
    return RunLog(tmp_path / "out" / "metrics.jsonl", PLAN, 1e12, 1024, enabled)


def test_cpu_step_line_fits_80_columns_and_leaves_gpu_fields_to_the_file(tmp_path, capsys):
    log = _log(tmp_path)
    rec = log.step(999, 1000, 2.345678, 3e-4, 12.5, 0.3456, {"rss": [2**30, 3 * 2**30]})
    line = capsys.readouterr().out.rstrip("\n")
    assert line == "step  999/1000 | loss 2.3457 | lr 3.0e-04 | gnorm 12.5 | 0.346 s (plan 0.109 s)"
    assert len(line) <= 80
    written = json.loads((tmp_path / "out" / "metrics.jsonl").read_text())
    assert written["peak_rss"] == [2**30, 3 * 2**30] and written["mfu"] == rec["mfu"] > 0
    assert written["tokens_per_s"] == pytest.approx(1024 / 0.3456)
    log.close()


def test_accelerator_step_line_adds_throughput_mfu_and_the_allocator(tmp_path, capsys):
    log = _log(tmp_path)
    log.step(1, 2, 2.0, 1e-3, 1.0, 0.5, {"allocated": [2**30, 2 * 2**30], "reserved": [3 * 2**30, 4 * 2**30]})
    line = capsys.readouterr().out.strip()
    tflops = 4e12 / (0.5 * 8) / 1e12
    assert line.endswith(f"| 2,048 tok/s | {tflops:.3g} TFLOP/s/GPU | MFU {100 * tflops:.1f}% | peak 2.00 GiB "
                         "(reserved 4.00)")
    log.close()


def test_summary_says_what_the_run_did_and_where_its_outputs_went(tmp_path, capsys):
    log = _log(tmp_path)
    log.step(5, 5, 1.25, 1e-3, 1.0, 0.5, {"rss": [1]})
    text = log.summary(5, {"checkpoint": str(tmp_path / "ck" / "step_00000005"), "Hugging Face": None})
    lines = text.splitlines()
    assert lines[0].startswith("done: 5 steps in ") and "5,120 tokens" in lines[0] and lines[0].endswith(
        "final loss 1.2500")
    rows = {line.split()[0]: line.split(None, 1)[1] for line in lines[1:]}
    assert rows["metrics"] == str(tmp_path / "out" / "metrics.jsonl")
    assert rows["checkpoint"] == str(tmp_path / "ck" / "step_00000005")
    assert "Hugging" not in rows                                   # an output the run did not write
    if log.tb is not None:                                         # tensorboard installed
        assert rows["TensorBoard"] == f"tensorboard --logdir {tmp_path / 'out' / 'tensorboard'}"
    assert capsys.readouterr().out.rstrip("\n").endswith(text)
    log.close()
    quiet = _log(tmp_path, enabled=False)                          # the other ranks say nothing
    quiet.step(5, 5, None, 1e-3, 1.0, 0.5, {"rss": [1]})
    assert quiet.summary(5, {"checkpoint": None}) == "" and capsys.readouterr().out == ""
