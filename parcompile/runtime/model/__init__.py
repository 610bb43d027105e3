"""The layers generated programs are built from: tensor-parallel linears, norms, RoPE, attention, MoE, MLA, FP8 and quantized weights."""
