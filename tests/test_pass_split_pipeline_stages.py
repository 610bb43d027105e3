import pytest

from parcompile.passes.base import PassError
from parcompile.passes.split_pipeline_stages import chunk_layers
from tests.plan_factories import run_until, spec, tiny_model


def test_chunk_layers():
    assert chunk_layers(8, 4, 1) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert chunk_layers(7, 2, 1) == [[0, 1, 2, 3], [4, 5, 6]]
    assert chunk_layers(6, 2, 1, (4, 2)) == [[0, 1, 2, 3], [4, 5]]
    with pytest.raises(ValueError):
        chunk_layers(6, 2, 1, (3, 2))


def test_even_split_and_ends():
    g, ctx = run_until(spec(pp=2), "split-pipeline-stages")
    assert ctx.results.chunks == ((0, 1), (2, 3))
    assert g.node("embedding").stage == 0 and g.node("tokens").stage == 0
    for n in ("final_norm", "lm_head", "loss", "labels"):
        assert g.node(n).stage == 1
    assert g.node("layers.1.mlp.w2").stage == 0
    assert g.node("layers.2.attn_norm").stage == 1


def test_interleaved_assignment_megatron():
    # 8 layers, pp 2, 2 virtual stages: model chunk k lives on rank k % 2
    g, ctx = run_until(spec(tiny_model(layers=8), pp=2, virtual_stages=2, schedule="gpipe"), "split-pipeline-stages")
    assert ctx.results.chunks == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert (g.node("layers.4.attn.wq").stage, g.node("layers.4.attn.wq").chunk) == (0, 2)
    assert (g.node("layers.7.attn.wq").stage, g.node("layers.7.attn.wq").chunk) == (1, 3)
    assert g.node("loss").chunk == 3 and g.node("loss").stage == 1


def test_tied_head_gets_a_copy_when_pp_exceeds_one():
    g, _ = run_until(spec(tiny_model(tie_embeddings=True), pp=2), "split-pipeline-stages")
    head = g.node("lm_head").params[0]
    assert head.name == "lm_head.weight" and head.tied_to == "embedding.weight"
    g1, _ = run_until(spec(tiny_model(tie_embeddings=True)), "split-pipeline-stages")
    assert g1.node("lm_head").params[0].name == "embedding.weight"


def test_bad_stage_layers_is_the_checks_tables_error():
    """The user's rule is the checks table's (tests/test_checks.py:
    test_stage_layers_wrong_length_and_sum); an unchecked config that reaches the pass
    anyway is a bug, reported as the pass's failure."""
    with pytest.raises(PassError, match="pass split-pipeline-stages failed: ValueError: .*sum to"):
        run_until(spec(pp=2, stage_layers=(1, 2)), "split-pipeline-stages")


def test_layer_less_end_chunks_hold_the_embedding_and_the_output_layer():
    """Issue 29 (Llama 3 paper section 3.3.2): stage_layers 0 for the first and the last
    model chunk; a 0 anywhere else is refused (the checks table says so for a spec)."""
    assert chunk_layers(3, 2, 2, (0, 2, 1, 0)) == [[], [0, 1], [2], []]
    for bad in ((1, 0, 2, 0), (0, 3, -1, 1)):
        with pytest.raises(ValueError, match="middle chunk"):
            chunk_layers(3, 2, 2, bad)
    g, ctx = run_until(spec(tiny_model(layers=3), tp=2, pp=2, virtual_stages=2, schedule="interleaved_1f1b",
                            stage_layers=(0, 2, 1, 0)), "insert-collectives")
    assert ctx.results.chunks == ((), (0, 1), (2,), ())
    assert (g.node("embedding").stage, g.node("embedding").chunk) == (0, 0)
    for n in ("final_norm", "lm_head", "loss"):
        assert (g.node(n).stage, g.node(n).chunk) == (1, 3)
    assert (g.node("layers.0.attn_norm").stage, g.node("layers.0.attn_norm").chunk) == (1, 1)
    nodes = list(g.nodes())
    sends = {(nd.op.attr("src_chunk"), nd.op.attr("dst_chunk")) for nd in nodes if nd.kind == "send_recv"}
    assert sends == {(0, 1), (1, 2), (2, 3)}
    # the vocab-parallel embedding's tp reduction runs on its own chunk, before the send
    # (Megatron-LM's embedding reduces before the pipeline send)
    conv = [nd for nd in nodes if nd.kind == "redistribute" and g.inputs(nd.name) == ["embedding"]]
    assert len(conv) == 1 and (conv[0].stage, conv[0].chunk, conv[0].op.layer) == (0, 0, None)
    assert any(k == "all_reduce" for k, _ in conv[0].op.attr("fwd"))
