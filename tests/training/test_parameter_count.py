"""The parameter count of a config is computed from its sizes, and equals the real model's."""

from octlm.model import ModelConfig, OctLM
from octlm.training import config

SHAPES = [
    dict(width=16, n_layers=1, n_heads=2),  # MHA
    dict(width=48, n_layers=3, n_heads=6, n_kv_heads=2),  # GQA
    dict(width=32, n_layers=2, n_heads=4, n_kv_heads=1, vocab_size=300),  # MQA, another vocab
    dict(width=40, n_layers=2, n_heads=4, max_length=64, window=8),  # mlp width rounded up to 8
    *config.PRESETS.values(),
]


def test_counts_need_no_model_and_equal_the_real_models(monkeypatch):
    def refuse(self, model_config):
        raise AssertionError("a parameter count built a model")

    with monkeypatch.context() as patch:
        patch.setattr(OctLM, "__init__", refuse)
        counts = [config.parameter_count(ModelConfig(**shape)) for shape in SHAPES]
        summary = config.preset_summary()
    for shape, count in zip(SHAPES, counts, strict=True):
        real = sum(p.numel() for p in OctLM(ModelConfig(**shape)).parameters())
        assert count == real, shape
    for name, sizes in config.PRESETS.items():
        bpe, byte = (
            sum(p.numel() for p in OctLM(ModelConfig(**sizes, vocab_size=vocab)).parameters())
            for vocab in (config.DEFAULT_BPE_VOCAB, 256)
        )
        [line] = [line for line in summary.splitlines() if line.startswith(f"{name}: ")]
        assert f"{bpe / 1e6:.2f}M parameters with BPE" in line
        assert f"({byte / 1e6:.2f}M with --tokenizer bytes)" in line
