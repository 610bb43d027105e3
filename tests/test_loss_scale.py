"""fp16 dynamic loss scaling: the scale halves on overflow and doubles after clean steps."""

from parcompile.runtime.train.loss_scale import DynamicLossScaler


def test_scale_halves_on_overflow_and_grows_after_the_interval():
    s = DynamicLossScaler(initial=1024.0, growth_interval=3, minimum=1.0)
    s.update(overflow=True)
    assert s.scale == 512.0 and s.good_steps == 0
    for _ in range(2):
        s.update(overflow=False)
    assert s.scale == 512.0
    s.update(overflow=False)
    assert s.scale == 1024.0
    for _ in range(20):
        s.update(overflow=True)
    assert s.scale == 1.0   # never below the minimum
