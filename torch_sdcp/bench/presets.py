"""The model geometries the bench runs (``--preset``): total heads, the
latent and RoPE widths of a query head, and index_topk."""

PRESETS = {
    "glm-5": dict(heads=64, head_dim=512, rope_dim=64, k=2048),
    "deepseek-v3.2": dict(heads=128, head_dim=512, rope_dim=64, k=2048),
}
