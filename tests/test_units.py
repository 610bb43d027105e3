"""Units (parcompile/config/units.py) and quantities in specs."""

from __future__ import annotations

import pytest

from parcompile.config.units import UNITS, dimension_of, quantity, to_si, units_of
from parcompile.diagnostics import SpecError
from parcompile.frontend import load_spec

CLUSTER_TAIL = """
model m from "llama3-8b" { }
parallel { tp = 8 }
"""


def cluster(body: str) -> str:
    return 'cluster c from "h100-sxm" {\n' + body + "\n}\n" + CLUSTER_TAIL


@pytest.mark.parametrize("text, si", [
    ("1 B", 1), ("1 KB", 1e3), ("1 MB", 1e6), ("1 GB", 1e9), ("1 TB", 1e12),
    ("1 KiB", 1024), ("1 MiB", 2**20), ("1 GiB", 2**30), ("1 TiB", 2**40),
    ("1 MB/s", 1e6), ("1 GB/s", 1e9), ("1 TB/s", 1e12), ("400 Gb/s", 50e9),
    ("1 GFLOPS", 1e9), ("989 TFLOPS", 989e12), ("1 PFLOPS", 1e15),
    ("1 ns", 1e-9), ("5 us", 5e-6), ("2 ms", 2e-3), ("3 s", 3.0),
    ("10 %", 0.1),
])
def test_conversion_to_si(text, si):
    assert quantity(text) == pytest.approx(si, rel=1e-12)


def test_dimensions_and_case_sensitivity():
    assert dimension_of("GB") == "memory" and dimension_of("Gb/s") == "bandwidth"
    assert dimension_of("gb") is None and dimension_of("GIB") is None
    assert units_of("time") == ("ns", "us", "ms", "s")
    assert set(UNITS) == {"B", "KB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB", "MB/s", "GB/s", "TB/s",
                          "Gb/s", "GFLOPS", "TFLOPS", "PFLOPS", "ns", "us", "ms", "s", "%"}
    with pytest.raises(KeyError):
        to_si(1, "Gib")


def test_quantities_in_a_spec_become_si():
    cfg, _ = load_spec(cluster("memory = 40 GiB\ninter_node_bw = 400 Gb/s\nhbm_bw = 2 TB/s\n"
                               "peak_flops = 1.5 PFLOPS\nintra_node_latency = 3 us\nmemory_reserve = 5%\n"
                               "inter_node_latency = 0 s"))
    c = cfg.cluster
    assert c.memory == 40 * 2**30 and isinstance(c.memory, int)
    assert c.inter_node_bw == 50e9 and c.hbm_bw == 2e12 and c.peak_flops == 1.5e15
    assert c.intra_node_latency == pytest.approx(3e-6) and c.memory_reserve == pytest.approx(0.05)
    assert c.inter_node_latency == 0
    assert load_spec(cluster("memory_reserve = 0.2"))[0].cluster.memory_reserve == 0.2


def _one(text: str) -> tuple[str, int, int, str | None]:
    with pytest.raises(SpecError) as e:
        load_spec(text, filename="u.par")
    assert len(e.value.diagnostics) == 1, e.value.render()
    d = e.value.diagnostics[0]
    return d.message, d.span.line, d.span.column, d.help


def test_quantity_of_another_dimension_full_render():
    with pytest.raises(SpecError) as e:
        load_spec(cluster("    memory = 400 GB/s"), filename="u.par")
    assert str(e.value) == (
        "u.par:2:14: error: expected a memory size, got a bandwidth\n"
        "    memory = 400 GB/s\n"
        "             ^^^^^^^^\n"
        "  help: memory takes `B`, `KB`, `MB`, `GB`, `TB`, `KiB`, `MiB`, `GiB` or `TiB`"
    )


def test_bare_number_where_quantity_is_needed():
    assert _one(cluster("memory = 80")) == (
        "missing unit: memory takes a memory size", 2, 10,
        "write `80 GiB`; a memory size takes `B`, `KB`, `MB`, `GB`, `TB`, `KiB`, `MiB`, `GiB` or `TiB`")
    assert _one(cluster("peak_flops = 312"))[3].startswith("write `312 TFLOPS`;")


def test_unknown_unit():
    message, line, col, help = _one(cluster("memory = 80 Gib"))
    assert (message, line, col) == ("unknown unit `Gib`", 2, 13)
    assert help.startswith("did you mean `GiB` (units are case-sensitive)? units are `B`, `KB`")


@pytest.mark.parametrize("written, help", [
    # a case-insensitive match wins over the closest raw spelling (`tb/s` is nearer `Gb/s`)
    ("hbm_bw = 3 tb/s", "did you mean `TB/s` (units are case-sensitive)? "),
    ("inter_node_bw = 400 gb/s", "did you mean `GB/s` or `Gb/s` (units are case-sensitive)? "),
    ("peak_flops = 989 tflops", "did you mean `TFLOPS` (units are case-sensitive)? "),
    ("peak_flops = 989 TFLOP", "did you mean `TFLOPS`? "),
])
def test_unknown_unit_suggestions_are_case_aware(written, help):
    message, line, col, got = _one(cluster(written))
    assert message.startswith("unknown unit") and got.startswith(help + "units are `B`, ")


def test_word_where_quantity_is_needed():
    assert _one(cluster("memory = lots")) == ("expected a memory size, got `lots`", 2, 10,
                                             "write e.g. `memory = 80 GiB`")


def test_quantity_must_be_positive():
    assert _one(cluster("memory = -1 GiB")) == ("memory must be positive, got `-1 GiB`", 2, 10,
                                               "use a number above 0")
    assert _one(cluster("memory = 1e999 GiB"))[:3] == ("expected a finite number, got `1e999 GiB`", 2, 10)


def test_fractions():
    assert _one(cluster("memory_reserve = 150%")) == (
        "memory_reserve must be in [0, 1), got `150%`", 2, 18,
        "memory_reserve is a fraction: write e.g. `0.1` or `10%`")
    assert _one(cluster("memory_reserve = 10 GB")) == (
        "expected a fraction, got a memory size", 2, 18,
        "write a number such as `0.1` or a percentage such as `10%`")
    assert _one(cluster("memory_reserve = lots")) == (
        "expected a fraction, got `lots`", 2, 18,
        "write a number such as `0.1` or a percentage such as `10%`")


def test_unit_on_a_plain_number_key():
    assert _one(cluster("nodes = 2 GB")) == ("expected an integer, got `2 GB`", 2, 9, "drop the unit `GB`")


def test_a_huge_time_is_written_in_a_few_digits():
    """`host_link_bw = 1e-300 GB/s` (offload) made report.md's host line say the PCIe copy
    takes '599,229,629,...,368.0 days': 300 digits, ,.1f of any size. Now beyond a million
    days the count is in three significant digits; below, as before."""
    import re

    import parcompile
    from parcompile.core.units import seconds_text

    assert seconds_text(5700.5 * 86400) == "5,700.5 days" and seconds_text(3 * 3600) == "3.0 h"
    assert seconds_text(1e300) == f"{1e300 / 86400:.3g} days" == "1.16e+295 days"
    spec = ('model m from "llama3-8b" { }\ncluster c from "h100-sxm" { nodes = 1, host_link_bw = 1e-300 GB/s }\n'
            'parallel { tp = 8, zero = 1, offload = optimizer }\ntrain { steps = 1 }\n')
    report = parcompile.compile(spec, filename="h.par").report_md()
    assert "days" in report and max(len(m) for m in re.findall(r"[\d,.]+", report)) < 40
