"""LoRA's plan (parcompile/analysis/lora.py): memory per rank held against sums computed by
hand from the model's shapes, and the time model's frozen weights."""

from __future__ import annotations

from pathlib import Path

import parcompile

from tests.test_checks import spec

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "lora" / "llama3.1_70b_lora_1x8_h100.par"


def _plans(**train):
    full = parcompile.compile(spec())
    lora = parcompile.compile(spec(train={"method": "lora", **train}))
    return full, lora


def test_tiny_memory_by_hand():
    """examples/tiny's model (fp32: 4 bytes, no master copy; Adam: 2 states), tp 2, pp 2, dp 2,
    zero 0, micro_batch 2 of 64 tokens, m = 4, rank 16 on every linear of the layers."""
    full, lora = _plans()
    h, kv, f, v, layers, r, tp, e = 64, 32, 128, 256, 2, 16, 2, 4   # 2 layers per stage
    linears = [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f)]   # (out, in): wq wk wv wo w1 w3 w2
    base_layer = sum(o * i for o, i in linears) // tp + 2 * h              # + two norms, replicated
    adapters = layers * sum(r * (o + i) for o, i in linears) // tp          # A and B, both split over tp
    frozen = [layers * base_layer + v * h // tp,                            # stage 0: + embedding
              layers * base_layer + v * h // tp + h]                        # stage 1: + head, final norm
    tokens = 2 * 64
    in_flight = [2, 1]                                                      # 1F1B: min(p - s, m)
    for s, st in enumerate(lora.memory.per_stage):
        assert st.params == e * frozen[s] + e * adapters
        assert st.grads == 4 * adapters                                      # fp32 gradients, adapters only
        assert st.optimizer == 8 * adapters                                  # two fp32 Adam moments
        # the adapters keep their r-wide intermediate (tokens x r, model dtype) per micro-batch in flight
        added = in_flight[s] * layers * len(linears) * tokens * r * e
        if s == 0:   # layer 0's input norm keeps nothing: no gradient reaches it (all weights before are frozen)
            added -= in_flight[s] * tokens * h * e
        else:        # the frozen LM head keeps no input (its weight has no gradient): one micro-batch of it
            added -= tokens * h * e
        assert st.activations - full.memory.per_stage[s].activations == added
        assert full.memory.per_stage[s].params == e * frozen[s]


def test_zero1_shards_adapter_states_only():
    full, lora = _plans()
    lora1 = parcompile.compile(spec(parallel={"zero": "1"}, train={"method": "lora"}))
    a = lora.memory.per_stage[0].grads // 4
    st = lora1.memory.per_stage[0]
    assert st.params == lora.memory.per_stage[0].params      # frozen weights are not sharded by zero 1
    assert st.optimizer == 8 * -(-a // 2)                     # the adapters' states over dp = 2


def test_dp_reduces_adapters_only():
    """The step's data-parallel gradient all-reduce moves the adapters' fp32 gradients, not the model's."""
    full, lora = _plans()
    def dp_bytes(plan):
        return sum(c["bytes"] * c["count"] for c in plan.data["comm"]["collectives"] if c["axis"] == "dp_cp"
                   and c["where"].startswith("grad"))
    assert dp_bytes(lora) == 4 * sum(st.grads // 4 for st in lora.memory.per_stage)
    assert dp_bytes(full) == 4 * sum(st["params_per_rank"] for st in full.data["stages"])


def test_backward_collectives_run_where_a_gradient_reaches():
    """Sequence parallelism (tp 2): the frozen embedding's reduce-scatter has no backward
    all-gather; the first adapted module's output reduce-scatter has one (its gradient reaches
    the adapters inside), its input all-gather no reduce-scatter (no input gradient); the input
    all-gather is regathered in backward only where an adapter's A reads it (``o_proj`` alone:
    the frozen q, k, v keep no input). Counted by hand per micro-batch; the program's own counts
    are test_lora_program.py's verify."""
    def backward(train):
        plan = parcompile.compile(spec(parallel={"sequence_parallel": "true"}, train={"method": "lora", **train}))
        m = plan.data["schedule"]["num_microbatches"]
        return {(c["where"], c["op"]): c["count"] // m for c in plan.data["comm"]["collectives"]
                if c["phase"] == "backward" and c["axis"] == "tp" and c["where"] in ("embedding", "layers.0.attn")}

    assert backward({}) == {("layers.0.attn", "all_gather"): 2}   # output gradient + regather for the adapters' A
    # o_proj only: wo's adapter is added after wo's reduce-scatter, so no gradient reaches that
    # reduce-scatter or anything before it in layer 0
    assert backward({"lora_targets": '["o_proj"]'}) == {}
    assert backward({"lora_targets": '["v_proj"]'}) == {("layers.0.attn", "all_gather"): 2}


def test_frozen_weights_skip_the_weight_gradient():
    """A frozen weight's backward is the input gradient only: LoRA's step computes less than full
    training of the same model, and its model FLOPs are the full ones less one forward of the
    frozen GEMMs plus three of the adapters'."""
    full, lora = _plans()
    compute = [p.data["estimate"]["breakdown"]["compute"] for p in (full, lora)]
    assert compute[1] < compute[0]
    # the adapters' tp collectives are priced (rows `lora`) and timed (tp_comm grows)
    assert any(c["where"] == "lora" for c in lora.data["comm"]["collectives"])
    assert lora.data["estimate"]["breakdown"]["tp_comm"] > full.data["estimate"]["breakdown"]["tp_comm"]
    fm, lm = full.data["compute"]["model_flops_per_step"], lora.data["compute"]["model_flops_per_step"]
    h, kv, f, v, r = 64, 32, 128, 256, 16
    linears = [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f)]
    tokens = 16 * 64                                                          # global batch
    frozen_fwd = tokens * 2 * (4 * sum(o * i for o, i in linears) + v * h)    # 4 layers + the LM head
    adapters = 3 * tokens * 2 * 4 * sum(r * (o + i) for o, i in linears)
    assert lm == fm - frozen_fwd + adapters


def test_llama31_70b_lora_fits_one_node():
    plan = parcompile.compile(EXAMPLE)
    mem = plan.memory
    assert mem.fits and plan.config.parallel.tp == 8 and plan.config.cluster.nodes == 1
    h, f, kv, r, layers = 8192, 28672, 1024, 16, 80
    adapters = layers * r * ((h + h) + 2 * (h + kv) + (h + h) + 3 * (h + f)) // 8
    st = mem.per_stage[0]
    assert st.grads == 4 * adapters and st.optimizer == 12 * adapters      # fp32 grads; master + 2 moments
    assert st.params == 2 * plan.data["stages"][0]["params_per_rank"] + 2 * adapters
    text = plan.report_md()
    assert "## Memory (per rank)" in text and "fits" in text
    full = parcompile.compile(EXAMPLE.read_text().replace("method       = lora", "method = full").replace(
        "    lora_rank    = 16\n    lora_alpha   = 32\n", "").replace(
        '    lora_targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]\n', ""))
    assert not full.memory.fits


def test_zero3_shards_frozen_weights_by_hand():
    """zero 3 (dp 2, tp 2, pp 2, one bucket per stage at the default bucket size): each rank
    keeps half of its stage's frozen weights (no gradient, no optimizer state) and half of the
    adapters with their states; the step all-gathers the frozen bucket (in the model dtype,
    4 bytes here) and the adapters' bucket once each (pp > 1: kept across the micro-batches)
    and reduce-scatters the adapters' gradients only. Fails where LoRA with zero 3 is refused."""
    lora3 = parcompile.compile(spec(parallel={"zero": "3"}, train={"method": "lora"}))
    h, kv, f, v, layers, r, tp, e, d = 64, 32, 128, 256, 2, 16, 2, 4, 2
    linears = [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f)]
    base_layer = sum(o * i for o, i in linears) // tp + 2 * h
    adapters = layers * sum(r * (o + i) for o, i in linears) // tp
    frozen = [layers * base_layer + v * h // tp, layers * base_layer + v * h // tp + h]
    half = -(-adapters // d)
    for s, st in enumerate(lora3.memory.per_stage):
        assert st.params == e * -(-frozen[s] // d) + e * half    # fp32: the adapters' slices are the weights
        assert st.optimizer == 8 * half and st.grads == 4 * half
        got = sorted((c["bytes"], c["count"]) for c in lora3.data["comm"]["collectives"]
                     if c["stage"] == s and c["where"] == "params")
        assert got == sorted([(e * -(-frozen[s] // d) * d, 1), (e * half * d, 1)])
        rs = [c for c in lora3.data["comm"]["collectives"] if c["stage"] == s and c["op"] == "reduce_scatter"
              and c["axis"] == "dp_cp"]
        assert [c["bytes"] for c in rs] == [4 * half]


def test_grad_buckets_hold_the_adapters_only():
    """plan.json's ``comm.grad_buckets`` and report.md's gradient-reduction table list the
    buckets of the gradients that are reduced: the adapters' (by hand from the model's shapes,
    as in test_tiny_memory_by_hand), not the frozen model's (issue 49: the table showed the
    whole model's fp32 gradients). The estimate's reduction times them with the same count."""
    full, lora = _plans()
    h, kv, f, layers, r, tp = 64, 32, 128, 2, 16, 2
    linears = [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f)]
    adapters = layers * sum(r * (o + i) for o, i in linears) // tp     # per rank of a stage
    for row in lora.data["comm"]["grad_buckets"]["per_stage"]:
        assert sum(b["elements"] for b in row["dense"]) == adapters and not row["expert"]
        assert all(u.startswith("layers.") for b in row["dense"] for u in b["units"])
    red = {g["stage"]: g["buckets"] for g in lora.data["estimate"]["grad_reduction"]}
    assert red == {row["stage"]: len(row["dense"]) for row in lora.data["comm"]["grad_buckets"]["per_stage"]}
    full_sizes = [sum(b["elements"] for b in row["dense"]) for row in full.data["comm"]["grad_buckets"]["per_stage"]]
    assert full_sizes == [st["params_per_rank"] for st in full.data["stages"]]   # full training: the whole model


def test_plan_says_it_is_lora():
    """plan.json's ``train``, report.md and the HTML report say the method, the adapters'
    settings and the whole model's trainable (adapter) against frozen parameters, the
    adapters counted by hand from the model's shapes (issue 49: the plan never said LoRA)."""
    import html
    import re

    full, lora = _plans()
    h, kv, f, layers, r = 64, 32, 128, 4, 16
    linears = [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f)]
    adapters = layers * sum(r * (o + i) for o, i in linears)                # the whole model, unsplit
    assert full.data["train"] == {"method": "full", "trainable_params": full.data["model"]["params"],
                                  "frozen_params": 0}
    tr = lora.data["train"]
    assert (tr["method"], tr["trainable_params"], tr["frozen_params"]) == ("lora", adapters,
                                                                           full.data["model"]["params"])
    assert tr["lora"] == {"rank": 16, "alpha": 32.0, "dropout": 0.0, "adapted_linears": layers * len(linears),
                          "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
    text = lora.report_md()
    assert (f"LoRA: rank 16, alpha 32, dropout 0, adapters on q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
            f"down_proj ({layers * len(linears)} linears); {adapters:,} trainable parameters") in text
    assert f"{full.data['model']['params']:,} frozen" in text and "LoRA" not in full.report_md()
    cells = {k: v for k, v in re.findall(r'data-key="(train\.[a-z_.]+)" data-value="([^"]*)"', lora.report_html())}
    assert int(cells["train.trainable_params"]) == adapters and html.unescape(cells["train.method"]) == '"lora"'
    assert int(cells["train.frozen_params"]) == full.data["model"]["params"]
